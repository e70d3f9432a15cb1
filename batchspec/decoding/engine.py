"""The batched decode loop: speculative (a drafter proposes, the target verifies) or autoregressive.

Autoregressive decoding is the same loop with no drafter: every step is a plain step (gamma 0),
the target scores one position and the "bonus" token is simply the next token. Both strategies
therefore share the cache, positions, randomness and stopping rules.

Each step, over the B live rows of the batch:
  1. plan:     the gamma policy picks gamma (0: a plain step) and whether a tree, on a PlanView.
  2. propose:  the drafter proposes up to gamma tokens per row, d_1..d_G (G: the most any row
               proposes; a row proposing fewer pads its slots, which are never accepted).
  3. verify:   the target scores [last, d_1..d_G] in ONE forward: logits [B, G+1, V], processed
               (penalties, bias, min_tokens, a grammar's mask) at each position as if the
               proposals before it had been emitted; the draft's q is processed alike. Each row
               keeps n of its proposals plus one correction or bonus token. A tree of proposals
               (tree.py) comes back as each row's accepted path: from there on it reads as a chain.
  4. emit:     the kept block is cut at an EOS or stop id, or at max_new_tokens; the step's one
               host sync reads the outcome into a StepReport, and stop strings (stopping.py) and
               grammars (grammar.py) end rows on the host.
  5. record:   the rows' tallies, the policy and the drafter each take the report.
  6. rollback: the target cache is cut to the longest kept row, shorter rows get holes in the mask.
  7. evict:    finished rows leave the batch and the caches; compact when holes pile up.

The first step is the prefill's: a plain step whose forward is the one over the prompts (the
target then holds them whole), so N tokens decoded plainly cost N target forwards, as in generate.
Rows with a grammar add reads: its matchers run on the host, so each draft proposal is read
before the next position's mask.
"""

import hashlib
import time
from dataclasses import dataclass, field, fields, replace

import torch

from batchspec.decoding.compiled import Compiled
from batchspec.decoding.drafters import JumpDrafter, Proposal, make_drafter, tree_problem
from batchspec.decoding.drafters.proposal import on_device
from batchspec.decoding.grammar import GrammarRows
from batchspec.decoding.kv_cache import BatchKV, Static, StaticKV, padded
from batchspec.decoding.options import RowOptions
from batchspec.decoding.policy import GammaPolicy
from batchspec.decoding.processors import Processors
from batchspec.decoding.row_stats import RowStats
from batchspec.decoding.sampling import SamplingParams, accept_greedy, accept_sampled, probabilities
from batchspec.decoding.seq2seq import decoder_prefix, model_cache
from batchspec.decoding.step_report import PlanView, StepReport
from batchspec.decoding.stopping import StopRows
from batchspec.decoding.suffix_index import SuffixIndex
from batchspec.decoding.tree import accept_tree_greedy, tree_ancestors

