"""The run order (tests/run_order.py): each xdist worker's share led by its long files, the shares'
time balanced, every file once and whole; and the table it reads names only files that exist."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import REPO
from tests.run_order import FILE_SECONDS, LONG_FILE_S, estimate, known_seconds, shares

# Shaped like this suite: a few long files of a few tests each, many short files of many tests.
long_files = st.lists(st.tuples(st.sampled_from(["integration", "faults"]), st.integers(1, 5), st.floats(10, 300)), max_size=12)
short_files = st.lists(st.tuples(st.sampled_from(["unit", "bad_inputs"]), st.integers(1, 40), st.floats(0.1, 9.9)), max_size=40)
files_strategy = st.tuples(long_files, short_files).map(lambda drawn: drawn[0] + drawn[1]).filter(bool)


@given(files_strategy, st.integers(1, 4))
def test_each_workers_first_queue_holds_one_shares_long_files_whole_and_the_long_time_is_balanced(
    drawn: list[tuple[str, int, float]], workers: int
) -> None:
    files = [(f"tests/{folder}/test_{index}.py", count) for index, (folder, count, _) in enumerate(drawn)]
    known = {f"tests/{folder}/test_{index}.py": seconds for index, (folder, _, seconds) in enumerate(drawn)}
    dealt = shares(files, workers, known)
    assert len(dealt) == workers
    order = [path for share in dealt for path in share]
    assert sorted(order) == sorted(path for path, _ in files)  # each file once, whole
    seconds = {path: estimate(path, count, known) for path, count in files}
    long = [path for path in order if seconds[path] >= LONG_FILE_S]
    for share in dealt:  # long files first, longest first
        kinds = [seconds[path] >= LONG_FILE_S for path in share]
        assert kinds == sorted(kinds, reverse=True)
        times = [seconds[path] for path in share if seconds[path] >= LONG_FILE_S]
        assert times == sorted(times, reverse=True)
    if long:  # longest-processing-time: no share's long files exceed another's by more than one file
        loads = [sum(seconds[path] for path in share if seconds[path] >= LONG_FILE_S) for share in dealt]
        assert max(loads) - min(loads) <= max(seconds[path] for path in long) + 1e-9
    # xdist's worksteal hands out the list in order, each idle worker len(pending) // workers left of
    # what is pending (xdist/scheduler/worksteal.py). Wherever the short files can pad every share to
    # its place (each share's long tests and one short file fit in 1/n, as with this suite's 521
    # unit tests of 630), each worker's first queue holds one share's long files, whole: its split
    # falls among short tests, and the long time is as balanced as the shares'.
    count = dict(files)
    widest_short = max((count[path] for path in order if seconds[path] < LONG_FILE_S), default=0)
    long_counts = [sum(count[path] for path in share if seconds[path] >= LONG_FILE_S) for share in dealt]
    if any(held + widest_short > sum(count.values()) / workers for held in long_counts):
        return
    tests = [path for path in order for _ in range(count[path])]
    queues, pending = [], tests
    for left in range(workers, 0, -1):
        queues.append(pending[: len(pending) // left])
        pending = pending[len(pending) // left :]
    long_time = []
    for queue in queues:
        held = {path for path in queue if seconds[path] >= LONG_FILE_S}
        assert all(queue.count(path) == count[path] for path in held), (queue, dealt)  # long files whole
        long_time.append(sum(seconds[path] for path in held))
    assert max(long_time) - min(long_time) <= max((seconds[path] for path in long), default=0) + 1e-9, (long_time, dealt)


def test_the_seconds_table_names_only_test_files_that_exist() -> None:
    table = known_seconds(FILE_SECONDS)
    assert len(table) >= 20, "tests/file_seconds.json lost its rows"
    missing = [path for path in table if not (REPO / path).is_file()]
    assert not missing, f"tests/file_seconds.json names files that are gone (refresh it: tests/README.md): {missing}"
