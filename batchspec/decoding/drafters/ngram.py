"""Prompt lookup (n-gram) drafting: propose what followed the latest earlier occurrence of a row's
last n tokens in its own context (prompt and output so far), the longest n in n_min..n_max first.

Each row keeps an index from every n-gram of its context to the position right after its latest
occurrence, extended with the tokens each step appends: a lookup is n_max - n_min + 1 dictionary
reads per row, whatever the context's length. Contexts and indexes live on the host, where the
step's one sync already brings the new tokens; proposals go to the device in one copy that does
not wait for it.

A match whose continuation starts at `end` in a context of L tokens proposes the tokens from
`end` on, and where they run into the row's own end the copy goes on with period L - end (a
repeating pattern keeps repeating): up to gamma tokens. No match: the row proposes nothing.
Proposals are deterministic, so q is one-hot (Proposal.q None).
"""

import torch

from batchspec.decoding.drafters.proposal import Proposal, looked_up


class NgramDrafter:
    source = "ngram"
    behind = 0  # it reads every token as the step's sync brings it

    def __init__(self, prompts: list[list[int]], n_min: int, n_max: int, device: torch.device):
        self.n_min, self.n_max, self.device = n_min, n_max, device
        self.contexts: list[list[int]] = [[] for _ in prompts]
        self.index: list[dict[tuple, int]] = [{} for _ in prompts]  # n-gram -> where its latest continuation starts
        for b, prompt in enumerate(prompts):
            self.add(b, prompt)

    def add(self, b: int, tokens: list[int]) -> None:
        """Append tokens to row b's context, indexing the n-grams each one continues."""
        context, index = self.contexts[b], self.index[b]
        for token in tokens:
            end = len(context)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                index[tuple(context[end - n :])] = end
            context.append(token)

    def lookup(self, b: int, gamma: int) -> list[int]:
        """Up to gamma tokens continuing row b's longest matched suffix ([] when none matches)."""
        context, index = self.contexts[b], self.index[b]
        L = len(context)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            end = index.get(tuple(context[L - n :]))
            if end is not None:
                return [context[end + k % (L - end)] for k in range(gamma)]
        return []

    def propose(self, last, gamma: int, params, u, process=None) -> Proposal:
        return looked_up([self], len(self.contexts), gamma, self.device)

    def verified(self, report) -> None:
        for b, tokens in enumerate(report.blocks):
            self.add(b, tokens)

    def select(self, keep: torch.Tensor, kept: list[int]) -> None:
        self.contexts = [self.contexts[b] for b in kept]
        self.index = [self.index[b] for b in kept]

    def compact(self, longest: int) -> None:
        """No cache to compact."""