DRAFT, ACCEPT, NEXT = 0, 1, 2  # uniform streams: draft draws, accept tests, correction/bonus draws


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = SamplingParams()
    gamma: int | None = None  # draft proposals per step; None: auto (0..gamma_max, chosen each step)
    gamma_max: int = 8  # the most proposals auto may choose
    ngram: tuple[int, int] | None = None  # (n_min, n_max): prompt lookup drafting (with a draft model: hybrid)
    suffix: SuffixIndex | None = None  # with ngram: the run's index of earlier completions, drafting beside each
    # row's own text (drafters/suffix.py) in place of n-gram lookup; shared by every batch that holds it
    tree_width: int = 1  # > 1: the draft model proposes trees this wide (greedy batches without a grammar)
    seed: int = 0
    compact_at: float = 0.3  # compact the caches when this fraction of slots are pads or holes
    share_prefill: bool = True  # prefill a prompt that several rows hold once (off: bench's baseline for n)
    forced_bos_token_id: int | None = None  # the first token of every row (the generation config's)
    forced_eos_token_id: int | None = None  # the last token of a row that reaches its limit
    jump_forward: bool = True  # with a drafter: propose the text a row's grammar forces (off: bench's baseline)
    static_cache: bool = False  # caches allocated once per batch (kv_cache.StaticKV), where a model can take one
    compiled: Compiled | None = None  # the run's compiled step forwards (on static caches); None: eager

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.gamma is not None and self.gamma < 1:
            raise ValueError(f"gamma must be >= 1 (or None: auto), got {self.gamma}")
        if self.gamma_max < 1:
            raise ValueError(f"gamma_max must be >= 1, got {self.gamma_max}")
        if self.ngram is not None and not 1 <= self.ngram[0] <= self.ngram[1]:
            raise ValueError(f"ngram sizes need 1 <= n_min <= n_max, got {self.ngram}")
        if self.tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {self.tree_width}")
        if self.tree_width > 1 and self.ngram is not None:
            raise ValueError("a tree is drafted by the draft model alone: no n-gram lookup beside it")
        if self.suffix is not None and self.ngram is None:
            raise ValueError("the suffix drafter looks a row's own text up with the ngram sizes: give ngram too")

    def policy(self, trees: bool | None = None) -> GammaPolicy:
        """A fresh gamma policy for these settings (a job shares one across its batches); trees:
        whether steps may propose trees (default: with a tree width; several drafts do too)."""
        trees = self.tree_width > 1 if trees is None else trees
        return GammaPolicy(self.gamma or self.gamma_max, fixed=self.gamma, trees=trees)


@dataclass
class RowOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS or stop id, or a stop string), "length" (max_new_tokens) or "error"
    stats: dict
    text_end: int | None = None  # a stop string ended the row: its text is decode(token_ids)[:text_end]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per token: its logprob, top (id, logprob)
    trace: dict | None = None  # per step: proposals and how many were accepted; when the row finished
    error: str | None = None  # why the row could not be decoded to its end (finish_reason "error"), else None


@dataclass
class BatchOutput:
    rows: list[RowOutput]  # in the order of the prompts given
    stats: dict


def row_seed(seed: int, row_id) -> int:
    """A 63-bit seed from (seed, row id): a row's randomness is its own, wherever it is batched."""
    digest = hashlib.blake2b(f"{seed}\x1f{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Rows:
    """Per-row device state of the live rows; every tensor has the batch as dim 0."""

    last: torch.Tensor  # [B] newest token, not yet in any cache
    produced: torch.Tensor  # [B] tokens generated so far
    limit: torch.Tensor  # [B] the row's max_new_tokens
    uniforms: torch.Tensor  # [B, W, 3] per-row uniforms by output position and stream (W = limit + G + 1)
    stop_ids: torch.Tensor  # [B, K] ids that end the row (its EOS ids and stop ids), -1: none

    def select(self, keep: torch.Tensor) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name)[keep])

    def uniform(self, stream: int, width: int) -> torch.Tensor:
        """[B, width]: uniforms for output positions produced .. produced + width - 1."""
        at = self.produced[:, None] + torch.arange(width, device=self.produced.device)  # [B, width]
        return self.uniforms[:, :, stream].gather(1, at)


@dataclass
class Tally:
    """One live row's tokens, statistics and trace on the host, filled from each step's report."""

    index: int  # position of the row in the caller's prompt list
    limit: int  # the row's max_new_tokens
    stats: RowStats
    top_logprobs: int | None = None  # None: no logprobs; k: keep each token's and the top k
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    proposed_steps: list[int] = field(default_factory=list)  # per step: proposals (0: a plain step)
    accepted_steps: list[int] = field(default_factory=list)  # per step: proposals accepted

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)

    def add(self, report: StepReport, b: int) -> None:
        """Row b of the step's report: its block (cut short, it keeps only the accepted
        proposals in it), logprobs and statistics."""
        block, proposed, accepted = report.blocks[b], report.proposed[b], report.kept[b]
        self.tokens += block
        self.logprobs += report.logprobs[b]
        self.proposed_steps.append(proposed)
        self.accepted_steps.append(accepted)
        tree = (report.nodes, report.ranks[b]) if report.tree else None
        self.stats.add_step(len(block), proposed, report.sources[b], accepted, report.draft_forwards, tree)

    def output(self, report: StepReport, b: int, speculative: bool, trees: bool) -> RowOutput:
        """The row as it ended in row b of the step's report."""
        error = report.errors[b]
        reason = "error" if error else "stop" if report.stopped[b] else "length"
        trace = {"proposed": self.proposed_steps, "accepted": self.accepted_steps, "finished_at": time.time()}
        return RowOutput(self.tokens, reason, self.stats.record(speculative, trees), report.text_ends[b],
                         self.logprobs if self.top_logprobs is not None else None, trace, error)


