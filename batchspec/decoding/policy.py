"""Which gamma each step: a fixed one, or the one the measured costs say pays most (0 included).

A step with gamma proposals gives a row whose proposals are each accepted with probability alpha
  E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)
tokens (Leviathan et al. 2023), never more than the row may still generate, and costs T(B, gamma)
seconds with B live rows: one target forward over gamma+1 positions and gamma draft forwards.
`--gamma auto` picks before every step the gamma in 0..gamma_max with the most expected tokens
per second, sum over rows of E / T (the goodput of SmartSpec, Liu et al. 2024); gamma 0 is a
plain target step, the draft sits out.

- alpha: per row, its own checked proposals (older ones fading) shrunk towards the run's alpha,
  so that rows that copy their prompt and rows that do not are told apart.
- T: whole steps timed as the job runs, by live rows and gamma (a host clock read after the
  step's one sync: no sync added, and on a GPU it holds the launches and the wait alike). A
  gamma not timed yet at B is estimated from those that were (linear in gamma, or carried over
  from the nearest B), tried when that estimate says it pays, and timed then.
- While gamma 0 wins, a probe step with the best gamma > 0 comes after 16 plain steps, then
  after 32, 64, ... 512, and never before the time its estimated loss (what it costs over the
  tokens it should bring) is 1% of the plain steps between probes: a pair that started badly
  can still switch speculation on later, at a bounded price. The loss includes the draft's
  catch-up: its first forward also reads every token it skipped, a cost per row and skipped
  token timed on the steps that did so (those steps do not count towards T).
"""

import math

PRIOR_ALPHA = 0.5  # the run's alpha before any proposal was checked
PRIOR_WEIGHT = 2.0  # proposals' worth of the run's alpha in each row's estimate
ROW_DECAY = 0.95  # per speculative step: acceptance changes along a completion
RUN_DECAY = 0.98
PRIOR_SLOPE = 0.1  # a proposal's cost relative to a plain step, before two gammas were timed
PROBE_FIRST, PROBE_LAST = 16, 512  # plain steps before a probe of speculation (doubling)
PROBE_BUDGET = 0.01  # the most of the time an expected-to-lose probe may take


def expected_tokens(alphas: list[float], remaining: list[int], gamma_max: int) -> list[float]:
    """Tokens a step yields with gamma = 0..gamma_max, summed over rows (host numbers: rows'
    alphas and the tokens each may still generate): E = 1 + a + ... + a^(m-1), m = min(gamma + 1,
    remaining)."""
    totals = [0.0] * (gamma_max + 1)
    for alpha, left in zip(alphas, remaining):
        power, tokens = 1.0, 0.0
        for gamma in range(gamma_max + 1):
            if gamma < left:
                tokens, power = tokens + power, power * alpha
            totals[gamma] += tokens
    return totals


def row_alpha(accepted: float, checked: float, prior: float) -> float:
    """A row's alpha from its decayed accepted and checked proposals, shrunk towards the run's."""
    return (accepted + PRIOR_WEIGHT * prior) / (checked + PRIOR_WEIGHT)


class StepCosts:
    """Seconds per step by (live rows B, gamma): moving averages of timed steps, and estimates
    for cells not timed yet."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.cells: dict[int, dict[int, float]] = {}  # B -> gamma -> seconds

    def add(self, rows: int, gamma: int, seconds: float) -> None:
        cell = self.cells.setdefault(rows, {})
        old = cell.get(gamma)
        cell[gamma] = seconds if old is None else old + self.weight * (seconds - old)

    def estimates(self, rows: int, gamma_max: int) -> list[float] | None:
        """T(rows, g) for g in 0..gamma_max, or None before any step was timed. A batch size
        never timed borrows the nearest one's costs: only their ratios matter to the choice."""
        if not self.cells:
            return None
        near = rows if rows in self.cells else min(self.cells, key=lambda b: (abs(math.log(b / rows)), b))
        timed = self.cells[near]
        if len(timed) == gamma_max + 1:
            return [timed[g] for g in range(gamma_max + 1)]
        slope = self.slope(near)
        return [timed[g] if g in timed else self.between(timed, g, slope) for g in range(gamma_max + 1)]

    @staticmethod
    def between(timed: dict[int, float], gamma: int, slope: float) -> float:
        """Linear between the timed gammas around `gamma`, else from the nearest one along `slope`."""
        below = max((g for g in timed if g < gamma), default=None)
        above = min((g for g in timed if g > gamma), default=None)
        if below is not None and above is not None:
            return timed[below] + (timed[above] - timed[below]) * (gamma - below) / (above - below)
        nearest = below if below is not None else above
        return max(timed[nearest] + (gamma - nearest) * slope, 1e-9)

    def slope(self, rows: int) -> float:
        """Seconds per extra proposal at `rows`: a least-squares line through its timed gammas;
        with one timed gamma, the relative slope of the nearest batch size with two, else
        PRIOR_SLOPE."""
        if len(self.cells[rows]) >= 2:
            return line(self.cells[rows])[1]
        (gamma, seconds), = self.cells[rows].items()
        relative = PRIOR_SLOPE
        fitted = {b: line(timed) for b, timed in self.cells.items() if len(timed) >= 2}
        if fitted:
            intercept, slope = fitted[min(fitted, key=lambda b: abs(math.log(b / rows)))]
            relative = slope / intercept
        return seconds * relative / (1 + relative * gamma)


