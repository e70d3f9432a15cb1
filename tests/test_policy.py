"""The gamma policy alone, through its two calls (plan, record): synthetic acceptance and step
costs, no models, no clocks. What it must do, whatever its constants: pick what the formula says,
settle a useless draft on plain steps and a perfect one on gamma max, switch speculation on later
for a pair that starts badly, replace step costs timed on another machine, and keep a static
batch's speculation off where its slowest rows make it lose."""

import random
from collections import deque

import pytest

from batchspec.decoding.policy import (MARGIN, PROBE_LAST, GammaPolicy, StepCosts, chain_tokens, expected,
                                       tail_share)
from batchspec.decoding.step_report import PlanView, StepReport


def report(rows: int, gamma: int, seconds: float | None = None, accepted: list[int] | None = None,
           planned: int | None = None, tree: bool = False, finished: list[bool] | None = None,
           behind: int = 0) -> StepReport:
    """A step's report as the engine hands it to the policy (blocks of accepted + 1 tokens)."""
    accepted = accepted if accepted is not None else [0] * rows
    return StepReport(
        planned=gamma if planned is None else planned, gamma=gamma, tree=tree, nodes=0, proposed=[gamma] * rows,
        sources=["model" if gamma else None] * rows, accepted=accepted, ranks=[],
        blocks=[[0] * (n + 1) for n in accepted],
        logprobs=[[]] * rows, finished=finished or [False] * rows, stopped=[False] * rows, text_ends=[None] * rows,
        errors=[None] * rows, draft_forwards=gamma, behind=behind, longest=0, slots=0, empty_slots=0, seconds=seconds,
        proposal=None, n=None)


def accepts(rng: random.Random, alpha: float, gamma: int, left: int = 10**9) -> int:
    """Proposals accepted of gamma, each with probability alpha until the first rejection (a
    row with `left` tokens to go keeps at most left - 1 of them)."""
    n = 0
    while n < min(gamma, left - 1) and rng.random() < alpha:
        n += 1
    return n


def decode(policy: GammaPolicy, alpha, cost, lengths: list[int], rng: random.Random, alphas=None,
           steps: int | None = None) -> tuple[float, list[int]]:
    """A static batch as the engine decodes it (at most `steps` steps): rows of `lengths` tokens,
    each accepting at alpha(step) (or its own alphas[b]), steps costing cost(rows, gamma); the
    prefill's plain step first, steps over a new number of rows untimed, the draft catching up
    after plain steps. Returns the batch's seconds and the gammas chosen."""
    left, alphas = list(lengths), alphas or [None] * len(lengths)
    seconds, chosen, rows_before, behind = 0.0, [], None, 100
    while left and len(chosen) != steps:
        rows, step = len(left), len(chosen)
        gamma, tree = policy.plan(PlanView(left, behind, False)) if chosen else (0, False)
        accepted = [accepts(rng, a if a is not None else alpha(step), gamma, k) for a, k in zip(alphas, left)]
        left = [k - n - 1 for k, n in zip(left, accepted)]
        took = cost(rows, gamma)
        seconds += took
        policy.record(report(rows, gamma, took if rows == rows_before else None, accepted, behind=behind,
                             finished=[k <= 0 for k in left]))
        alphas = [a for a, k in zip(alphas, left) if k > 0]
        left, rows_before, behind = [k for k in left if k > 0], rows, 0 if gamma else behind + 1
        chosen.append(gamma)
    return seconds, chosen


def run(policy: GammaPolicy, alpha, cost, steps: int, rows: int = 1, seed: int = 0) -> list[int]:
    """`steps` steps of rows that never end; returns the gammas chosen (the prefill's included)."""
    return decode(policy, alpha, cost, [10**9] * rows, random.Random(seed), steps=steps)[1]


class Plain(GammaPolicy):
    def plan(self, view):
        return 0, False


