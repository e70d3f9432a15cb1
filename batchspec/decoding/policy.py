"""Which gamma each step: a fixed one, or the one the measured costs say pays most (0 included).

A step with gamma proposals gives a row whose proposals are each accepted with probability alpha
  E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)
tokens (Leviathan et al. 2023), never more than the row may still generate, and costs T(B, gamma)
seconds with B rows in the batch: one target forward over gamma+1 positions and gamma draft forwards.
`--gamma auto` picks before every step the gamma in 0..gamma_max with the most expected work
per second; gamma 0 is a plain target step, the draft sits out.

- Work: tokens per second over all rows (sum of E / T, the goodput of SmartSpec, Liu et al.
  2024) is what a server that refills its batch gains. A static batch lasts as long as its
  longest completion: with plain steps every row advances one token a step, so they end
  together; speculation runs ahead on the rows that accept most and leaves the others to
  finish in smaller, dearer steps. So a step's work is what it takes off the time plain steps
  would need to finish the batch, c * (the longest remainder) + d * (all rows' remainders),
  where T(B, 0) = c + d * B (c: what every step costs, d: each row's share, fitted from the
  plain steps timed at different batch sizes: StepCosts.fixed_share): a step yielding `tokens`
  in all and shortening the longest remainder by `critical` does c * critical + d * tokens (a
  plain step: its own cost). d is shrunk towards PRIOR_FIXED_SHARE's by FIXED_PRIOR rows^2:
  a batch whose rows end late passes through a few sizes close together, and until 2026-12-05
  sizes under 2x apart read the prior alone (traced on the embedded pair in bfloat16 at 16
  rows: plain steps 48-53 ms at 10 to 16 rows, a fixed share near 1, priced at 0.5: gamma 1's
  work 1.29 plain steps where its critical rows gained 1.20, a promised 4 % where it lost 9 %;
  fitted, 0.73). Where c is small (a CPU at large batches) this is the goodput; where it
  dominates (a GPU's weight-bound steps) speculation pays only as far as the slowest rows
  gain. The longest remainder shrinks by its row's mean yield times tail_share: yields spread
  from step to step, and the batch waits for the last of its rows (traced on a paying pair at
  16 rows in float32: priced at the mean, auto speculated on 41 % of its row-steps and ran at
  0.91x ar, where every fixed gamma lost; with the lag, 0.97x, plain steps).
- Rows differ: each accepts at its own rate, and the batch waits for the slowest pace. Rows told
  apart (alpha, below) are priced each at its own alpha; rows that are not (a batch's first
  steps; with gamma 1 a row checks one proposal a step, too few to tell) are priced at the run's
  alpha, their mean yields spread by spread * (dE/dalpha)^2, spread the variance of the run's
  rows' alphas, measured on the rows that ended (GammaPolicy.spread), and the slowest of B such
  rows takes longest / (E - z sqrt of that) steps (tail_share). Traced on the embedded pair in
  bfloat16 at 16 rows with gamma 1: the rows' rates ran from 0.12 to 0.64 (sd 0.11 about 0.33)
  and read as alike on their faded evidence; priced alike, gamma 1 promised 3.5-12 % over a
  plain step where it lost 9 %, and auto speculated on half its row-steps at 0.93x ar.
- alpha: per row, its own checked proposals (older ones fading) shrunk towards the run's alpha, so
  that rows that copy their prompt and rows that do not are told apart. The slowest row's estimate
  prices the batch's length, and the least of B noisy estimates is biased low: the run's alpha
  weighs as many proposals as the rows' rates say (empirical Bayes, row_alphas), PRIOR_WEIGHT
  where they spread widely, all of a row's estimate where their spread is within what their noise
  spreads by chance (ALIKE_LEVEL): rows alike are priced at the run's alpha (traced on a paying
  pair in bfloat16 at 8 rows: the critical row's alpha 0.62 against the run's 0.77, and auto took
  plain steps where fixed gamma 3 ran 1.1x ar; simulated with exact step costs, 0.96x the best
  fixed gamma, with rows pooled 0.98x, and as before where rows differ). A row's noise is taken
  over its proposals' effective count, the older ones weighing less (Kish's: checked^2 over the
  sum of squared weights): early in a batch its few steps weigh alike, and counted as faded ones
  (twice the proposals) the noise read half its size, the spread of rows alike passed for a
  difference, and a row that missed once priced the batch (traced on the paying pair in bfloat16
  at 8 rows, the rows' rates alike: gamma 2's critical yield fell from 2.17 to 1.81 tokens after a
  step that accepted 7 of 13, and auto took plain steps on 72 % of its row-steps, at 0.89x fixed
  gamma 2; simulated with costs from that trace, 40 seeds, rows alike: 1.096x ar, 1.086x with
  weights up to 64 over the faded count, 1.169x at fixed gamma 2; rows at 0.70-0.85: 1.091x,
  1.071x, 1.147x). The rates' spread weighs each by its count (Pearson's chi-square): a row checks
  proposals up to its first rejection, so the rows that reject early hold the rates furthest out
  (0 of 1) on the fewest proposals, and their unweighted spread over the rows' mean noise passed
  for a difference in a batch's first steps: 8 rows alike at 0.77 with gamma 3 read as apart after
  2 steps in 12 % of draws, at 0.9 after one in 57 % (the test's level: 1 %); weighed, 3 % and
  19 % (row_alphas). Evidence fades with every step, plain ones included: a row's towards the run's
  alpha, the run's (more slowly) towards the higher of PRIOR_ALPHA and the alpha of all the run's
  proposals (none faded), which keeps PRIOR_WEIGHT proposals' worth in it. alpha is only measured
  while speculating, so speculation stops on a low estimate and, were the evidence kept, would
  stay stopped on it: the last estimate before plain steps is the low tail of its noise, not the
  pair's acceptance (simulated at batch 1 with an acceptance where gamma 1 gains 10 %: auto
  stopped on estimates of 0.20-0.26 against the true 0.32 and forwent most of the gain). Fading,
  the estimate drifts back over a break-even it fell under by chance and speculation is tried
  again; a draft that is useless drifts back there only after hundreds of plain steps and falls
  again at once, for under 1 % of the run's time (tests/test_policy.py). Towards PRIOR_ALPHA
  alone, a pair whose break-even is over it (a paying pair at batch 1: 0.65) drifted under it and
  stayed there, the probes' few proposals aside: the run's own alpha holds it over.
- A run checks TRIAL proposals before its alpha may stop speculation. The first steps are the
  least known: gammas' first timings run new shapes (traced on a paying pair at batch 1: 1.3-1.6x
  their later cost), and a handful of proposals weigh little against the prior's (4 of 5
  accepted read 0.61): plain steps won there and held, the draft's catch-up pricing probes out
  within each row, for the rest of the run. A useless draft costs TRIAL proposals' steps once
  (a step at B rows checks B of them at least).
- T: whole steps timed as the job runs, by the batch's rows and gamma (a host clock read after the
  step's one sync: no sync added, and on a GPU it holds the launches and the wait alike). A
  gamma not timed yet at B is estimated from those that were (linear in gamma, the plain step
  left out where it lies under a rising line through the gammas > 0: StepCosts.fit; or carried
  over from the nearest B), tried when that estimate says it pays, and timed then. Where two
  cells at B were timed twice or more, a cell timed once is priced at no more than they say
  (StepCosts.basis): one timing is the least sure (a shape's first run, a stall), and a gamma
  priced by it alone is not timed again while others win (simulated on a batch of 16 rows
  shrinking as its rows end, each cell's first timing 1.3-1.6x, gamma 1 1.08x plain steps: at
  auto's plain choices where the world's costs said gamma 1, gamma 1 was priced at 1.27x its
  cost, timed once; auto ran at 0.975x plain steps, 0.988x so). A gamma timed
  while the plain step cost over STALE (2) times what it costs now is priced at no more than
  that estimate, until timed again (StepCosts.current): timed on a slower machine, its cost would
  keep it out for good, where plain steps win and no probe can afford it.
- A batch size prices its steps off its own cells once it is known: its plain step and a gamma
  > 0 each timed there twice (StepCosts.known); until then off the nearest known batch size's,
  whose ratios are what the choice reads. The batch sizes that a static batch's rows reach as
  they end are timed a few steps each, and one timing there, a shape's first run or a stall,
  set the ratio that decides, for that size and, lent, for the sizes under it: simulated on a
  batch of 16 rows whose rows end at different lengths (11 at 64 tokens), plain steps 98-121 ms
  at 11 to 16 rows (as traced on the embedded pair in float32: no cheaper with fewer rows),
  gamma 1 1.3x that and 0.35x more a proposal, each cell's first timing 1.3-1.6x, 5 % of steps
  1.3-2x: at a plain step timed once high, gamma 1 was priced at 0.9 plain steps, and auto ran
  at 0.941x plain steps at alpha 0.35 (gamma 1: 0.974x) over a warm-up batch and 4 more (40
  seeds), 0.946x at alpha 0.5 (gamma 1: 1.08x); priced off known sizes, 0.962x and 0.975x.
- A step costs more the longer the caches its queries attend over, and a batch's caches grow
  by a slot or more every step. Cells timed at different points of a batch were priced apart
  by that: the plain cost timed at a batch's start beside gamma's late in it, or the other
  way, and whichever was timed late looked dearer. So each timing is taken to empty caches,
  over exp(growth * L) with L the slots (the engine's target cache, a host number), and
  estimates are priced over the step's own caches; growth is the least-squares slope of log
  seconds over L within each cell (StepCosts.learn). A share, not a time: in the engine, on
  the paying pair at 8 rows in bfloat16, over 40 to 120 slots, plain steps took 22.5 to 23.7
  ms, gamma 1 33.1 to 34.7 and gamma 2 43.9 to 46.2, each 5 % more (a speculative step's
  draft forwards read their own growing cache too). Priced as a time per row and slot, learned
  from the speculative steps that made most timings, a plain step over a batch's first caches
  was priced at 17.8 ms where it took 23.4, and auto took plain steps through most of that
  batch where fixed gamma 2 ran 1.15x ar. Simulated with rows of 256 tokens at 8 rows, each
  step 1.5 % dearer per 10 slots, acceptance 0.8: auto ran at 1.079x plain steps blind to the
  caches, 1.096x priced over them (tests/test_policy.py).
- Speculation is chosen only when it promises MARGIN more work per second than a plain step:
  the costs are noisy timings, and the best of noisy estimates is the one most likely
  underestimated (the optimizer's curse), so a gain promised within the noise is more often a
  loss (traced: gamma 1 promised ~4 % at batch 8 and ran at 0.87x plain). A gain under
  MARGIN forgone leaves auto within MARGIN of that gamma, so MARGIN stays well under the 5 %
  that auto may trail the best fixed gamma by.
- While gamma 0 wins, a probe step with the best gamma > 0 comes after 16 plain steps, then
  after 32, 64, ... 512, and never before the time its estimated loss (what it costs over the
  work it should do) is 1% of the plain steps between probes: a pair that started badly
  can still switch speculation on later, at a bounded price. A probe's work is a lone step's
  among plain ones: it brings a static batch's end nearer only as far as every row that may
  hold the longest remainder after it accepts (lone_critical; 8 rows tied at alpha 0.33:
  1.0001 tokens, where steps that all speculate shorten it by 1.24). Priced as one of those,
  a probe at 8 rows on the embedded pair in bfloat16 (plain steps 54 ms, gamma 1 74.5, the
  draft 60 tokens behind) was priced at 28 ms of its batch, as a lone step 46; run against
  plain steps alone, its two steps cost the batch 95-113 ms of 3.9 s. A probe after plain steps is the
  draft's catch-up, timed apart (below), so it measures alpha alone: the step after it takes
  the same gamma and is timed as that gamma, or a gamma whose cost was timed high once (a
  batch size's first shapes) would keep plain steps on through every probe.
- A probe's loss is priced with the costs as estimated, a gamma timed once at this B (or never:
  priced off other cells) included. A first timing is the least sure (a shape's first run, a
  stall in it), and at 8 rows or more the trial's few steps each try another gamma: priced by
  one high timing each, their loss put the first probe some 250 plain steps on, the draft's
  catch-up in it, past the bench's runs (seen once in 8 bench runs of a Qwen 2 pair built like
  the paying one at batch 8 in float32: plain steps through its timed runs, 0.96x ar, where
  fixed gamma 3 ran 1.18x). Two rules keep such a timing from standing: a gamma's first timing
  at a B is timed again at once (below), and the lesser of the two stands. Simulated (8 rows,
  alpha 0.74, gamma 2 and 3 paying about 1.25x, each cell's first timing 1.3-1.6x, 15 % of
  steps stalled 1.3-2x, a warm-up batch and four more), no run of 200 ends its first batch on
  plain steps and keeps them; 10 without the re-timing, 14 without the lesser standing. Until
  2026-11-29 a gamma timed under twice at B priced no probe, which came on the doubling
  schedule alone: at the sizes a batch's end passes through in a few steps each, a probe every
  16 to 32 plain steps, each with the draft's catch-up (traced on the embedded pair in float32
  at 16 rows: 7 of auto's 13 runs of speculation in its 5 passes, the warm-up's included, were
  probes, 6 of them at 2 to 15 rows, priced at 0.63-0.98 of a plain step's work a second; auto
  ran at 0.95x ar). Simulated over ten models of the test machine (24 seeds each; each cell's
  first timing 1.3-1.6x, steps 0.88-1.18x at random and 5 % of them 1.3-2x, the machine's speed
  in phases of about a batch, each batch size's first step untimed), auto over plain steps went
  from 0.952 to 0.964, 0.967 to 0.974 and 0.932 to 0.970 where gamma 1 loses a little, and
  from 1.086 to 1.074 on the paying pair's traced costs at 16 rows (+0.4 % on the mean of the
  ten). The probes given up are a bad start's way back at batch 1: with no trial (TRIAL 0), one
  of 32 runs fell to 1.07x plain steps where gamma 4 runs 1.42x (tests/test_policy.py).
- A gamma's first timing at a B is confirmed at once: the next step at B takes the same gamma
  (chain or tree), and the lesser of its two timings stands (StepCosts.confirming). Its one
  timing, a shape's first run or a stall in it, priced that gamma and, along the cost line, the
  gammas near it, until a probe or a re-timing came: simulated with the paying pair's costs as
  traced at 16 rows in bfloat16 (rows of 20-100 tokens capped at 64, acceptance 0.77), a trial
  step of gamma 4 timed at 2x its cost priced gamma 1 at 92 ms against its 59, and plain steps
  ran for a batch and a half. Simulated over seven models of the test machine's costs (those
  of tests/test_policy.py and the traced ones; each cell's first timing 1.3-1.6x, 5 % of steps
  1.3-2x, the machine's speed in phases, each batch size's first step untimed; 20 seeds each),
  auto's speed over the best fixed gamma's moved from 0.88-1.04 (mean 0.959) to 0.91-1.04
  (0.965), by model +2.6, +2.4, +1.4 (8 and 16 rows), +0.3, -0.1 (4 and 8), -0.7 (16) and
  -1.3 % (batch 1); with each step's cost exact (5 % noise), +0.2 % on the mean.
- While a gamma > 0 wins, another choice, a plain step included, is re-timed now and then: of
  the plain step and the gammas next to the best, the one timed longest ago at this B, at least
  RETIME_GAP steps apart and within the same 1% budget of its estimated loss
  (GammaPolicy.retime). A cost is updated only when its gamma runs, and one slow timing (a busy
  machine; a batch size's first step, with tensor shapes not run before) would otherwise keep a
  gamma out for the rest of the run, or, a plain step's, keep speculation on where it loses
  (traced at batch 8 on the embedded pair: a plain step at 7 rows timed once at 87 ms against
  58-65 ms at 6 and 8 rows, and every later step at 7 rows speculated). A
  plain step's cost at this B timed PLAIN_STALE timings ago or more is re-timed first, on a
  budget of its own: whether speculation pays at all turns on it, and the shared budget,
  priced by the same stale cost, went to the many gammas > 0. The machine's speed comes in
  phases minutes apart that do not slow every step alike (the 2-core VM: plain steps at 8 rows
  75 ms in one, 115 in the next, gamma 1's 105 and 125), and plain costs timed in a slow phase
  kept a batch speculating at 0.9x plain steps in the fast one after it. Simulated with phases
  drawn at random per batch, where gamma 1 loses 14 % in one (tests/test_policy.py), this took
  auto from 0.973x to 0.991x plain steps; it costs a strongly paying pair under 1 %.
- A plain cost that one timing alone turned against speculation (a stale cell that started
  again from it, where the cost it replaced had plain steps win) is timed once more before
  speculation goes on it, and the second timing stands. Speculating, a plain step is not
  timed again, so a plain timing that reads high stands (one that reads low is timed again at
  once): traced on a paying pair at 16 rows, each batch's first plain step read 57 ms against
  41-45 around it, gamma 2 then looked 1.3x better, and the batch speculated where every fixed
  gamma lost 9-12 %. It costs one plain step per such restart. The lesser of the two stood
  before, and the lesser of two noisy timings reads low, so plain steps won on it: simulated on
  batches of 4 rows at acceptance 0.33, gamma 1 at 1.14 plain steps (as the embedded pair's in
  bfloat16), steps 5 % apart, auto ran at 0.977x fixed gamma 1, 0.985x with the second.
- A timing more than HOLD over its cell's estimate is held, and counts only if the cell's next
  timing is over that too (the lesser of the two then): the 2-core VM stalls now and then (a
  paying pair's plain steps at 8 rows read 34-42 ms, one in twenty 46-57; a gamma 4 step at 7
  rows 202 ms against 108). Counted, such a timing lifts a moving average by a fifth of its
  excess, or is all of a stale cell's new estimate, and auto takes other gammas or plain steps
  for many steps: simulated with 5 % of steps 1.3-2x slower, auto ran at 0.92-0.98x the best
  fixed gamma, held at 0.94-1.0x (tests/test_policy.py). A machine that did slow down stays
  slow, and the cell's next timing confirms it (the cell keeps its price until then, so it is
  chosen as often as before).
- Rows that ended leave the batch, unless steps were timed faster with more rows (by
  KEEP_MARGIN): then they stay in it, inert, and the batch keeps the faster size (batch_rows).
  CPU matrix kernels are not monotone in their rows: on the 2-core test machine float32 ran a
  plain step at 7 rows in 100 ms, at 8 in 79 ms, at 6 in 82 ms (the output layer's kernel: 38
  vs 15 ms at 7 and 8 rows), where transformers' generate, which keeps finished rows, stays at
  8. The sizes compared are timed at different points of a batch (the smaller ones near its
  end) and each in short runs, so the comparison takes the run's means over KEEP_EVIDENCE
  steps or more, and only a gap well beyond their noise: bfloat16, with no cliff (47, 49, 50
  ms at 6, 7, 8 rows, medians), once read 61, 56, 49 ms in the moving averages. A batch size
  timed fewer times is evicted to, and timed then: on a GPU, where fewer rows should never cost
  more, rows leave. Trees never keep rows (their drafters go on proposing for every row).
- The draft's catch-up: after plain steps (and at a batch's start, its prompts) its first forward
  also reads every token it skipped, a cost per row and skipped token: what a step that did so
  took over the next one, where that took the same gamma at as many rows (such steps do not count
  towards T). Against the gamma's estimate instead, a cost timed on a slower machine, or not timed
  yet, went into it (traced on an H100 at batch 1: 1.3-1.7 ms a token against steps of 20 ms,
  where reading 50 tokens costs about what reading one does, and probes priced out within every
  row). The cost is the least-squares slope through 0 of those differences over the row-tokens
  read (older catch-ups weighing CATCH_DECAY each, CATCH_PRIOR row-tokens' worth of 0 before any):
  each difference holds a step's timing noise, and over the few tokens read after a plain step or
  two (a plain step's re-timing) that noise was the estimate, averaged catch-up by catch-up
  (simulated at 8 rows, steps timed 13 % apart, the draft reading 0.1 ms a row and token: runs'
  medians 0.14-0.48 ms, up to 2.7; fitted, 0.09-0.10), and a batch's first speculative step, 41
  tokens behind, was priced at several plain steps. It is paid once for all the speculative steps
  after it, so a step with gamma > 0 is priced with the catch-up spread over the steps the batch
  has left at that gamma (the tokens its rows may still generate over the step's expected tokens):
  speculation that clearly pays starts at once, one that barely pays waits while a short batch end
  would not repay the draft's reading. A probe's loss includes the whole catch-up: if speculation
  still does not pay, the draft falls behind again.
- Trees (--tree-width W, or several drafts' chains, with auto): a tree of depth gamma is one
  more choice beside the chain of gamma, with its own step costs and its own run alpha (per
  depth of the accepted path); a tree's work is its chain's times the run's
  E(tree alpha) / E(chain alpha). A tree not timed yet is priced as the chain (its verify is
  wider: it is tried, then timed), and its alpha starts TREE_LIFT above the chain's, so that
  trees are tried early and kept only if they pay.
"""