def stop_table(stop_ids: list[list[int]]) -> torch.Tensor:
    """[B, K]: the ids that end each row, padded with -1 (never a token)."""
    rows = [list(dict.fromkeys(ids)) for ids in stop_ids]
    table = torch.full((len(rows), max(map(len, rows), default=0)), -1, dtype=torch.long)
    for b, ids in enumerate(rows):
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return table


def start_rows(row_ids, limits: list[int], seeds: list[int], stop_ids: list[list[int]], config: DecodeConfig,
               gamma_max: int, device) -> Rows:
    B, width = len(row_ids), max(limits) + gamma_max + 1
    if config.sampling.greedy:  # no randomness needed
        uniforms = torch.empty(B, 0, 3, dtype=torch.float64)
    else:
        generators = [torch.Generator().manual_seed(row_seed(seed, r)) for seed, r in zip(seeds, row_ids)]
        uniforms = torch.stack([torch.rand(width, 3, generator=g, dtype=torch.float64) for g in generators])
    return Rows(
        last=torch.zeros(B, dtype=torch.long, device=device),
        produced=torch.zeros(B, dtype=torch.long, device=device),
        limit=torch.tensor(limits, dtype=torch.long, device=device),
        uniforms=uniforms.to(device),
        stop_ids=stop_table(stop_ids).to(device),
    )


def prefill(target, ids: torch.Tensor, mask: torch.Tensor | None, prompts: list[list[int]], share: bool = True,
            source: tuple[torch.Tensor, torch.Tensor] | None = None,
            static: Static | None = None) -> tuple[BatchKV, torch.Tensor]:
    """The target's cache holding every decoder prompt (ids, mask: [B, P]; mask None: no pad),
    and its logits after each [B, 1, V]: the first step's. An encoder–decoder target first
    encodes `source` (the prompts, right-padded). share: a prompt that several rows hold (n
    samples of one request) is prefilled once, its cache copied. static: a static cache's plan."""
    first: dict[tuple | int, int] = {}
    origin = [first.setdefault(tuple(prompt) if share else b, b) for b, prompt in enumerate(prompts)]  # [B]
    distinct = list(first.values())  # [U]
    kv = model_cache(target, len(distinct), ids.device, source and (source[0][distinct], source[1][distinct]), static)
    logits = kv.forward(ids[distinct], mask if mask is None else mask[distinct], logits_to_keep=1)  # [U, 1, V]
    if len(distinct) < len(prompts):
        at = {b: k for k, b in enumerate(distinct)}
        rows = torch.tensor([at[b] for b in origin], device=ids.device)  # [B]
        kv.select(rows)
        logits = logits[rows]
    return kv, logits


