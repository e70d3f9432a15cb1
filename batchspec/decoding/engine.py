"""The batched decode loop: speculative (a drafter proposes, the target verifies) or autoregressive.

Autoregressive decoding is the same loop with no drafter: every step is a plain step (gamma 0),
the target scores one position and the "bonus" token is simply the next token. Both strategies
therefore share the cache, positions, randomness and stopping rules.

Each step, for the B rows of the batch (live ones, and rows that ended kept inert: see 7):
  1. choose:  the policy picks gamma for this step (fixed, or auto: 0..gamma_max).
  2. propose: the drafter proposes up to gamma tokens per row, d_1..d_G (G: the most any row
              proposes; a row proposing fewer pads its slots, which are never accepted).
  3. verify:  the target scores [last, d_1..d_G] in ONE forward: logits [B, G+1, V], processed
              (penalties, bias, min_tokens, a grammar's mask) at each position as if the
              proposals before it had been emitted; the draft's q is processed alike. A tree
              of proposals (tree.py) is scored in one forward too, and comes back as each
              row's accepted path: from there on the step reads as for a chain.
  4. accept:  each row keeps n of its proposals plus one correction or bonus token.
  5. emit:    stop inside the kept block at an EOS or stop id, at max_new_tokens, or (on the
              host) where a stop string completes.
  6. rollback: the target cache is cut to the longest kept row, shorter rows get holes in the
              mask; the drafter cuts its own state.
  7. evict:   finished rows leave the batch and the caches; compact when holes pile up. Where
              the policy has timed the batch's steps with more rows as faster (CPU matrix
              kernels can run 7 rows slower than 8), rows that ended stay in it, inert: they
              accept nothing, add no token and count in no statistic, only in the step's shape.

The first step is the prefill's: a plain step whose forward is the one over the prompts (the
target then holds them whole), so N tokens decoded plainly cost N target forwards, as in generate.

The step reads the device once (one host sync): accepted lengths, the emitted tokens, which rows
finished, and what the policy and the caches need. Each row's tokens and statistics are kept on
the host from there (Tally), so a finished row leaves without another read. Rows with a grammar
add reads: its matchers run on the host, so each draft proposal and the verified block are read
before the next position's mask.
"""

import hashlib
import time
from dataclasses import dataclass, field, fields, replace

import torch

from batchspec.decoding.drafters import JumpDrafter, Proposal, make_drafter, tree_problem
from batchspec.decoding.drafters.proposal import on_device
from batchspec.decoding.grammar import GrammarRows
from batchspec.decoding.kv_cache import BatchKV, padded
from batchspec.decoding.options import RowOptions
from batchspec.decoding.policy import Expected, GammaPolicy, expected_tokens, row_alphas, row_seen
from batchspec.decoding.processors import Processors
from batchspec.decoding.sampling import SamplingParams, accept_greedy, accept_sampled, probabilities
from batchspec.decoding.seq2seq import decoder_prefix, model_cache
from batchspec.decoding.stopping import StopStrings
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
    tree_width: int = 1  # > 1: the draft model proposes trees this wide (greedy batches without a grammar)
    seed: int = 0
    compact_at: float = 0.3  # compact the caches when this fraction of slots are pads or holes
    share_prefill: bool = True  # prefill a prompt that several rows hold once (off: bench's baseline for n)
    forced_bos_token_id: int | None = None  # the first token of every row (the generation config's)
    forced_eos_token_id: int | None = None  # the last token of a row that reaches its limit
    jump_forward: bool = True  # with a drafter: propose the text a row's grammar forces (off: bench's baseline)

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

    def policy(self, trees: bool | None = None) -> GammaPolicy:
        """A fresh gamma policy for these settings (a job shares one across its batches); trees:
        whether steps may propose trees (default: with a tree width; several drafts do too)."""
        trees = self.tree_width > 1 if trees is None else trees
        return GammaPolicy(self.gamma or self.gamma_max, fixed=self.gamma, trees=trees)