import functools
import math
from statistics import NormalDist
from typing import NamedTuple

PRIOR_ALPHA = 0.5  # the run's alpha before any proposal was checked
PRIOR_WEIGHT = 8.0  # proposals' worth of the run's alpha in a row's estimate, of PRIOR_ALPHA or its own in the run's
ALIKE_LEVEL = 0.99  # rows whose rates spread under this quantile of what noise alone spreads them by are alike
ROW_DECAY = 0.95  # per step: acceptance changes along a completion
RUN_DECAY = 0.98  # per speculative step
PLAIN_DECAY = 0.995  # per plain step, towards PRIOR_ALPHA or the run's own: see alpha above
PRIOR_SLOPE = 0.1  # a proposal's cost relative to a plain step, before a cost line was fitted
PROBE_FIRST, PROBE_LAST = 16, 512  # plain steps before a probe of speculation (doubling)
PROBE_BUDGET = 0.01  # the most of the time an expected-to-lose probe (or re-timing) may take
RETIME_GAP = 16  # speculative steps at least between two re-timings of another gamma
PLAIN_STALE = 2 * RETIME_GAP  # timings after which a plain step's cost at B is re-timed first, on its own budget
TREE_LIFT = 1.25  # a tree's alpha over the chain's, before any tree was checked
HOLD = 0.25  # a timing this much over its cell's estimate counts only once the cell's next timing confirms it
KEEP_MARGIN = 0.1  # how much faster a bigger batch's steps must have been timed for rows that end to stay
KEEP_EVIDENCE = 8  # steps timed at a batch size before its mean time counts for that
MIN_RISE = 0.05  # the least a proposal adds to a step, in plain steps, on a cost line (StepCosts.fit)
OFF_LINE = 0.25  # how far over a plain step's cost the gammas' line may start, the plain step on it (StepCosts.fit)
TRIAL = 16  # proposals a run checks before its alpha may stop speculation (twice PRIOR_WEIGHT)
STALE = 2.0  # a gamma timed while a plain step cost this many times what it costs now is priced anew
MARGIN = 0.03  # the least gain in expected work per second over a plain step that speculation needs
PRIOR_FIXED_SHARE = 0.5  # the share of a plain step that does not grow with its rows, before it was measured
FIXED_PRIOR = 8.0  # rows^2: the weight of PRIOR_FIXED_SHARE in the line through the plain steps (fixed_share)
CONTEXT_PRIOR = 2000.0  # slots^2 of spread within cells: the weight of a growth of 0 (StepCosts.learn)
CATCH_PRIOR = 8.0  # row-tokens read at no cost: the weight of a catch-up cost of 0 (GammaPolicy.observe)
CATCH_DECAY = 0.8  # per catch-up: how much an older one weighs in the catch-up cost


