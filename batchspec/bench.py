"""Side-by-side throughput: speculative (the draft model at fixed gammas and auto, n-gram lookup,
the hybrid of both) vs our autoregressive baseline vs transformers' generate (and its assisted
generation and prompt lookup, which take one row at a time).

Every method decodes the same prompts, greedy, in batches of each batch size, in one process:
a warm-up batch first (not timed), then `repeats` passes over the batches (more at a batch size
of few batches, so that every method is timed in `min_runs` runs of a batch), batch by batch
(every method decodes a batch before any decodes the next), in lockstep: a step at a time,
the one furthest behind stepping next, so that a phase of the machine slows them alike
(transformers' generate on a greenlet of its own, paused at every step by its streamer). A cell's
time is its batches' times, each batch's fastest run counting (tok/s), and one method's speed
over another's (x ar, x hf, the verdicts, the best config) is the median over passes of their
times' ratio in the same pass (faster). Bare forwards, which price the ideal, take a turn on a
few batches of each pass too. Each speculative method keeps one gamma policy for the whole
cell, as a job keeps one for its run, so auto is timed as it runs once it has measured its step
costs. Tokens/s counts each row's own completion tokens.
"""

import re
import statistics
import time
from dataclasses import dataclass, field, replace

import greenlet
import torch
from transformers import CompileConfig

from batchspec.bench_files import best_configs, write_results
from batchspec.buckets import make_encoder
from batchspec.decoding import DecodeConfig, RowOptions
from batchspec.decoding.compiled import Compiled
from batchspec.decoding.engine import BatchDecoder, BatchOutput
from batchspec.decoding.kv_cache import padded
from batchspec.decoding.policy import GammaPolicy, chain_tokens
from batchspec.decoding.seq2seq import decoder_prefix, model_cache
from batchspec.decoding.suffix_index import SuffixIndex
from batchspec.defaults import default_draft, default_target
from batchspec.errors import UsageError
from batchspec.fidelity import mean_jsd, mismatches
from batchspec.api import option_grammar
from batchspec.models import load_pair
from batchspec.sources import Row, RowError, read_jsonl

HF, ASSISTED, LOOKUP, AR, AUTO = "hf generate", "hf assisted", "hf prompt lookup", "ar", "spec auto"
COMPILED = " compiled"  # --compile: hf generate (static cache), ar and spec auto again, their step forwards compiled
TRANSFORMERS = (HF, ASSISTED, LOOKUP, HF + COMPILED)  # methods transformers' generate runs (in lockstep: Generating)
CONTROL = "ar again"  # --control: ar twice, side by side; its speed over ar is the measurement's noise
NGRAM, HYBRID, SUFFIX, SUFFIX_HYBRID = "ngram auto", "hybrid auto", "suffix auto", "suffix hybrid auto"
DRAFTERS = {"model": AUTO, "ngram": NGRAM, "hybrid": HYBRID, "suffix": SUFFIX,
            "suffix-hybrid": SUFFIX_HYBRID}  # --drafters -> the auto method of each
WITH_MODEL = ("model", "hybrid", "suffix-hybrid")  # the drafters that run the draft model
WITH_OPTIONS = " + options"  # --with-options: ar and spec auto again, every row with OPTIONS
SCHEMA, NO_JUMP = " + schema", " + schema, no jump"  # --json-schema: ar and spec auto (without jump-forward) again
# every processor and 5 logprobs, at strengths too small to change a token: the same work on the same outputs
OPTIONS = RowOptions(repetition_penalty=1 + 1e-6, frequency_penalty=1e-6, presence_penalty=1e-6, min_tokens=1,
                     logit_bias={0: 1e-6}, logprobs=5)

COST_BATCHES = 4  # batches a pass whose turn also times bare forwards (at batch 1 on the paying pair: 3 s each)


@dataclass
class Cell:
    """One method at one batch size, over all the prompts."""

    batch_size: int
    method: str  # HF, ASSISTED, LOOKUP, AR, AUTO, NGRAM, HYBRID or "spec gamma=N"
    config: DecodeConfig
    draft: object | None = None  # the draft model its decoder runs
    times: list[float] = field(default_factory=list)  # seconds of each timed pass (its batches' times)
    seconds: float = 0.0  # its time: each batch's fastest run, summed (settle)
    outputs: list[list[int]] = field(default_factory=list)  # completion token ids per prompt (fastest runs)
    stats: list[dict] = field(default_factory=list)  # per-row stats (batchspec methods; fastest runs)
    forwards: int = 0  # target forwards in the fastest runs
    peak_mib: float | None = None  # the most memory its warm-up batch held above what was held before it
    mismatches: list[dict] = field(default_factory=list)  # rows unlike its reference's (fidelity.mismatches)
    policy: GammaPolicy | None = None
    ideal: float | None = None  # the speed-up over ar its alpha promises at bare forward costs (ForwardCosts)
    options: RowOptions | None = None  # every row's (--with-options, --json-schema)
    samples: int = 1  # rows per prompt, side by side in a batch (--samples)
    mask_seconds: float = 0.0  # host time its grammar masks took (fastest runs)

    def prompts(self, prompts: list[list[int]]) -> list[list[int]]:
        """The rows it decodes: as many as `prompts`, each prompt `samples` times in a row."""
        return [prompts[i // self.samples] for i in range(len(prompts))]

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.outputs)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def gamma(self) -> int | str | None:
        """A fixed gamma, "auto", or None (no gamma policy)."""
        return None if self.policy is None else "auto" if self.policy.auto else self.policy.fixed

    @property
    def wasted(self) -> float | None:
        """Of the target cache slots decode steps wrote, the share rolled back (rejected proposals)."""
        if not self.stats:
            return None
        rejected = self.total("draft_tokens") - self.total("accepted_tokens")
        return rejected / (self.tokens + rejected) if self.tokens + rejected else 0.0

    def total(self, key: str) -> int:
        return sum(s[key] for s in self.stats)

    @property
    def alpha(self) -> float | None:
        """The per-proposal acceptance of E(alpha, gamma) that the accepted tokens per speculative
        step imply at the gammas the steps used (accepted / drafted understates it: proposals after
        a rejection are never accepted)."""
        steps = [sum(column) for column in zip(*(s["gamma_histogram"] for s in self.stats))][1:]  # per gamma 1..
        if not sum(steps):
            return None
        shares = {g: count / sum(steps) for g, count in enumerate(steps, start=1) if count}
        return geometric_alpha(self.accepted_length, shares)

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens a row gained per target forward (None without a gamma policy: 1 or unknown)."""
        forwards = self.total("target_forwards")
        return self.total("completion_tokens") / forwards if forwards and self.policy else None

    @property
    def accepted_length(self) -> float | None:
        steps = sum(sum(s["gamma_histogram"][1:]) for s in self.stats)
        return self.total("accepted_tokens") / steps if steps else None

    def gammas_used(self) -> str:
        """Share of row-steps per gamma, e.g. "0:10% 3:90%", each row's first step left out (the
        prefill's, plain: not a choice)."""
        counts = [sum(column) for column in zip(*(s["gamma_histogram"] for s in self.stats))]
        counts[:1] = [counts[0] - len(self.stats)] if counts else []
        steps = sum(counts)
        return " ".join(f"{g}:{100 * c / steps:.0f}%" for g, c in enumerate(counts) if c) if steps else ""


@dataclass
class Run:
    """One batch decoded by one cell."""

    outputs: list[list[int]]  # completion token ids per row
    stats: list[dict] = field(default_factory=list)  # per-row stats (batchspec methods)
    mask_seconds: float = 0.0  # host time its grammar masks took
    seconds: float = 0.0  # its time, timed
    forwards: int = 0  # its target forwards


def geometric_alpha(accepted: float, shares: dict[int, float]) -> float:
    """The alpha at which steps proposing gamma tokens with probability shares[gamma] accept
    `accepted` tokens on average, each proposal accepted with probability alpha until the first
    rejection: sum over gamma of shares[gamma] * (alpha + ... + alpha^gamma) = accepted."""

    def mean_accepted(alpha: float) -> float:
        return sum(share * sum(alpha ** i for i in range(1, g + 1)) for g, share in shares.items())

    low, high = 0.0, 1.0
    for _ in range(50):  # bisection: mean_accepted rises with alpha
        middle = (low + high) / 2
        low, high = (middle, high) if mean_accepted(middle) < accepted else (low, middle)
    return (low + high) / 2


@dataclass
class ForwardCosts:
    """Median seconds of bare forwards at one batch size, timed as the steps run them:
    target[s - 1] the target's over s new tokens back to back (plain steps, n-gram lookup's
    verifies); step[g - 1] a draft model's step of gamma g: g draft forwards over one token, then
    the target's over g + 1 (empty: no draft); prefill: the target's forward over the batch's
    prompts (an encoder–decoder's encoding included) and the draft's (0.0: no draft). On a CPU a
    draft's forwards right after the target's run slower than back to back: the target's
    weights have pushed the draft's out of the processor's caches."""

    target: list[float]
    step: list[float]
    prefill: tuple[float, float]

    @classmethod
    def median(cls, samples: list["ForwardCosts"]) -> "ForwardCosts":
        """Each cost's median over samples timed at different moments of the passes, taken
        relative to its own sample's plain forward (target[0]), times that forward's median.
        The machine's speed moves between samples, and medians taken apart would set one
        sample's step against another's plain forward (traced on the embedded pair in bfloat16
        at batch 1: gamma 1's step over a plain forward, estimated from 8 samples, had an sd of
        0.12 taken apart and 0.04 paired; a bench read it at 0.96, under the target's forward
        that the step holds)."""
        plain = statistics.median(s.target[0] for s in samples)

        def medians(costs):  # costs(sample) -> its seconds; each taken over that sample's plain forward
            relative = ([cost / s.target[0] for cost in costs(s)] for s in samples)
            return [plain * statistics.median(column) for column in zip(*relative)]

        return cls(medians(lambda s: s.target), medians(lambda s: s.step), tuple(medians(lambda s: s.prefill)))

    def ideal(self, alpha: float, gamma: int, tokens: float, drafts: bool = True) -> float:
        """Speed-up over ar of a batch whose rows generate `tokens` each, if every step cost its
        forwards only: in both the target's prefill gives each row its first token; then ar takes
        a plain step per token, spec a step of gamma per E(alpha, gamma) tokens, and its draft
        reads the prompts too (none of that for n-gram lookup: drafts False)."""
        target_prefill, draft_prefill = self.prefill if drafts else (self.prefill[0], 0.0)
        steps = max(tokens - 1, 0.0)
        step = self.step[gamma - 1] if drafts else self.target[gamma]
        spec = target_prefill + draft_prefill + steps / chain_tokens(alpha, gamma) * step
        return (target_prefill + steps * self.target[0]) / spec


@torch.inference_mode()
def forward_costs(pair, prompts: list[list[int]], gamma_max: int, repeats: int = 5) -> ForwardCosts:
    """Time bare forwards with `prompts` (one batch) in the caches (an encoder–decoder pair's:
    encoded, its decoder prefix in the caches)."""
    device, seq2seq = pair.target.device, pair.target.config.is_encoder_decoder
    source = padded(prompts, device, left=False) if seq2seq else None
    ids, mask = padded([decoder_prefix(pair.target)] * len(prompts) if seq2seq else prompts, device)

    def primed(model):
        """A cache holding the prompts, and the median seconds of 3 prefills."""
        dense = model is pair.target and mask.all()  # as the decoder runs: a target without pads goes maskless

        def prefill():
            kv = model_cache(model, len(prompts), device, source)
            kv.forward(ids, None if dense else mask, logits_to_keep=1)  # (the drafters always pass their masks)
            return kv

        seconds, caches = zip(*(timed(prefill) for _ in range(3)))
        return caches[-1], sorted(seconds)[1]

    (target, target_prefill), (draft, draft_prefill) = primed(pair.target), (None, 0.0)
    if pair.draft is not None:
        draft, draft_prefill = primed(pair.draft)
    newest = ids[:, -1:]  # [B, 1]
    none_kept = torch.zeros_like(ids[:, 0])

    def forwards(gamma: int, drafts: bool) -> None:
        """A step's forwards, rolled back after: gamma of the draft's (drafts), then the target's."""
        for _ in range(gamma if drafts else 0):
            draft.forward(newest)
        target.forward(newest.expand(-1, gamma + 1))
        target.rollback(none_kept, gamma + 1, 0)
        if drafts:
            draft.rollback(none_kept, gamma, 0)

    def median_seconds(gamma: int, drafts: bool) -> float:
        seconds = [timed(lambda: forwards(gamma, drafts))[0] for _ in range(repeats + 1)]
        return sorted(seconds[1:])[repeats // 2]  # the first at a new width is not counted: it warms up

    return ForwardCosts([median_seconds(g, False) for g in range(gamma_max + 1)],
                        [median_seconds(g, True) for g in range(1, gamma_max + 1)] if draft else [],
                        (target_prefill, draft_prefill))


def ideal_speedup(cell: Cell, cells: list[Cell], costs: ForwardCosts) -> float | None:
    """What the cell's alpha promises at its forward costs for rows as long as its own: for a
    fixed gamma, that gamma's; for auto, the best of plain steps (1) and every gamma up to
    gamma_max, at the alpha the most proposals measured. None for the hybrids, whose steps mix
    both kinds of cost; a model-free drafter's steps cost the target's forwards only."""
    if cell.policy is None or cell.method in (HYBRID, SUFFIX_HYBRID):
        return None
    drafts, tokens = cell.draft is not None, cell.tokens / len(cell.outputs)
    if not cell.policy.auto:
        return costs.ideal(cell.alpha, cell.policy.fixed, tokens, drafts) if cell.alpha is not None else None
    alpha = measured_alpha(cell, cells) or 0.0  # None: nothing like it ever speculated
    return max([1.0] + [costs.ideal(alpha, g, tokens, drafts) for g in range(1, cell.policy.gamma_max + 1)])


def measured_alpha(cell: Cell, cells: list[Cell]) -> float | None:
    """The alpha of the cell's drafter on these prompts, from whichever cell at its batch size,
    alike but for gamma, checked the most proposals: a fixed gamma speculates on every step,
    auto perhaps on a few probes only, whose alpha would price its ideal by its own misses."""
    alike = [c for c in cells if c.batch_size == cell.batch_size and c.policy is not None and c.alpha is not None
             and (c.draft, c.options, c.samples) == (cell.draft, cell.options, cell.samples)
             and replace(c.config, gamma=None) == replace(cell.config, gamma=None)]
    return max(alike, key=lambda c: c.total("draft_tokens")).alpha if alike else None


def hf_generate(pair, prompts: list[list[int]], config: DecodeConfig, method: str, streamer=None) -> list[list[int]]:
    """transformers' greedy generate (ASSISTED: with the draft as assistant model; LOOKUP: prompt
    lookup with the n-gram sizes of `config`; both one row only); completions cut after the first
    EOS id, as ours are. streamer: given the prompt, then each step's tokens."""
    seq2seq = pair.target.config.is_encoder_decoder  # generate reads its source right-padded
    ids, mask = padded(prompts, pair.target.device, left=not seq2seq)
    eos = list(pair.eos_token_ids)
    max_new_tokens = config.max_new_tokens
    extra = {ASSISTED: {"assistant_model": pair.draft},
             LOOKUP: {"prompt_lookup_num_tokens": config.gamma_max,
                      "max_matching_ngram_size": config.ngram[1] if config.ngram else None},
             HF + COMPILED: {"cache_implementation": "static", "compile_config": hf_compile(ids.device)},
             }.get(method, {})
    out = pair.target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                               eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, streamer=streamer,
                               **extra)
    completions = out[:, len(decoder_prefix(pair.target)) if seq2seq else ids.shape[1] :].tolist()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in completions]


