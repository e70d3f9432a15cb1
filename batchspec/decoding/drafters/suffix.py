"""Drafting from what the job has already written: each row proposes from the run's suffix index of
earlier completions (suffix_index.SuffixIndex, shared by every batch of the run) or from its own
prompt and output, whichever matched the longer suffix of its context, as long as the confidence
holds (a weak match proposes little or nothing). Each row's completion joins the index as it
ends, so the batches after it draft from it. Proposals are deterministic: q is one-hot."""

import torch

from batchspec.decoding.drafters.proposal import Proposal, looked_up
from batchspec.decoding.suffix_index import Draft, RowText, SuffixIndex, propose


class SuffixDrafter:
    source = "suffix"
    behind = 0  # it reads every token as the step's sync brings it

    def __init__(self, index: SuffixIndex, prompts: list[list[int]], n_min: int, n_max: int,
                 device: torch.device):
        self.index, self.device = index, device
        self.rows = [RowText(prompt, n_min=n_min, n_max=n_max) for prompt in prompts]  # each row's own text
        self.outputs: list[list[int]] = [[] for _ in prompts]  # what each row generated so far
        self.drafts: list[Draft | None] = [None] * len(prompts)  # this step's proposal per row

    def lookup(self, b: int, gamma: int) -> list[int]:
        self.drafts[b] = propose(self.index, self.rows[b], gamma)
        return self.drafts[b].tokens

    def propose(self, last, gamma: int, params, u, process=None) -> Proposal:
        return looked_up([self], len(self.rows), gamma, self.device)

    def verified(self, report) -> None:
        """Tell the index how its own proposals fared, extend the rows' texts, and add each row
        that ended to the index."""
        for b, (tokens, draft) in enumerate(zip(report.blocks, self.drafts)):
            if draft is not None and draft.source == "suffix" and report.sources[b] == self.source:
                self.index.verified(draft, report.kept[b])
            self.rows[b].extend(tokens)
            self.outputs[b] += tokens
            if report.finished[b]:
                self.index.add(self.outputs[b])
        self.drafts = [None] * len(self.rows)

    def select(self, keep: torch.Tensor, kept: list[int]) -> None:
        self.rows = [self.rows[b] for b in kept]
        self.outputs = [self.outputs[b] for b in kept]
        self.drafts = [self.drafts[b] for b in kept]

    def compact(self, longest: int) -> None:
        """No cache to compact."""