class Expected(NamedTuple):
    """What a step yields with gamma = 0..gamma_max, expected (host numbers)."""

    tokens: list[float]  # summed over the rows
    critical: list[float]  # how much the longest completion the batch has left shrinks
    lone: list[float]  # how much it shrinks by a lone step's yields (a probe's: lone_critical)


def chain_tokens(alpha: float, gamma: int) -> float:
    """E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha): a row's expected tokens from a chain
    of gamma proposals (alpha kept just under 1)."""
    a = min(alpha, 1 - 1e-6)
    return (1 - a ** (gamma + 1)) / (1 - a)


def expected_tokens(alphas: list[float], remaining: list[int], gamma_max: int, spread: float = 0.0) -> Expected:
    """A step's expected yield per gamma from the rows' alphas and the tokens each may still
    generate: E = 1 + a + ... + a^(m-1) per row, m = min(gamma + 1, remaining), summed; and the
    longest remainder before the step less the longest after it, times the share of it the
    batch's end gains when the rows' yields spread (tail_share). spread: the variance of the
    rows' true alphas about `alphas` (rows priced alike: row_alphas), which spreads their mean
    yields by spread * (dE/dalpha)^2."""
    totals = [0.0] * (gamma_max + 1)
    after = [0.0] * (gamma_max + 1)  # the longest remainder after the step
    moments = [(1.0, 0.0, 0.0)] * (gamma_max + 1)  # the yield of the row that holds it: mean, variance, mean's
    for alpha, left in zip(alphas, remaining):
        power, below = 1.0, 0.0  # a^gamma, a^(gamma-1)
        tokens, square, slope = 0.0, 0.0, 0.0  # E; E(t^2) = sum of (2k + 1) a^k; dE/da = sum of k a^(k-1), k < m
        for gamma in range(gamma_max + 1):
            if gamma < left:
                tokens, square, slope = tokens + power, square + (2 * gamma + 1) * power, slope + gamma * below
                power, below = power * alpha, power
            totals[gamma] += tokens
            if left - tokens > after[gamma]:
                after[gamma], moments[gamma] = left - tokens, (tokens, square - tokens**2, spread * slope**2)
    longest = max(remaining, default=0)
    critical = [(longest - a) * tail_share(longest, mean, variance, len(remaining), apart)
                for a, (mean, variance, apart) in zip(after, moments)]
    return Expected(totals, critical, lone_critical(alphas, remaining, gamma_max))


