"""Run-level statistics: added up batch by batch, shown on the progress bar and in the summary."""

import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from batchspec.decoding.row_stats import RowStats


def progress_bar(total: int | None, enabled: bool) -> tqdm:
    """Rows done, on stderr: refreshed every second on a terminal, every 30 s in a log file."""
    return tqdm(total=total, unit="row", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                mininterval=1 if sys.stderr.isatty() else 30)


@dataclass
class RunStats:
    rows_ok: int = 0
    rows_error: int = 0
    rows_skipped: int = 0  # done by an earlier run of the same OUT
    rows: RowStats = field(default_factory=RowStats)  # the output rows' statistics, summed
    pad_slots: int = 0
    prompt_slots: int = 0
    empty_cache_slots: int = 0
    cache_slots: int = 0
    batches: int = 0
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
            self.rows.add(row.stats)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def postfix(self) -> dict:
        shown = {"tok/s": f"{self.rows.completion_tokens / max(self.seconds, 1e-9):.1f}"}
        if self.rows.draft_tokens:
            shown["accept"] = f"{self.rows.accepted_tokens / self.rows.draft_tokens:.2f}"
        return shown

    def summary(self) -> dict:
        return {
            "rows_ok": self.rows_ok,
            "rows_error": self.rows_error,
            "rows_skipped": self.rows_skipped,
            "batches": self.batches,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.rows.completion_tokens / max(self.seconds, 1e-9), 2),
            **self.rows.totals(),
            "padding_fraction": self.pad_slots / self.prompt_slots if self.prompt_slots else 0.0,
            "wasted_cache_fraction": self.empty_cache_slots / self.cache_slots if self.cache_slots else 0.0,
        }


def by_source(totals: dict) -> str:
    """Acceptance per source that proposed, e.g. "model 0.310 in 120 row-steps, suffix 0.750 in 40"."""
    return ", ".join(f"{source} {rate:.3f} in {totals[f'{source}_steps']} row-steps"
                     for source, rate in totals["acceptance_by_source"].items())
