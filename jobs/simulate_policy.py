"""`--gamma auto` against plain steps and every fixed gamma, in simulation: the gamma policy
decodes static batches (tests/test_policy.py's decode_batches: synthetic acceptance, step costs
from a model of a machine) under the timing noise of the 2-core test VM, and the same batches are
decoded by plain steps and by each fixed gamma under the same noise. Prints, per scenario, auto's
speed over plain steps and over the best of the others (means over seeds of per-seed ratios),
and their mean over the scenarios. This is how the "simulated" numbers of
docs/performance-history.md are measured, and the way to try a change to the policy before a
bench: `--policy FILE` runs a copy of batchspec/decoding/policy.py instead of the installed one.

Noise (--noise, all by default): first: each (rows, gamma)'s first step 1.3-1.6x (a shape's first
run); stall: 5 % of steps 1.3-2x; phases: the machine's speed 0.8-1.25x in phases of 60 steps,
the same for every method step by step; jitter: each step 0.88-1.18x; untimed: each batch size's
first step is not timed (the engine times no step whose shapes changed). Not by default:
unequal: the phases slow plain steps more than speculative ones (a plain step's factor is the
phase's squared), as the VM's did once (plain steps at 8 rows 75 ms in one, 115 in the next,
gamma 1's 105 and 125), and as a case of tests/test_policy.py does. `--oracle` divides the
phase out of every timing the policy sees: what a cost model that knew the machine's speed
could gain.

    python jobs/simulate_policy.py [--seeds 24] [--noise first,stall,phases,jitter,untimed]
                                   [--scenarios "ef16 a.45,cpu1 a.7"] [--policy FILE] [--oracle]
"""
import argparse
import functools
import importlib.util
import random
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_policy import cpu_step, decode_batches, paying_step  # noqa: E402

NOISES = ("first", "stall", "phases", "jitter", "untimed")  # the default
KINDS = NOISES + ("unequal",)
PHASE_STEPS = 60  # steps a phase of the machine's speed lasts (about a batch)
BATCHES = 4  # batches a run decodes after its first (a warm-up: not counted)


def traced16(rows: int, gamma: int) -> float:
    """A paying pair's step costs as traced in bfloat16 on the VM at up to 16 rows (gamma 1
    1.43x a plain step at 16 rows)."""
    fixed = [38, 44, 50.5, 66] + [66 + 8 * (g - 3) for g in range(4, 9)]
    per_row = [0.94, 2.0, 4.1, 4.25] + [4.25 + (g - 3) for g in range(4, 9)]
    return (fixed[gamma] + per_row[gamma] * rows) / 1000


def embedded(rows: int, gamma: int) -> float:
    """The embedded pair in float32 on the VM: plain steps 85 ms and 3.7 a row, gamma 1 1.28x."""
    plain = 0.085 + 0.0037 * rows
    return plain * (1.12 + 0.16 * gamma) if gamma else plain


def full(rng: random.Random, rows: int) -> list[int]:
    return [64] * rows