def verify(target_kv: BatchKV, rows: Rows, proposal: Proposal, params: SamplingParams, processors: Processors,
           logprobs: bool, known: torch.Tensor | None = None):
    """The target scores [last, d_1..d_G] in one forward. known: the logits [B, 1, V] after `last`
    when they are known (the prefill's, for a first plain step: no forward). Returns n [B],
    next_token [B], when asked the raw log-softmax [B, G+1, V] of the target's logits (before any
    processing or warping), and the proposal as checked (a tree's: each row's accepted path)."""
    if proposal.parents is not None:
        return verify_tree(target_kv, rows, proposal, processors, logprobs)
    draft_tokens, gamma, lengths = proposal.tokens, proposal.width, proposal.short_lengths()  # lengths [B] | None
    inputs = torch.cat([rows.last[:, None], draft_tokens], dim=1)  # [B, G+1]
    logits = target_kv.forward(inputs) if known is None else known  # [B, G+1, V]
    raw = torch.log_softmax(logits.float(), dim=-1) if logprobs else None
    logits = processors(logits, draft_tokens, rows.produced)
    if params.greedy:
        return *accept_greedy(logits, draft_tokens, lengths), raw, proposal
    p = probabilities(logits, params)  # [B, G+1, V]
    u_accept, u_next = rows.uniform(ACCEPT, gamma), rows.uniform(NEXT, gamma + 1)
    return *accept_sampled(p, proposal.q, draft_tokens, u_accept, u_next, lengths), raw, proposal


def verify_tree(target_kv: BatchKV, rows: Rows, tree: Proposal, processors: Processors, logprobs: bool):
    """A tree of depth D (greedy): the target scores [last, d_1..d_N] in one tree-masked forward,
    each slot processed after its ancestors, keeps each row's accepted path in its cache (slots
    [last, path], D+1 of them, which the step's rollback then cuts) and returns as verify does,
    the proposal as the rows' paths: tokens [B, D], raw [B, D+1, V]."""
    inputs = torch.cat([rows.last[:, None], tree.tokens], dim=1)  # [B, N+1]
    depth = max(tree.lengths)
    parents = torch.cat([tree.parents.new_full((len(inputs), 1), -1), tree.parents], dim=1)  # [B, N+1]
    logits = target_kv.forward_tree(inputs, parents, depth)  # [B, N+1, V]
    ancestors = tree_ancestors(parents, depth)  # [B, N+1, N+1]
    processed = processors(logits, tree.tokens, rows.produced, ancestors=ancestors)
    n, next_token, path = accept_tree_greedy(processed, tree.tokens, tree.parents, ancestors, depth)  # path [B, D+1]
    target_kv.take_tree(path)
    raw = None
    if logprobs:
        raw = torch.log_softmax(logits.gather(1, path[:, :, None].expand(-1, -1, logits.shape[-1])).float(), dim=-1)
    return n, next_token, raw, replace(tree, tokens=inputs.gather(1, path[:, 1:]), parents=None, path=path)


def token_logprobs(raw: torch.Tensor, new: torch.Tensor, k: int) -> torch.Tensor:
    """raw [B, G+1, V] log-softmax, new [B, G+1] the blocks' tokens -> [B, G+1, 1 + 2k]: each
    slot's token logprob, the top k logprobs and their ids."""
    top = raw.topk(k, dim=-1)
    return torch.cat([raw.gather(-1, new[..., None]), top.values, top.indices.to(raw.dtype)], dim=-1)


