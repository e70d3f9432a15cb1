"""A set of row ids at 8 bytes an id: for duplicate detection and resume over millions of rows.

Ids are kept as 64-bit hashes of their JSON form (so 5 and "5" differ): a sorted array plus a
small unsorted buffer that is merged in when it fills up.
"""

import hashlib
import heapq
from array import array
from bisect import bisect_left

import orjson


def id_hash(row_id) -> int:
    return int.from_bytes(hashlib.blake2b(orjson.dumps(row_id), digest_size=8).digest(), "little")


class IdSet:
    BUFFER = 65536

    def __init__(self):
        self.sorted = array("Q")
        self.buffer: set[int] = set()

    def __len__(self) -> int:
        return len(self.sorted) + len(self.buffer)

    def __contains__(self, row_id) -> bool:
        h = id_hash(row_id)
        if h in self.buffer:
            return True
        i = bisect_left(self.sorted, h)
        return i < len(self.sorted) and self.sorted[i] == h

    def add(self, row_id) -> None:
        self.buffer.add(id_hash(row_id))
        if len(self.buffer) >= self.BUFFER:
            self.sorted = array("Q", heapq.merge(self.sorted, sorted(self.buffer)))
            self.buffer.clear()
