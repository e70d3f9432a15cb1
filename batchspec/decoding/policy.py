"""Which gamma each step: a fixed one, or with auto the one whose expected work per second is the
most, gamma 0 (a plain target step, the draft sitting out) included, speculation only where it
promises MARGIN more than a plain step (the best of noisy estimates reads high). Two calls:
plan(view) -> (gamma, tree) before a step, record(report) after it; everything the choice reads is
kept here.

A step of gamma proposals, each accepted with probability alpha, yields a row
E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha) tokens (Leviathan et al. 2023), never more
than it may still generate, and costs T(B, gamma) seconds at B rows. A static batch lasts as long
as its longest completion, so a step's work is priced as what it takes off the time plain steps
would need to finish the batch: with T(B, 0) = c + d * B, c * (how much the longest remainder
shrinks) + d * (the tokens all rows gain). The longest remainder shrinks by its row's yield times
the share a batch's end keeps when yields vary and rows' alphas differ (tail_share).

The derivation, each rule's reason and its measured worth: docs/gamma-policy.md.
"""

import math
import statistics
from collections import deque
from statistics import NormalDist
from typing import NamedTuple

from batchspec.decoding.step_report import checked as checked_of

PRIOR_ALPHA = 0.5  # the run's alpha before any proposal was checked
PRIOR_WEIGHT = 8.0  # proposals' worth of the prior in the run's alpha (of PRIOR_ALPHA in its overall alpha)
RUN_DECAY = 0.98  # per speculative step: older proposals weigh less
PLAIN_DECAY = 0.995  # per plain step: the run's alpha fades towards its overall one, so speculation is retried
MARGIN = 0.03  # the least gain in work per second over a plain step that speculation needs
PROBE_FIRST, PROBE_LAST = 16, 512  # plain steps before a probe of speculation (doubling)
BUDGET = 0.01  # the most of the time a probe or a re-timing expected to lose may take
RETIME_GAP = 16  # speculative steps at least between two re-timings of another choice
TIMINGS = 3  # a cell's cost: the median of its last TIMINGS timings (calibration: its cells full)
CALIBRATION = (0, 1, 3)  # gammas timed at a batch size first met, none calibrated within NEAR of it (3: or gamma_max)
NEAR = 2.0  # a batch size within this factor of a calibrated one is priced by its cost ratios
MIN_RISE = 0.05  # the least a proposal adds to a step, in plain steps, on the line through the gammas timed
PRIOR_FIXED_SHARE = 0.5  # c / T(B, 0) before plain steps were timed at several batch sizes
FIXED_PRIOR = 8.0  # rows^2: the prior's weight in the line through the plain steps (fixed_share)
TREE_LIFT = 1.25  # a tree's alpha over the chain's before any tree was checked


def chain_tokens(alpha: float, gamma: int) -> float:
    """E(alpha, gamma): a row's expected tokens from a chain of gamma proposals."""
    a = min(alpha, 1 - 1e-6)
    return (1 - a ** (gamma + 1)) / (1 - a)


def expected(alpha: float, remaining: list[int], gamma_max: int, spread: float) -> tuple[list[float], list[float]]:
    """Per gamma 0..gamma_max: the tokens the rows are expected to gain in all, and how much the
    longest remainder shrinks (its row's mean yield times tail_share). The rows share the run's
    alpha; spread: the variance of their true alphas about it, which spreads their mean yields by
    spread * (dE/dalpha)^2."""
    tokens = [sum(chain_tokens(alpha, min(g, left - 1)) for left in remaining) for g in range(gamma_max + 1)]
    longest, critical = max(remaining), []
    for gamma in range(gamma_max + 1):
        slots = range(min(gamma + 1, longest))  # the tokens the longest row may gain: 1 + k, k in slots
        mean = sum(alpha**k for k in slots)
        variance = sum((2 * k + 1) * alpha**k for k in slots) - mean**2
        slope = sum(k * alpha ** (k - 1) for k in slots if k)  # dE/dalpha
        critical.append(mean * tail_share(longest, mean, variance, len(remaining), spread * slope**2))
    return tokens, critical


def tail_share(longest: int, mean: float, variance: float, rows: int, apart: float = 0.0) -> float:
    """The share of a row's mean yield by which a batch's end comes nearer a step: the longest
    remainder takes steps = longest / mean, and the last of `rows` rows lags behind by z (the
    expected largest of `rows` standard normals, Blom's) times the spread of the steps a row
    takes, sqrt(variance * steps) / mean from its yields' noise, and from the rows' paces (their
    mean yields spread by `apart`) the slowest's, mean - z sqrt(apart), taking longest / that
    steps; the two lags add in quadrature."""
    if rows < 2 or variance + apart <= 0 or longest <= 0:
        return 1.0
    z = NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))
    steps = longest / mean
    noise_lag = z * math.sqrt(variance * steps) / mean
    pace_lag = longest / max(mean - z * math.sqrt(apart), 1.0) - steps
    return steps / (steps + math.hypot(noise_lag, pace_lag))


