"""A host lookup (n-gram, a grammar's forced text) where a row has one, the draft model elsewhere.

A lookup costs next to nothing and, where the output copies its input (or the grammar allows
one continuation), is accepted far more often than a small model's guess; the model covers the
other rows. When every row has a match the model sits out the step and owes the accepted tokens
(ModelDrafter catches up in its next forward); when it runs, rows that took the lookup's
proposal keep only `last` in the draft cache and owe their accepted tokens likewise, so the
cache holds each row's true context either way.
"""

import torch

from batchspec.decoding.drafters.model import ModelDrafter
from batchspec.decoding.drafters.proposal import Proposal, on_device
from batchspec.decoding.sampling import one_hot


class HybridDrafter:
    def __init__(self, model: ModelDrafter, lookup):
        """lookup: a host drafter (NgramDrafter, JumpDrafter, or FirstOf of them)."""
        self.model, self.lookup = model, lookup

    @property
    def behind(self) -> int:
        return self.model.behind

    def propose(self, last: torch.Tensor, gamma: int, params, u, process=None) -> Proposal:
        looked = self.lookup.propose(last, gamma, params, u)
        if all(looked.lengths):  # every row has a match
            return looked
        drafted = self.model.propose(last, gamma, params, u, process)
        matched = on_device([k > 0 for k in looked.lengths], last.device, torch.bool)[:, None]  # [B, 1]
        tokens = drafted.tokens.clone()  # [B, G]
        tokens[:, : looked.width] = torch.where(matched, looked.tokens, tokens[:, : looked.width])
        q = drafted.q
        if q is not None:  # a looked-up proposal is certain: q one-hot
            q = torch.where(matched[:, :, None], one_hot(tokens, q), q)  # [B, G, V]
        lengths = [k or gamma for k in looked.lengths]
        sources = [source or "model" for source in looked.sources]
        return Proposal(tokens, q, lengths, sources, drafted.forwards)

    def verified(self, report) -> None:
        self.lookup.verified(report)
        self.model.verified(report)

    def select(self, keep: torch.Tensor, kept: list[int]) -> None:
        self.lookup.select(keep, kept)
        self.model.select(keep, kept)

    def compact(self, longest: int) -> None:
        self.model.compact(longest)
