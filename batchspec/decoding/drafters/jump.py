"""Jump-forward: where a row's grammar allows one continuation only (`{"name":"` at the start of
an object whose first key is required, `","age":` between two required keys, the EOS once the
grammar is complete), propose that text's tokens. No draft forward; the target, masked by the
same grammar, accepts them unless it prefers another tokenization of the same text."""

from batchspec.decoding.drafters.proposal import Proposal, looked_up
from batchspec.decoding.grammar import GrammarRows


class JumpDrafter:
    source = "jump"
    behind = 0  # it reads the grammar's state, which the engine keeps current

    def __init__(self, grammar: GrammarRows, device):
        self.grammar, self.device = grammar, device

    def lookup(self, b: int, gamma: int) -> list[int]:
        return self.grammar.forced(b, gamma)

    def propose(self, last, gamma: int, params, u, process=None) -> Proposal:
        return looked_up([self], len(last), gamma, self.device)

    def verified(self, report) -> None:
        """The engine advances the grammar."""

    def select(self, keep, kept: list[int]) -> None:
        """The engine selects the grammar's rows."""

    def compact(self, longest: int) -> None:
        """No cache to compact."""
