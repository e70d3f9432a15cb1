"""On a GPU: decode time with cuDNN attention off (batchspec's choice, see ANY_SHAPE_ATTENTION in
batchspec/decoding/attention.py) against allowed (PyTorch's default, tried first on Hopper and
newer), for ar, fixed gamma 3 and auto. Each method decodes its own batches, rotated from the
prompts and cut by a few tokens so that no earlier batch had their shapes, as in a real job;
both settings decode the same ones, taking turns to go first; the first batches are not timed
(warm-up).

    python jobs/attention_ab.py TARGET DRAFT [--dtype bfloat16] [--batch-size 8] [--batches 6]
"""
import argparse
import time
from dataclasses import replace

import torch
from torch.nn.attention import SDPBackend

from batchspec.bench import load_prompts
from batchspec.decoding import DecodeConfig, decode_batch
from batchspec.decoding.attention import ANY_SHAPE_ATTENTION
from batchspec.models import load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="sample_data/prompts.jsonl")
    args = parser.parse_args()
    pair = load_pair(args.target, args.draft, dtype=args.dtype, device="auto")
    prompts = load_prompts(args.prompts, pair.tokenizer, None)
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=pair.eos_token_ids)
    methods = {"ar": (base, None), "gamma 3": (replace(base, gamma=3), pair.draft), "auto": (base, pair.draft)}
    sync = torch.cuda.synchronize if pair.target.device.type == "cuda" else (lambda: None)

    def batch(m: int) -> list[list[int]]:
        """The m-th batch: prompts m, m+1, ... (cycled), each less its last m % 7 tokens."""
        return [(p := prompts[(m + i) % len(prompts)])[: len(p) - m % 7] for i in range(args.batch_size)]

    def seconds(method: str, rows: list[list[int]], cudnn: bool) -> float:
        config, draft = methods[method]
        if cudnn:
            ANY_SHAPE_ATTENTION.insert(0, SDPBackend.CUDNN_ATTENTION)
        try:
            sync()
            start = time.perf_counter()
            decode_batch(pair.target, draft, rows, list(range(len(rows))), config, None, config.policy(),
                         pair.tokenizer)
            sync()
            return time.perf_counter() - start
        finally:
            if cudnn:
                ANY_SHAPE_ATTENTION.remove(SDPBackend.CUDNN_ATTENTION)

    totals = {}  # (method, cudnn) -> seconds
    for k in range(args.batches):
        for j, method in enumerate(methods):
            rows = batch(len(methods) * k + j)
            for cudnn in (k % 2 == 0, k % 2 == 1):  # which goes first alternates
                took = seconds(method, rows, cudnn)
                if k:
                    totals[method, cudnn] = totals.get((method, cudnn), 0.0) + took
    print(f"{pair.target.device}, {args.dtype}, batch {args.batch_size}, {args.batches - 1} timed batches a method")
    for method in methods:
        off, on = totals[method, False], totals[method, True]
        print(f"{method:8s} cuDNN off {off:7.2f} s   allowed {on:7.2f} s   off / allowed {off / on:.2f}")


if __name__ == "__main__":
    main()