def hf_compile(device: torch.device) -> CompileConfig:
    """generate's compiled decode forward on any device (it compiles on GPUs only, unless told)."""
    config = CompileConfig(mode="default" if device.type == "cpu" else "reduce-overhead")
    config._compile_all_devices = True
    return config


def assistable(pair) -> bool:
    """transformers assists only with a draft of the target's vocabulary width (else it wants its
    universal assisted decoding, for other tokenizers)."""
    return pair.draft is not None and len({m.config.get_text_config().vocab_size
                                           for m in (pair.target, pair.draft)}) == 1


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def decode(pair, cell: Cell, batch: list[list[int]]) -> Run:
    """One batch decoded by cell.method: completions, row stats, the seconds grammar masks took
    (timing and counting are the caller's)."""
    if cell.method in TRANSFORMERS:
        return Run(hf_generate(pair, batch, cell.config, cell.method))
    return finished(start(pair, cell, batch).run())


def start(pair, cell: Cell, batch: list[list[int]]) -> BatchDecoder:
    """A batchspec method's decoder of one batch, its prompts prefilled."""
    options = [cell.options] * len(batch) if cell.options else None
    return BatchDecoder(pair.target, cell.draft, batch, list(range(len(batch))), cell.config, options, cell.policy,
                        pair.tokenizer)


