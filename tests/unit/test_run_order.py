"""The run order (tests/run_order.py): each xdist worker's share led by its long files, the shares'
time balanced, every file once and whole; and the table it reads names only files that exist."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import REPO
from tests.run_order import FILE_SECONDS, LONG_FILE_S, estimate, known_seconds, shares

files_strategy = st.lists(
    st.tuples(st.sampled_from(["unit", "integration", "faults", "bad_inputs"]), st.integers(1, 40), st.floats(0.1, 300)),
    min_size=1,
    max_size=40,
)


@given(files_strategy, st.integers(1, 4))
def test_each_share_starts_with_its_long_files_and_the_split_xdist_makes_falls_among_short_ones(
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
    # xdist hands worker k the tests from k/n to (k+1)/n of the list: each of its starts lies in a
    # share's short files or at a share's start, never inside a long file, wherever the short files
    # can pad every share to its place (each share's long tests and one short file fit in 1/n, as
    # with this suite's 521 unit tests of 630).
    count = dict(files)
    widest_short = max((count[path] for path in order if seconds[path] < LONG_FILE_S), default=0)
    long_counts = [sum(count[path] for path in share if seconds[path] >= LONG_FILE_S) for share in dealt]
    if any(held + widest_short > sum(count.values()) / workers for held in long_counts):
        return
    total, starts, position = sum(count.values()), {}, 0
    for index, share in enumerate(dealt):
        for path in share:
            starts[path] = (index, position)
            position += count[path]
    for worker in range(1, workers):
        split = total * worker // workers
        inside = [path for path in order if starts[path][1] < split < starts[path][1] + count[path]]
        for path in inside:
            assert seconds[path] < LONG_FILE_S, (split, path, dealt)


def test_the_seconds_table_names_only_test_files_that_exist() -> None:
    table = known_seconds(FILE_SECONDS)
    assert len(table) >= 20, "tests/file_seconds.json lost its rows"
    missing = [path for path in table if not (REPO / path).is_file()]
    assert not missing, f"tests/file_seconds.json names files that are gone (refresh it: tests/README.md): {missing}"