@dataclass
class RowOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS or stop id, or a stop string) or "length" (max_new_tokens)
    stats: dict
    text_end: int | None = None  # a stop string ended the row: its text is decode(token_ids)[:text_end]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per token: its logprob, top (id, logprob)
    trace: dict | None = None  # per step: proposals and how many were accepted; when the row finished


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
    """One live row's tokens and statistics, on the host, filled from each step's sync."""

    index: int  # position of the row in the caller's prompt list
    gamma_max: int
    tree_width: int  # a tree's nodes per depth (its width, or the number of drafts); 1: chains only
    limit: int  # the row's max_new_tokens
    stop: StopStrings | None = None  # the row's stop strings
    top_logprobs: int | None = None  # None: no logprobs; k: keep each token's and the top k
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    text_end: int | None = None  # where a stop string cut the text
    target_forwards: int = 0
    draft_forwards: int = 0
    speculative_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: list[int] = field(init=False)  # accepted lengths 0..gamma_max (speculative steps)
    gammas: list[int] = field(init=False)  # steps per number of proposals 0..gamma_max (0: plain steps)
    sources: dict[str, int] = field(default_factory=lambda: {"model": 0, "ngram": 0, "jump": 0})  # steps each proposed
    proposed_steps: list[int] = field(default_factory=list)  # per step: proposals (0: a plain step)
    accepted_steps: list[int] = field(default_factory=list)  # per step: proposals accepted
    seen: tuple[float, float, float] = (0.0, 0.0, 0.0)  # decayed accepted, checked, squares: its alpha (row_seen)
    tree_steps: int = 0  # speculative steps whose proposal was a tree
    tree_nodes: int = 0  # the trees' nodes, summed
    branches: list[int] = field(init=False)  # tree steps per rank in its depth of the accepted path's end

    def __post_init__(self):
        self.histogram, self.gammas = [0] * (self.gamma_max + 1), [0] * (self.gamma_max + 1)
        self.branches = [0] * self.tree_width

    @property
    def checked(self) -> int:
        """Its proposals checked over its completion: in each step, up to the first rejection."""
        return sum(min(n + 1, k) for n, k in zip(self.accepted_steps, self.proposed_steps))

    def cut_at_stop(self, tokens: list[int]) -> list[int]:
        """The tokens up to the one that completes a stop string (all of them when none does)."""
        for k, token in enumerate(tokens):
            self.text_end = self.stop.add(token)
            if self.text_end is not None:
                return tokens[: k + 1]
        return tokens

    def add_step(self, proposed: int, source: str | None, n: int, draft_forwards: int, tokens: list[int],
                 logprobs: list, tree: tuple[int, int] | None = None) -> None:
        """A step in which the row had `proposed` proposals from `source` (a tree's: its depth),
        accepted n and gained `tokens` (a block cut short keeps only the accepted proposals in
        it), with their logprobs; the draft model ran draft_forwards times. tree: (its nodes, the
        rank in its depth of the accepted path's deepest node: its beam rank, or its draft among
        several) when the proposal was a tree."""
        if tree:
            self.tree_steps += 1
            self.tree_nodes += tree[0]
            self.branches[tree[1]] += n > 0
        n = min(n, len(tokens))
        self.tokens += tokens
        self.logprobs += logprobs
        self.target_forwards += 1
        self.draft_forwards += draft_forwards
        self.gammas[proposed] += 1
        self.proposed_steps.append(proposed)
        self.accepted_steps.append(n)
        if proposed:
            self.sources[source] += 1
            self.speculative_steps += 1
            self.drafted += proposed
            self.accepted += n
            self.histogram[n] += 1

    def output(self, prompt_tokens: int, stopped: bool, speculative: bool) -> RowOutput:
        stats = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(self.tokens),
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "mean_accepted_length": self.accepted / self.speculative_steps if self.speculative_steps else None,
            "accepted_length_histogram": self.histogram if speculative else [],
            "gamma_histogram": self.gammas if speculative else [],
            "model_steps": self.sources["model"],
            "ngram_steps": self.sources["ngram"],
            "jump_steps": self.sources["jump"],
            **({"tree_steps": self.tree_steps, "tree_nodes": self.tree_nodes, "tree_branch_histogram": self.branches}
               if self.tree_width > 1 else {}),
        }
        trace = {"proposed": self.proposed_steps, "accepted": self.accepted_steps, "finished_at": time.time()}
        return RowOutput(self.tokens, "stop" if stopped else "length", stats, self.text_end,
                         self.logprobs if self.top_logprobs is not None else None, trace)


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
            source: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[BatchKV, torch.Tensor]:
    """The target's cache holding every decoder prompt (ids, mask: [B, P]; mask None: no pad),
    and its logits after each [B, 1, V]: the first step's. An encoder–decoder target first
    encodes `source` (the prompts, right-padded). share: a prompt that several rows hold (n
    samples of one request) is prefilled once, its cache copied."""
    first: dict[tuple | int, int] = {}
    origin = [first.setdefault(tuple(prompt) if share else b, b) for b, prompt in enumerate(prompts)]  # [B]
    distinct = list(first.values())  # [U]
    kv = model_cache(target, len(distinct), ids.device, source and (source[0][distinct], source[1][distinct]))
    logits = kv.forward(ids[distinct], mask if mask is None else mask[distinct], logits_to_keep=1)  # [U, 1, V]
    if len(distinct) < len(prompts):
        at = {b: k for k, b in enumerate(distinct)}
        rows = torch.tensor([at[b] for b in origin], device=ids.device)  # [B]
        kv.select(rows)
        logits = logits[rows]
    return kv, logits