def line(points: dict[float, float], prior: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line y = a + b * x through points {x: y}, the slope
    shrunk towards prior[0] with prior[1] (in x^2) of weight (ridge regression)."""
    n = len(points)
    mean_x, mean_y = sum(points) / n, sum(points.values()) / n
    spread = sum((x - mean_x) ** 2 for x in points) + prior[1]
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points.items()) + prior[0] * prior[1]) / spread
    return mean_y - slope * mean_x, slope


class StepCosts:
    """Seconds per step by (rows B, gamma, tree): each cell the median of its last TIMINGS
    timings, so that one stall does not move it, nor one step timed alone among steps of another
    choice (a probe's, a re-timing's), which reads slower than in a run of them; a machine that
    did slow down moves it within two timings. Cells not timed are priced along a line through
    the gammas timed at B, and a batch size not calibrated by the nearest calibrated one's costs,
    scaled by the cells both timed."""

    def __init__(self, gamma_max: int):
        self.calibration = sorted({min(g, gamma_max) for g in CALIBRATION})  # plain, and two gammas where there are
        self.cells: dict[tuple[int, int, bool], deque] = {}
        self.timings = 0
        self.timed_at: dict[tuple[int, int, bool], int] = {}  # a cell -> the timing that last updated it

    def add(self, rows: int, gamma: int, tree: bool, seconds: float) -> None:
        cell = (rows, gamma, tree)
        self.cells.setdefault(cell, deque(maxlen=TIMINGS)).append(seconds)
        self.timings += 1
        self.timed_at[cell] = self.timings

    def cost(self, rows: int, gamma: int, tree: bool = False) -> float | None:
        timings = self.cells.get((rows, gamma, tree))
        return statistics.median(timings) if timings else None

    def calibrated(self, rows: int) -> bool:
        """Whether calibration's cells at rows are full (TIMINGS timings each: one timing, a stall,
        would set the run's ratios)."""
        return all(len(self.cells.get((rows, g, False), ())) == TIMINGS for g in self.calibration)

    def calibrating(self, rows: int) -> int | None:
        """The gamma to time next at `rows` when no batch size within NEAR of it was calibrated
        (None: none to time)."""
        if any(self.calibrated(b) and abs(math.log(b / rows)) <= math.log(NEAR) for b, _, _ in self.cells):
            return None
        return next((g for g in self.calibration if len(self.cells.get((rows, g, False), ())) < TIMINGS), None)

    def estimates(self, rows: int, gamma_max: int, tree: bool = False) -> list[float]:
        """T(rows, g) for g in 0..gamma_max (a tree's: the chain's where no tree was timed): the
        nearest calibrated batch size's, scaled by the median ratio of the cells timed at both."""
        base = min((b for b, _, _ in self.cells if self.calibrated(b)), key=lambda b: (abs(math.log(b / rows)), b))
        ratios = [self.cost(rows, g, t) / self.cost(base, g, t) for b, g, t in self.cells if b == rows
                  and (base, g, t) in self.cells]
        scale = statistics.median(ratios) if ratios and base != rows else 1.0
        timed = {g: self.cost(base, g) for b, g, t in self.cells if b == base and not t}
        drafted = {g: seconds for g, seconds in timed.items() if g}
        intercept, slope = line(drafted if len(drafted) >= 2 else timed)
        slope = max(slope, MIN_RISE * timed[0])  # each proposal adds a draft forward at least
        chain = [timed.get(g, max(intercept + slope * g, timed[0])) for g in range(gamma_max + 1)]
        own = [self.cost(base, g, True) if tree else None for g in range(gamma_max + 1)]
        return [scale * (mine or theirs) for mine, theirs in zip(own, chain)]

    def fixed_share(self, rows: int) -> float:
        """c / T(rows, 0), where T(B, 0) = c + d * B: a least-squares line through the plain
        steps timed at each batch size, its slope d shrunk towards (1 - PRIOR_FIXED_SHARE) of the
        mean plain step per mean row with FIXED_PRIOR rows^2 of weight."""
        plain = {b: self.cost(b, 0) for b, g, t in self.cells if g == 0}  # B -> seconds
        prior = (1 - PRIOR_FIXED_SHARE) * sum(plain.values()) / sum(plain)  # d: seconds a row
        c, d = line(plain, prior=(prior, FIXED_PRIOR))
        c = max(c, 1e-9)
        return c / (c + max(d, 0.0) * rows)


class Choice(NamedTuple):
    rate: float  # expected work per second (a plain step's: 1)
    gamma: int
    tree: bool
    work: float  # the step's expected work, in seconds of plain steps
    seconds: float  # its expected cost


def loss(other: Choice, best: Choice) -> float:
    """What a step of `other` instead of `best` is expected to lose, in best's steps."""
    return other.seconds / best.seconds - other.work / best.work


class GammaPolicy:
    """gamma per step. fixed: always that gamma; None: auto, up to gamma_max. trees: a tree may be
    proposed instead of a chain, always with a fixed gamma, where it pays with auto. One policy
    serves a whole run (a job passes it to every batch): what it measured carries over."""

    def __init__(self, gamma_max: int, fixed: int | None = None, trees: bool = False):
        if gamma_max < 1 or (fixed is not None and not 1 <= fixed <= gamma_max):
            raise ValueError(f"need 1 <= gamma <= gamma_max, got gamma {fixed}, gamma_max {gamma_max}")
        self.gamma_max, self.fixed, self.trees = gamma_max, fixed, trees
        self.costs = StepCosts(gamma_max)
        self.ran: set[tuple[int, int, bool]] = set()  # cells that ran once: a shape's first run is not timed
        self.accepted, self.checked = 0.0, 0.0  # the chains' proposals, faded
        self.run_accepted, self.run_checked = 0, 0  # all the run's chain proposals
        self.tree_accepted, self.tree_checked = 0.0, 0.0  # along the trees' accepted paths, faded
        self.live: list[tuple[int, int]] = []  # per live row: its proposals accepted and checked so far
        self.ended = (0, 0.0, 0.0, 0.0, 0.0)  # rows ended: count; accepted, checked, accepted^2 / checked, checked^2
        self.plain_steps, self.probe_gap = 0, PROBE_FIRST
        self.since_retime, self.credit = 0, 0.0  # speculative steps since a re-timing, the loss it may spend
        self.repeat: tuple[int, bool] | None = None  # a probe's choice, once more: its first step caught the draft up

    @property
    def auto(self) -> bool:
        return self.fixed is None

    @property
    def alpha(self) -> float:
        """The run's acceptance, recent proposals weighing most, with PRIOR_WEIGHT proposals'
        worth of the higher of PRIOR_ALPHA and all the run's proposals' alpha: evidence fades
        towards that on plain steps, so a run that stopped on a low estimate tries again."""
        overall = (self.run_accepted + PRIOR_WEIGHT * PRIOR_ALPHA) / (self.run_checked + PRIOR_WEIGHT)
        return (self.accepted + PRIOR_WEIGHT * max(PRIOR_ALPHA, overall)) / (self.checked + PRIOR_WEIGHT)

    @property
    def tree_alpha(self) -> float:
        """The same along the trees' accepted paths, from TREE_LIFT times the chains' before any."""
        prior = min(TREE_LIFT * self.alpha, 1 - 1e-3)
        return (self.tree_accepted + PRIOR_WEIGHT * prior) / (self.tree_checked + PRIOR_WEIGHT)

    @property
    def spread(self) -> float:
        """The variance of the run's rows' alphas about its mean, from the rows that ended, each
        weighing its checked proposals, less what their noise alpha (1 - alpha) / checked
        spreads them by (DerSimonian and Laird's); 0 before two rows ended."""
        rows, accepted, checked, accepted_squares, checked_squares = self.ended
        if rows < 2:
            return 0.0
        alpha = accepted / checked
        spread = accepted_squares - accepted**2 / checked - (rows - 1) * alpha * (1 - alpha)
        return max(spread / (checked - checked_squares / checked), 0.0)

    def plan(self, view) -> tuple[int, bool]:
        """The next step's gamma, and whether a tree, for the batch `view` (step_report.PlanView)."""
        if self.fixed is not None:
            return self.fixed, self.trees and view.trees
        if self.repeat:
            (gamma, tree), self.repeat = self.repeat, None
            return gamma, tree
        rows = len(view.remaining)
        gamma = self.costs.calibrating(rows)
        if gamma is not None:
            return gamma, False
        choices = self.choices(view)
        best = max(choices, key=lambda c: c.rate)  # the first of equals: chains before trees
        if best.rate < (1 + MARGIN) * choices[0].rate:  # choices[0]: the plain step
            return self.probe(choices, view.behind)
        self.plain_steps, self.probe_gap = 0, PROBE_FIRST
        best = self.retime(rows, best, choices)
        return best.gamma, best.tree

    def choices(self, view) -> list[Choice]:
        """Each choice's expected work per second: the plain step, chains of 1..gamma_max, and
        trees of those depths where the batch can take one."""
        rows = len(view.remaining)
        tokens, critical = expected(self.alpha, view.remaining, self.gamma_max, self.spread)
        costs = self.costs.estimates(rows, self.gamma_max)
        c = self.costs.fixed_share(rows) * costs[0]
        work = [c * shrinks + (costs[0] - c) / rows * gains for gains, shrinks in zip(tokens, critical)]
        choices = [Choice(w / s, g, False, w, s) for g, (w, s) in enumerate(zip(work, costs))]
        if self.trees and view.trees:
            lift = [chain_tokens(self.tree_alpha, g) / chain_tokens(self.alpha, g) for g in range(len(work))]
            tree_costs = self.costs.estimates(rows, self.gamma_max, tree=True)
            choices += [Choice(w * up / s, g, True, w * up, s)
                        for g, (w, up, s) in enumerate(zip(work, lift, tree_costs)) if g]
        return choices

    def probe(self, choices: list[Choice], behind: int) -> tuple[int, bool]:
        """A plain step, or, once PROBE_FIRST plain steps passed (doubling to PROBE_LAST between
        probes) and the probe's expected loss is BUDGET of the plain steps since the last, the
        best speculative choice, for two steps when the draft must first catch up (that one is
        not timed): so a pair that started badly, or a machine that changed, switches speculation
        on again at a bounded price."""
        self.plain_steps += 1
        probe = max((c for c in choices if c.gamma), key=lambda c: c.rate)
        steps = 2 if behind > 1 else 1
        if self.plain_steps < max(self.probe_gap, steps * (probe.seconds - probe.work) / choices[0].seconds / BUDGET):
            return 0, False
        self.plain_steps, self.probe_gap = 0, min(2 * self.probe_gap, PROBE_LAST)
        self.repeat = (probe.gamma, probe.tree) if steps == 2 else None
        return probe.gamma, probe.tree

    def retime(self, rows: int, best: Choice, choices: list[Choice]) -> Choice:
        """best, or now and then (RETIME_GAP steps apart, once the steps since the last have
        earned BUDGET each of its expected loss) the choice next to it (the plain step, one
        gamma under or over, chain or tree) timed longest ago at `rows`, or never: a cost is
        timed only when its choice runs, and a slow timing would otherwise stand for good (or
        a line through costs timed long ago price the gammas past best)."""
        self.since_retime, self.credit = self.since_retime + 1, self.credit + BUDGET
        if self.since_retime < RETIME_GAP:
            return best
        near = [c for c in choices if (not c.gamma or abs(c.gamma - best.gamma) <= 1) and c[1:3] != best[1:3]]
        oldest = min(near, key=lambda c: self.costs.timed_at.get((rows, c.gamma, c.tree), 0), default=None)
        if oldest is None or self.credit < loss(oldest, best):
            return best
        self.since_retime, self.credit = 0, 0.0
        return oldest

    def record(self, report) -> None:
        """A step's outcome (step_report.StepReport): the rows' acceptance, and its time at its
        shape, unless the shape ran there for the first time or the draft caught up first."""
        self.count_rows(report)
        if report.gamma and not report.planned:  # a plain step's jump-forward: no choice of the policy's
            return
        accepted, checked = sum(report.accepted), sum(checked_of(report.accepted, report.offered))
        if report.tree:
            self.tree_accepted = RUN_DECAY * self.tree_accepted + accepted
            self.tree_checked = RUN_DECAY * self.tree_checked + checked
        elif report.gamma:
            self.accepted, self.checked = RUN_DECAY * self.accepted + accepted, RUN_DECAY * self.checked + checked
            self.run_accepted, self.run_checked = self.run_accepted + accepted, self.run_checked + checked
        else:
            self.accepted, self.checked = PLAIN_DECAY * self.accepted, PLAIN_DECAY * self.checked
        cell = (report.rows, report.gamma, report.tree)
        caught_up = report.gamma and report.behind > 1  # the draft first read what it skipped
        if report.seconds is not None and not caught_up and cell in self.ran:
            self.costs.add(*cell, report.seconds)
        self.ran.add(cell)

    def count_rows(self, report) -> None:
        """Each live row's proposals accepted and checked over its completion; the rows that
        ended this step go into the run's spread of alphas. The rows of a report are the live
        rows of the last one, less those that ended (a new batch starts when none is left)."""
        if len(self.live) != report.rows:
            self.live = [(0, 0)] * report.rows
        kept = report.kept
        rows = [(a + k, c + n) for (a, c), k, n in zip(self.live, kept, checked_of(kept, report.offered))]
        for (accepted, checked), done in zip(rows, report.finished):
            if done and checked:
                count, *sums = self.ended
                more = (accepted, checked, accepted**2 / checked, checked**2)
                self.ended = (count + 1, *(s + m for s, m in zip(sums, more)))
        self.live = [row for row, done in zip(rows, report.finished) if not done]