def some_end_early(rng: random.Random, rows: int) -> list[int]:
    return [64] * (rows - rows // 4) + [rng.randint(20, 64) for _ in range(rows // 4)]


# name -> (step costs, alpha, rows, the rows' lengths, the fixed gammas compared, the sd of the rows' alphas)
SCENARIOS = {
    "ef16 a.33": (embedded, 0.33, 16, some_end_early, [1, 2], 0.0),
    "ef8 a.33": (embedded, 0.33, 8, some_end_early, [1, 2], 0.0),
    "ef16 a.45": (embedded, 0.45, 16, some_end_early, [1, 2], 0.0),
    "ef4 a.4": (embedded, 0.4, 4, some_end_early, [1, 2], 0.0),
    "traced16 a.77": (traced16, 0.77, 16, full, [1, 2, 3], 0.0),
    "traced16 a.5": (traced16, 0.5, 16, some_end_early, [1, 2], 0.0),
    "traced16 a.6 b8": (traced16, 0.6, 8, full, [1, 2, 3], 0.0),
    "paying4 a.8": (paying_step, 0.8, 4, full, [2, 3, 4, 5], 0.0),
    "cpu8 a.5": (cpu_step, 0.5, 8, full, [1, 2, 3], 0.0),
    "cpu1 a.7": (cpu_step, 0.7, 1, full, [2, 3, 4, 5], 0.0),
    # rows whose alphas differ: the embedded pair's rows spread by 0.11 about 0.33 (one batch of 16 with gamma 1)
    "ef16 a.4 sd.11": (embedded, 0.4, 16, some_end_early, [1, 2], 0.11),
    "traced16 a.7 sd.1": (traced16, 0.7, 16, full, [1, 2, 3], 0.1),
    "cpu8 a.6 sd.15": (cpu_step, 0.6, 8, full, [1, 2, 3], 0.15),
}


@functools.cache
def load_policy(path: str | None):
    """GammaPolicy from a copy of policy.py at `path`, else the installed one."""
    if path is None:
        from batchspec.decoding.policy import GammaPolicy
        return GammaPolicy
    spec = importlib.util.spec_from_file_location("variant_policy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GammaPolicy


def make_policy(GammaPolicy, method: str):
    """auto, a fixed gamma ("g3"), or plain steps throughout ("plain")."""
    if method == "auto":
        return GammaPolicy(8)
    if method == "plain":
        policy = GammaPolicy(8, fixed=1)
        policy.choose = lambda *args, **kwargs: 0
        return policy
    return GammaPolicy(8, fixed=int(method[1:]))


def untimed_at_new_sizes(policy) -> None:
    """The policy sees no timing of a step whose batch size differs from the step before's."""
    observe, last = policy.observe, [None]

    def observing(rows, gamma, accepted, checked, seconds, *args, **kwargs):
        seconds, last[0] = (seconds if rows == last[0] else None), rows
        observe(rows, gamma, accepted, checked, seconds, *args, **kwargs)
    policy.observe = observing


def phase_told(policy, level) -> None:
    """The policy sees every timing over the machine's phase now (level())."""
    observe = policy.observe

    def observing(rows, gamma, accepted, checked, seconds, *args, **kwargs):
        observe(rows, gamma, accepted, checked, None if seconds is None else seconds / level(), *args, **kwargs)
    policy.observe = observing


def run(scenario: str, method: str, seed: int, noise: frozenset, policy_path: str | None, oracle: bool) -> float:
    """One run's seconds over its batches after the first."""
    step, alpha, rows, lengths_of, _, alpha_sd = SCENARIOS[scenario]
    rng, levels_rng, lengths_rng = random.Random(seed + 7), random.Random(seed + 99), random.Random(seed)
    levels = [levels_rng.uniform(0.8, 1.25) for _ in range(50)]
    steps, timed_before = [0], set()

    def level() -> float:
        """The machine's speed now: a factor on every step's cost."""
        return levels[steps[0] // PHASE_STEPS % len(levels)] if "phases" in noise else 1.0

    def seconds(batch: int, rows: int, gamma: int) -> float:
        cost = step(rows, gamma)
        steps[0] += 1
        phase = level() ** (2 if "unequal" in noise and not gamma else 1)
        cost *= phase * (rng.uniform(0.88, 1.18) if "jitter" in noise else 1.0)
        if "first" in noise and (rows, gamma) not in timed_before:
            timed_before.add((rows, gamma))
            cost *= rng.uniform(1.3, 1.6)
        return cost * (rng.uniform(1.3, 2.0) if "stall" in noise and rng.random() < 0.05 else 1.0)

    policy = make_policy(load_policy(policy_path), method)
    if oracle and method == "auto":
        phase_told(policy, level)
    if "untimed" in noise:
        untimed_at_new_sizes(policy)
    lengths = [lengths_of(lengths_rng, rows) for _ in range(BATCHES + 1)]
    return sum(decode_batches(policy, alpha, seconds, lengths, seed, catch_up=0.0001, prompt=50, alpha_sd=alpha_sd)[1:])


def compare(scenario: str, seeds: int, noise: frozenset, policy_path: str | None, oracle: bool) -> dict[str, float]:
    """auto's speed over plain steps ("plain") and over the fastest other method ("best"),
    means over seeds of per-seed ratios, and which method was the fastest ("fastest")."""
    methods = ["auto", "plain"] + [f"g{g}" for g in SCENARIOS[scenario][4]]
    times = {m: [run(scenario, m, seed, noise, policy_path, oracle) for seed in range(seeds)] for m in methods}
    fastest = min(methods[1:], key=lambda m: sum(times[m]))
    return {"plain": faster(times["auto"], times["plain"]), "best": faster(times["auto"], times[fastest]),
            "fastest": fastest}


def faster(ours: list[float], theirs: list[float]) -> float:
    """How many times as fast as `theirs` `ours` ran: the mean over seeds of the ratio."""
    return statistics.mean(t / o for o, t in zip(ours, theirs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=24)
    parser.add_argument("--noise", default=",".join(NOISES), help="comma-separated, of " + ", ".join(KINDS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    parser.add_argument("--policy", help="a copy of batchspec/decoding/policy.py to run instead")
    parser.add_argument("--oracle", action="store_true", help="tell the policy the machine's phase")
    args = parser.parse_args()
    noise = frozenset(n for n in args.noise.split(",") if n)
    scenarios = args.scenarios.split(",")
    if unknown := (noise - set(KINDS)) | (set(scenarios) - set(SCENARIOS)):
        parser.error(f"unknown: {', '.join(sorted(unknown))}")
    with ProcessPoolExecutor() as pool:
        results = list(pool.map(functools.partial(compare, seeds=args.seeds, noise=noise, policy_path=args.policy,
                                                  oracle=args.oracle), scenarios))
    print(f"{'scenario':16s}  auto/plain  auto/best  (best)")
    for scenario, r in zip(scenarios, results):
        print(f"{scenario:16s}  {r['plain']:10.3f}  {r['best']:9.3f}  ({r['fastest']})")
    print(f"{'mean':16s}  {statistics.mean(r['plain'] for r in results):10.4f}  "
          f"{statistics.mean(r['best'] for r in results):9.4f}")


if __name__ == "__main__":
    main()