def lone_critical(alphas: list[float], remaining: list[int], gamma_max: int) -> list[float]:
    """[G+1]: how much one step, alone, shortens the longest remainder, expected: 1 + the sum over
    j = 2..gamma+1 of P(every row's remainder after the step is under longest - j + 1), a row
    `gap` under the longest needing j - gap tokens (or all it has left), with probability
    alpha^(that - 1). A row alone gains its whole yield; rows that tie need every one of them to
    accept (8 rows at 0.33: 1.0001 tokens with gamma 1). Rows further than gamma_max under the
    longest cannot hold it after one step and are left out."""
    longest = max(remaining, default=0)
    near = [(alpha, longest - left, left) for alpha, left in zip(alphas, remaining) if longest - left < gamma_max]
    lone, total = [1.0], 1.0
    for j in range(2, gamma_max + 2):
        if j <= longest:
            total += math.prod(alpha ** (max(min(j - gap, left), 1) - 1) for alpha, gap, left in near)
        lone.append(total)
    return lone


def tail_share(longest: int, mean: float, variance: float, rows: int, apart: float = 0.0) -> float:
    """The share of its rows' expected yield by which a batch's end comes nearer, a step at a
    time, where a step's yield varies by `variance` about `mean` per row, and the rows' mean
    yields by `apart` about that mean: the longest remainder takes steps = longest / mean at the
    mean, and the last of `rows` rows to finish lags behind by z, the expected largest of `rows`
    standard normals (Blom's approximation), times the spread of the steps a row takes: from its
    yields' noise, sqrt(variance * steps) / mean (a renewal count's); from the rows' paces, the
    slowest's, mean - z sqrt(apart) (one token a step at least), takes longest / that steps. The
    two lags, each z spreads, add in quadrature. Simulated over 16 rows of 64 tokens, rows'
    alphas spread by 0.13 about 0.35 with gamma 1: the batch's end came 1.109 tokens a step
    nearer, priced 1.103 (1.199 with the rows' yields alike); 0.12 about 0.77 with gamma 3:
    1.938, priced 1.965 (2.341). Plain steps (no variance) and a batch of one row (no largest
    of several) lose nothing."""
    if rows < 2 or variance + apart <= 0 or longest <= 0:
        return 1.0
    z = NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))
    steps = longest / mean
    noise_lag = z * math.sqrt(variance * steps) / mean
    pace_lag = longest / max(mean - z * math.sqrt(apart), 1.0) - steps
    return steps / (steps + math.hypot(noise_lag, pace_lag))


def row_seen(seen: tuple[float, float, float], accepted: int, proposed: int) -> tuple[float, float, float]:
    """A row's decayed (accepted, checked, squares) proposals after a step in which it had
    `accepted` of `proposed` accepted (0 proposed: a plain step, the old evidence only fades);
    squares: the checked proposals each counted by its weight squared (checked^2 / squares is
    their effective count)."""
    accepted_before, checked_before, squares = seen
    checked = min(accepted + 1, proposed)
    return (accepted_before * ROW_DECAY + accepted, checked_before * ROW_DECAY + checked,
            squares * ROW_DECAY**2 + checked)


def row_alpha(accepted: float, checked: float, prior: float, weight: float = PRIOR_WEIGHT) -> float:
    """A row's alpha from its decayed accepted and checked proposals, shrunk towards the run's
    with `weight` proposals' worth of it."""
    return (accepted + weight * prior) / (checked + weight)


def row_alphas(seen: list[tuple[float, float, float]], prior: float,
               run_spread: float = 0.0) -> tuple[list[float], float]:
    """The rows' alphas from their decayed (accepted, checked, squares) proposals, each shrunk
    towards the run's alpha `prior` by the same weight (empirical Bayes), and the variance of the
    rows' true alphas about them: run_spread (GammaPolicy.spread) where the rows are not told
    apart, 0 where they are. Were the rows alike,
    a row's rate would vary about prior by prior (1 - prior) / n, n = checked^2 / squares its
    proposals' effective count, and the rates' squared deviations from their mean, each over
    that noise (Pearson's chi-square, Q), would follow a chi-square of B - 1 degrees of freedom:
    under its ALIKE_LEVEL quantile, the rows are taken as alike and priced at prior. Over it,
    the true alphas spread by v = (Q - (B - 1)) / (sum w - sum w^2 / sum w), w = 1 / noise
    (DerSimonian and Laird's), which weighs prior as prior (1 - prior) / v - 1 proposals (a beta
    distribution's), PRIOR_WEIGHT at least. Weighed by their counts, not compared unweighted with
    the rows' mean noise: see the module's alpha."""
    rates = [(accepted / checked, checked**2 / squares) for accepted, checked, squares in seen if checked > 0]
    weight = PRIOR_WEIGHT
    if len(rates) >= 2:
        free = len(rates) - 1  # degrees of freedom
        precisions = [n / (prior * (1 - prior)) for _, n in rates]  # 1 / a rate's noise, were the rows alike
        total = sum(precisions)
        mean = sum(w * rate for w, (rate, _) in zip(precisions, rates)) / total
        pearson = sum(w * (rate - mean) ** 2 for w, (rate, _) in zip(precisions, rates))  # chi-square if alike
        if pearson <= chi_square_quantile(free, ALIKE_LEVEL):
            return [prior] * len(seen), run_spread
        spread = (pearson - free) / (total - sum(w * w for w in precisions) / total)  # the true alphas' (D-L)
        weight = max(prior * (1 - prior) / spread - 1, PRIOR_WEIGHT)
        run_spread = 0.0
    return [row_alpha(accepted, checked, prior, weight) for accepted, checked, _ in seen], run_spread


