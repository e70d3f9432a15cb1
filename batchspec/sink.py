"""Records out: append-only JSONL, flushed and fsync'ed per batch, resumable, locked.

Knows which ids are done (resume), which input lines already have an error record, and writes
the run fingerprint and the summary. Knows nothing of tensors.
"""

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson

from batchspec.errors import UsageError, UserError, first_line
from batchspec.idset import IdSet
from batchspec.sources import Row, RowError


@dataclass(frozen=True)
class OutputPaths:
    out: Path
    errors: Path
    summary: Path
    fingerprint: Path
    lock: Path

    @classmethod
    def of(cls, out: str) -> "OutputPaths":
        """out.jsonl -> out.errors.jsonl, out.summary.json, out.run.json, out.lock."""
        path = Path(out)
        stem = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.name
        side = lambda suffix: path.with_name(stem + suffix)  # noqa: E731
        return cls(path, side(".errors.jsonl"), side(".summary.json"), side(".run.json"), side(".lock"))

    def all(self) -> list[Path]:
        return [self.out, self.errors, self.summary, self.fingerprint]


@contextmanager
def locked(paths: OutputPaths):
    """Hold an exclusive lock on OUT for the run; a second writer fails at once. The kernel drops
    the lock when the process dies, kill -9 included. The file names the holder's pid while it
    runs (for that error and `batchspec status`), and nothing once it ended: a pid left there
    would read as a run still going once the system gives that number to another process."""
    paths.lock.parent.mkdir(parents=True, exist_ok=True)
    with open(paths.lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            raise UserError(f"another batchspec run (pid {holder}) is writing {paths.out}; not starting") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()


@contextmanager
def atomic_file(path: Path):
    """A binary file that replaces `path` only once it is completely written and synced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def recover(path: Path, id_key: str) -> Iterator[dict]:
    """Records of a JSONL file we wrote; a torn last line (a kill mid-write) is cut off the file.
    A complete line that is not one of our records means the file is not ours as it stands."""
    if not path.exists():
        return
    good_end = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                record = orjson.loads(line) if line.endswith(b"\n") else None
            except orjson.JSONDecodeError:
                record = None
            if record is None:
                if f.read(1):
                    raise UsageError(f"{path} is damaged at line {number}; move it away or use --overwrite")
                break
            if not (isinstance(record, dict) and isinstance(record.get(id_key), (str, int))):
                raise UsageError(f"{path} line {number} is not a batchspec record (no {id_key!r}); move it away or "
                                 "use --overwrite")
            good_end += len(line)
            yield record
    if good_end != path.stat().st_size:
        os.truncate(path, good_end)


def output_paths(out: str, sources: list[str]) -> OutputPaths:
    """OUT's paths, a symlinked OUT resolved to the file it names (so that its side files, lock
    included, sit beside what is written); refused when any of them is one of the run's own
    input files (`sources`: the input, templates, schemas)."""
    paths = OutputPaths.of(str(Path(out).resolve()))
    if paths.out.exists() and not paths.out.is_file():
        raise UsageError(f"--out {out} is not a regular file (a device, a FIFO): choose a file to write")
    blocked = next((p for p in paths.out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise UsageError(f"--out {out} is inside {blocked}, which is a file, not a folder: choose another --out")
    for source in sources:
        for path in paths.all():
            if path.exists() and os.path.exists(source) and os.path.samefile(path, source):
                raise UsageError(f"--out {out} would write over {source}, an input of this run; choose another --out")
    return paths


def written(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def refuse_foreign(paths: OutputPaths) -> None:
    """Refuse an OUT with records that batchspec did not start (no fingerprint beside it)."""
    if any(written(path) for path in (paths.out, paths.errors)) and not paths.fingerprint.exists():
        raise UsageError(f"{paths.out} exists and was not started by batchspec (no {paths.fingerprint.name} beside "
                         "it); choose another --out, or pass --overwrite to replace it")


def claim(paths: OutputPaths, fingerprint: dict) -> None:
    """Make OUT this run's, or refuse: a new OUT gets the run's fingerprint; an OUT with records
    is resumed only when its fingerprint exists and matches (so a torn tail is cut only in a file
    batchspec started, and a resume never mixes runs of different options). A run that stopped
    before writing a record (a model refused, a typo) mixes nothing: its fingerprint is replaced."""
    if not any(written(path) for path in (paths.out, paths.errors)):
        write_atomic(paths.fingerprint, orjson.dumps(fingerprint, option=orjson.OPT_INDENT_2))
        return
    refuse_foreign(paths)
    try:
        stored = orjson.loads(paths.fingerprint.read_bytes())
        changed = changed_options(stored, fingerprint)
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        raise UsageError(f"{paths.fingerprint} is damaged; pass --overwrite to start {paths.out} over") from None
    if changed:
        raise UsageError(
            f"{paths.out} was started by a run with different {', '.join(changed)}; rerun with the same "
            "options to resume, or pass --overwrite to start over"
        )


def changed_options(stored: dict, fingerprint: dict) -> list[str]:
    """What differs between a stored fingerprint and this run's. An option the stored one lacks
    (added to batchspec since that run started) is unchanged while this run leaves it unset."""
    old, new = stored.get("options", {}), fingerprint["options"]
    changed = {k for k in old.keys() | new.keys() if (k in old or new[k]) and old.get(k) != new.get(k)}
    files = ("input", "chat_template", "json_schema", "grammar")  # what each file says
    return sorted(changed | {k for k in files if stored.get(k) != fingerprint.get(k)})


class Sink:
    def __init__(self, paths: OutputPaths, id_key: str = "id"):
        self.paths, self.id_key = paths, id_key
        self.done = IdSet()
        for record in recover(paths.out, id_key):
            self.done.add(record[id_key])
        self.error_lines = {record["line"]: record.get("id") for record in recover(paths.errors, "line")}  # line -> id
        self.resumed_rows, self.resumed_errors = len(self.done), len(self.error_lines)
        paths.out.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(paths.out, "ab")
        self.errors = open(paths.errors, "ab")
        self.pending_errors: list[bytes] = []

    def is_done(self, item: Row | RowError) -> bool:
        """Written by an earlier run: a bad line's line is in the error file; a good row's id is in
        OUT, or its line's error record names it (a row that failed in decoding). A stream sent
        again with another row at a line that was bad has that row decoded, not skipped."""
        if isinstance(item, Row):
            return item.id in self.done or self.error_lines.get(item.line) == item.id
        return item.line in self.error_lines

    def error(self, error: RowError) -> None:
        """Buffered: a kill before the next flush only means the rerun finds the line bad again."""
        self.pending_errors.append(orjson.dumps(error.record()) + b"\n")
        self.error_lines[error.line] = error.id
        if len(self.pending_errors) >= 1000:
            self.flush_errors()

    def flush_errors(self) -> None:
        if self.pending_errors:
            durable_append(self.errors, b"".join(self.pending_errors))
            self.pending_errors.clear()

    def write(self, records: list[dict]) -> None:
        durable_append(self.out, b"".join(orjson.dumps(r) + b"\n" for r in records))
        for record in records:
            self.done.add(record[self.id_key])
        self.flush_errors()

    def close(self) -> None:
        self.flush_errors()
        self.out.close()
        self.errors.close()


@contextmanager
def foreign(where: str):
    """What a record or summary that batchspec did not write makes its reader raise (a KeyError,
    a TypeError, a JSONDecodeError, ...) becomes one UsageError naming where it is."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        raise UsageError(f"{where} is not what batchspec writes ({type(e).__name__}: {first_line(e)})") from None


def complete_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a file's complete lines: a line being written right now is left out."""
    if path.exists():
        with open(path, "rb") as f:
            yield from ((number, line) for number, line in enumerate(f, 1) if line.endswith(b"\n"))


def read_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, record) of each complete line of one of our JSONL files, where "path:line" (for
    `foreign` around what the reader then takes from the record)."""
    for number, line in complete_lines(path):
        where = f"{path}:{number}"
        with foreign(where):
            record = orjson.loads(line)
        yield where, record


def read_summary(path: Path) -> dict:
    """A run's summary ({} when there is none yet)."""
    if not path.exists():
        return {}
    with foreign(str(path)):
        summary = orjson.loads(path.read_bytes())
        if not isinstance(summary, dict):
            raise TypeError(f"a JSON {type(summary).__name__}, not an object")
        return summary


def durable_append(f, data: bytes) -> None:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
