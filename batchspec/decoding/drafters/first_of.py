"""Host drafters tried in order: each row takes the first one's proposal that has any (the
grammar's forced text before an n-gram match)."""

from batchspec.decoding.drafters.proposal import Proposal, looked_up


class FirstOf:
    behind = 0  # host drafters read every token as the step's sync brings it

    def __init__(self, drafters: list):
        self.drafters = drafters

    def propose(self, last, gamma: int, params, u, process=None) -> Proposal:
        return looked_up(self.drafters, len(last), gamma, last.device)

    def verified(self, report) -> None:
        for drafter in self.drafters:
            drafter.verified(report)

    def select(self, keep, kept: list[int]) -> None:
        for drafter in self.drafters:
            drafter.select(keep, kept)

    def compact(self, longest: int) -> None:
        """No cache to compact."""