def logprob_entries(values: list[float], count: int, k: int, top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """A row's host copy of token_logprobs (its slots flattened, each 1 + 2 top values) -> for
    its first `count` slots: (logprob, [(id, logprob)] of its own top k <= top)."""
    slots = [values[j * (1 + 2 * top) : (j + 1) * (1 + 2 * top)] for j in range(count)]
    return [(s[0], [(int(s[1 + top + i]), s[1 + i]) for i in range(k)]) for s in slots]


def kept_blocks(rows: Rows, draft_tokens, n, next_token):
    """The block each row appends: d_1..d_n, next_token, cut at the first of its stop ids (EOS) or
    at the row's limit.

    Returns new [B, G+1] (a row's first count[b] are its tokens, the rest scratch), count [B],
    finished [B] bool and stopped [B] bool (finished on an EOS id).
    """
    gamma = draft_tokens.shape[1]
    new = torch.cat([draft_tokens, next_token[:, None]], dim=1)  # [B, G+1]
    new.scatter_(1, n[:, None], next_token[:, None])  # d_1..d_n, next_token, then scratch
    slot = torch.arange(gamma + 1, device=n.device)  # [G+1]
    count = torch.minimum(n + 1, rows.limit - rows.produced)  # [B]
    is_eos = (new[:, :, None] == rows.stop_ids[:, None, :]).any(-1) & (slot[None, :] < count[:, None])
    stopped = is_eos.any(-1)
    count = torch.where(stopped, is_eos.int().argmax(-1) + 1, count)
    rows.produced += count
    return new, count, stopped | (rows.produced >= rows.limit), stopped


def forced_tokens(config: DecodeConfig, limits: list[int], gamma_max: int, device) -> torch.Tensor | None:
    """[B, W]: the token forced at each output index, -1 where none (None: no row has any). The
    forced EOS wins where both fall on one index, as in generate."""
    if config.forced_bos_token_id is None and config.forced_eos_token_id is None:
        return None
    forced = torch.full((len(limits), max(limits) + gamma_max + 1), -1, dtype=torch.long)
    if config.forced_bos_token_id is not None:
        forced[:, 0] = config.forced_bos_token_id
    if config.forced_eos_token_id is not None:
        forced[torch.arange(len(limits)), torch.tensor(limits) - 1] = config.forced_eos_token_id
    return forced.to(device)


def drafts_problem(target, drafts: list, config: DecodeConfig) -> str | None:
    """Why these draft models cannot draft with these settings (None: they can)."""
    if len(drafts) > 1 and (config.tree_width > 1 or config.ngram is not None):
        return "several draft models propose one chain each: no tree width or n-gram lookup beside them"
    return tree_problem([target, *drafts]) if config.tree_width > 1 or len(drafts) > 1 else None


def read(*tensors: torch.Tensor) -> list[list[float]]:
    """The step's one host sync: the tensors, flattened, in one read from the device."""
    host = torch.cat([t.double().flatten() for t in tensors]).tolist()
    return split(host, [t.numel() for t in tensors])


def split(values: list, sizes: list[int]) -> list[list]:
    """values cut into consecutive pieces of the given sizes."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return [values[a:b] for a, b in zip(starts, starts[1:])]


class BatchDecoder:
    """Decodes one static batch. target/draft: causal LMs, or encoder–decoder models (which
    encode the prompts and decode from their decoder prefix), on one device; the draft proposes,
    or with config.ngram n-gram lookup does (both: hybrid); neither: autoregressive. draft may
    be a list of several: each proposes a chain, the chains are checked as one tree.

    prompts: token ids per row, lengths may differ (each >= 1); row_ids: one id per row, which
    seeds its randomness with its seed; options: each row's own RowOptions (limit, seed, stop
    ids and strings, penalties, logprobs, grammar; default: the config's settings); policy: the
    gamma policy, shared by the batches of a run (default: a fresh one from config); tokenizer:
    needed by rows with stop strings or a grammar.
    Greedy output equals `target.generate(do_sample=False)` on each row alone, with the same
    processing; sampled output follows the target's own sampling distribution.
    """

    @torch.inference_mode()
    def __init__(self, target, draft, prompts: list[list[int]], row_ids: list, config: DecodeConfig,
                 options: list[RowOptions] | None = None, policy: GammaPolicy | None = None, tokenizer=None):
        options = options or [RowOptions()] * len(prompts)
        if not prompts or not len(prompts) == len(row_ids) == len(options):
            raise ValueError("need one row id (and options) per prompt and at least one prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        drafts = list(draft) if isinstance(draft, (list, tuple)) else [draft] * (draft is not None)
        problem = drafts_problem(target, drafts, config)
        if problem:
            raise ValueError(problem)
        if tokenizer is None and any(o.stop or o.grammar for o in options):
            raise ValueError("stop strings and grammars need the tokenizer")
        self.config, self.prompts = config, prompts
        width = len(drafts) if len(drafts) > 1 else config.tree_width  # a tree's nodes per depth
        self.policy = policy or config.policy(trees=width > 1)
        device = target.device
        # an encoder–decoder target encodes the prompts; its decoder starts from its own prefix
        source = padded(prompts, device, left=False) if target.config.is_encoder_decoder else None
        decoder_prompts = prompts if source is None else [decoder_prefix(target)] * len(prompts)
        ids, mask = padded(decoder_prompts, device)  # [B, P]
        limits = [o.max_new_tokens or config.max_new_tokens for o in options]
        static = static_plan(config, ids.shape[1] + max(limits) + self.policy.gamma_max * width + 1)
        # the prefill runs every prompt through: its logits make the first step, a plain one
        even = len({len(p) for p in decoder_prompts}) == 1  # no pad: the target's cache starts dense
        self.target_kv, self.first_logits = prefill(target, ids, None if even else mask, prompts, config.share_prefill,
                                                    source, static)
        vocab = target.get_output_embeddings().weight.shape[0]
        grammars = [o.grammar for o in options]
        self.grammar = GrammarRows(grammars, tokenizer, vocab, config.eos_token_ids, device,
                                   skip_first=config.forced_bos_token_id is not None) if any(grammars) else None
        speculates = bool(drafts) or config.ngram is not None
        self.jump = JumpDrafter(self.grammar, device) if self.grammar and config.jump_forward and speculates else None
        self.trees = width > 1 and config.sampling.greedy and self.grammar is None  # else the first draft's chains
        self.drafter = make_drafter(drafts if self.trees else drafts[:1], config.ngram, prompts, ids, mask, vocab,
                                    source, self.jump, config.tree_width if self.trees else 1, config.suffix, static)
        gamma_max = self.policy.gamma_max if self.drafter else 0
        seeds = [config.seed if o.seed is None else o.seed for o in options]
        stop_ids = [o.ending_ids(config.eos_token_ids) for o in options]
        self.rows = start_rows(row_ids, limits, seeds, stop_ids, config, gamma_max, device)
        self.rows.last = ids[:, -1]  # the drafters owe the last prompt token, like any newest token
        self.processors = Processors(options, decoder_prompts, self.rows.stop_ids, vocab, device,
                                     forced_tokens(config, limits, gamma_max, device), self.grammar)
        self.top_logprobs = max((o.logprobs for o in options if o.logprobs is not None), default=None)
        self.stops = StopRows([o.stop for o in options], tokenizer, [o.include_stop_str for o in options])
        self.trees_counted = width > 1  # the rows' statistics count tree steps
        self.tallies = [Tally(b, limit, row_stats(len(prompt), gamma_max, width, source is not None), o.logprobs)
                        for b, (o, limit, prompt) in enumerate(zip(options, limits, prompts))]  # the live rows
        self.last_rows = None  # the rows of the last step: a step over as many is timed
        self.results: list[RowOutput | None] = [None] * len(prompts)
        self.totals = {"slots": 0, "empty_slots": 0, "verify_steps": 0, "compactions": 0}
        self.padding_fraction = 1.0 - float(mask.float().mean())

    @property
    def done(self) -> bool:
        return not self.tallies

    def remaining(self) -> list[int]:
        """Per live row: the tokens it may still generate."""
        return [tally.remaining for tally in self.tallies]

    @torch.inference_mode()
    def step(self) -> None:
        """One plan/propose/verify/emit/record/rollback/evict round over the live rows."""
        started = time.perf_counter()
        known, self.first_logits = self.first_logits, None  # the prefill's logits: the first step is plain
        behind = self.drafter.behind if self.drafter else 0
        gamma, tree = self.plan() if known is None else (0, False)
        proposal = self.propose(gamma, tree, first=known is not None)
        n, next_token, raw, proposal = verify(self.target_kv, self.rows, proposal, self.config.sampling,
                                              self.processors, self.top_logprobs is not None, known)
        report = self.emit(proposal, n, next_token, raw, gamma, behind, started)
        self.record(report)
        self.rollback(report)
        self.evict(report)

    def plan(self) -> tuple[int, bool]:
        """The policy's gamma and whether a tree, for the live rows (a plain step without a drafter)."""
        if self.drafter is None:
            return 0, False
        gamma, tree = self.policy.plan(PlanView(self.remaining(), self.drafter.behind, self.trees))
        return gamma, tree and self.trees

    def propose(self, gamma: int, tree: bool, first: bool) -> Proposal:
        """The drafter's proposal of gamma tokens per row (a tree's: of that depth); for a plain
        step, what the rows' grammars force (jump-forward: no draft forward), or nothing."""
        rows, params = self.rows, self.config.sampling
        if tree:
            return self.drafter.propose_tree(rows.last, gamma)
        if gamma:
            u = None if params.greedy else rows.uniform(DRAFT, gamma)  # [B, gamma]
            return self.drafter.propose(rows.last, gamma, params, u, self.process_draft if self.processors.active
                                        else None)
        if self.jump and not first:
            return self.jump.propose(rows.last, self.policy.gamma_max, params, None)
        return Proposal.none(rows.last)

    def emit(self, proposal: Proposal, n: torch.Tensor, next_token: torch.Tensor, raw: torch.Tensor | None,
             planned: int, behind: int, started: float) -> StepReport:
        """Append each row's kept block (n [B] proposals accepted, then next_token [B]; raw: the
        target's log-softmax [B, G+1, V] when logprobs are asked), read the step's outcome in its
        one host sync, and end the rows that stop strings complete or whose grammar fails."""
        rows, kv, gamma, top = self.rows, self.target_kv, proposal.width, self.top_logprobs
        slots, empty_slots = kv.mask.numel(), (kv.mask == 0).sum()
        longest = (kv.mask.sum(-1) - (gamma - n)).max()  # valid slots after the rollback
        new, count, finished, stopped = kept_blocks(rows, proposal.tokens, n, next_token)  # new [B, G+1]
        self.processors.emitted(new, count)
        rows.last = next_token
        logprobs = token_logprobs(raw, new, top) if raw is not None else n[:0]  # [B, G+1, 1 + 2 top]
        n_host, count, finished, stopped, new, (empty_slots, longest), logprobs, won = read(
            n, count, finished, stopped, new, torch.stack([empty_slots, longest]), logprobs, proposal.won(n))
        B = len(n_host)
        blocks = [[int(t) for t in block[: int(k)]] for block, k in zip(split(new, [gamma + 1] * B), count)]
        text_ends = self.stops.cut(blocks)  # a stop string may complete before the block's EOS or limit
        errors = self.grammar.advance(blocks) if self.grammar else [None] * B
        row_logprobs = split(logprobs, [len(logprobs) // B] * B) if top is not None else [[]] * B
        seconds = time.perf_counter() - started if B == self.last_rows else None  # a new shape's first step: untimed
        self.last_rows = B
        return StepReport(
            planned=planned, gamma=gamma, tree=proposal.path is not None, nodes=proposal.nodes,
            proposed=proposal.lengths, sources=proposal.sources, accepted=[int(k) for k in n_host],
            ranks=[proposal.rank(int(slot)) for slot in won], blocks=blocks,
            logprobs=[logprob_entries(lp, len(block), t.top_logprobs, top) if t.top_logprobs is not None else []
                      for lp, block, t in zip(row_logprobs, blocks, self.tallies)],
            finished=[bool(f) or end is not None or e is not None for f, end, e in zip(finished, text_ends, errors)],
            stopped=[bool(s) or end is not None for s, end in zip(stopped, text_ends)], text_ends=text_ends,
            errors=errors, draft_forwards=proposal.forwards, behind=behind, longest=int(longest), slots=slots,
            empty_slots=int(empty_slots), seconds=seconds, proposal=proposal, n=n)

    def record(self, report: StepReport) -> None:
        """The rows' tallies, the batch's totals, the policy and the drafter take the step's report."""
        for b, tally in enumerate(self.tallies):
            tally.add(report, b)
        self.totals["slots"] += report.slots
        self.totals["empty_slots"] += report.empty_slots
        self.totals["verify_steps"] += 1
        if self.drafter:
            self.policy.record(report)
            self.drafter.verified(report)

    def rollback(self, report: StepReport) -> None:
        """Cut the target cache to the longest kept row; shorter rows get holes."""
        if report.gamma:
            self.target_kv.rollback(report.n + 1, report.gamma + 1, max(report.accepted) + 1)

    def evict(self, report: StepReport) -> None:
        """Rows that ended go to the results and leave the batch and the caches; the caches are
        compacted when pads and holes pile up."""
        for b, tally in enumerate(self.tallies):
            if report.finished[b]:
                self.results[tally.index] = tally.output(report, b, self.drafter is not None, self.trees_counted)
        live = [b for b, done in enumerate(report.finished) if not done]
        if len(live) < len(self.tallies):
            self.select(live)
        kv = self.target_kv
        if live and kv.length - report.longest >= max(1, self.config.compact_at * kv.length):
            kv.compact(report.longest)
            if self.drafter:
                self.drafter.compact(report.longest)
            self.totals["compactions"] += 1

    def select(self, kept: list[int]) -> None:
        """Keep the rows `kept` (host indices) of the batch, in every part that holds rows."""
        self.tallies = [self.tallies[b] for b in kept]
        if not kept:
            return
        keep = on_device(kept, self.rows.last.device)
        self.rows.select(keep)
        self.processors.select(keep)
        self.stops.select(kept)
        if self.grammar:
            self.grammar.select(kept)
        self.target_kv.select(keep)
        if self.drafter:
            self.drafter.select(keep, kept)

    def process_draft(self, logits: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
        """The draft's next-token logits [B, V] after its proposals [B, i] of this step, processed
        as the target's are at that position."""
        return self.processors(logits[:, None], proposals, self.rows.produced, first=proposals.shape[1])[:, 0]

    def run(self) -> BatchOutput:
        while not self.done:
            self.step()
        return self.output()

    def output(self) -> BatchOutput:
        """Results of a finished batch; stats: padding and wasted-cache fractions, raw slot counts."""
        totals = self.totals
        stats = {
            "rows": len(self.prompts),
            "padding_fraction": self.padding_fraction,
            "wasted_cache_fraction": totals["empty_slots"] / totals["slots"] if totals["slots"] else 0.0,
            "mask_seconds": self.grammar.seconds if self.grammar else 0.0,  # host time of grammar masks
            "static_cache": isinstance(self.target_kv, StaticKV),
            **totals,
        }
        return BatchOutput(self.results, stats)


def static_plan(config: DecodeConfig, capacity: int) -> Static | None:
    """The batch's static caches (capacity: its longest prompt, limit and one step's slots), or
    None: dynamic ones."""
    return Static(capacity, config.compiled) if config.static_cache or config.compiled else None


def row_stats(prompt_tokens: int, gamma_max: int, width: int, encoded: bool) -> RowStats:
    """A row's statistics before its first step: histograms gamma_max + 1 wide (a tree's ranks:
    its width); an encoder–decoder's encoding counts as a target forward."""
    return RowStats(prompt_tokens=prompt_tokens, target_forwards=int(encoded),
                    accepted_length_histogram=[0] * (gamma_max + 1), gamma_histogram=[0] * (gamma_max + 1),
                    tree_branch_histogram=[0] * width * (width > 1))


def decode_batch(target, draft, prompts: list[list[int]], row_ids: list, config: DecodeConfig,
                 options: list[RowOptions] | None = None, policy: GammaPolicy | None = None,
                 tokenizer=None) -> BatchOutput:
    """Decode one static batch; see BatchDecoder."""
    return BatchDecoder(target, draft, prompts, row_ids, config, options, policy, tokenizer).run()