def batches_speed(cost, lengths, alpha: float = 0.5, alpha_sd: float = 0.0, seeds: int = 4, batches: int = 4,
                  fixed: int | None = None) -> float:
    """auto's (or a fixed gamma's) speed over plain steps on static batches of `lengths`, the
    first batch (a warm-up) not counted: the mean over seeds of the seconds' ratio."""
    ratios = []
    for seed in range(seeds):
        times = {}
        for name, policy in (("plain", Plain(8)), ("auto", GammaPolicy(8, fixed=fixed))):
            rng = random.Random(seed)
            runs = [[min(max(rng.gauss(alpha, alpha_sd), 0.0), 1.0) for _ in lengths] for _ in range(batches + 1)]
            times[name] = [decode(policy, None, cost, lengths, rng, alphas)[0] for alphas in runs][1:]
            times[name] = sum(times[name])
        ratios.append(times["plain"] / times["auto"])
    return sum(ratios) / len(ratios)


def by_formula(alpha: float, cost, gamma_max: int) -> int:
    """argmax over gamma of E(alpha, gamma) / T(gamma); a plain step unless that beats it by MARGIN."""
    rate = [chain_tokens(alpha, g) / cost(g) for g in range(gamma_max + 1)]
    best = max(range(gamma_max + 1), key=rate.__getitem__)
    return best if rate[best] >= (1 + MARGIN) * rate[0] else 0


@pytest.mark.parametrize("alpha, base, per_draft", [
    (0.9, 1.0, 0.05),  # cheap draft, good acceptance: a long gamma
    (0.6, 1.0, 0.2),
    (0.8, 1.0, 0.6),  # a draft as dear as half the target: short
    (0.2, 1.0, 0.3),  # poor acceptance: plain steps
])
def test_a_row_alone_takes_what_the_formula_says(alpha, base, per_draft):
    """One row, acceptance alpha, steps of base + per_draft * gamma: after its first steps the
    policy settles on the formula's gamma (its neighbours re-timed now and then)."""
    cost = lambda rows, g: base + per_draft * g  # noqa: E731
    chosen = run(GammaPolicy(8), lambda step: alpha, cost, steps=1500)
    late = chosen[-500:]
    best = by_formula(alpha, lambda g: cost(1, g), 8)
    assert max(set(late), key=late.count) == best and late.count(best) > 0.9 * len(late)


def settled(policy: GammaPolicy, alpha: float, cost, rows: int = 1) -> GammaPolicy:
    """The policy after a run that measured acceptance alpha on 10^5 proposals and timed every
    gamma at `rows` rows (each after its shape's first run, which is not timed)."""
    policy.record(report(10**5, 1, accepted=[1] * round(alpha * 10**5) + [0] * round((1 - alpha) * 10**5)))
    for gamma in range(policy.gamma_max + 1):
        for _ in range(5):
            policy.record(report(rows, gamma, cost(rows, gamma)))
    return policy


@pytest.mark.parametrize("gain, chosen", [(0.02, 0), (0.05, 1)])
def test_a_gain_inside_the_margin_stays_plain(gain, chosen):
    """gamma 1 promising 2 % more tokens per second than a plain step is not taken (timings are
    noisy, and the best of noisy estimates reads high); 5 % is."""
    cost = lambda rows, g: 1.5 / (1 + gain) if g else 1.0  # noqa: E731 (E(0.5, 1) = 1.5 tokens)
    assert settled(GammaPolicy(1), 0.5, cost).plan(PlanView([1000], 0, False)) == (chosen, False)


def test_expected_tokens_never_exceed_what_a_row_may_still_generate():
    assert expected(1.0, [100], 4, 0.0)[0] == pytest.approx([1, 2, 3, 4, 5], rel=1e-4)
    assert expected(1.0, [2], 4, 0.0)[0] == pytest.approx([1, 2, 2, 2, 2], rel=1e-4)  # two tokens left: no more
    assert expected(0.0, [100], 4, 0.0)[0] == pytest.approx([1] * 5)
    assert expected(0.5, [100, 100], 2, 0.0)[0] == pytest.approx([2, 3, 3.5])  # summed over rows
    assert expected(0.5, [100], 2, 0.0)[1] == pytest.approx([1, 1.5, 1.75])  # a row alone: its own yield


