"""Several draft models (`--draft A --draft B`): each proposes its own chain and the chains,
merged into a trie (decoding/tree.py), are checked in one target forward. Different drafts guess
wrong in different places, so the row keeps the longest chain the target agrees with.

The trie is laid out depth by depth, [d_1 of each draft, d_2 of each draft, ...]; where chains
agree on their first i tokens the later ones hang below the first's node (their own copy at that
depth stays, childless: a tie the acceptance walk breaks towards the first). After the check each
draft keeps the part of the accepted path that is its own chain and owes the rest, which it
reads with its next forward, as after any step it did not draft.

On a chain step (the gamma policy found trees do not pay, or a sampled batch) only the first
draft proposes; the others sit out and catch up later.
"""

from dataclasses import replace

import torch

from batchspec.decoding.drafters.model import ModelDrafter
from batchspec.decoding.drafters.proposal import Proposal
from batchspec.decoding.sampling import SamplingParams

GREEDY = SamplingParams()


def merged_parents(chains: torch.Tensor) -> torch.Tensor:
    """chains [B, G, K] (depth, draft) -> parents [B, G*K]: each node's parent slot in [root,
    nodes depth by depth], the first chain that agrees with the node's own up to its parent."""
    B, G, K = chains.shape
    agree = (chains[:, :, :, None] == chains[:, :, None, :]).long().cumprod(1)  # [B, G, K, K]: through depth i
    first = agree.argmax(-1)  # [B, G, K]: the first chain agreeing with each through depth i (itself at worst)
    below = 1 + torch.arange(G - 1, device=chains.device)[None, :, None] * K + first[:, :-1]  # [B, G-1, K]
    return torch.cat([chains.new_zeros(B, 1, K), below], dim=1).flatten(1)


class SeveralDrafters:
    def __init__(self, drafters: list[ModelDrafter]):
        self.drafters = drafters
        self.chains: torch.Tensor | None = None  # [B, G, K] the last tree's chains

    @property
    def behind(self) -> int:
        return max(d.behind for d in self.drafters)

    def propose(self, last: torch.Tensor, gamma: int, params, u, process=None) -> Proposal:
        """A chain step: the first draft's."""
        return self.drafters[0].propose(last, gamma, params, u, process)

    def propose_tree(self, last: torch.Tensor, gamma: int) -> Proposal:
        """Each draft's greedy chain of gamma, merged: tokens and parents [B, gamma × drafts]."""
        chains = [d.propose(last, gamma, GREEDY, None) for d in self.drafters]
        self.chains = torch.stack([c.tokens for c in chains], dim=2)  # [B, G, K]
        B, K = last.shape[0], len(chains)
        return Proposal(self.chains.flatten(1), None, [gamma] * B, ["model"] * B, forwards=gamma * K,
                        parents=merged_parents(self.chains), nodes=gamma * K)

    def verified(self, report) -> None:
        proposal, n = report.proposal, report.n
        if proposal.path is None:  # a chain of the first draft (or a plain step): the others sat out
            self.drafters[0].verified(report)
            sat_out = replace(report, proposal=replace(proposal, forwards=0))
            for drafter in self.drafters[1:]:
                drafter.verified(sat_out)
            return
        path = proposal.tokens  # [B, G]: each row's accepted path (its first n)
        for k, drafter in enumerate(self.drafters):
            drafter.noted(report.blocks)
            common = (self.chains[:, :, k] == path).long().cumprod(-1).sum(-1).minimum(n)  # [B]
            drafter.kept(path, n, common, max(report.accepted))

    def select(self, keep: torch.Tensor, kept: list[int]) -> None:
        for drafter in self.drafters:
            drafter.select(keep, kept)

    def compact(self, longest: int) -> None:
        for drafter in self.drafters:
            drafter.compact(longest)
