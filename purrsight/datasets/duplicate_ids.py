"""Our JSONL's duplicate-id check in 8 bytes a sample, for ``prepare``'s survey of millions of lines.

A dict of every id to its line cost about 0.1 KiB a sample, and the survey's process kept that
memory after the dict was freed (Python's allocator holds on to small-object pages), as did every
decoding process forked after it: +113 MiB each at a million lines (bench/results/data.md, "The input
formats at a million rows"). Here each id is kept as its 64-bit hash in one array; after the file,
equal hashes are found by sorting, and only their ids are then looked up again by a second read
of the file (duplicates are rare: a clean file is read once), so a hash collision is never
reported as a duplicate.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import numpy as np


class IdHashes:
    """The hashes of one file's ids, in reading order."""

    def __init__(self) -> None:
        self._hashes = array("q")

    def add(self, sample_id: str) -> None:
        self._hashes.append(hash(sample_id))  # one process: str hashes are stable within it

    def suspects(self) -> set[int]:
        """The hashes seen more than once (a duplicate id, or a collision the second read tells apart)."""
        if len(self._hashes) < 2:
            return set()
        ordered = np.sort(np.frombuffer(self._hashes, dtype=np.int64))
        return {int(h) for h in ordered[1:][ordered[1:] == ordered[:-1]]}


def duplicate_lines(records: Iterable[tuple[str, int]], suspects: set[int]) -> list[tuple[str, int, int]]:
    """(id, line, first line) for each record whose id came before, among ``records`` ((id, line) in
    file order) whose hash is in ``suspects``."""
    first_line: dict[str, int] = {}
    found = []
    for sample_id, line in records:
        if hash(sample_id) not in suspects:
            continue
        if sample_id in first_line:
            found.append((sample_id, line, first_line[sample_id]))
        else:
            first_line[sample_id] = line
    return found
