"""`batchspec status`: where a run (or each shard of one) stands, read only from its files, so
it is safe while the run goes on: it takes no lock and writes nothing. Rows remaining are
counted from the input named in the summary a stopped run left (unknown before that)."""

import os

from batchspec.errors import UsageError
from batchspec.merge import row_stats, shard_outputs
from batchspec.shards import owned
from batchspec.sink import OutputPaths, complete_lines, foreign, read_records, read_summary
from batchspec.sources import read_run_input

HEADER = ["output", "rows", "errors", "remaining", "acceptance", "tok/s", "state"]


def running(paths: OutputPaths) -> bool:
    """Whether the pid in the lock file is alive (the lock itself is left alone)."""
    try:
        os.kill(int(paths.lock.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def shard_status(paths: OutputPaths) -> dict:
    rows = completion = proposed = accepted = 0
    for where, record in read_records(paths.out):
        with foreign(where):
            stats = row_stats(record)
            completion += stats["completion_tokens"]
            proposed += stats["draft_tokens"]
            accepted += stats["accepted_tokens"]
        rows += 1
    summary = read_summary(paths.summary)
    finished = bool(summary.get("finished"))
    # tokens/s over the output's life: from the first run's start (its fingerprint) to the last write
    seconds = paths.out.stat().st_mtime - paths.fingerprint.stat().st_mtime if paths.fingerprint.exists() and \
        paths.out.exists() else 0
    state = "running" if running(paths) else "finished" if finished else "stopped" if summary else "not started"
    errors = sum(1 for _ in complete_lines(paths.errors))
    with foreign(str(paths.summary)):
        total = None if finished or not summary else input_rows(summary["input"], summary["options"])
    return {
        "output": str(paths.out),
        "rows": rows,
        "errors": errors,
        "remaining": 0 if finished else None if total is None else total - rows - errors,
        "acceptance": accepted / proposed if proposed else None,
        "tok/s": completion / seconds if seconds > 0 else None,
        "state": state,
    }


def input_rows(source: str, options: dict) -> int | None:
    """Non-blank lines (or examples) of the input that belong to this shard; None if it is gone."""
    if not (os.path.isfile(source) or os.path.isdir(source) or source.startswith("hf:")):
        return None  # gone, or a stream (stdin, a FIFO): not for status to read
    return sum(1 for _ in owned(read_run_input(source, options), options["num_shards"], options["shard_index"]))


def status(out_or_template: str) -> list[dict]:
    """Each shard's (or OUT's) status; none where no shard of a template has started."""
    if os.path.isdir(out_or_template):
        raise UsageError(f"{out_or_template!r} is a folder: give a run's --out (or its {{shard}} template)")
    shards = shard_outputs(out_or_template) if "{shard" in out_or_template else [OutputPaths.of(out_or_template)]
    return [shard_status(p) for p in shards]


def table(rows: list[dict]) -> str:
    def cell(value, header: str) -> str:
        if value is None:
            return "?"
        return (f"{value:.1f}" if header == "tok/s" else f"{value:.3f}") if isinstance(value, float) else str(value)

    widths = [max(len(h), *(len(cell(r[h], h)) for r in rows)) for h in HEADER]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths))]
    lines += ["  ".join(cell(r[h], h).ljust(w) for h, w in zip(HEADER, widths)) for r in rows]
    return "\n".join(lines)