def steps_to_end(rng: random.Random, alpha: float, gamma: int, tokens: int = 64) -> int:
    """The steps a row of `tokens` tokens takes with gamma proposals a step."""
    steps = 0
    while tokens > 0:
        tokens, steps = tokens - accepts(rng, alpha, gamma, tokens) - 1, steps + 1
    return steps


@pytest.mark.parametrize("alpha, sd, gamma, rows", [(0.77, 0.0, 3, 16), (0.6, 0.0, 1, 4), (0.35, 0.13, 1, 16),
                                                    (0.77, 0.12, 3, 16), (0.6, 0.1, 2, 8)])
def test_a_static_batch_ends_with_its_slowest_row(alpha, sd, gamma, rows):
    """rows rows of 64 tokens at a fixed gamma, each accepting at its own alpha drawn about alpha
    with sd `sd`: the steps until the last one ends, over 300 batches, make the batch's end come
    nearer by the expected critical yield a step, within 5 %; priced at a row's mean yield, the
    end came 10-25 % nearer than it does."""
    rng = random.Random(0)
    last = sum(max(steps_to_end(rng, min(max(rng.gauss(alpha, sd), 0.0), 1.0), gamma) for _ in range(rows))
               for _ in range(300)) / 300
    critical = expected(alpha, [64] * rows, gamma, sd**2)[1]
    assert critical[0] == 1 and critical[gamma] == pytest.approx(64 / last, rel=0.05)
    assert rows < 8 or chain_tokens(alpha, gamma) > 1.09 * 64 / last
    assert tail_share(64, 1.0, 0.0, rows) == tail_share(64, 2.0, 0.5, 1) == 1.0  # plain steps, a row alone


def test_the_runs_spread_of_alphas_is_measured_on_the_rows_that_ended():
    """200 rows of 20 to 60 steps of one proposal, their alphas drawn about 0.6 with sd 0.1: the
    run's spread, from the rows as they end, reads 0.01 within a fifth (5 runs' mean), and under
    0.001 where the rows are alike (their rates spread by their noise alone); 0 before two rows
    ended."""
    for sd, low, high in ((0.1, 0.008, 0.012), (0.0, 0.0, 0.001)):
        spreads = []
        for seed in range(5):
            rng, policy = random.Random(seed), GammaPolicy(gamma_max=8)
            alphas, left = [rng.gauss(0.6, sd) for _ in range(200)], [rng.randint(20, 60) for _ in range(200)]
            assert policy.spread == 0.0
            while left:
                accepted = [int(rng.random() < a) for a in alphas]
                left = [k - 1 for k in left]
                policy.record(report(len(left), 1, accepted=accepted, finished=[k == 0 for k in left]))
                alphas, left = [a for a, k in zip(alphas, left) if k], [k for k in left if k]
            spreads.append(policy.spread)
        assert low <= sum(spreads) / len(spreads) <= high


def test_a_static_batchs_tail_keeps_speculation_off_where_it_loses():
    """Batches of 16 rows of 64 tokens on a model of the paying pair at 16 rows in float32 on the
    2-core VM (plain steps 28 ms and 1.5 ms a row; gamma 2 and 3 at 2.2 and 2.46 of that, as
    traced), acceptance 0.7: every fixed gamma loses, as the batch waits for its slowest row;
    auto stays within 2.5 % of plain steps."""
    def cost(rows: int, gamma: int) -> float:
        plain = 0.028 + 0.0015 * rows
        return plain * (1.94 + 0.26 * (gamma - 1)) if gamma else plain

    assert all(batches_speed(cost, [64] * 16, 0.7, fixed=g, seeds=2) < 0.95 for g in (1, 2, 3))
    assert batches_speed(cost, [64] * 16, 0.7) > 0.975


