"""The order the tests run in: each xdist worker's share starting with its longest files.

``pytest-xdist --dist worksteal`` hands the first worker the first ``len // n`` tests, the next the
next share, and so on, and an idle worker later takes half of a busy one's remaining queue from
its end. So the long files must lead each worker's share, and the many short ones follow, where a
steal takes them: with the long files first in the list (as until 2026-11-28) they all landed in
the first worker's share, the second worker ran unit tests and then stole from the first's end,
and the two met in the middle, at test_fsdp.py, which ran alone for the run's last two minutes.

Here the long files are dealt to the workers longest first, each to the share with the least
time so far (the longest-processing-time rule), and the short files fill the shares to an equal
count of tests, so each share's first tests are its long ones. A file's tests stay together, in
their order (module fixtures). Times come from ``tests/file_seconds.json`` (a fresh clone's run,
refreshed with ``python -m tests.suite_budget --file-seconds``), else a folder's mean per test.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

FILE_SECONDS = Path(__file__).resolve().parent / "file_seconds.json"
# Seconds per test by folder, for a file the table does not list (fresh-clone means, 2026-11-28).
FOLDER_MEAN_S = {"faults": 39.0, "launcher": 28.0, "integration": 22.0, "bench": 12.0, "bad_inputs": 3.0}
DEFAULT_MEAN_S = 0.2  # tests/unit's (0.3): a unit file the table leaves out measured under 5 s
# Files that take less than this are the fillers, dealt after the long ones.
LONG_FILE_S = 10.0


def known_seconds(table: Path = FILE_SECONDS) -> dict[str, float]:
    """path (from the repository root, as pytest names it) -> its tests' seconds, from the table."""
    return {str(k): float(v) for k, v in json.loads(table.read_text())["seconds"].items()} if table.exists() else {}


def estimate(path: str, tests: int, known: dict[str, float]) -> float:
    if path in known:
        return known[path]
    folder = path.split("/")[1] if path.startswith("tests/") else ""
    return tests * FOLDER_MEAN_S.get(folder, DEFAULT_MEAN_S)


def shares(files: Sequence[tuple[str, int]], workers: int, known: dict[str, float]) -> list[list[str]]:
    """``files`` (path, number of tests), in collection order, dealt into ``workers`` shares: each
    share its long files longest first, then short files until it holds its count of tests."""
    seconds = {path: estimate(path, count, known) for path, count in files}
    count_of = dict(files)
    long = sorted((path for path, _ in files if seconds[path] >= LONG_FILE_S), key=lambda p: -seconds[p])
    short = [path for path, _ in files if seconds[path] < LONG_FILE_S]
    dealt: list[list[str]] = [[] for _ in range(max(1, workers))]
    load = [0.0] * len(dealt)
    for path in long:
        least = min(range(len(dealt)), key=lambda i: (load[i], i))
        dealt[least].append(path)
        load[least] += seconds[path]
    total = sum(count for _, count in files)
    held = [sum(count_of[p] for p in share) for share in dealt]
    for path in short:  # each share up to its end in xdist's split (i + 1 shares of n), the last takes the rest
        ends = (total * (i + 1) / len(dealt) for i in range(len(dealt) - 1))
        target = next((i for i, end in enumerate(ends) if sum(held[: i + 1]) < end), len(dealt) - 1)
        dealt[target].append(path)
        held[target] += count_of[path]
    return dealt
