"""The batched decode loop: speculative (draft proposes, target verifies) or autoregressive.

Autoregressive decoding is the same loop with no draft and gamma = 0: the target scores one
position per step and the "bonus" token is simply the next token. Both strategies therefore
share the cache, positions, randomness and stopping rules.

Each step, for B live rows and G = gamma:
  1. propose: the draft runs G forwards, drawing d_1..d_G (argmax, or from q).
  2. verify:  the target scores [last, d_1..d_G] in ONE forward: logits [B, G+1, V].
  3. accept:  each row keeps n in 0..G proposals plus one correction or bonus token.
  4. emit:    stop inside the kept block at an EOS id or at max_new_tokens.
  5. rollback: both caches are cut to the longest kept row, shorter rows get holes in the mask.
  6. evict:   finished rows leave the batch and both caches; compact when holes pile up.
"""

import hashlib
from dataclasses import dataclass, field, fields

import torch

from batchspec.decoding.kv_cache import BatchKV
from batchspec.decoding.sampling import SamplingParams, accept_greedy, accept_sampled, probabilities, sample

DRAFT, ACCEPT, NEXT = 0, 1, 2  # uniform streams: draft draws, accept tests, correction/bonus draws


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = SamplingParams()
    gamma: int = 5  # draft proposals per step; unused without a draft
    seed: int = 0
    compact_at: float = 0.3  # compact the caches when this fraction of slots are pads or holes

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")