def test_rows_whose_alphas_differ_keep_speculation_off_where_it_loses():
    """Batches of 16 rows (12 of 64 tokens, 4 of 20 to 64), each accepting at its own alpha drawn
    about 0.5 with sd 0.15; plain steps 40 ms and 0.6 a row, gamma 1 1.3x that and 0.18x more a
    proposal: fixed gamma 1 runs under plain steps (the batch waits for its slowest rows), and
    auto, pricing the rows' spread of alphas measured on those that ended, within 2 % of them
    (as the embedded pair in bfloat16 at 16 rows, its rows' alphas 0.11 apart about 0.33)."""
    def cost(rows: int, gamma: int) -> float:
        plain = 0.040 + 0.0006 * rows
        return plain * (1.3 + 0.18 * (gamma - 1)) if gamma else plain

    lengths = [64] * 12 + [20, 35, 50, 64]
    assert batches_speed(cost, lengths, 0.5, alpha_sd=0.15, fixed=1) < 0.98
    assert batches_speed(cost, lengths, 0.5, alpha_sd=0.15) > 0.98


def test_speculation_that_pays_at_a_batch_of_rows_is_taken():
    """The same batches where gamma 2-3 cost little more than a plain step (a GPU's weight-bound
    steps, or a cheap draft) and acceptance is 0.8: auto speculates and gains most of the best
    fixed gamma's speed-up."""
    def cost(rows: int, gamma: int) -> float:
        return (0.020 + 0.0002 * rows) * (1 + 0.12 * gamma)

    best = max(batches_speed(cost, [64] * 8, 0.8, fixed=g, seeds=2) for g in (2, 3, 4))
    assert best > 1.5 and batches_speed(cost, [64] * 8, 0.8, seeds=2) > 0.95 * best


def test_a_useless_draft_settles_on_plain_steps():
    """Acceptance 0.02: after its first steps (the calibration) the run takes plain steps, but for
    probes that cost under 1 % of its time."""
    cost = lambda rows, g: 1.0 + 0.3 * g  # noqa: E731
    late = run(GammaPolicy(8), lambda step: 0.02, cost, steps=3000, rows=4)[1000:]
    assert late.count(0) / len(late) > 0.98
    assert sum(cost(4, g) - cost(4, 0) for g in late) < 0.01 * len(late)


def test_a_perfect_draft_grows_gamma_to_the_most():
    chosen = run(GammaPolicy(8), lambda step: 1.0, lambda rows, g: 1.0 + 0.05 * g, steps=300, rows=4)
    assert chosen.index(8) < 50
    assert chosen[-100:].count(8) >= 90  # the others only re-timed now and then


