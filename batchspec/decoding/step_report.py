"""What the engine hands the parts around its step: a view of the batch before it (the policy's
plan) and a typed report after it, filled by the step's one host sync, that the tallies, the
gamma policy and the drafter each take."""

from dataclasses import dataclass
from functools import cached_property

import torch

from batchspec.decoding.drafters.proposal import Proposal


@dataclass(frozen=True)
class PlanView:
    """The batch as the policy plans its next step on it (host values)."""

    remaining: list[int]  # per live row: the tokens it may still generate
    behind: int  # tokens the drafter must read before it can propose (a catch-up after plain steps)
    trees: bool  # whether this batch can verify a tree (greedy, a tree drafter, no grammar)


@dataclass
class StepReport:
    """One step over B rows. Glossary: a row proposed `proposed[b]` tokens (a tree: its depth),
    kept `accepted[b]` of them and appended `blocks[b]`: those, then the target's correction of
    the first rejected proposal or its bonus token after all, cut where the row ended."""

    planned: int  # the gamma the policy planned (0: a plain step; the prefill's; a jump-forward's)
    gamma: int  # the width verified, G (0: nothing proposed)
    tree: bool  # the proposal was a tree: accepted counts along each row's accepted path
    nodes: int  # a tree's nodes (0: a chain)
    proposed: list[int]  # per row: proposals (0: none)
    sources: list[str | None]  # per row: what proposed them ("model", "ngram", "jump"; None: nothing)
    accepted: list[int]  # per row: proposals accepted (a tree's: the accepted path's length)
    ranks: list[int]  # per row of a tree: the rank in its depth of the accepted path's end ([] for a chain)
    blocks: list[list[int]]  # per row: the tokens it appended this step
    logprobs: list[list]  # per row: each appended token's (logprob, [(id, logprob)] top) (empty: none asked)
    finished: list[bool]  # per row: it ended this step (it leaves the batch)
    stopped: list[bool]  # per row: it ended on a stop id, EOS or stop string ("stop"; else "length" or an error)
    text_ends: list[int | None]  # per row: where a stop string cut its text
    errors: list[str | None]  # per row: why it could not go on (its grammar's engine failed), else None
    draft_forwards: int  # the draft model's forwards this step
    behind: int  # tokens the drafter read first (> 1: a catch-up, which is no typical step to time)
    longest: int  # the longest row's valid cache slots after the rollback
    slots: int  # the target cache's slots (mask entries) the step ran over, pads and holes included
    empty_slots: int  # of those, pads and holes
    seconds: float | None  # the step's time; None: not timed (a batch's first step, or its first at a new size)
    proposal: Proposal  # on the device: the proposal as checked (a tree's: each row's accepted path)
    n: torch.Tensor  # [B] on the device: accepted

    @property
    def rows(self) -> int:
        return len(self.accepted)

    @cached_property
    def kept(self) -> list[int]:
        """Per row: the accepted proposals its block keeps (a block cut short keeps fewer)."""
        return [min(n, len(block)) for n, block in zip(self.accepted, self.blocks)]

    @cached_property
    def offered(self) -> list[int]:
        """Per row: the proposals that count as checked up to its first rejection. A row that
        proposed nothing in a step that verified proposals (a lookup without a match beside rows
        with one) yielded one token at the step's width, as a row whose first proposal was
        rejected: one."""
        return [k or int(self.planned > 0 and self.gamma > 0) for k in self.proposed]


def checked(accepted: list[int], offered: list[int]) -> list[int]:
    """Per row: proposals checked, up to the first rejection."""
    return [min(n + 1, k) for n, k in zip(accepted, offered)]
