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

from batchspec.errors import UsageError, UserError
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
    the lock when the process dies, kill -9 included."""
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
        yield


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


def recover(path: Path) -> Iterator[dict]:
    """Records of a JSONL file we wrote; a torn last line (a kill mid-write) is cut off the file."""
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
                    raise UserError(f"{path} is damaged at line {number}; move it away or use --overwrite")
                break
            good_end += len(line)
            yield record
    if good_end != path.stat().st_size:
        os.truncate(path, good_end)


def check_fingerprint(paths: OutputPaths, fingerprint: dict) -> None:
    """First run: store the fingerprint. Later runs: refuse to mix outputs of different runs. A
    run that stopped before writing a record (a model refused, a typo) mixes nothing: its
    fingerprint is replaced."""
    written = any(path.exists() and path.stat().st_size for path in (paths.out, paths.errors))
    if not paths.fingerprint.exists() or not written:
        write_atomic(paths.fingerprint, orjson.dumps(fingerprint, option=orjson.OPT_INDENT_2))
        return
    changed = changed_options(orjson.loads(paths.fingerprint.read_bytes()), fingerprint)
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
    return sorted(changed | {k for k in ("input", "chat_template") if stored.get(k) != fingerprint.get(k)})


class Sink:
    def __init__(self, paths: OutputPaths, id_key: str = "id"):
        self.paths, self.id_key = paths, id_key
        self.done = IdSet()
        for record in recover(paths.out):
            self.done.add(record[id_key])
        self.error_lines = {record["line"] for record in recover(paths.errors)}
        self.resumed_rows, self.resumed_errors = len(self.done), len(self.error_lines)
        paths.out.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(paths.out, "ab")
        self.errors = open(paths.errors, "ab")
        self.pending_errors: list[bytes] = []

    def is_done(self, item: Row | RowError) -> bool:
        """Written by an earlier run: its line is in the error file, or (a good row) its id in OUT."""
        return item.line in self.error_lines or (isinstance(item, Row) and item.id in self.done)

    def error(self, error: RowError) -> None:
        """Buffered: a kill before the next flush only means the rerun finds the line bad again."""
        self.pending_errors.append(orjson.dumps(error.record()) + b"\n")
        self.error_lines.add(error.line)
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


def durable_append(f, data: bytes) -> None:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