@functools.cache
def chi_square_quantile(free: int, level: float) -> float:
    """The chi-square distribution's quantile at `level` with `free` degrees of freedom (Wilson
    and Hilferty's cube of a normal: within 1 % of it at the 0.99 level)."""
    scale = 2 / (9 * free)
    return free * (1 - scale + NormalDist().inv_cdf(level) * math.sqrt(scale)) ** 3


class StepCosts:
    """Seconds per step by (live rows B, gamma) over empty caches: moving averages of timed
    steps, each over scale(the slots its cache held), and estimates for cells not timed
    yet. A cell not timed in RETIME_GAP timings starts again from the new one; a plain step's
    second timing since then replaces the first (it confirms a cost that turned the choice to
    speculation: see GammaPolicy.choose), and a gamma's second timing ever replaces its first
    if lower (confirming). A timing over HOLD above its cell's estimate
    is held: it counts only if the cell's next timing is over that too (the lesser of the two
    counts then), and is dropped if not."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.cells: dict[int, dict[int, float]] = {}  # B -> gamma -> seconds
        self.timings = 0
        self.timed_at: dict[tuple[int, int], int] = {}  # (B, gamma) -> the timing that last updated it
        self.plain_timings: dict[int, int] = {}  # B -> plain steps timed since its plain cell (re)started
        self.replaced: dict[int, float] = {}  # B -> the plain estimate that its last restart replaced
        self.sums: dict[tuple[int, int], tuple[float, int]] = {}  # (B, gamma) -> the run's seconds summed, steps
        self.held: dict[tuple[int, int], float] = {}  # (B, gamma) -> its last timing, held: HOLD over the estimate
        self.plain_then: dict[tuple[int, int], float] = {}  # (B, gamma > 0) -> the plain estimate when it was timed
        self.growth = 0.0  # how much a step's log seconds grow a slot of its cache
        self.timed_over: dict[tuple[int, int], float] = {}  # (B, gamma) -> the slots its estimate was timed over
        self.spread = [0.0, 0.0]  # summed over the cells: (slots - mean)^2, (slots - mean) * log seconds
        # (B, gamma) -> the batch, and within it the timings, their mean slots and mean log seconds
        self.means: dict[tuple[int, int], tuple[int, int, float, float]] = {}
        self.batch, self.slots = 0, 0  # the batch timed last (counted by the caches shrinking), its caches' slots

    def scale(self, context: int) -> float:
        """What a step over caches of `context` slots costs over one over empty ones: a factor."""
        return math.exp(self.growth * context)

    def learn(self, rows: int, gamma: int, seconds: float, context: int) -> None:
        """growth from a timing: the least-squares slope of log seconds over the slots, each
        cell's timings within a batch about their own means (cells differ in cost; each grows by
        about the same share: measured in the engine on the paying pair at 8 rows in bfloat16,
        over 40 to 120 slots, plain steps 22.5 to 23.7 ms, gamma 1 33.1 to 34.7, gamma 2 43.9 to
        46.2, each 5 %; batches differ too, in their prompts' pads and the machine's phase:
        traced on the embedded pair in bfloat16, ar's plain steps at 6 rows, a batch's last
        steps, read a slope of 0.0081 a slot across two batches of 45- and 90-slot prompts, its
        8-row steps 0.0001, and auto, priced by 0.006, took gamma 6 at 6 rows where gamma 1 lost;
        within each batch, ar's cells read no growth), with CONTEXT_PRIOR of spread at slope 0 (a
        batch's steps of one cell spread over some 20000). A batch starts where the caches are
        shorter than the last timing's (a compaction within one starts anew too). The cells'
        estimates move to the new slope (Welford's updates: one cell's sums change)."""
        self.batch, self.slots = self.batch + (context < self.slots), context
        batch, n, mean_x, mean_y = self.means.get((rows, gamma), (self.batch, 0, 0.0, 0.0))
        if batch != self.batch:
            n, mean_x, mean_y = 0, 0.0, 0.0
        x, y = float(context), math.log(seconds)
        dx, n = x - mean_x, n + 1
        mean_x, mean_y = mean_x + dx / n, mean_y + (y - mean_y) / n
        self.means[rows, gamma] = (self.batch, n, mean_x, mean_y)
        self.spread = [self.spread[0] + dx * (x - mean_x), self.spread[1] + dx * (y - mean_y)]
        growth = max(self.spread[1] / (self.spread[0] + CONTEXT_PRIOR), 0.0)
        for (b, g), slots in self.timed_over.items():
            self.cells[b][g] *= math.exp((self.growth - growth) * slots)
        self.growth = growth

    def add(self, rows: int, gamma: int, seconds: float, context: int = 0) -> None:
        """A step's timing at `rows` rows and `gamma`, its caches `context` slots long."""
        raw, seconds = seconds, seconds / self.scale(context)
        old = self.cells.get(rows, {}).get(gamma)
        if old is not None and seconds > (1 + HOLD) * old:
            if (rows, gamma) not in self.held:
                self.held[rows, gamma] = seconds  # an outlier until the next timing says otherwise
                return
            seconds = min(seconds, self.held[rows, gamma])
        self.held.pop((rows, gamma), None)
        restarts = old is None or self.timings - self.timed_at[rows, gamma] > RETIME_GAP  # older than any re-timing's gap
        if restarts:
            if gamma == 0 and self.cells:
                self.replaced[rows] = self.estimates(rows, 0)[0]
            new = seconds
        elif self.confirming(rows, gamma):
            new = seconds if gamma == 0 else min(old, seconds)  # a plain step's second stands, a gamma's lesser
        else:
            new = old + self.weight * (seconds - old)
        self.cells.setdefault(rows, {})[gamma] = new
        slots = self.timed_over.get((rows, gamma), context)
        self.timed_over[rows, gamma] = context if restarts else slots + self.weight * (context - slots)
        if gamma and 0 in self.cells[rows]:
            self.plain_then[rows, gamma] = self.cells[rows][0]
        if gamma == 0:
            self.plain_timings[rows] = 1 if restarts else self.plain_timings[rows] + 1
        self.timings += 1
        self.timed_at[rows, gamma] = self.timings
        total, steps = self.sums.get((rows, gamma), (0.0, 0))
        self.sums[rows, gamma] = (total + seconds, steps + 1)
        self.learn(rows, gamma, raw, context)

    def timings_of(self, rows: int, gamma: int) -> int:
        """How many steps the run timed at (rows, gamma)."""
        return self.sums.get((rows, gamma), (0.0, 0))[1]

    def confirming(self, rows: int, gamma: int) -> bool:
        """Whether the next timing at (rows, gamma), unless it restarts the cell, replaces the
        cell's estimate: a plain step's second since its cell (re)started (see GammaPolicy.choose),
        a gamma's second ever if lower (a shape's first run, or a stall in it, priced it: see
        probes in the module's notes)."""
        return self.plain_timings[rows] == 1 if gamma == 0 else self.timings_of(rows, gamma) == 1

    def unconfirmed(self, rows: int, seconds: float) -> float:
        """The plain estimate at `rows` that its one timing since its cell (re)started replaced,
        over `seconds` (the estimate now); 1 once it was timed again, or with nothing replaced."""
        if self.plain_timings.get(rows) != 1 or rows not in self.replaced:
            return 1.0
        return self.replaced[rows] / seconds

    def mean(self, rows: int, gamma: int) -> float | None:
        """The run's mean seconds of the steps timed at (rows, gamma); None before KEEP_EVIDENCE."""
        total, steps = self.sums.get((rows, gamma), (0.0, 0))
        return total / steps if steps >= KEEP_EVIDENCE else None

    def estimates(self, rows: int, gamma_max: int) -> list[float] | None:
        """T(rows, g) for g in 0..gamma_max, or None before any step was timed: the costs timed at
        rows once it is known, else the nearest known batch size's (only their ratios matter to
        the choice), else, before any is known, those of rows or the nearest batch size timed."""
        if not self.cells:
            return None
        known = [b for b in self.cells if self.known(b)] or list(self.cells)
        return self.own(rows if rows in known else min(known, key=lambda b: (abs(math.log(b / rows)), b)), gamma_max)

    def known(self, rows: int) -> bool:
        """Whether rows' plain step and a gamma > 0 were each timed there twice at least, so that
        its own cells may price it: one timing of either, a shape's first run or a stall, had set
        the ratio that decides (see the module's notes)."""
        return self.timings_of(rows, 0) >= 2 and any(g and self.timings_of(rows, g) >= 2 for g in self.cells[rows])

    def own(self, rows: int, gamma_max: int) -> list[float]:
        """T(rows, g) for g in 0..gamma_max from the cells that price rows (StepCosts.basis):
        the others lie between them, or along the cost line (StepCosts.fit) beyond them, at no
        more than their own estimates; with one cell, on the costs of the nearest batch size
        with a line (StepCosts.borrowed)."""
        timed, everything = self.basis(rows), self.cells[rows]
        fitted = self.fit(rows)
        guess = self.borrowed(rows, gamma_max) if fitted is None else [
            self.between(timed, g, fitted[1]) for g in range(gamma_max + 1)]  # the timed ones are overridden below
        return [timed[g] if g in timed else min(guess[g], everything.get(g, math.inf)) for g in range(gamma_max + 1)]

    def borrowed(self, rows: int, gamma_max: int) -> list[float]:
        """T(rows, g) where one gamma was timed (a batch size's first steps are plain): the costs
        of the nearest batch size with a cost line, scaled to the one timed here, else a line
        rising PRIOR_SLOPE of it per proposal. Scaled whole, they keep the step from the plain
        cost to the first proposal's, which a slope alone would drop: traced at 16 rows on the
        embedded pair, plain steps 82 ms and gamma 1 128 ms, the batch's rows ending priced gamma
        1 to 5 at 15 rows at 70-71 ms, as its plain step, and gamma 4 ran at 172 ms."""
        (gamma, seconds), = self.basis(rows).items()
        lines = [b for b in self.cells if self.fit(b)]
        if not lines:
            return [seconds * (1 + PRIOR_SLOPE * g) / (1 + PRIOR_SLOPE * gamma) for g in range(gamma_max + 1)]
        other = self.own(min(lines, key=lambda b: abs(math.log(b / rows))), max(gamma, gamma_max))
        return [seconds * cost / other[gamma] for cost in other[: gamma_max + 1]]

    def current(self, rows: int) -> dict[int, float]:
        """The cells timed at `rows` (gamma -> seconds) less those of gammas > 0 timed while a plain
        step cost over STALE times what it costs now. Timed on a slower machine (a phase of
        it, a batch size's first shapes), such a cost is priced at no more than the others say
        until it is timed again; kept, it would keep its gamma out, as plain steps win and the
        probes it prices never come (traced on an H100 at 8 rows: gamma 2 timed once at 185 ms
        while plain steps took 58 ms; plain steps then took 13 ms, and the first probe came 515
        of them later, where fixed gamma 3 ran 1.37x plain steps). One timed while the plain
        step cost less than now looks cheap: it is chosen, and so timed again."""
        timed = self.cells[rows]
        plain = timed.get(0, math.inf)  # no plain step timed at rows: none is stale
        return {g: seconds for g, seconds in timed.items()
                if not g or self.plain_then.get((rows, g), 0.0) <= STALE * plain}

    def basis(self, rows: int) -> dict[int, float]:
        """The cells that price `rows` (gamma -> seconds): the current ones timed twice at least,
        where two are, else all current ones. A cell timed once is then priced at no more than
        those say, so that it is tried where that pays and timed a second time, whose lesser with
        the first stands (StepCosts.confirming)."""
        timed = self.current(rows)
        sure = {g: seconds for g, seconds in timed.items() if self.timings_of(rows, g) >= 2}
        return sure if len(sure) >= 2 else timed

    @staticmethod
    def between(timed: dict[int, float], gamma: int, slope: float) -> float:
        """Linear between the timed gammas around `gamma`, else from the nearest one along `slope`."""
        below = max((g for g in timed if g < gamma), default=None)
        above = min((g for g in timed if g > gamma), default=None)
        if below is not None and above is not None:
            return timed[below] + (timed[above] - timed[below]) * (gamma - below) / (above - below)
        nearest = below if below is not None else above
        return max(timed[nearest] + (gamma - nearest) * slope, 1e-9)

    def fixed_share(self, rows: int) -> float:
        """c / T(rows, 0), where a plain step costs T(B, 0) = c + d * B: a least-squares line
        through the plain steps timed at each batch size, its slope d shrunk towards the
        prior's, (1 - PRIOR_FIXED_SHARE) of the mean plain step per mean row, with FIXED_PRIOR
        rows^2 worth of it (PRIOR_FIXED_SHARE where a single batch size was timed)."""
        plain = {b: timed[0] for b, timed in self.cells.items() if 0 in timed}  # B -> seconds
        if not plain:
            return PRIOR_FIXED_SHARE
        prior = (1 - PRIOR_FIXED_SHARE) * sum(plain.values()) / sum(plain)  # d: seconds a row
        c, d = line(plain, prior=(prior, FIXED_PRIOR))
        return c / (c + d * rows)

    def fit(self, rows: int) -> tuple[float, float] | None:
        """(intercept, slope) of a least-squares line through the gammas > 0 that price `rows`
        (StepCosts.basis), and through its plain step too unless the line's intercept is over
        (1 + OFF_LINE) times it; None with fewer than two points. A plain step runs no draft and
        verifies one token: where the draft's own cost per step is large, the plain step is off
        the line, and a line through it takes that cost for a cost per proposal (traced at batch 1
        on a paying pair: plain 24 ms, gamma 1, 2, 3, 5 at 46, 56, 53, 62 ms; the line through plain, 1 and 2
        priced gamma 5 at 100 ms, and gamma 3 and up never ran). Where it lies on the line, it
        is one more point, and the best timed. A line through the gammas > 0 that rises less than
        MIN_RISE of a plain step per proposal would price every gamma above at about the cost of
        those timed, where each proposal adds a draft forward at least (two neighbours may read
        alike or the other way: timing noise, or a CPU kernel's tiles); the plain step joins it
        then (traced at 16 rows on the embedded pair: in float32, gamma 1 and 2 at 188 and 180 ms
        priced every gamma above at 180 ms, and gamma 8 ran at 507, 4.4 plain steps; in
        bfloat16, both at 128 ms, a rise of 0.7 ms against plain steps of 82). With the plain
        step on it, the line rises MIN_RISE of it per proposal at least: a gamma timed at the
        plain step's cost or under (each timed in another phase of the machine) laid it flat
        (traced on the embedded pair in bfloat16 at 3 rows: plain 54.7 ms, gamma 1 54.0, every
        gamma above priced at 54.0 ms, and gamma 8 and 7 ran at 130 ms)."""
        timed = self.basis(rows)
        drafted = {g: seconds for g, seconds in timed.items() if g}
        if len(drafted) >= 2:
            intercept, slope = line(drafted)
            if 0 not in timed or slope >= MIN_RISE * timed[0] and intercept > (1 + OFF_LINE) * timed[0]:
                return intercept, slope
        if len(timed) < 2:
            return None
        return line(timed, least=MIN_RISE * timed[0])  # timed holds the plain step here (else drafted had a line)