def verify(target_kv: BatchKV, rows: Rows, proposal: Proposal, lengths: torch.Tensor | None, params: SamplingParams,
           processors: Processors, logprobs: bool, known: torch.Tensor | None = None):
    """The target scores [last, d_1..d_G] in one forward. lengths: [B] proposals per row (None:
    all G); known: the logits [B, 1, V] after `last` when they are known (the prefill's, for a
    first plain step: no forward). Returns n [B], next_token [B], when asked the raw log-softmax
    [B, G+1, V] of the target's logits (before any processing or warping), and the proposal as
    checked (a tree's: each row's accepted path)."""
    if proposal.parents is not None:
        return verify_tree(target_kv, rows, proposal, processors, logprobs)
    draft_tokens, gamma = proposal.tokens, proposal.width
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


def emit(rows: Rows, draft_tokens, n, next_token):
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
        # the prefill runs every prompt through: its logits make the first step, a plain one
        even = len({len(p) for p in decoder_prompts}) == 1  # no pad: the target's cache starts dense
        self.target_kv, self.first_logits = prefill(target, ids, None if even else mask, prompts, config.share_prefill,
                                                    source)
        vocab = target.get_output_embeddings().weight.shape[0]
        grammars = [o.grammar for o in options]
        self.grammar = GrammarRows(grammars, tokenizer, vocab, config.eos_token_ids, device,
                                   skip_first=config.forced_bos_token_id is not None) if any(grammars) else None
        speculates = bool(drafts) or config.ngram is not None
        self.jump = JumpDrafter(self.grammar, device) if self.grammar and config.jump_forward and speculates else None
        self.trees = width > 1 and config.sampling.greedy and self.grammar is None  # else the first draft's chains
        self.drafter = make_drafter(drafts if self.trees else drafts[:1], config.ngram, prompts, ids, mask, vocab,
                                    source, self.jump, config.tree_width if self.trees else 1)
        gamma_max = self.policy.gamma_max if self.drafter else 0
        limits = [o.max_new_tokens or config.max_new_tokens for o in options]
        seeds = [config.seed if o.seed is None else o.seed for o in options]
        stop_ids = [o.ending_ids(config.eos_token_ids) for o in options]
        self.rows = start_rows(row_ids, limits, seeds, stop_ids, config, gamma_max, device)
        self.rows.last = ids[:, -1]  # the drafters owe the last prompt token, like any newest token
        self.processors = Processors(options, decoder_prompts, self.rows.stop_ids, vocab, device,
                                     forced_tokens(config, limits, gamma_max, device), self.grammar)
        self.top_logprobs = max((o.logprobs for o in options if o.logprobs is not None), default=None)
        stops = [StopStrings(o.stop, tokenizer, o.include_stop_str) if o.stop else None for o in options]
        self.tallies: list[Tally | None] = [Tally(b, gamma_max, width, limit, stop, o.logprobs) for b, (o, limit, stop)
                                            in enumerate(zip(options, limits, stops))]  # the batch's rows (None: inert)
        for tally in self.tallies:  # an encoder–decoder's encoding is a forward (the prefill is the first step's)
            tally.target_forwards = int(source is not None)
        self.idles = getattr(self.drafter, "idle_rows", self.drafter is None) and self.grammar is None  # rows may idle
        self.context = min((c for m in [target, *drafts] if (c := getattr(m.config, "max_position_embeddings", None))),
                           default=None)  # positions the models know
        self.last_rows = None  # the rows of the last step: a step over as many is timed
        self.expected: Expected | None = None  # what the live rows should yield per gamma (auto)
        self.left = sum(limits)  # tokens the live rows may still generate (auto: kept by expected_tokens)
        self.results: list[RowOutput | None] = [None] * len(prompts)
        self.totals = {"slots": 0, "empty_slots": 0, "verify_steps": 0, "compactions": 0}
        self.padding_fraction = 1.0 - float(mask.float().mean())

    @property
    def done(self) -> bool:
        return not any(self.tallies)

    @torch.inference_mode()
    def step(self) -> None:
        """One choose/propose/verify/accept/emit/rollback/evict round over the live rows."""
        started = time.perf_counter()
        rows, params, drafter, target_kv = self.rows, self.config.sampling, self.drafter, self.target_kv
        B = len(self.tallies)  # live rows and inert ones
        known, self.first_logits = self.first_logits, None  # the prefill's: the first step is plain
        behind = drafter.behind if drafter else 0
        context = target_kv.length  # the slots the step's queries attend over, less its own
        chosen = self.policy.choose(B, self.expected, behind, self.left, context) if drafter and known is None else 0
        if chosen and self.trees and self.policy.tree:
            proposal = drafter.propose_tree(rows.last, chosen)
        elif chosen:
            u = None if params.greedy else rows.uniform(DRAFT, chosen)  # [B, gamma]
            process = self.process_draft if self.processors.active else None
            proposal = drafter.propose(rows.last, chosen, params, u, process)
        elif self.jump and known is None:  # a plain step, but what the grammars force costs no draft forward
            proposal = self.jump.propose(rows.last, self.policy.gamma_max, params, None)
        else:
            proposal = Proposal.none(rows.last)
        lengths, top = proposal.short_lengths(), self.top_logprobs
        n, next_token, raw, proposal = verify(target_kv, rows, proposal, lengths, params, self.processors,
                                              top is not None, known)
        if None in self.tallies:  # inert rows (produced == limit) accept nothing: they add one slot a step
            n = torch.where(rows.produced < rows.limit, n, 0)
        gamma, draft_tokens = proposal.width, proposal.tokens
        won = proposal.path.gather(1, n[:, None]) if proposal.path is not None else n[:0]  # [B, 1]: a tree's node
        slots, empty_slots = target_kv.mask.numel(), (target_kv.mask == 0).sum()
        longest_row = (target_kv.mask.sum(-1) - (gamma - n)).max()  # valid slots after the rollback
        new, count, finished, stopped = emit(rows, draft_tokens, n, next_token)
        self.processors.emitted(new, count)
        logprobs = token_logprobs(raw, new, top) if raw is not None else n[:0]  # [B, G+1, 1 + 2 top]
        # the step's one host sync: the rows' new tokens and what the rollback, the eviction, the
        # compaction and the policy need
        sync = (n, count, finished, stopped, new.flatten(), torch.stack([empty_slots, longest_row]), logprobs.flatten(),
                won.flatten())
        host = split(torch.cat([t.double() for t in sync]).tolist(), [t.numel() for t in sync])
        n_host, count_host, finished_host, stopped_host, new_host, (empty_host, longest_host), lp_host, won_host = host
        self.totals["slots"] += slots
        self.totals["empty_slots"] += int(empty_host)
        self.totals["verify_steps"] += 1
        blocks = [[int(t) for t in block[: int(k)]] for block, k in zip(split(new_host, [gamma + 1] * B), count_host)]
        row_logprobs = split(lp_host, [len(lp_host) // B] * B) if top is not None else [[]] * B
        for b, tally in enumerate(self.tallies):
            if tally is None:  # inert: its block is empty
                continue
            if tally.stop:  # a stop string may complete before the block's EOS or limit too
                blocks[b] = tally.cut_at_stop(blocks[b])
                if tally.text_end is not None:
                    finished_host[b] = stopped_host[b] = True
            k = tally.top_logprobs
            entries = logprob_entries(row_logprobs[b], len(blocks[b]), k, top) if k is not None else []
            tree = (proposal.nodes, int(won_host[b] - 1) % (proposal.nodes // gamma)) if won_host else None
            tally.add_step(proposal.lengths[b], proposal.sources[b], int(n_host[b]), proposal.forwards, blocks[b],
                           entries, tree)
        if self.grammar:
            self.grammar.advance(blocks)
        tree = proposal.path is not None
        # a row that proposed nothing in a speculative step that verified proposals (a lookup
        # without a match beside rows with one) yielded one token at the step's width, as a row
        # whose first proposal was rejected: so its alpha, and the run's, count it (a step where
        # no row proposed is a plain step, and a plain step's jump-forward no choice: neither
        # tells anything)
        offered = [k or int(chosen > 0 and gamma > 0) for k in proposal.lengths]  # [B] host
        if drafter and self.policy.auto:
            self.expected = self.expected_tokens(n_host, [0] * B if tree else offered, finished_host)
        max_n = int(max(n_host))
        checked_host = sum(min(k + 1, proposed) for k, proposed, tally in zip(n_host, offered, self.tallies) if tally)
        # untimed: the prefill's step, and the first over a batch of new shape (fresh buffers: up to 30 % slower)
        seconds = time.perf_counter() - started if B == self.last_rows else None
        self.last_rows = B
        if chosen or not gamma:  # a plain step's jump-forward tells the policy nothing of its choices
            self.policy.observe(B, gamma, int(sum(n_host)), int(checked_host), seconds, behind, tree, context)
        if drafter:
            if gamma:
                target_kv.rollback(n + 1, gamma + 1, max_n + 1)
            drafter.verified(proposal, rows.last, n, max_n, blocks)
        rows.last = next_token
        ended = [bool(tally) and bool(done) for tally, done in zip(self.tallies, finished_host)]  # live rows that ended
        if any(ended):
            if any(t.stop for t in self.tallies if t):  # stop strings found on the host end rows too
                finished = on_device(finished_host, finished.device, torch.bool)
            self.evict(finished, ended, stopped_host, gamma)
        if not self.done and target_kv.length - longest_host >= max(1, self.config.compact_at * target_kv.length):
            target_kv.compact(int(longest_host))
            if drafter:
                drafter.compact(int(longest_host))
            self.totals["compactions"] += 1

    def process_draft(self, logits: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
        """The draft's next-token logits [B, V] after its proposals [B, i] of this step, processed
        as the target's are at that position."""
        return self.processors(logits[:, None], proposals, self.rows.produced, first=proposals.shape[1])[:, 0]

    def expected_tokens(self, n: list[float], lengths: list[int], finished: list[float]) -> Expected:
        """What the rows still live after this step are expected to yield per gamma with a
        chain, each at its own alpha (updated with this step's n of `lengths` proposals, none
        after a tree) and remaining limit, the rows priced alike spread by the run's spread of
        alphas; on the host, from the step's sync. Also sets self.left, those remaining limits
        summed, and tells the policy the proposals of each row that ended."""
        seen, remaining = [], []
        for tally, k, proposed, done in zip(self.tallies, n, lengths, finished):
            if tally is None:  # inert
                continue
            tally.seen = row_seen(tally.seen, int(k) if proposed else 0, proposed)  # after a tree: the fading only
            if done:
                self.policy.row_ended(tally.accepted, tally.checked)
            else:
                seen.append(tally.seen)
                remaining.append(tally.limit - len(tally.tokens))
        self.left = sum(remaining)
        alphas, spread = row_alphas(seen, self.policy.alpha, self.policy.spread)
        return expected_tokens(alphas, remaining, self.policy.gamma_max, spread)

    def evict(self, finished: torch.Tensor, ended: list[bool], stopped_host: list[float], gamma: int) -> None:
        """Move the rows that ended this step (ended: host bools) into results, and out of the
        batch and the caches, or keep them there, inert, where the policy has timed steps of
        this gamma with more rows as faster. finished [B] bool: on the device, every row that is
        not live (ended now, or inert)."""
        for b, (tally, stopped) in enumerate(zip(self.tallies, stopped_host)):
            if ended[b]:
                prompt = self.prompts[tally.index]
                self.results[tally.index] = tally.output(len(prompt), bool(stopped), self.drafter is not None)
                self.tallies[b] = None
        live = [b for b, tally in enumerate(self.tallies) if tally]
        if not live:
            return
        size = self.policy.batch_rows(len(live), len(self.tallies), gamma) if self.may_idle() else len(live)
        if size > len(live):  # rows that stay accept and add nothing from here on
            self.rows.limit = torch.where(finished, self.rows.produced, self.rows.limit)
        if size < len(self.tallies):
            self.shrink(size, live, finished)
        if size > len(live) and self.drafter:
            self.drafter.idle([tally is None for tally in self.tallies])

    def shrink(self, size: int, live: list[int], finished: torch.Tensor) -> None:
        """Keep `size` rows of the batch: the live ones (host indices) and the first inert ones."""
        idle = [b for b, tally in enumerate(self.tallies) if tally is None]
        kept = sorted(live + idle[: size - len(live)])
        self.tallies = [self.tallies[b] for b in kept]
        if size == len(live):
            keep = torch.argsort(finished.to(torch.uint8), stable=True)[:size]  # the live rows, on the device
        else:
            keep = on_device(kept, finished.device)
        self.rows.select(keep)
        self.processors.select(keep)
        if self.grammar:
            self.grammar.select(kept)
        self.target_kv.select(keep)
        if self.drafter:
            self.drafter.select(keep, kept)

    def may_idle(self) -> bool:
        """Whether rows that ended may stay in the batch, inert: not with trees (their drafters
        would go on proposing for them) or grammars, and only while the positions they keep
        taking, one a step, stay inside the models' context."""
        if not self.idles:
            return False
        left = max(t.limit - len(t.tokens) for t in self.tallies if t)  # steps the batch may still take
        return self.context is None or self.target_kv.length + left + self.policy.gamma_max + 1 <= self.context

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
            **totals,
        }
        return BatchOutput(self.results, stats)


def decode_batch(target, draft, prompts: list[list[int]], row_ids: list, config: DecodeConfig,
                 options: list[RowOptions] | None = None, policy: GammaPolicy | None = None,
                 tokenizer=None) -> BatchOutput:
    """Decode one static batch; see BatchDecoder."""
    return BatchDecoder(target, draft, prompts, row_ids, config, options, policy, tokenizer).run()
