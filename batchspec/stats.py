"""Run-level statistics: added up batch by batch, shown on the progress bar and in the summary."""

import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm


def progress_bar(total: int | None, enabled: bool) -> tqdm:
    """Rows done, on stderr: refreshed every second on a terminal, every 30 s in a log file."""
    return tqdm(total=total, unit="row", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                mininterval=1 if sys.stderr.isatty() else 30)


@dataclass
class RunStats:
    rows_ok: int = 0
    rows_error: int = 0
    rows_skipped: int = 0  # done by an earlier run of the same OUT
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    model_steps: int = 0  # row-steps whose proposal came from the draft model
    ngram_steps: int = 0  # row-steps whose proposal came from n-gram lookup
    jump_steps: int = 0  # row-steps whose proposal was a grammar's forced text (jump-forward)
    tree_steps: int = 0  # row-steps whose proposal was a token tree (--tree-width)
    tree_nodes: int = 0  # their trees' nodes
    branches: list[int] = field(default_factory=list)  # tree steps per beam rank of the accepted path's end
    pad_slots: int = 0
    prompt_slots: int = 0
    empty_cache_slots: int = 0
    cache_slots: int = 0
    batches: int = 0
    histogram: list[int] = field(default_factory=list)  # accepted lengths 0..gamma, all rows
    gammas: list[int] = field(default_factory=list)  # row-steps per gamma used (0: plain steps)
    started: float = field(default_factory=time.monotonic)

    def add_batch(self, batch, output) -> None:
        """batch: buckets.Batch; output: decoding.BatchOutput."""
        self.batches += 1
        self.rows_ok += len(batch.rows)  # a row's n samples are one row
        pads, slots = batch.padding
        self.pad_slots += pads
        self.prompt_slots += slots
        self.empty_cache_slots += output.stats["empty_slots"]
        self.cache_slots += output.stats["slots"]
        for row in output.rows:
            s = row.stats
            self.prompt_tokens += s["prompt_tokens"]
            self.completion_tokens += s["completion_tokens"]
            self.draft_tokens += s["draft_tokens"]
            self.accepted_tokens += s["accepted_tokens"]
            self.model_steps += s["model_steps"]
            self.ngram_steps += s["ngram_steps"]
            self.jump_steps += s["jump_steps"]
            self.tree_steps += s.get("tree_steps", 0)
            self.tree_nodes += s.get("tree_nodes", 0)
            self.branches = add_up(self.branches, s.get("tree_branch_histogram", []))
            self.histogram = add_up(self.histogram, s["accepted_length_histogram"])
            self.gammas = add_up(self.gammas, s["gamma_histogram"])

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def postfix(self) -> dict:
        shown = {"tok/s": f"{self.completion_tokens / max(self.seconds, 1e-9):.1f}"}
        if self.acceptance_rate is not None:
            shown["accept"] = f"{self.acceptance_rate:.2f}"
        return shown

    def summary(self) -> dict:
        return {
            "rows_ok": self.rows_ok,
            "rows_error": self.rows_error,
            "rows_skipped": self.rows_skipped,
            "batches": self.batches,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.completion_tokens / max(self.seconds, 1e-9), 2),
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "model_steps": self.model_steps,
            "ngram_steps": self.ngram_steps,
            "jump_steps": self.jump_steps,
            "tree_steps": self.tree_steps,
            "tree_nodes": self.tree_nodes,
            "tree_branch_histogram": self.branches,
            "accepted_length_histogram": self.histogram,
            "gamma_histogram": self.gammas,
            "padding_fraction": self.pad_slots / self.prompt_slots if self.prompt_slots else 0.0,
            "wasted_cache_fraction": self.empty_cache_slots / self.cache_slots if self.cache_slots else 0.0,
        }


def add_up(total: list[int], more: list[int]) -> list[int]:
    """Element-wise sum of two histograms, the shorter one padded with zeros."""
    longer, shorter = (total, more) if len(total) >= len(more) else (more, total)
    return [a + (shorter[i] if i < len(shorter) else 0) for i, a in enumerate(longer)]
