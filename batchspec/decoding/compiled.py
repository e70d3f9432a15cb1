"""The run's compiled step forwards (--compile): each model's forward compiled for each shape a
step meets (buffer rows R, new slots S, buffer slots C) over static caches (kv_cache.StaticKV).

A compile costs tens of seconds (a 135M model on 2 CPU cores: about 45 s cold), so each shape's
is bought the way a ski-renter buys skis: its forwards run eagerly until they have cost `after`
seconds, then it compiles. A job shorter than that never compiles, a shape met rarely (a batch's
last few rows) is never compiled, and a long job pays at most `after` extra per shape it
compiles. Forwards wider than a step (prefills, each of a new length) always run eagerly.
Static caches bound the shapes: R is a power of two below the batch size, S at most a step's
slots, C a bucket. A compiled forward guards on its inputs' strides, so its position ids go in
as a fresh copy (a [B, 1] slice keeps its parent's row stride, which `contiguous` keeps too). On
CUDA the forward is captured as CUDA graphs ("reduce-overhead"), and its logits are copied out
of the graph's memory before the next replay overwrites them.
"""

import time
from collections import defaultdict

import torch


class Compiled:
    def __init__(self, slots: int, after: float = 30.0, device_type: str = "cpu"):
        self.slots = slots  # forwards of at most this many new slots may run compiled: a step's, not a prefill's
        self.after = after  # eager seconds at a shape before it compiles
        self.graphs = device_type == "cuda"  # capture CUDA graphs
        self.eager_seconds: dict[tuple, float] = defaultdict(float)  # (model, shape) -> its eager forwards' time
        self.compile_seconds = 0.0  # the first compiled call at each shape (compiling, and the forward)
        self.shapes: set[tuple] = set()  # (model, shape) compiled
        self.forwards: dict[int, object] = {}  # id(model) -> its compiled forward (one per model, a graph per shape)
        settings = torch._dynamo.config  # each shape is a recompile of the forward: allow many (the name before 2.6)
        limit = "recompile_limit" if hasattr(settings, "recompile_limit") else "cache_size_limit"
        setattr(settings, limit, max(getattr(settings, limit), 256))

    def forward(self, model, shape: tuple):
        """The forward of `model` at `shape` (R, S, C): timed eager while that shape has cost less
        than `after` seconds, then compiled (None: the model's own, untimed: too many slots)."""
        if shape[1] > self.slots:
            return None
        key = (id(model), shape)
        if self.eager_seconds[key] < self.after:
            return self.timed(model, key)
        if id(model) not in self.forwards:
            mode = "reduce-overhead" if self.graphs else None
            self.forwards[id(model)] = torch.compile(model.forward, dynamic=False, mode=mode)
        if key not in self.shapes:
            self.shapes.add(key)
            return self.timed(self.replayed(self.forwards[id(model)]), None)
        return self.replayed(self.forwards[id(model)])

    def timed(self, forward, key: tuple | None):
        """forward, its call's seconds added to the eager seconds of `key` (None: to compile_seconds)."""
        def call(**inputs):
            started = time.perf_counter()
            out = forward(**inputs)
            seconds = time.perf_counter() - started
            if key is None:
                self.compile_seconds += seconds
            else:
                self.eager_seconds[key] += seconds
            return out
        return call

    def replayed(self, compiled):
        """compiled, its position ids given fresh strides and (CUDA graphs) its logits copied out
        of the graph's memory, which the next replay reuses."""
        def call(position_ids: torch.Tensor, **inputs):
            out = compiled(position_ids=position_ids.clone(memory_format=torch.contiguous_format), **inputs)
            if self.graphs:
                out.logits = out.logits.clone()
            return out
        return call

    def summary(self) -> dict:
        return {"compiled_shapes": len(self.shapes), "compile_seconds": round(self.compile_seconds, 1),
                "eager_seconds": round(sum(self.eager_seconds.values()), 1)}