@dataclass
class RowOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS id) or "length" (max_new_tokens)
    stats: dict


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
    """Per-row state of the live rows; every tensor has the batch as dim 0."""

    index: torch.Tensor  # [B] position of the row in the caller's prompt list
    last: torch.Tensor  # [B] newest token, not yet in either cache
    pending: torch.Tensor  # [B] the draft's last proposal, not yet in the draft cache
    has_pending: torch.Tensor  # [B] long 0/1: pending must go into the draft cache first
    produced: torch.Tensor  # [B] tokens generated so far
    limit: torch.Tensor  # [B] the row's max_new_tokens
    out: torch.Tensor  # [B, W] generated tokens (W = max limit + G + 1, tail is scratch)
    uniforms: torch.Tensor  # [B, W, 3] per-row uniforms by output position and stream
    counts: torch.Tensor  # [B, 4] target_forwards, draft_forwards, verify_steps, accepted_tokens
    histogram: torch.Tensor  # [B, G+1] how often each accepted length occurred
    any_pending: bool = field(default=False)

    def select(self, keep: torch.Tensor) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value[keep])

    def uniform(self, stream: int, width: int) -> torch.Tensor:
        """[B, width]: uniforms for output positions produced .. produced + width - 1."""
        at = self.produced[:, None] + torch.arange(width, device=self.produced.device)  # [B, width]
        return self.uniforms[:, :, stream].gather(1, at)


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts -> ids, mask: [B, P], left-padded (pad id 0, never looked at: the mask rules)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[b, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def fit_width(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [..., Vd] -> [..., vocab]: compare on the shared ids, never propose others."""
    if logits.shape[-1] >= vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def start_rows(row_ids, limits: list[int], seeds: list[int], config: DecodeConfig, gamma: int, device) -> Rows:
    B, width = len(row_ids), max(limits) + gamma + 1
    if config.sampling.greedy:  # no randomness needed
        uniforms = torch.empty(B, 0, 3, dtype=torch.float64)
    else:
        generators = [torch.Generator().manual_seed(row_seed(seed, r)) for seed, r in zip(seeds, row_ids)]
        uniforms = torch.stack([torch.rand(width, 3, generator=g, dtype=torch.float64) for g in generators])

    def zeros():
        return torch.zeros(B, dtype=torch.long, device=device)

    return Rows(
        index=torch.arange(B, device=device),
        last=zeros(),
        pending=zeros(),
        has_pending=zeros(),
        produced=zeros(),
        limit=torch.tensor(limits, dtype=torch.long, device=device),
        out=torch.zeros(B, width, dtype=torch.long, device=device),
        uniforms=uniforms.to(device),
        counts=torch.zeros(B, 4, dtype=torch.long, device=device),
        histogram=torch.zeros(B, gamma + 1, dtype=torch.long, device=device),
    )


def propose(draft_kv: BatchKV, rows: Rows, gamma: int, params: SamplingParams, vocab: int):
    """The draft's G proposals. Returns tokens [B, G] and q [B, G, V] (None when greedy)."""
    ones = torch.ones_like(rows.last)[:, None]  # [B, 1]
    ids, mask = rows.last[:, None], ones  # [B, 1]
    if rows.any_pending:  # last step's fully accepted rows still owe the draft its last proposal
        ids = torch.stack([rows.pending, rows.last], dim=1)  # [B, 2]
        mask = torch.stack([rows.has_pending, rows.last.new_ones(rows.last.shape)], dim=1)
    u = None if params.greedy else rows.uniform(DRAFT, gamma)  # [B, G]
    tokens, qs = [], []
    for i in range(gamma):
        logits = fit_width(draft_kv.forward(ids, mask, logits_to_keep=1)[:, -1], vocab)  # [B, V]
        if params.greedy:
            x = logits.argmax(-1)
        else:
            qs.append(probabilities(logits, params))
            x = sample(qs[-1], u[:, i])
        tokens.append(x)
        ids, mask = x[:, None], ones
    return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)


def verify(target_kv: BatchKV, rows: Rows, draft_tokens, q, params: SamplingParams):
    """The target scores [last, d_1..d_G] in one forward. Returns n [B] and next_token [B]."""
    inputs = torch.cat([rows.last[:, None], draft_tokens], dim=1)  # [B, G+1]
    logits = target_kv.forward(inputs, torch.ones_like(inputs))  # [B, G+1, V]
    if params.greedy:
        return accept_greedy(logits, draft_tokens)
    gamma = draft_tokens.shape[1]
    p = probabilities(logits, params)  # [B, G+1, V]
    q = q if q is not None else p.new_zeros(p.shape[0], 0, p.shape[-1])
    return accept_sampled(p, q, draft_tokens, rows.uniform(ACCEPT, gamma), rows.uniform(NEXT, gamma + 1))


def emit(rows: Rows, draft_tokens, n, next_token, eos_ids):
    """Append d_1..d_n, next_token to each row, cut at the first EOS id or at the row's limit.

    Returns finished [B] bool and stopped [B] bool (finished on an EOS id).
    """
    gamma = draft_tokens.shape[1]
    new = torch.cat([draft_tokens, next_token[:, None]], dim=1)  # [B, G+1]
    new.scatter_(1, n[:, None], next_token[:, None])  # d_1..d_n, next_token, then scratch
    slot = torch.arange(gamma + 1, device=n.device)  # [G+1]
    count = n + 1  # [B]
    remaining = rows.limit - rows.produced  # [B]
    is_eos = torch.isin(new, eos_ids) & (slot[None, :] < torch.minimum(count, remaining)[:, None])
    stopped = is_eos.any(-1)
    count = torch.where(stopped, is_eos.int().argmax(-1) + 1, torch.minimum(count, remaining))
    rows.out.scatter_(1, rows.produced[:, None] + slot, new)
    rows.produced += count
    return stopped | (rows.produced >= rows.limit), stopped


def row_outputs(rows: Rows, done: torch.Tensor, stopped: list[bool], prompt_tokens: list[int], gamma: int):
    """RowOutputs of the rows at `done` ([K] indices), with one device-to-host copy per tensor."""
    produced = rows.produced[done].tolist()
    out, counts, histogram = rows.out[done].tolist(), rows.counts[done].tolist(), rows.histogram[done].tolist()
    outputs = []
    for k in range(len(produced)):
        target_forwards, draft_forwards, steps, accepted = counts[k]
        proposed = steps * gamma
        stats = {
            "prompt_tokens": prompt_tokens[k],
            "completion_tokens": produced[k],
            "draft_tokens": proposed,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "target_forwards": target_forwards,
            "draft_forwards": draft_forwards,
            "mean_accepted_length": accepted / steps if steps and gamma else None,
            "accepted_length_histogram": histogram[k] if gamma else [],
        }
        outputs.append(RowOutput(out[k][: produced[k]], "stop" if stopped[k] else "length", stats))
    return outputs


class BatchDecoder:
    """Decodes one static batch. target/draft: causal LMs on one device (draft None = autoregressive).

    prompts: token ids per row, lengths may differ (each >= 1); row_ids: one id per row, which
    seeds its randomness with its seed (seeds, default: config.seed); max_new_tokens: a limit
    per row (default: config.max_new_tokens).
    Greedy output equals `target.generate(do_sample=False)` on each row alone; sampled output
    follows the target's own sampling distribution.
    """

    @torch.inference_mode()
    def __init__(self, target, draft, prompts: list[list[int]], row_ids: list, config: DecodeConfig,
                 max_new_tokens: list[int] | None = None, seeds: list[int] | None = None):
        limits = max_new_tokens or [config.max_new_tokens] * len(prompts)
        seeds = seeds or [config.seed] * len(prompts)
        if not prompts or not len(prompts) == len(row_ids) == len(limits) == len(seeds):
            raise ValueError("need one row id (and limit and seed) per prompt and at least one prompt")
        if min(limits) < 1:
            raise ValueError("every row's max_new_tokens must be >= 1")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.config, self.prompts = config, prompts
        self.gamma = config.gamma if draft is not None else 0
        self.vocab = target.get_output_embeddings().weight.shape[0]
        device = target.device
        self.eos_ids = torch.tensor(config.eos_token_ids, dtype=torch.long, device=device)
        ids, mask = left_pad(prompts, device)  # [B, P]
        self.caches = [BatchKV(m, len(prompts), device) for m in (target, draft) if m is not None]
        self.rows = start_rows(row_ids, limits, seeds, config, self.gamma, device)
        self.rows.last = ids[:, -1]  # the last prompt token is fed by the first step, like any newest token
        if ids.shape[1] > 1:
            for kv in self.caches:
                kv.forward(ids[:, :-1], mask[:, :-1], logits_to_keep=1)
            own_prefill = (mask.sum(-1) > 1).long()  # a 1-token prompt has nothing to prefill
            self.rows.counts[:, : len(self.caches)] += own_prefill[:, None]
        self.results: list[RowOutput | None] = [None] * len(prompts)
        self.totals = {"slots": 0, "empty_slots": 0, "verify_steps": 0, "compactions": 0}
        self.padding_fraction = 1.0 - float(mask.float().mean())

    @property
    def done(self) -> bool:
        return self.rows.index.numel() == 0

    @torch.inference_mode()
    def step(self) -> None:
        """One propose/verify/accept/emit/rollback/evict round over the live rows."""
        rows, gamma, params = self.rows, self.gamma, self.config.sampling
        target_kv = self.caches[0]
        if gamma:
            draft_tokens, q = propose(self.caches[1], rows, gamma, params, self.vocab)
        else:
            draft_tokens, q = rows.last.new_zeros(rows.last.shape[0], 0), None
        n, next_token = verify(target_kv, rows, draft_tokens, q, params)
        slots, empty_slots = target_kv.mask.numel(), (target_kv.mask == 0).sum()
        longest_row = (target_kv.mask.sum(-1) - (gamma - n)).max()  # valid slots after the rollback
        rows.counts += torch.stack([torch.ones_like(n), torch.full_like(n, gamma), torch.ones_like(n), n], dim=1)
        rows.histogram += torch.nn.functional.one_hot(n, gamma + 1)
        finished, stopped = emit(rows, draft_tokens, n, next_token, self.eos_ids)
        # the step's one host sync: what the rollback, the eviction and the compaction need
        B = n.shape[0]
        host = torch.cat([n, finished.long(), stopped.long(), torch.stack([empty_slots, longest_row])]).tolist()
        max_n, finished_host, stopped_host = max(host[:B]), host[B : 2 * B], host[2 * B : 3 * B]
        self.totals["slots"] += slots
        self.totals["empty_slots"] += host[-2]
        self.totals["verify_steps"] += 1
        if gamma:
            target_kv.rollback(n + 1, gamma + 1, max_n + 1)
            self.caches[1].rollback((n + 1).clamp(max=gamma), gamma, min(max_n + 1, gamma))
            rows.pending, rows.has_pending = draft_tokens[:, -1], (n == gamma).long()
            rows.any_pending = max_n == gamma
        rows.last = next_token
        if any(finished_host):
            self.evict(finished_host, stopped_host)
        if not self.done and target_kv.length - host[-1] >= max(1, self.config.compact_at * target_kv.length):
            for kv in self.caches:
                kv.compact()
            self.totals["compactions"] += 1

    def evict(self, finished: list[int], stopped: list[int]) -> None:
        """Move finished rows (host lists of 0/1) into results and out of the batch and both caches."""
        done = [b for b, f in enumerate(finished) if f]
        keep = [b for b, f in enumerate(finished) if not f]
        device = self.rows.index.device
        indices = self.rows.index[done].tolist()
        prompt_tokens = [len(self.prompts[i]) for i in indices]
        outputs = row_outputs(
            self.rows, torch.tensor(done, device=device), [stopped[b] for b in done], prompt_tokens, self.gamma
        )
        for i, output in zip(indices, outputs):
            self.results[i] = output
        keep_t = torch.tensor(keep, dtype=torch.long, device=device)
        self.rows.select(keep_t)
        for kv in self.caches:
            kv.select(keep_t)

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
            **totals,
        }
        return BatchOutput(self.results, stats)


def decode_batch(target, draft, prompts: list[list[int]], row_ids: list, config: DecodeConfig,
                 max_new_tokens: list[int] | None = None, seeds: list[int] | None = None) -> BatchOutput:
    """Decode one static batch; see BatchDecoder."""
    return BatchDecoder(target, draft, prompts, row_ids, config, max_new_tokens, seeds).run()
