"""A gamma policy for tests: a scripted sequence of gammas, cycled, so that switches between plain
steps (gamma 0) and speculative ones happen where a test wants them."""

import math

from batchspec.decoding.policy import GammaPolicy


class Scripted(GammaPolicy):
    """trees: every speculative step a tree (where the batch can take one)."""

    def __init__(self, gammas: list[int], gamma_max: int, trees: bool = False):
        super().__init__(gamma_max, trees=trees)
        self.gammas, self.steps = gammas, 0

    def choose(self, rows: int, expected, behind: int = 0, left: float = math.inf, context: int = 0) -> int:
        """The script's next gamma; `tree` is left as the test set it."""
        self.steps += 1
        return self.gammas[(self.steps - 1) % len(self.gammas)]

    def batch_rows(self, live: int, rows: int, gamma: int) -> int:
        """Rows that end leave the batch, whatever the steps' timings say (Idling: they stay)."""
        return live


class Idling(Scripted):
    """Scripted gammas, and rows that end stay in the batch, inert, as where more rows were timed
    faster: `keep` of them at most (None: every one, the batch keeps its size)."""

    def __init__(self, gammas: list[int], gamma_max: int, keep: int | None = None):
        super().__init__(gammas, gamma_max)
        self.keep = keep

    def batch_rows(self, live: int, rows: int, gamma: int) -> int:
        return rows if self.keep is None else min(rows, live + self.keep)