def finished(output: BatchOutput) -> Run:
    return Run([r.token_ids for r in output.rows], [r.stats for r in output.rows], output.stats["mask_seconds"])


def methods(pair, batch_size: int, drafters: list[str], gammas: list[int], base: DecodeConfig,
            ngram: tuple[int, int], with_options: bool = False, samples: int = 1,
            schema: RowOptions | None = None, tree_widths: tuple[int, ...] = (), control: bool = False,
            compile: float | None = None) -> list[Cell]:
    """The cells one batch size compares: transformers' (its one-row methods at batch 1 only),
    ar (control: and ar again, whose speed over ar is the measurement's noise), the draft model at
    each fixed gamma (and trees of each of tree_widths at that depth, and with auto), each
    drafter with auto (ngram: n-gram sizes),
    with_options: ar and the model's auto again with OPTIONS on every row, and samples > 1: ar
    over rows that repeat each prompt `samples` times, prefilled once (n) or each (copies);
    schema (every row's grammar): ar and the model's auto with it, and auto without jump-forward;
    compile (seconds, or None: none): transformers' generate on a static cache with its compiled
    forward, and ar and the model's auto with compiled step forwards, a step shape compiled after
    `compile` seconds of eager forwards at it."""
    lookup = replace(base, ngram=ngram)
    one_row = [ASSISTED] * assistable(pair) + [LOOKUP] * ("ngram" in drafters) if batch_size == 1 else []
    cells = [Cell(batch_size, HF, base)] + [Cell(batch_size, m, lookup) for m in one_row]
    cells += [Cell(batch_size, AR, base)] + [Cell(batch_size, CONTROL, base)] * control
    if "model" in drafters:
        cells += [Cell(batch_size, f"spec gamma={g}", replace(base, gamma=g), pair.draft) for g in gammas]
        cells += [Cell(batch_size, tree_method(w, g), replace(base, gamma=g, tree_width=w), pair.draft)
                  for w in tree_widths for g in [*gammas, None]]
    for drafter in drafters:
        config = base if drafter == "model" else lookup
        config = replace(config, suffix=SuffixIndex()) if drafter.startswith("suffix") else config
        cells.append(Cell(batch_size, DRAFTERS[drafter], config, pair.draft if drafter in WITH_MODEL else None))
    if with_options:
        cells.append(Cell(batch_size, AR + WITH_OPTIONS, base, options=OPTIONS))
        if "model" in drafters:
            cells.append(Cell(batch_size, AUTO + WITH_OPTIONS, base, pair.draft, options=OPTIONS))
    if schema:
        cells.append(Cell(batch_size, AR + SCHEMA, base, options=schema))
        if "model" in drafters:
            cells.append(Cell(batch_size, AUTO + SCHEMA, base, pair.draft, options=schema))
            cells.append(Cell(batch_size, AUTO + NO_JUMP, replace(base, jump_forward=False), pair.draft,
                              options=schema))
    if compile is not None:
        cells.append(Cell(batch_size, HF + COMPILED, base))
        compiled = replace(base, compiled=compiled_steps(pair, base, compile))
        cells += [Cell(batch_size, method + COMPILED, compiled, draft)
                  for method, draft in [(AR, None)] + [(AUTO, pair.draft)] * ("model" in drafters)]
    if samples > 1:
        cells.append(Cell(batch_size, copies(samples), replace(base, share_prefill=False), samples=samples))
        cells.append(Cell(batch_size, f"{AR} n={samples}", base, samples=samples))
    for cell in cells:
        plain = cell.method in TRANSFORMERS or cell.method.startswith(AR)  # no gamma policy
        cell.policy = None if plain else cell.config.policy()
    return cells


def compiled_steps(pair, base: DecodeConfig, after: float) -> Compiled:
    """The compiled cells' step forwards: a shape compiles after `after` seconds of eager forwards
    at it (0: when first met, in the warm-up batch mostly; 30: as a run does)."""
    return Compiled(slots=base.gamma_max + 1, after=after, device_type=pair.target.device.type)


def tree_method(width: int, gamma: int | None) -> str:
    return f"spec tree w={width} " + ("auto" if gamma is None else f"gamma={gamma}")


def copies(samples: int) -> str:
    return f"{AR} x{samples} copies"


