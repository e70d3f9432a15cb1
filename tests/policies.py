"""A gamma policy for tests: a scripted sequence of gammas, cycled, so that switches between plain
steps (gamma 0) and speculative ones happen where a test wants them."""

from batchspec.decoding.policy import GammaPolicy


class Scripted(GammaPolicy):
    """trees: every speculative step a tree (where the batch can take one); a test may set `tree`
    between steps."""

    def __init__(self, gammas: list[int], gamma_max: int, trees: bool = False):
        super().__init__(gamma_max, trees=trees)
        self.gammas, self.steps, self.tree = gammas, 0, trees

    def plan(self, view) -> tuple[int, bool]:
        """The script's next gamma, a tree where `tree` is set."""
        self.steps += 1
        gamma = self.gammas[(self.steps - 1) % len(self.gammas)]
        return gamma, self.tree and gamma > 0
