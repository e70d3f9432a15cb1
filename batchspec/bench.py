"""Side-by-side throughput: speculative vs our autoregressive baseline vs transformers' generate.

All three decode the same greedy batches in one process, interleaved and repeated, so the ratios
hold even on a noisy machine. Tokens/s counts each row's own completion tokens.
"""

import time
from dataclasses import dataclass

import torch

from batchspec.buckets import make_encoder
from batchspec.decoding import DecodeConfig, decode_batch
from batchspec.decoding.engine import left_pad
from batchspec.defaults import default_draft, default_target
from batchspec.errors import UsageError
from batchspec.models import load_pair
from batchspec.sources import Row, RowError, read_jsonl


@dataclass
class BenchRow:
    batch_size: int
    tokens: int
    spec_s: float
    ar_s: float
    hf_s: float
    acceptance: float

    def cells(self) -> list[str]:
        spec, ar, hf = (self.tokens / s for s in (self.spec_s, self.ar_s, self.hf_s))
        return [
            str(self.batch_size), f"{spec:.1f}", f"{ar:.1f}", f"{hf:.1f}",
            f"{spec / ar:.2f}x", f"{spec / hf:.2f}x", f"{self.acceptance:.2f}",
        ]


HEADER = ["batch", "spec tok/s", "ar tok/s", "hf generate tok/s", "spec/ar", "spec/hf", "acceptance"]


def hf_generate(model, prompts, max_new_tokens: int, eos_ids) -> None:
    ids, mask = left_pad(prompts, model.device)
    model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_ids) or None, pad_token_id=eos_ids[0] if eos_ids else 0,
    )


def timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def bench_batch(pair, prompts, *, gamma: int, max_new_tokens: int, repeats: int) -> BenchRow:
    """Best of `repeats` interleaved runs of spec, ar and HF generate on one batch."""
    eos = pair.eos_token_ids
    config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos, gamma=gamma)
    ids = list(range(len(prompts)))
    best = {"spec": float("inf"), "ar": float("inf"), "hf": float("inf")}
    for _ in range(repeats):
        seconds, spec = timed(lambda: decode_batch(pair.target, pair.draft, prompts, ids, config))
        best["spec"] = min(best["spec"], seconds)
        seconds, ar = timed(lambda: decode_batch(pair.target, None, prompts, ids, config))
        best["ar"] = min(best["ar"], seconds)
        seconds, _ = timed(lambda: hf_generate(pair.target, prompts, max_new_tokens, eos))
        best["hf"] = min(best["hf"], seconds)
    tokens = sum(len(r.token_ids) for r in ar.rows)
    proposed = sum(r.stats["draft_tokens"] for r in spec.rows)
    accepted = sum(r.stats["accepted_tokens"] for r in spec.rows)
    return BenchRow(len(prompts), tokens, best["spec"], best["ar"], best["hf"], accepted / max(proposed, 1))


def markdown_table(rows: list[BenchRow]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def run_bench(pair, prompts: list[list[int]], *, batch_sizes, gamma: int, max_new_tokens: int, repeats: int):
    """One warm-up, then a BenchRow per batch size (batches cut from the front of `prompts`)."""
    bench_batch(pair, prompts[:1], gamma=gamma, max_new_tokens=8, repeats=1)
    return [
        bench_batch(pair, prompts[:size], gamma=gamma, max_new_tokens=max_new_tokens, repeats=repeats)
        for size in batch_sizes
    ]


def load_prompts(path: str, tokenizer, count: int) -> list[list[int]]:
    """Token ids of the first good rows of a JSONL input (chat rows templated), cycled to `count`."""
    rows = [item for item in read_jsonl(path) if isinstance(item, Row)]
    if not rows:
        raise UsageError(f"no usable rows in {path}")
    encoded = [ids for ids in make_encoder(tokenizer, context_length=None, max_new_tokens=0, truncate=None)(rows)
               if not isinstance(ids, RowError)]
    return [encoded[i % len(encoded)] for i in range(count)]


def bench(*, target: str | None, draft: str | None, prompts: str, batch_sizes: list[int], gamma: int,
          max_new_tokens: int, repeats: int, dtype: str, device: str) -> str:
    """The markdown table of run_bench on a model pair (default: the embedded one)."""
    if target is None:
        target, draft = default_target(), draft or default_draft()
    if draft is None:
        raise UsageError("bench compares speculative decoding with the rest: give --draft with --target")
    pair = load_pair(target, draft, dtype=dtype, device=device)
    token_ids = load_prompts(prompts, pair.tokenizer, max(batch_sizes))
    rows = run_bench(pair, token_ids, batch_sizes=batch_sizes, gamma=gamma, max_new_tokens=max_new_tokens,
                     repeats=repeats)
    where = f"{pair.target.device.type}, {str(pair.target.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads"
    return (f"target {target}\ndraft  {draft}\n{where}; gamma {gamma}, max_new_tokens {max_new_tokens}, "
            f"greedy, best of {repeats}\n\n{markdown_table(rows)}")