def bench_size(pair, prompts, batch_size: int, drafters: list[str], gammas: list[int], base: DecodeConfig,
               ngram: tuple[int, int], repeats: int, with_options: bool, samples: int,
               schema: RowOptions | None = None, tree_widths: tuple[int, ...] = (), min_runs: int = 1,
               interleave: str = "step", control: bool = False, compile: float | None = None) -> list[Cell]:
    """Every method at one batch size: a warm-up batch each (alone: the memory it holds), then
    timed passes, batch by batch (counting target forwards), `repeats` of them or as many more as
    time every method in `min_runs` runs of a batch. interleave "step": the methods decode each
    batch in lockstep; "batch": each decodes it whole in turn. Bare forwards are timed among them,
    in the turn of COST_BATCHES batches a pass spread over it (of those as wide as the first):
    the ideal takes each cost's median, so that neither the VM's drift over a pass nor a stall
    while they ran moves it."""
    cells = methods(pair, batch_size, drafters, gammas, base, ngram, with_options, samples, schema, tree_widths,
                    control, compile)
    for cell in cells:  # auto measures its costs
        with PeakMemory(pair.target.device) as memory:
            decode(pair, cell, cell.prompts(prompts)[:batch_size])
        cell.peak_mib = memory.mib
    groups = [cells] if interleave == "step" else [[cell] for cell in cells]
    starts = range(0, len(prompts), batch_size)
    passes = max(repeats, -(-min_runs // len(starts)))
    runs = {id(cell): [[] for _ in starts] for cell in cells}  # per cell, per batch: its timed Runs
    timings, width = [], min(batch_size, len(prompts))  # ForwardCosts timed on batches as wide as the first
    every = -(-len(starts) // COST_BATCHES)  # the batches apart they are timed on
    widest = max(gammas + [base.gamma_max])  # the most proposals any cell's steps make
    forwards = Counter()
    hook = pair.target.register_forward_pre_hook(forwards)
    try:
        for group, b in interleaved(groups + [None], len(starts), passes):  # None: time bare forwards
            if group is None:
                batch = prompts[starts[b] : starts[b] + batch_size]
                if b % every == 0 and len(batch) == width:
                    timings.append(forward_costs(pair, batch, widest, repeats=1))
                continue
            if b == 0:  # a pass is a job over the prompts: a suffix index holds only its own batches' completions
                for cell in group:
                    if cell.config.suffix is not None:
                        cell.config = replace(cell.config, suffix=SuffixIndex())
            batches = [cell.prompts(prompts)[starts[b] : starts[b] + batch_size] for cell in group]
            if len(group) == 1:
                done = [whole(pair, group[0], batches[0], forwards)]
            else:
                done = lockstep(pair, group, batches, forwards)
            for cell, run in zip(group, done):
                runs[id(cell)][b].append(run)
    finally:
        hook.remove()
    costs = ForwardCosts.median(timings)
    for cell in cells:
        settle(cell, runs[id(cell)])
        cell.ideal = ideal_speedup(cell, cells, costs)
    return cells


class Counter:
    """Counts its calls (a forward pre-hook: the target's forwards)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *_):
        self.calls += 1


def whole(pair, cell: Cell, batch: list[list[int]], forwards: Counter) -> Run:
    """One batch decoded by one cell alone, timed."""
    before = forwards.calls
    seconds, run = timed(lambda: decode(pair, cell, batch))
    run.seconds, run.forwards = seconds, forwards.calls - before
    return run


class Stepping:
    """One batchspec method's run of a batch, decoded a step at a time beside other runs."""

    def __init__(self, pair, cell: Cell, batch: list[list[int]]):
        self.seconds, self.decoder = timed(lambda: start(pair, cell, batch))  # its time so far: prefill, steps
        self.tokens = sum(self.decoder.remaining())  # what its rows may generate in all

    @property
    def progress(self) -> float:
        """The share of its rows' tokens generated (a row that ended: all of its own)."""
        return 1 - sum(self.decoder.remaining()) / self.tokens

    @property
    def done(self) -> bool:
        return self.decoder.done

    def step(self) -> None:
        seconds, _ = timed(self.decoder.step)
        self.seconds += seconds

    def result(self) -> Run:
        return replace(finished(self.decoder.output()), seconds=self.seconds)


class Generating:
    """transformers' generate of a batch, a step at a time beside other runs: it runs on a greenlet
    (a stack of its own, switched to within the caller's thread), and its streamer, handed each
    step's tokens, switches back there. Its time is what it measures from each turn's start to
    the step's tokens (on a GPU, synchronized). In a thread of its own instead (each thread has
    OpenMP workers of its own, asleep while the other thread computes: the cost grew with
    OMP_WAIT_POLICY=PASSIVE and was gone with ACTIVE), the step after each of its steps took
    longer: on a paying pair in bfloat16 at 16 rows (generate, ar and ar again, 3 batches,
    twice), ar's steps after generate's 3.2-3.4 ms longer than its 48-52 ms after ar again's, and
    ar, stepping after generate three times as often as ar again, took 0.98-1.04x ar again's time
    batch by batch; on the greenlet, 36.3 and 37.8 ms after generate's, 37.4 and 38.4 after ar
    again's."""

    def __init__(self, pair, cell: Cell, batch: list[list[int]]):
        self.limit, self.generated = cell.config.max_new_tokens, -1  # -1: its prompt is put first
        self.seconds, self.outputs = 0.0, None
        self.runner = greenlet.greenlet(self.generate)
        switch(self.runner, pair, cell, batch)  # up to its prompt's put: nothing computed yet

    def generate(self, pair, cell: Cell, batch: list[list[int]]) -> None:
        """The greenlet's work: an error is raised in the caller, where the switch to it returns."""
        self.began = time.perf_counter()
        self.outputs = hf_generate(pair, batch, cell.config, cell.method, streamer=self)
        self.seconds += time.perf_counter() - self.began

    def put(self, tokens: torch.Tensor) -> None:
        """The streamer's: the prompt, then each step's new tokens ([B], or [1, n] assisted)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - self.began
        self.generated += 1 if self.generated < 0 or tokens.dim() == 1 else tokens.shape[-1]
        switch(self.runner.parent)
        self.began = time.perf_counter()

    def end(self) -> None:
        pass

    @property
    def progress(self) -> float:
        return self.generated / self.limit

    @property
    def done(self) -> bool:
        return self.runner.dead

    def step(self) -> None:
        switch(self.runner)

    def result(self) -> Run:
        return Run(self.outputs, seconds=self.seconds)


def switch(to: greenlet.greenlet, *args) -> None:
    """Switch to another greenlet, keeping this one's grad mode: torch keeps it per thread, which
    greenlets share, and generate's no_grad would otherwise leak into the other runs (or, with
    two generates, one's exit restore a mode over the other's)."""
    grad = torch.is_grad_enabled()
    try:
        to.switch(*args)
    finally:
        torch.set_grad_enabled(grad)


def lockstep(pair, cells: list[Cell], batches: list[list[list[int]]], forwards: Counter) -> list[Run]:
    """Each cell's run of its batch, the runs decoded side by side a step at a time: the run that
    has generated the least share of its tokens steps next (of those tied, the one that stepped
    last: two alike, ar and ar again, step ABBA, each going first as often), so that every method
    meets each phase of the machine in the same share of its work. Each run's time is its own
    start's and steps' (on a GPU each synchronized). Whole runs one after another meet different
    phases: ar against ar on the embedded pair in bfloat16 at batch 16 (6 passes) read
    0.95-1.18x pass by pass, in lockstep 0.996-1.012x."""
    runs, counts = [], []
    for cell, batch in zip(cells, batches):
        before = forwards.calls
        runs.append((Generating if cell.method in TRANSFORMERS else Stepping)(pair, cell, batch))
        counts.append(forwards.calls - before)
    live = [i for i, run in enumerate(runs) if not run.done]
    last = [0] * len(runs)  # the step each run last took: of those tied, the latest steps first
    while live:
        i = min(live, key=lambda i: (runs[i].progress, -last[i]))
        before = forwards.calls
        runs[i].step()
        counts[i], last[i] = counts[i] + forwards.calls - before, max(last) + 1
        if runs[i].done:
            live.remove(i)
    return [replace(run.result(), forwards=count) for run, count in zip(runs, counts)]


def interleaved(units: list, batches: int, repeats: int):
    """The timed runs in order, (unit, batch index), pass after pass, a unit a cell or cells run
    together: every unit decodes a batch before any decodes the next, so that a machine whose speed
    drifts over minutes slows every method alike; every other batch, and each batch every other
    pass, in reverse order, so that no method always runs after the same ones (on a machine that
    slows along a batch's turn, or a heap the methods before grew)."""
    for repeat in range(repeats):
        for batch in range(batches):
            for unit in units if (repeat + batch) % 2 == 0 else units[::-1]:
                yield unit, batch


def settle(cell: Cell, runs: list[list[Run]]) -> None:
    """The cell's results from its runs (per batch, one per pass): each batch's fastest run
    counts, with its rows and stats. Every method decoded that batch side by side in each pass, so
    the fastest is the one a stall or a slow phase of the machine touched least; whole passes,
    minutes long, each hold some of both. times: each pass's (its batches' times)."""
    cell.times = [sum(batch[p].seconds for batch in runs) for p in range(len(runs[0]))]
    best = [min(batch, key=lambda run: run.seconds) for batch in runs]
    cell.seconds = sum(run.seconds for run in best)
    cell.outputs = [row for run in best for row in run.outputs]
    cell.stats = [row for run in best for row in run.stats]
    cell.forwards = sum(run.forwards for run in best)
    cell.mask_seconds = sum(run.mask_seconds for run in best)


def faster(cell: Cell, other: Cell) -> float:
    """How many times as fast as `other` `cell` ran: the median over passes of other's time over
    cell's in that pass. Both decoded every batch of a pass side by side, so a slow phase of the
    machine that touched the pass slowed both, where each cell's fastest runs (its tok/s) may
    come from passes minutes apart. Traced at batch 16 on the 2-core VM (8-10 passes of ar,
    auto and fixed gammas, each decoding whole batches in turn), over every 4 of the passes the
    ratio of the fastest runs moved by a standard deviation of 0.04-0.10, the median of the
    passes' ratios by 0.02-0.07, about half."""
    return statistics.median(theirs / ours for ours, theirs in zip(cell.times, other.times))


class PeakMemory:
    """The most memory (MiB) a block of work held above what was held when it began: the CUDA
    allocator's peak on a GPU; on CPU the process's resident set at its high-water mark, which
    the block's start resets (Linux; None where it cannot be reset). Nothing runs beside the
    work: a thread reading the resident set every millisecond slowed the timed passes by 6-25 %
    on a 2-core CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device, self.mib = device, None

    def __enter__(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = reset_peak_resident()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        elif self.base is not None:
            self.mib = (process_status("VmHWM") - self.base) / 2**20


def process_status(name: str) -> int:
    """Bytes of a memory line of /proc/self/status (VmRSS: resident now, VmHWM: its peak)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(name + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_resident() -> int | None:
    """Resets the process's resident high-water mark to its resident set and returns that
    (bytes); None where it cannot (not Linux, or /proc/self/clear_refs not writable)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return process_status("VmRSS")
    except (OSError, StopIteration):
        return None


def table(cells: list[Cell]) -> str:
    header = ["batch", "method", "tok/s", "x ar", "x hf", "rows = ar", "alpha", "tokens/step", "accepted/step",
              "gamma used", "ideal x ar", "achieved/ideal"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for size in sorted({c.batch_size for c in cells}):
        row_cells = [c for c in cells if c.batch_size == size]
        ar, hf = (next(c for c in row_cells if c.method == m) for m in (AR, HF))
        for c in row_cells:
            speedup = faster(c, ar)
            lines.append("| " + " | ".join([
                str(size), c.method, f"{c.rate:.1f}", f"{speedup:.2f}", f"{faster(c, hf):.2f}",
                f"{len(c.outputs) - len(c.mismatches)}/{len(c.outputs)}", fmt(c.alpha),
                fmt(c.tokens_per_step), fmt(c.accepted_length),
                c.gammas_used(), fmt(c.ideal), fmt(speedup / c.ideal if c.ideal else None),
            ]) + " |")
    return "\n".join(lines)


def reference(cell: Cell, cells: list[Cell]) -> Cell:
    """The ar cell whose rows a cell's must equal: same batch size, options and rows."""
    return next(a for a in cells if a.batch_size == cell.batch_size and a.method.startswith(AR)
                and (a.options, a.samples) == (cell.options, cell.samples))


def run_options(cell: Cell) -> dict | None:
    """The `batchspec run` options that decode as the cell does (None: not a run setting)."""
    if cell.options or cell.samples > 1 or cell.method in TRANSFORMERS:
        return None
    compiled = {"compile": True} if cell.config.compiled else {}
    if cell.policy is None:
        return {"mode": "ar"} | compiled
    options = {"mode": "spec", "gamma": cell.gamma} | compiled
    if cell.config.tree_width > 1:
        options |= {"tree_width": cell.config.tree_width}
    if cell.config.ngram:
        lookup = "suffix" if cell.config.suffix is not None else "ngram"
        options |= {"ngram_min": cell.config.ngram[0], "ngram_max": cell.config.ngram[1]}
        options |= {lookup: True} if cell.draft is not None else {"draft": lookup}
    return options


def result_rows(cells: list[Cell], jsd: float | None) -> list[dict]:
    """One row per cell with bench_files.COLUMNS, each pass's seconds, every mismatch and the
    run options it stands for."""
    rows = []
    for c in cells:
        ar = next(a for a in cells if a.batch_size == c.batch_size and a.method == AR)
        median = statistics.median(c.times)
        first = c.mismatches[0] if c.mismatches else {}
        rows.append({
            "batch_size": c.batch_size, "method": re.sub(r" (auto|gamma=\d+)", "", c.method),
            "gamma": "" if c.gamma is None else c.gamma, "tokens_per_s": c.rate,
            "tokens_per_s_median": c.tokens / median,
            "spread": (max(c.times) - min(c.times)) / median, "seconds_per_row": median / len(c.outputs),
            "speedup_vs_ar": faster(c, ar), "alpha": c.alpha, "accepted_length": c.accepted_length,
            "target_forwards_per_token": c.forwards / c.tokens if c.tokens else None,
            "wasted_cache_fraction": c.wasted, "peak_memory_mib": c.peak_mib, "rows": len(c.outputs),
            "rows_equal_ar": len(c.outputs) - len(c.mismatches), "first_mismatch_row": first.get("row"),
            "first_mismatch_position": first.get("position"), "first_mismatch_margin": first.get("margin"),
            "jsd_target_draft": jsd, "times": c.times, "mismatches": c.mismatches, "run_options": run_options(c),
        })
    return rows


def verdicts(cells: list[Cell]) -> str:
    """Per batch size: the fastest method, each drafter's auto against ar, and the model's auto
    against its best fixed gamma (each ratio: faster); with --control, ar against itself."""
    lines = []
    for size in sorted({c.batch_size for c in cells}):
        cell = {c.method: c for c in cells if c.batch_size == size}
        over = lambda a, b: faster(cell[a], cell[b])  # noqa: E731
        best = max((m for m in cell if m != CONTROL), key=lambda m: over(m, AR))
        fixed = max((m for m in cell if m.startswith("spec gamma=")), key=lambda m: over(m, AR), default=None)
        line = f"batch {size}: fastest {best} ({over(best, AR):.2f}x ar)"
        line += "".join(f"; {m} {over(m, AR):.2f}x ar" for m in DRAFTERS.values() if m in cell)
        if fixed and AUTO in cell:
            line += f", {over(AUTO, fixed):.2f}x the best fixed ({fixed})"
        trees = [c for c in cell.values() if c.config.tree_width > 1]
        if trees:
            tree = max(trees, key=lambda c: over(c.method, AR)).method
            chain = AUTO if cell[tree].gamma == "auto" else f"spec gamma={cell[tree].gamma}"
            line += f"; fastest tree {tree} {over(tree, chain):.2f}x the chain ({chain})"
        line += "".join(f"; {m}{WITH_OPTIONS} {over(m + WITH_OPTIONS, m):.2f}x without"
                        for m in (AR, AUTO) if m + WITH_OPTIONS in cell)
        if AR + SCHEMA in cell:
            masked = cell[AR + SCHEMA]
            line += (f"; {AR}{SCHEMA} {over(AR + SCHEMA, AR):.2f}x ar "
                     f"(masks {1e6 * masked.mask_seconds / masked.tokens:.0f} us/token)")
        if AUTO + SCHEMA in cell:
            line += (f", {AUTO}{SCHEMA} {over(AUTO + SCHEMA, AR + SCHEMA):.2f}x it, "
                     f"{over(AUTO + SCHEMA, AUTO + NO_JUMP):.2f}x without jump-forward")
        shared = next((c for c in cell.values() if c.samples > 1 and c.config.share_prefill), None)
        if shared:
            line += f"; {shared.method} {over(shared.method, copies(shared.samples)):.2f}x {shared.samples} copies"
        if CONTROL in cell:
            line += f"; {CONTROL} {over(CONTROL, AR):.2f}x ar (the noise of these ratios)"
        lines.append(line)
    return "\n".join(lines)


def best_of(cells: list[Cell]) -> str:
    """How many runs each batch's time is the best of: "each batch the best of 2 runs (batch 8: 4)"."""
    passes = {c.batch_size: len(c.times) for c in cells}  # batch size -> timed passes
    usual = min(passes.values())
    more = ", ".join(f"batch {size}: {n}" for size, n in passes.items() if n > usual)
    return f"each batch the best of {usual} runs" + (f" ({more})" if more else "")


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def load_prompts(path: str, tokenizer, count: int | None) -> list[list[int]]:
    """Token ids of the good rows of a JSONL input (chat rows templated): the first `count`,
    cycled if the file has fewer (None: all of them)."""
    rows = [item for item in read_jsonl(path) if isinstance(item, Row)]
    encoded = [ids for ids in make_encoder(tokenizer, context_length=None, max_new_tokens=0, truncate=None)(rows)
               if not isinstance(ids, RowError)]
    if not encoded:
        raise UsageError(f"no usable rows in {path}")
    return [encoded[i % len(encoded)] for i in range(count or len(encoded))]


def bench(*, target: str | None, draft: str | None, prompts: str, rows: int | None, batch_sizes: list[int],
          drafters: list[str], gammas: list[int], gamma_max: int, ngram_min: int, ngram_max: int,
          max_new_tokens: int, repeats: int, dtype: str, device: str, with_options: bool = False,
          samples: int = 1, out_dir: str | None = None, write_config: str | None = None,
          json_schema: str | None = None, tree_widths: tuple[int, ...] = (), min_runs: int = 1,
          interleave: str = "step", control: bool = False, compile: float | None = None) -> str:
    """The markdown report of every method at every batch size on a model pair (default: the
    embedded one); out_dir: also results.csv, results.json and plots there; write_config: the
    fastest setting per batch size as --config files; json_schema: a JSON schema file, every row's
    output constrained by it in extra cells; tree_widths: the draft's trees of these widths beside
    its chains; min_runs: each method's timed runs of a batch at every batch size, at least
    (passes are added where a batch size has fewer batches); interleave: "step" (the methods
    decode each batch in lockstep) or "batch" (each decodes it whole in turn: one batch's
    caches held at a time); control: ar twice, its speed over itself the noise of every ratio;
    compile: the compiled cells' --compile-after (methods; None: no compiled cells)."""
    models = {"target": target, "draft": draft} if target is not None else {}  # for the config files
    if target is None:
        target, draft = default_target(), draft or default_draft()
    if draft is None and set(WITH_MODEL) & set(drafters):
        raise UsageError("the model and hybrid drafters need --draft with --target (or --drafters ngram,suffix)")
    if not 1 <= ngram_min <= ngram_max:
        raise UsageError(f"need 1 <= --ngram-min <= --ngram-max, got {ngram_min} and {ngram_max}")
    gammas = gammas if "model" in drafters else []
    tree_widths = tuple(w for w in tree_widths if w > 1) if "model" in drafters else ()
    pair = load_pair(target, draft if set(WITH_MODEL) & set(drafters) else None, dtype=dtype, device=device)
    token_ids = load_prompts(prompts, pair.tokenizer, rows or max(batch_sizes))
    schema = RowOptions(grammar=option_grammar("json_schema", json_schema, pair.tokenizer)) if json_schema else None
    base = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=pair.eos_token_ids, gamma_max=gamma_max,
                        **pair.forced_tokens)
    cells = [cell for size in batch_sizes
             for cell in bench_size(pair, token_ids, size, drafters, gammas, base, (ngram_min, ngram_max), repeats,
                                    with_options, samples, schema, tree_widths, min_runs, interleave, control,
                                    compile)]
    for cell in cells:
        cell.mismatches = mismatches(pair.target, cell.prompts(token_ids), cell.outputs, reference(cell, cells).outputs)
    written = []
    if out_dir or write_config:
        ar_outputs = next(c.outputs for c in cells if c.method == AR)
        jsd = mean_jsd(pair.target, pair.draft, token_ids, ar_outputs) if pair.draft is not None else None
        rows = result_rows(cells, jsd)
        about = {"target": target, "draft": draft, "device": str(pair.target.device), "dtype": str(pair.target.dtype),
                 "threads": torch.get_num_threads(), "prompts": len(token_ids), "max_new_tokens": max_new_tokens,
                 "repeats": repeats, "min_runs": min_runs, "interleave": interleave, "greedy": True}
        written += write_results(out_dir, rows, about) if out_dir else []
        settings = {**models, "dtype": dtype, "gamma_max": gamma_max}
        written += best_configs(write_config, rows, settings) if write_config else []
    dtype_name = str(pair.target.dtype).removeprefix("torch.")
    where = f"{pair.target.device.type}, {dtype_name}, {torch.get_num_threads()} threads"
    turns = "methods in lockstep" if interleave == "step" else "each method a whole batch in turn"
    refused = pair.draft is not None and not assistable(pair)
    note = "\n(no hf assisted: transformers refuses a draft of another vocabulary width)" if refused else ""
    drafted_by = f"draft  {draft if pair.draft is not None else '(none)'}; n-gram sizes {ngram_min}..{ngram_max}"
    return (f"target {target}\n{drafted_by}\n"
            f"{where}; {len(token_ids)} prompts, max_new_tokens {max_new_tokens}, "
            f"greedy, {turns}, {best_of(cells)}\n\n{table(cells)}\n\n{verdicts(cells)}{note}"
            + "".join(f"\nwrote {path}" for path in written))
