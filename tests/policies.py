"""A gamma policy for tests: a scripted sequence of gammas, cycled, so that switches between plain
steps (gamma 0) and speculative ones happen where a test wants them."""

import math

from batchspec.decoding.policy import GammaPolicy


class Scripted(GammaPolicy):
    """trees: every speculative step a tree (where the batch can take one)."""

    def __init__(self, gammas: list[int], gamma_max: int, trees: bool = False):
        super().__init__(gamma_max, trees=trees)
        self.gammas, self.steps = gammas, 0

    def choose(self, rows: int, expected, behind: int = 0, left: float = math.inf) -> int:
        """The script's next gamma; `tree` is left as the test set it."""
        self.steps += 1
        return self.gammas[(self.steps - 1) % len(self.gammas)]
