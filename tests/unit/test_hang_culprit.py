"""The hang verdict (purrsight/training/hang_culprit.py) from the records every rank publishes."""

from __future__ import annotations

from purrsight.training.hang_culprit import STALE_AFTER_S, Progress, culprit_line, rank_ranges

NOW = 10_000.0


def record(rank: int, step: int, phase: str, beat_age: float = 1.0, phase_age: float = 300.0) -> Progress:
    return Progress(
        rank=rank, node=rank // 4, host=f"host-{rank // 4}", step=step, phase=phase, phase_at=NOW - phase_age, beat=NOW - beat_age
    )


def test_rank_ranges_are_compact() -> None:
    assert rank_ranges([7, 0, 1, 2, 4, 6]) == "0-2,4,6-7"
    assert rank_ranges([5]) == "5"


def test_a_frozen_rank_is_named_by_its_stopped_heartbeat() -> None:
    records: dict[int, Progress | None] = {r: record(r, 171, "backward", phase_age=600) for r in range(8)}
    records[3] = record(3, 170, "step done", beat_age=STALE_AFTER_S + 590, phase_age=612)
    line = culprit_line(records, 8, NOW)
    assert line.startswith("rank 3 (node 0, host-0) last finished training step 170, 612 s ago, and stopped answering")
    assert line.endswith("ranks 0-2,4-7 wait in step 172 (backward)")


def test_a_live_rank_stuck_behind_the_others_is_named_by_where_it_is() -> None:
    """A deadlock: the process still publishes, but it never reached the step's backward."""
    records: dict[int, Progress | None] = {r: record(r, 40, "backward") for r in range(4)}
    records[2] = record(2, 40, "forward", phase_age=500)
    line = culprit_line(records, 4, NOW)
    assert line == (
        "rank 2 (node 0, host-0) last finished training step 40, 500 s ago, and is still in step 41 (forward); "
        "ranks 0-1,3 wait in step 41 (backward)"
    )


def test_a_rank_that_never_published_and_nobody_behind_are_said() -> None:
    records: dict[int, Progress | None] = {0: record(0, 5, "step done"), 1: None}
    assert culprit_line(records, 2, NOW) == "rank(s) 1 published no progress; rank 0 waits after step 5"
    level: dict[int, Progress | None] = {r: record(r, 5, "backward") for r in range(2)}
    assert culprit_line(level, 2, NOW) == "no rank is behind: ranks 0-1 wait in step 6 (backward)"
