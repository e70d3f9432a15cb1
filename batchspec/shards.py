"""Shards: every row belongs to exactly one of N shards, by a stable hash of its id.

The hash ignores window, batch size and row order, so a rerun or another batch size never
moves a row. Under a SLURM array the shard comes from the array task, for arrays that do not
start at 0 too.
"""

import hashlib
import os

from batchspec.errors import UsageError


def shard_of(key: str, num_shards: int) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % num_shards


def owner_key(item) -> str:
    """A row's id, or for an error line without one its line number."""
    return item.id if item.id is not None else f"line:{item.line}"


def owned(items, num_shards: int, shard_index: int):
    """Only the rows and error lines of shard shard_index."""
    if num_shards == 1:
        return items
    return (i for i in items if shard_of(owner_key(i), num_shards) == shard_index)


def resolve(num_shards: int | None, shard_index: int | None, out: str, env=os.environ) -> tuple[int, int, str]:
    """(num_shards, shard_index, OUT with {shard} filled in). Unset: SLURM array task, else 1 shard."""
    if num_shards is None and "SLURM_ARRAY_TASK_COUNT" in env:
        num_shards = int(env["SLURM_ARRAY_TASK_COUNT"])
        shard_index = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", 0))
    num_shards = num_shards or 1
    shard_index = shard_index or 0
    if not 0 <= shard_index < num_shards:
        raise UsageError(f"--shard-index must be in 0..{num_shards - 1}, got {shard_index}")
    if num_shards > 1 and "{shard" not in out:
        raise UsageError("with several shards, --out needs a {shard} placeholder, e.g. out/part-{shard:05d}.jsonl")
    try:
        return num_shards, shard_index, out.format(shard=shard_index)
    except (KeyError, IndexError, ValueError) as e:
        raise UsageError(f"--out {out!r}: only a {{shard}} placeholder can be filled in ({e})") from None