def line(timed: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope >= 0) of the least-squares line seconds = a + b * gamma."""
    n = len(timed)
    mean_g, mean_s = sum(timed) / n, sum(timed.values()) / n
    spread = sum((g - mean_g) ** 2 for g in timed)
    slope = max(sum((g - mean_g) * (s - mean_s) for g, s in timed.items()) / spread, 0.0)
    return max(mean_s - slope * mean_g, 1e-9), slope


class GammaPolicy:
    """gamma per step. fixed: always that gamma; None: auto, up to gamma_max.

    One policy serves a whole run (the job passes it to every batch): step costs and the run's
    alpha carry over from batch to batch.
    """

    def __init__(self, gamma_max: int, fixed: int | None = None):
        if gamma_max < 1 or (fixed is not None and not 1 <= fixed <= gamma_max):
            raise ValueError(f"need 1 <= gamma <= gamma_max, got gamma {fixed}, gamma_max {gamma_max}")
        self.gamma_max, self.fixed = gamma_max, fixed
        self.costs = StepCosts()
        self.accepted, self.checked = PRIOR_ALPHA * PRIOR_WEIGHT, PRIOR_WEIGHT  # decayed run totals
        self.plain_steps, self.probe_gap = 0, PROBE_FIRST
        self.catch_up: float | None = None  # seconds a step spends per row and token the draft skipped

    @property
    def auto(self) -> bool:
        return self.fixed is None

    @property
    def alpha(self) -> float:
        """The run's per-proposal acceptance, recent proposals weighing most."""
        return self.accepted / self.checked

    def choose(self, rows: int, expected: list[float] | None, behind: int = 0) -> int:
        """The next step's gamma for `rows` live rows. expected[g]: the tokens they are expected
        to yield with gamma g (None: as many rows at the run's alpha); behind: the tokens the
        draft must read before it can propose (host int)."""
        if self.fixed is not None:
            return self.fixed
        costs = self.costs.estimates(rows, self.gamma_max)
        if costs is None:
            return 0  # time a plain step first
        if expected is None:
            a = min(self.alpha, 1 - 1e-6)
            expected = [rows * (1 - a ** (g + 1)) / (1 - a) for g in range(self.gamma_max + 1)]
        rates = [tokens / seconds for tokens, seconds in zip(expected, costs)]
        best = max(range(len(rates)), key=rates.__getitem__)
        if best:
            self.plain_steps, self.probe_gap = 0, PROBE_FIRST
            return best
        self.plain_steps += 1
        probe = max(range(1, len(rates)), key=rates.__getitem__)
        catch_up = (self.catch_up or 0.0) * rows * behind
        loss = (costs[probe] + catch_up) / costs[0] - expected[probe] / expected[0]  # in plain steps: cost - yield
        if self.plain_steps < max(self.probe_gap, loss / PROBE_BUDGET):
            return 0
        self.plain_steps, self.probe_gap = 0, min(2 * self.probe_gap, PROBE_LAST)
        return probe

    def observe(self, rows: int, gamma: int, accepted: int, checked: int, seconds: float | None,
                behind: int = 0) -> None:
        """A step's outcome: proposals accepted and checked (all rows), its seconds (None: not
        timed) and the tokens the draft read first (behind > 1: a catch-up, timed apart)."""
        if gamma:
            self.accepted = RUN_DECAY * self.accepted + accepted
            self.checked = RUN_DECAY * self.checked + checked
        if seconds is None:
            return
        if not gamma or behind <= 1:
            self.costs.add(rows, gamma, seconds)
            return
        costs = self.costs.estimates(rows, self.gamma_max)
        if costs is not None:
            per_token = max(seconds - costs[gamma], 0.0) / (rows * behind)
            self.catch_up = per_token if self.catch_up is None else self.catch_up + 0.2 * (per_token - self.catch_up)