@pytest.mark.parametrize("per_draft", [0.1, 0.3])
def test_a_pair_that_starts_badly_switches_speculation_on_later(per_draft):
    """Acceptance 0 for 1500 steps (plain steps win), then 0.9: a probe finds out, and trying
    cost under 1 % of the time before. With a dear draft (0.3) a probe's one step cannot lift
    the run's alpha over what speculation needs: that takes the evidence fading while plain."""
    switch = 1500
    cost = lambda rows, g: 1.0 + per_draft * g  # noqa: E731
    chosen = run(GammaPolicy(8), lambda step: 0.0 if step < switch else 0.9, cost, steps=switch + 2 * PROBE_LAST,
                 rows=4)
    assert sum(cost(1, g) - cost(1, 0) for g in chosen[switch - 500 : switch]) < 0.01 * 500
    late = chosen[-PROBE_LAST // 2 :]
    assert sum(g >= 3 for g in late) > 0.9 * len(late)


@pytest.mark.parametrize("alpha, per_draft, rows", [(0.32, 0.2, 4), (0.8, 0.6, 4), (0.8, 0.6, 1)])
def test_speculation_stopped_by_a_low_estimate_is_tried_again(alpha, per_draft, rows):
    """gamma 1 at 1 + per_draft plain steps pays 1.1x at acceptance 0.32 (0.2) and 1.125x at 0.8
    (0.6). A chance run of rejections (half the acceptance over 50 proposals, after 500 at it)
    stops speculation; alpha, measured only while speculating, fades back towards the run's
    overall one while plain, and speculation resumes (at one row, where a probe checks one or
    two proposals, probes alone would take thousands of steps)."""
    cost = lambda rows, g: 1.0 + per_draft * g  # noqa: E731
    policy = GammaPolicy(1)
    run(policy, lambda step: alpha, cost, steps=300, rows=rows)
    policy.accepted, policy.checked = alpha / 2 * 50, 50.0
    policy.run_accepted, policy.run_checked = alpha * 500 + alpha / 2 * 50, 550
    assert policy.plan(PlanView([1000] * rows, 0, False)) == (0, False)
    late = run(policy, lambda step: alpha, cost, steps=1000, rows=rows, seed=1)[-500:]
    assert late.count(1) > 0.8 * len(late)


@pytest.mark.parametrize("speculation_pays_now", [True, False])
def test_step_costs_from_another_machine_are_replaced(speculation_pays_now):
    """A run's first 300 steps on a machine where speculation loses (drafting dear) or pays, then
    a machine where it is the other way round: within a few hundred steps the policy decides by
    the new costs (its probes and re-timings time the cells it does not choose)."""
    dear, cheap = (lambda rows, g: 1.0 + 0.9 * g), (lambda rows, g: 1.0 + 0.1 * g)
    before, after = (dear, cheap) if speculation_pays_now else (cheap, dear)
    policy = GammaPolicy(8)
    assert any(run(policy, lambda step: 0.7, before, steps=300)[-100:]) != speculation_pays_now
    late = run(policy, lambda step: 0.7, after, steps=700, seed=1)[-200:]
    assert (sum(map(bool, late)) > 0.9 * len(late)) == speculation_pays_now
    assert (late.count(0) > 0.9 * len(late)) != speculation_pays_now


def test_a_stall_does_not_move_a_cells_cost():
    """A cell's cost is the median of its last timings: one step stalled at 3x leaves it, a
    machine that did slow down moves it once its timings say so."""
    costs = StepCosts(gamma_max=8)
    for seconds in (1.0, 1.1, 0.9, 3.0):
        costs.add(4, 2, False, seconds)
    assert 0.9 <= costs.cost(4, 2) <= 1.1
    for _ in range(3):
        costs.add(4, 2, False, 2.0)
    assert costs.cost(4, 2) == pytest.approx(2.0)


def test_a_step_timed_alone_long_after_its_cells_timings_does_not_set_its_cost():
    """A plain step re-timed once among 100 speculative steps reads slower than plain steps in a
    run of them (the embedded pair at 8 rows: 62 ms against 45-52): the cell keeps its median."""
    costs = StepCosts(gamma_max=8)
    for _ in range(3):
        costs.add(8, 0, False, 1.0)
    for _ in range(100):
        costs.add(8, 1, False, 1.3)
    costs.add(8, 0, False, 1.3)
    assert costs.cost(8, 0) == pytest.approx(1.0)


def test_a_batch_size_first_met_is_calibrated_and_those_near_it_priced_by_its_ratios():
    """At 16 rows the policy first times a plain step, gamma 1 and gamma 3 three times each (after
    the shape's first run, which is not timed), then chooses; 12 rows, within 2x, are priced by
    the 16 rows' costs scaled by the cells timed at both; 7 rows are calibrated anew."""
    policy = GammaPolicy(8)
    cost = lambda rows, g: (1.0 + 0.1 * rows) * (1 + 0.2 * g)  # noqa: E731
    seconds, chosen = decode(policy, lambda step: 0.6, cost, [40] * 16, random.Random(0))
    assert chosen[:12] == [0] * 4 + [1] * 4 + [3] * 4  # each after an untimed first run (the prefill's, a catch-up)
    assert {(b, g) for b, g, tree in policy.costs.cells if b == 16} >= {(16, 0), (16, 1), (16, 3)}
    costs = StepCosts(gamma_max=8)
    for g in (0, 1, 3):
        for _ in range(3):
            costs.add(16, g, False, cost(16, g))
    assert costs.calibrating(12) is None and costs.calibrating(7) == 0
    costs.add(12, 1, False, cost(12, 1))
    assert costs.estimates(12, 4) == pytest.approx([cost(12, g) for g in range(5)])  # 16's line, scaled by gamma 1's


def test_the_fixed_share_of_a_step_is_fitted_across_batch_sizes():
    """A plain step costs c + d * B, here 2.2 + 0.1 * B (a fixed share of 0.73 at 8 rows): a line
    through the plain steps timed at each batch size, its slope shrunk towards the prior's. One
    size timed reads the prior; sizes far apart most of the way; flat costs over 10 to 16 rows
    (the embedded pair's plain steps in bfloat16: 48-53 ms) read over 0.7 at 16 rows."""
    costs = StepCosts(gamma_max=8)
    costs.add(8, 0, False, 3.0)
    assert costs.fixed_share(8) == pytest.approx(0.5)
    costs.add(6, 0, False, 2.8)
    costs.add(2, 0, False, 2.4)
    assert 0.6 < costs.fixed_share(8) < 0.65 and costs.fixed_share(1) > 0.9
    flat = StepCosts(gamma_max=8)
    for rows, seconds in [(16, 0.0502), (15, 0.0527), (14, 0.0523), (13, 0.0514), (12, 0.0503), (10, 0.0477)]:
        flat.add(rows, 0, False, seconds)
    assert flat.fixed_share(16) > 0.7


def test_a_probe_after_plain_steps_times_the_gamma_it_tries():
    """A probe whose draft must first catch up (not a typical step: untimed) takes its gamma once
    more, and that step is timed."""
    policy = GammaPolicy(1)
    chosen = run(policy, lambda step: 0.05, lambda rows, g: 1.0 + 0.5 * g, steps=400)
    probes = [i for i in range(20, 400) if chosen[i] and not chosen[i - 1]]
    assert probes and all(chosen[i + 1] == 1 for i in probes if i + 1 < 400)
    assert policy.costs.timed_at[1, 1, False] > probes[0] - 5  # timed by a probe (the timings: about the steps)


def test_a_cost_timed_slow_once_is_re_timed():
    """While one gamma wins, its neighbours and the plain step are re-timed now and then, so that
    a neighbour whose one timing read 3x its cost (a stall) is timed again."""
    cost = lambda rows, g: 1.0 + 0.1 * g  # noqa: E731
    policy = GammaPolicy(8)
    chosen = run(policy, lambda step: 0.75, cost, steps=400, rows=4)[100:]
    best = max(set(chosen), key=chosen.count)
    policy.costs.cells[4, best - 1, False] = deque([3 * cost(4, best - 1)])
    run(policy, lambda step: 0.75, cost, steps=1000, rows=4, seed=1)
    assert policy.costs.cost(4, best - 1) == pytest.approx(cost(4, best - 1))


@pytest.mark.parametrize("alphas, tree_cost, best", [
    ({False: 0.5, True: 0.85}, lambda g: 1.0 + 0.15 * g, True),  # trees accept far more, cost a little more
    ({False: 0.6, True: 0.7}, lambda g: 1.0 + 0.6 * g, False),  # their wide verify costs more than they bring
])
def test_trees_are_tried_and_kept_only_where_they_pay(alphas, tree_cost, best):
    """Chains and trees of the same draft, each with its own acceptance and step costs: auto
    tries trees (priced as chains until timed) and settles on whichever pays."""
    costs = {False: lambda g: 1.0 + 0.1 * g, True: tree_cost}
    policy, rng, chosen = GammaPolicy(4, trees=True), random.Random(0), []
    for step in range(600):
        gamma, tree = policy.plan(PlanView([1000], 0, True)) if step else (0, False)
        accepted = [accepts(rng, alphas[tree], gamma)]
        policy.record(report(1, gamma, costs[tree](gamma) if step else None, accepted, tree=tree))
        chosen.append((tree, gamma))
    assert any(tree for tree, _ in chosen[:60])  # trees were tried early
    assert sum(tree == best for tree, g in chosen[-200:] if g) > 0.9 * sum(1 for _, g in chosen[-200:] if g)


def test_a_fixed_gamma_is_always_chosen():
    policy = GammaPolicy(gamma_max=5, fixed=5)
    assert not policy.auto and run(policy, lambda step: 0.0, lambda rows, g: 1.0 + g, steps=20)[1:] == [5] * 19
    with pytest.raises(ValueError):
        GammaPolicy(gamma_max=4, fixed=5)