def line(timed: dict[int, float], least: float = 0.0, prior: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line seconds = a + b * x (x: gamma, or B), the
    slope held at `least` or over; prior: (a slope, its weight in x^2) that the slope is shrunk
    towards (ridge regression)."""
    n = len(timed)
    mean_g, mean_s = sum(timed) / n, sum(timed.values()) / n
    spread = sum((g - mean_g) ** 2 for g in timed) + prior[1]
    slope = max((sum((g - mean_g) * (s - mean_s) for g, s in timed.items()) + prior[0] * prior[1]) / spread, least)
    return max(mean_s - slope * mean_g, 1e-9), slope


class Choice(NamedTuple):
    rate: float  # expected work per second (a plain step's: 1)
    gamma: int
    tree: bool
    work: float  # the step's expected work, in seconds of plain steps
    seconds: float  # its expected cost, the draft's catch-up aside
    lone: float  # its work as a lone step among plain ones (a probe's)


def loss(other: Choice, best: Choice) -> float:
    """What a step of `other` instead of `best` is expected to lose, in best's steps: its cost
    less its work."""
    return other.seconds / best.seconds - other.work / best.work


class GammaPolicy:
    """gamma per step. fixed: always that gamma; None: auto, up to gamma_max. trees: a tree may
    be proposed instead of a chain (`tree` tells which the last choice was): always with a fixed
    gamma, where it pays with auto.

    One policy serves a whole run (the job passes it to every batch): step costs and the run's
    alpha carry over from batch to batch.
    """

    def __init__(self, gamma_max: int, fixed: int | None = None, trees: bool = False):
        if gamma_max < 1 or (fixed is not None and not 1 <= fixed <= gamma_max):
            raise ValueError(f"need 1 <= gamma <= gamma_max, got gamma {fixed}, gamma_max {gamma_max}")
        self.gamma_max, self.fixed, self.trees = gamma_max, fixed, trees
        self.tree = trees  # the last choice is a tree
        self.costs, self.tree_costs = StepCosts(), StepCosts()  # chains' (and plain steps'), trees'
        self.accepted, self.checked = 0.0, 0.0  # decayed run totals
        self.run_accepted, self.run_checked = 0, 0  # the run's chain proposals accepted and checked, none faded
        self.tree_accepted, self.tree_checked = 0.0, 0.0  # decayed totals of the trees' paths
        self.ended = (0, 0.0, 0.0, 0.0, 0.0)  # rows ended: count; accepted, checked, accepted^2 / checked, checked^2
        self.plain_steps, self.probe_gap = 0, PROBE_FIRST
        self.since_retime = 0  # speculative steps since another gamma than the best was re-timed
        self.credit, self.plain_credit = 0.0, 0.0  # best steps' worth of loss re-timings (stale plain steps') may spend
        self.catch_sums: tuple[float, float] | None = None  # over catch-ups, decayed: row-tokens read x extra s; squared
        self.caught: tuple | None = None  # the last catch-up step's (rows, gamma, tree, seconds, behind)
        self.probing: tuple[int, bool] | None = None  # a probe's (gamma, tree) to run once more: its step caught up
        self.confirming: tuple[int, int, bool] | None = None  # (B, gamma, tree): a cell timed once, to time again

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def costs_of(self, tree: bool) -> StepCosts:
        """The step costs of trees, or of chains and plain steps."""
        return self.tree_costs if tree else self.costs

    @property
    def catch_up(self) -> float | None:
        """Seconds a step spends per row and token the draft skipped (None before any catch-up was
        timed): the catch-ups' least-squares slope through 0, CATCH_PRIOR row-tokens' worth of 0 before."""
        if self.catch_sums is None:
            return None
        extra, squares = self.catch_sums
        return max(extra / (squares + CATCH_PRIOR**2), 0.0)

    @property
    def alpha(self) -> float:
        """The run's per-proposal acceptance, recent proposals weighing most, with PRIOR_WEIGHT
        proposals' worth of the higher of PRIOR_ALPHA and all the run's proposals' alpha (itself
        with PRIOR_WEIGHT of PRIOR_ALPHA): evidence fades towards it (see alpha above)."""
        overall = row_alpha(self.run_accepted, self.run_checked, PRIOR_ALPHA)
        return row_alpha(self.accepted, self.checked, max(PRIOR_ALPHA, overall))

    def row_ended(self, accepted: int, checked: int) -> None:
        """A row's proposals accepted and checked over its whole completion (a tree's along its
        accepted path), as it ends."""
        if checked:
            rows, accepted_sum, checked_sum, accepted_squares, checked_squares = self.ended
            self.ended = (rows + 1, accepted_sum + accepted, checked_sum + checked,
                          accepted_squares + accepted**2 / checked, checked_squares + checked**2)

    @property
    def spread(self) -> float:
        """The variance of the run's rows' alphas about its mean, from the rows that ended: their
        rates, each over its whole completion, spread by that and by their noise, alpha (1 -
        alpha) / checked (DerSimonian and Laird's estimate, each row weighing its checked
        proposals; 0 before two rows ended). A static batch ends with its slowest row, so rows
        that differ make speculation pay less than rows alike at their mean alpha (tail_share)."""
        rows, accepted, checked, accepted_squares, checked_squares = self.ended
        if rows < 2:
            return 0.0
        alpha = accepted / checked
        spread = accepted_squares - accepted**2 / checked - (rows - 1) * alpha * (1 - alpha)
        return max(spread / (checked - checked_squares / checked), 0.0)

    @property
    def tree_alpha(self) -> float:
        """The same along the trees' accepted paths, from TREE_LIFT times the chains' before any."""
        prior = min(TREE_LIFT * self.alpha, 1 - 1e-3)
        return (self.tree_accepted + PRIOR_WEIGHT * prior) / (self.tree_checked + PRIOR_WEIGHT)

    def tree_arm(self, rows: int, costs: list[float], context: int) -> tuple[list[float], list[float]]:
        """A tree's yield over a chain's and its seconds per depth 0..gamma_max over a cache of
        `context` slots (the chains' costs where no tree was timed yet)."""
        lift = [chain_tokens(self.tree_alpha, g) / chain_tokens(self.alpha, g) for g in range(len(costs))]
        if not self.tree_costs.cells:
            return lift, costs
        scale = self.tree_costs.scale(context)
        return lift, [seconds * scale for seconds in self.tree_costs.estimates(rows, self.gamma_max)]

    def work(self, rows: int, tokens: list[float], critical: list[float], plain: float) -> list[float]:
        """[G+1]: a step's expected work in seconds of plain steps. A plain step costs
        plain = T(B, 0) = c + d * B; a static batch lasts as long as its longest completion, so
        a step that shortens it by `critical` tokens and yields `tokens` in all does the work of
        c * critical + d * tokens (a plain step's: c + d * B)."""
        c = self.costs.fixed_share(rows) * plain
        d = (plain - c) / rows
        return [c * shrinks + d * yields for yields, shrinks in zip(tokens, critical)]

    def choose(self, rows: int, expected: Expected | None, behind: int = 0, left: float = math.inf,
               context: int = 0) -> int:
        """The next step's gamma for `rows` live rows. expected: what a step yields per gamma
        (None: as many rows alike at the run's alpha); behind: the tokens the draft must read
        before it can propose; left: the tokens the rows may still generate, summed; context:
        the slots of the target's cache (host numbers)."""
        if self.fixed is not None:
            return self.fixed
        if self.probing:  # the probe's own step read what the draft skipped, and was not timed as its gamma
            (gamma, self.tree), self.probing = self.probing, None
            return gamma
        if self.confirming:  # a gamma's first timing at a batch size: its next step there times it again
            (at, gamma, tree), self.confirming = self.confirming, None
            if at == rows:
                self.tree = tree
                return gamma
        empty = self.costs.estimates(rows, self.gamma_max)  # over empty caches
        if empty is None:
            return 0  # time a plain step first
        costs = [seconds * self.costs.scale(context) for seconds in empty]  # over this step's caches
        if expected is None:
            per_row = [chain_tokens(self.alpha, g) for g in range(self.gamma_max + 1)]
            lone = lone_critical([self.alpha] * rows, [self.gamma_max + 1] * rows, self.gamma_max)  # rows alike
            expected = Expected([rows * e for e in per_row], per_row, lone)
        work = self.work(rows, expected.tokens, expected.critical, costs[0])
        lone = self.work(rows, expected.tokens, expected.lone, costs[0])  # a probe's: one step, then plain ones
        arms = [(False, [1.0] * len(costs), costs)]
        if self.trees:
            arms.append((True, *self.tree_arm(rows, costs, context)))
        catch_up = (self.catch_up or 0.0) * rows * behind if behind > 1 else 0.0  # seconds: what the draft reads first
        choices = []
        for tree, lift, seconds in arms:
            for g in range(int(tree), self.gamma_max + 1):
                tokens, done = expected.tokens[g] * lift[g], work[g] * lift[g]
                share = catch_up * tokens / max(left, tokens) if g else 0.0  # over left / tokens steps
                choices.append(Choice(done / (seconds[g] + share), g, tree, done, seconds[g], lone[g] * lift[g]))
        best = max(choices, key=lambda c: c.rate)  # the first of equals: chains before trees
        if best.rate < (1 + MARGIN) * choices[0].rate:  # choices[0]: the plain step
            best = choices[0]
        self.tree = best.tree
        if best.gamma and best.rate * self.costs.unconfirmed(rows, empty[0]) < 1 + MARGIN:
            self.tree = False  # one new timing of the plain step alone turned the choice: time it again
            return 0
        if not best.gamma and self.run_checked < TRIAL:  # too few proposals checked to judge the draft
            best = max((c for c in choices if c.gamma and not c.tree), key=lambda c: c.rate)
        if best.gamma:
            self.plain_steps, self.probe_gap = 0, PROBE_FIRST
            return self.retime(rows, best, choices) if behind <= 1 else best.gamma  # a catch-up times no cell
        self.plain_steps += 1
        probe = max((c for c in choices if c.gamma), key=lambda c: c.rate)
        steps = 2 if behind > 1 else 1  # after a catch-up, one more step times the probe's gamma
        loss = (steps * (probe.seconds - probe.lone) + catch_up) / costs[0]  # in plain steps: cost - work
        wait = max(self.probe_gap, loss / PROBE_BUDGET)
        if self.plain_steps < wait:
            return 0
        self.plain_steps, self.probe_gap = 0, min(2 * self.probe_gap, PROBE_LAST)
        self.tree = probe.tree
        if steps == 2:
            self.probing = (probe.gamma, probe.tree)
        return probe.gamma

    def retime(self, rows: int, best: Choice, choices: list[Choice]) -> int:
        """best's gamma, or another choice's: of the plain step and the gammas next to best's
        (one under, one over, chains and trees), the one timed longest ago at `rows`, RETIME_GAP
        steps after the last re-timing at least, once the steps since the last have earned
        PROBE_BUDGET each of its estimated loss against best. A cost is updated only when its
        gamma runs, so a slow timing (a busy machine, new shapes) would otherwise stand for good.
        A step's work a second rises with gamma to one peak and falls after it, so a gamma
        further off can overtake best only through its neighbours, which are re-timed (and the
        cost line through them moved); re-timed too, the gammas far over best took the budget
        with steps up to twice best's, timed for a choice that could not win (simulated over
        ten models of the test VM, 96 seeds: auto x the best method 0.962 -> 0.965 on the mean,
        0.941 -> 0.949 on the paying pair's costs at 16 rows, where gamma 1 is best and gammas
        4-8 cost 2-3 of its steps).
        Gammas never timed at `rows` are not re-timed: they are priced off those that were, and
        tried when that price makes them best. Counted as the oldest, they took the budget: traced
        on a paying pair at 16 rows in bfloat16 (8 runs of a batch), gamma 1 was timed at 53-75 ms
        in a slow phase and then priced over gamma 2 (57-65 ms) for the rest of the run, the
        re-timings there going to gammas 4 and 5 (98 and 93 ms), where fixed gamma 1 ran at
        39-55 ms a step and was the fastest method.
        A plain step not timed at `rows` in PLAIN_STALE timings comes first, on a budget of its
        own that keeps what it did not spend (ready when a phase of the machine ends): whether
        to speculate at all turns on its cost, and the many gammas > 0 would spend the shared
        budget."""
        self.since_retime += 1
        self.credit, self.plain_credit = self.credit + PROBE_BUDGET, self.plain_credit + PROBE_BUDGET
        if self.since_retime < RETIME_GAP:
            return best.gamma
        plain_loss = loss(choices[0], best)  # choices[0]: the plain step
        if self.costs.timings - self.costs.timed_at.get((rows, 0), 0) > PLAIN_STALE and self.plain_credit >= plain_loss:
            self.since_retime, self.plain_credit, self.tree = 0, self.plain_credit - plain_loss, False
            return 0
        timed_at = lambda c: self.costs_of(c.tree).timed_at.get((rows, c.gamma))  # noqa: E731
        near = [c for c in choices if not c.gamma or abs(c.gamma - best.gamma) <= 1]  # plain, and next to best
        others = [c for c in near if (c.gamma, c.tree) != (best.gamma, best.tree) and timed_at(c) is not None]
        oldest = min(others, key=timed_at, default=None)
        if oldest is None or self.credit < loss(oldest, best):
            return best.gamma
        self.since_retime, self.credit, self.tree = 0, 0.0, oldest.tree
        return oldest.gamma

    def batch_rows(self, live: int, rows: int, gamma: int) -> int:
        """How many rows a batch of `rows` should go on with once its live rows fell to `live`:
        live (the rows that ended leave), or more, up to `rows` (that many stay, inert), where
        chain steps of this gamma ran faster with more rows, by KEEP_MARGIN at least, on the
        run's means over empty caches (the moving averages that price gammas follow the last few
        steps, too few where a batch size lasts a few steps of each batch; over the batch's
        caches, each grows by the same factor). live while steps at live rows were timed fewer
        than KEEP_EVIDENCE times: they are timed then."""
        own = self.costs.mean(live, gamma)
        timed = {b: t for b in range(live + 1, rows + 1) if (t := self.costs.mean(b, gamma)) is not None}  # B -> s
        if own is None or not timed:
            return live
        fastest = min(timed, key=timed.get)
        return fastest if timed[fastest] < (1 - KEEP_MARGIN) * own else live

    def observe(self, rows: int, gamma: int, accepted: int, checked: int, seconds: float | None,
                behind: int = 0, tree: bool = False, context: int = 0) -> None:
        """A step's outcome: proposals accepted and checked (all rows; a tree's: along the
        accepted paths), its seconds (None: not timed), the tokens the draft read first
        (behind > 1: a catch-up, which costs what it took over the next step when that takes the
        same gamma at as many rows: catch_up fits it per row and token) and the slots of the
        target's cache it ran over."""
        if tree:
            self.tree_accepted = RUN_DECAY * self.tree_accepted + accepted
            self.tree_checked = RUN_DECAY * self.tree_checked + checked
        elif gamma:
            self.accepted = RUN_DECAY * self.accepted + accepted
            self.checked = RUN_DECAY * self.checked + checked
            self.run_accepted, self.run_checked = self.run_accepted + accepted, self.run_checked + checked
        else:  # no new evidence: the old fades, and alpha towards all the run's proposals'
            self.accepted, self.checked = PLAIN_DECAY * self.accepted, PLAIN_DECAY * self.checked
        if seconds is None:
            return
        if gamma and behind > 1:  # priced against the next step, if it takes the same gamma at as many rows
            self.caught = (rows, gamma, tree, seconds, behind)
            return
        self.costs_of(tree).add(rows, gamma, seconds, context)
        self.confirming = (rows, gamma, tree) if gamma and self.costs_of(tree).timings_of(rows, gamma) == 1 else None
        if self.caught and self.caught[:3] == (rows, gamma, tree):
            caught_seconds, caught_behind = self.caught[3:]
            read = rows * caught_behind  # row-tokens
            extra, squares = self.catch_sums or (0.0, 0.0)
            self.catch_sums = (CATCH_DECAY * extra + read * (caught_seconds - seconds), CATCH_DECAY * squares + read**2)
        self.caught = None
