"""How a decode step's cost grows with the cache it attends over: the target's forward over W new
tokens a row for B rows, after a cache of L slots, for a few L (the median of its timings). The
gamma policy prices steps by their recent timings, whatever the cache holds (docs/gamma-policy.md);
this shows how much a step's cost moves with the cache on your model and machine. The forwards go through the
engine's cache (BatchKV), one row's prompt a slot shorter than the others, so that they attend
under the masks and the attention (batchspec.decoding.attention) a decode step of a padded batch
runs with. Timed without them, transformers' attention takes other paths: on a 12-layer Llama
(4 heads over 2) at 16 rows in bfloat16, a plain step over 240 slots read 2.07x its cost over
50, where the engine's grows 1.35x.

    python jobs/context_cost.py TARGET [--dtype bfloat16] [--device auto] [--rows 16]
                                [--widths 1,3] [--slots 50,115,160] [--repeats 9]
"""
import argparse
import statistics

import torch

from batchspec.bench import timed
from batchspec.decoding.kv_cache import BatchKV
from batchspec.models import load_pair


def forward_seconds(model, rows: int, slots: list[int], width: int, repeats: int) -> list[float]:
    """The median seconds, per cache length in `slots`, of the forward over `width` new tokens a
    row after that many cached ones; the lengths take turns, so that the machine's slower
    moments fall on all of them (each cache rolled back after its forward; the first round not
    counted: it warms up)."""
    vocab, device = model.config.vocab_size, model.device
    caches = [BatchKV(model, rows, device) for _ in slots]
    seconds = [[] for _ in slots]
    with torch.inference_mode():
        for length, cache in zip(slots, caches):
            prompt_mask = torch.ones(rows, length, dtype=torch.long, device=device)  # [B, L]
            prompt_mask[0, 0] = 0  # row 0 is a slot shorter: a left pad
            cache.forward(torch.randint(0, vocab, (rows, length), device=device), prompt_mask)
        for _ in range(repeats + 1):
            for cache, timings in zip(caches, seconds):
                ids = torch.randint(0, vocab, (rows, width), device=device)  # [B, W]
                timings.append(timed(lambda: cache.forward(ids))[0])
                cache.rollback(torch.zeros(rows, dtype=torch.long, device=device), width, 0)  # back to L slots
    return [statistics.median(timings[1:]) for timings in seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--widths", default="1,3", help="new tokens a row: 1 is a plain step, gamma + 1 a verify")
    parser.add_argument("--slots", default="50,115,160")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    model = load_pair(args.target, dtype=args.dtype, device=args.device).target
    slots = [int(s) for s in args.slots.split(",")]
    print(f"{args.rows} rows, {model.dtype}, {model.device}: ms per forward over a cache of L slots")
    print("width | " + " | ".join(f"L {s}" for s in slots) + f" | L {slots[-1]} over L {slots[0]}")
    for width in (int(w) for w in args.widths.split(",")):
        ms = [1000 * seconds for seconds in forward_seconds(model, args.rows, slots, width, args.repeats)]
        print(f"{width} | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {ms[-1] / ms[0]:.2f}x")


if __name__ == "__main__":
    main()
