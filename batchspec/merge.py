"""`batchspec merge`: the shard outputs of one sharded run -> one OUT, error file and summary.

Shards are found from the --out template the runs used (its {shard} placeholder globbed);
their summaries say how many shards there are and whether each finished.
"""

import glob
import os
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import orjson

from batchspec.errors import UsageError, UserError
from batchspec.sink import OutputPaths, atomic_file, foreign, read_records, read_summary, write_atomic, written
from batchspec.sources import Row, read_run_input


class IncompleteShards(UserError):
    exit_code = 3


def shard_outputs(template: str) -> list[OutputPaths]:
    """The OUT files matching a {shard} template, in name order."""
    if "{shard" not in template:
        raise UsageError(f"{template!r} has no {{shard}} placeholder: give the --out the shard runs used")
    pattern = re.sub(r"\{shard[^}]*\}", "*", template)
    return [OutputPaths.of(p) for p in sorted(glob.glob(pattern)) if not p.endswith(".errors.jsonl")]


def check_complete(shards: list[OutputPaths], allow_partial: bool) -> list[dict]:
    """The shards' summaries; refuses missing or unfinished shards unless allow_partial."""
    summaries = [read_summary(p.summary) for p in shards]
    known = [s for s in summaries if s]
    if not known:
        raise IncompleteShards("no shard has a summary yet: nothing finished to merge")
    with foreign("the shards' summaries"):
        total = known[0]["options"]["num_shards"]
        present = {s["options"]["shard_index"] for s in known}
    problems = [f"shard {i} is missing" for i in range(total) if i not in present]
    problems += [f"{p.out} is unfinished" for p, s in zip(shards, summaries) if not s.get("finished")]
    if problems and not allow_partial:
        raise IncompleteShards("; ".join(problems) + " (rerun those shards, or merge anyway with --allow-partial)")
    return known


def unique_lines(paths: list[Path], key: str) -> Iterator[tuple[dict, tuple[int, int, int]]]:
    """(record, place) of each complete line, the first with each record[key] only; a place is
    (file index, offset, length), so that lines can be copied later without being held.
    A torn last line (a shard killed mid-write, merged with --allow-partial) is skipped."""
    seen = set()
    for i, path in enumerate(paths):
        offsets = line_offsets(path)
        for where, record in read_records(path):
            with foreign(where):
                value = record[key]
            offset, length = next(offsets)
            if value not in seen:
                seen.add(value)
                yield record, (i, offset, length)


def line_offsets(path: Path) -> Iterator[tuple[int, int]]:
    """(offset, length) of each complete line of a file, in order."""
    offset = 0
    if path.exists():
        with open(path, "rb") as f:
            for line in f:
                if line.endswith(b"\n"):
                    yield offset, len(line)
                offset += len(line)


def copy_lines(paths: list[Path], places: list[tuple[int, int, int]], target: Path) -> None:
    """Write the lines at `places` (in that order) of the files `paths` atomically to target."""
    with ExitStack() as stack, atomic_file(target) as out:
        files = [stack.enter_context(open(p, "rb")) if p.exists() else None for p in paths]
        for i, offset, length in places:
            files[i].seek(offset)
            out.write(files[i].read(length))


def input_order(source: str, options: dict) -> dict[str, int]:
    items = read_run_input(source, options)
    return {item.id: item.line for item in items if isinstance(item, Row)}  # error lines hold no record


def row_stats(record: dict) -> dict:
    """A record's per-row statistics, in either output format."""
    return record["stats"] if "stats" in record else record["response"]["body"]["batchspec"]


def same_file(a: Path, b: Path) -> bool:
    return a.exists() and b.exists() and os.path.samefile(a, b)


def check_target(target: OutputPaths, overwrite: bool) -> None:
    """OUT may be replaced only when it is new, an earlier merge's (its summary lists shards) or
    `overwrite` says so: a merge never cuts a file batchspec did not write."""
    if written(target.out) and not overwrite and "shards" not in read_summary(target.summary):
        raise UsageError(f"{target.out} exists and is not an earlier merge's output; choose another --out, or pass "
                         "--overwrite to replace it")


def merge(template: str, out: str, *, allow_partial: bool = False, order_by_input: str | None = None,
          overwrite: bool = False) -> dict:
    target = OutputPaths.of(out)
    shards = shard_outputs(template)
    if any(same_file(mine, theirs) for mine in target.all() for shard in shards for theirs in shard.all()):
        raise UsageError(f"--out {out} is a shard's own file: the merge would write over what it reads; choose "
                         "another --out")
    check_target(target, overwrite)
    summaries = check_complete(shards, allow_partial)
    with foreign("the shards' summaries"):
        options = summaries[0]["options"]
        id_key = "custom_id" if options["output_format"] == "openai" else "id"
    outs, error_files = [p.out for p in shards], [p.errors for p in shards]
    totals = {"completion_tokens": 0, "draft_tokens": 0, "accepted_tokens": 0}
    records = []  # (id, place)
    for record, place in unique_lines(outs, id_key):
        with foreign(f"a record of {outs[place[0]]} ({record[id_key]!r})"):
            stats = row_stats(record)
            for k in totals:
                totals[k] += stats[k]
        records.append((record[id_key], place))
    errors = sorted((record["line"], place) for record, place in unique_lines(error_files, "line"))
    if order_by_input:
        position = input_order(order_by_input, options)
        records.sort(key=lambda pair: position.get(pair[0], float("inf")))
    target.out.parent.mkdir(parents=True, exist_ok=True)
    copy_lines(outs, [place for _, place in records], target.out)
    copy_lines(error_files, [place for _, place in errors], target.errors)
    summary = {
        "finished": all(s.get("finished") for s in summaries) and len(summaries) == options["num_shards"],
        "shards": [str(p.out) for p in shards],
        "rows_ok": len(records),
        "rows_error": len(errors),
        **totals,
        "acceptance_rate": totals["accepted_tokens"] / totals["draft_tokens"] if totals["draft_tokens"] else None,
    }
    write_atomic(target.summary, orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary
