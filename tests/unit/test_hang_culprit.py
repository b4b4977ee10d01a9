"""The hang verdict (purrsight/distributed/hang_culprit.py) from the records every rank publishes.

The verdict reads every record twice, a window apart: ``snapshots`` gives both reads, with the
ranks named in ``frozen`` publishing nothing between them (their heartbeat does not move)."""

from __future__ import annotations

import time
from dataclasses import replace

from purrsight.distributed.hang_culprit import RankStep, culprit_line, rank_ranges

NOW = 10_000.0
WINDOW = 6.0


def record(rank: int, step: int, phase: str, phase_age: float = 300.0, clock_offset: float = 0.0) -> RankStep:
    """What ``rank`` last published: ``phase_age`` seconds in its phase; ``clock_offset``: how far its
    host's wall clock is off."""
    now = NOW + clock_offset
    return RankStep(rank=rank, node=rank // 4, host=f"host-{rank // 4}", step=step, phase=phase, phase_at=now - phase_age, beat=now)


def snapshots(
    records: dict[int, RankStep | None], frozen: tuple[int, ...] = ()
) -> tuple[dict[int, RankStep | None], dict[int, RankStep | None]]:
    """The first read, ``WINDOW`` before ``records`` (the second): every rank but the frozen ones
    published in between."""
    earlier = {rank: r if r is None or rank in frozen else replace(r, beat=r.beat - (WINDOW - 1)) for rank, r in records.items()}
    return earlier, records


def test_rank_ranges_are_compact() -> None:
    assert rank_ranges([7, 0, 1, 2, 4, 6]) == "0-2,4,6-7"
    assert rank_ranges([5]) == "5"


def test_a_frozen_rank_is_named_by_its_stopped_heartbeat() -> None:
    records: dict[int, RankStep | None] = {r: record(r, 171, "backward", phase_age=600) for r in range(8)}
    records[3] = record(3, 170, "step done", phase_age=22)
    line = culprit_line(*snapshots(records, frozen=(3,)), 8, WINDOW)
    assert line.startswith(
        "rank 3 (node 0, host-0) last finished training step 170, 22 s before its last heartbeat, "
        "and stopped answering (no heartbeat for 6 s: frozen, or its node is gone)"
    )
    assert line.endswith("ranks 0-2,4-7 wait in step 172 (backward)")


def test_a_live_rank_stuck_behind_the_others_is_named_by_where_it_is() -> None:
    """A deadlock: the process still publishes, but it never reached the step's backward."""
    records: dict[int, RankStep | None] = {r: record(r, 40, "backward") for r in range(4)}
    records[2] = record(2, 40, "forward", phase_age=500)
    line = culprit_line(*snapshots(records), 4, WINDOW)
    assert line == (
        "rank 2 (node 0, host-0) last finished training step 40, 500 s ago, and is still in step 41 (forward); "
        "ranks 0-1,3 wait in step 41 (backward)"
    )


def test_a_rank_that_never_published_and_nobody_behind_are_said() -> None:
    records: dict[int, RankStep | None] = {0: record(0, 5, "step done"), 1: None}
    assert culprit_line(*snapshots(records), 2, WINDOW) == "rank(s) 1 published no step; rank 0 waits after step 5"
    level: dict[int, RankStep | None] = {r: record(r, 5, "backward") for r in range(2)}
    assert culprit_line(*snapshots(level), 2, WINDOW) == "no rank is behind: ranks 0-1 wait in step 6 (backward)"


def test_a_host_whose_clock_is_off_is_neither_named_frozen_nor_hides_a_frozen_rank() -> None:
    """Wall clocks disagree by seconds (minutes, without NTP): only a rank's own timestamps are
    compared with each other, and whether a heartbeat moved is seen on the reader's clock."""
    for offset in (-600.0, -30.0, 30.0, 600.0):
        records: dict[int, RankStep | None] = {r: record(r, 80, "backward") for r in range(4)}
        records[1] = record(1, 80, "backward", clock_offset=offset)  # alive, its clock off
        assert culprit_line(*snapshots(records), 4, WINDOW) == "no rank is behind: ranks 0-3 wait in step 81 (backward)"
        records[2] = record(2, 79, "step done", phase_age=40, clock_offset=offset)  # frozen, its clock off
        line = culprit_line(*snapshots(records, frozen=(2,)), 4, WINDOW)
        assert line.startswith("rank 2 (node 0, host-0) last finished training step 79, 40 s before its last heartbeat"), line
        assert line.endswith("ranks 0-1,3 wait in step 81 (backward)"), line


def test_a_watchdogs_firing_is_read_by_its_peers_in_its_generation_only() -> None:
    """A real TCPStore: the firing rank's line reaches a peer of its generation; a restart's
    board (the next generation) reads none; a store that is gone reads as none, not an error."""
    from datetime import timedelta

    import torch.distributed as dist

    from purrsight.distributed.hang_culprit import StepBoard
    from tests.helpers import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    firing, peer, restarted = (
        StepBoard("127.0.0.1", port, rank, 4, 0, generation) for rank, generation in ((2, 0), (0, 0), (0, 1))
    )
    assert peer.firing() is None
    firing.announce_firing("rank 2 (node 1) made no progress for 21 s; hang: rank 3 stopped answering")
    assert peer.firing() == "rank 2 (node 1) made no progress for 21 s; hang: rank 3 stopped answering"
    assert restarted.firing() is None
    del store  # the store's host is gone: said at once, not after the client's retries
    started = time.monotonic()
    assert peer.firing() is None
    assert time.monotonic() - started < 1.0


def test_a_rank_publishes_once_a_store_that_did_not_answer_comes() -> None:
    """A rank whose store is out of reach (its node cut off the network, the store's host gone)
    tries again at each heartbeat, without failing and without a TCPStore client while the port
    takes no connection (the client retries for its whole timeout, a C++ stack at each try: seen
    where the network is really cut, tests/faults/test_network_cut.py); once the store answers,
    its record arrives."""
    from datetime import timedelta

    import torch.distributed as dist

    from purrsight.distributed.hang_culprit import PUBLISH_S, StepBoard
    from tests.helpers import free_port

    port = free_port()
    board = StepBoard("127.0.0.1", port, 1, 2, 0, 0)
    clients: list[float] = []
    make_client = board._client
    board._client = lambda *args: clients.append(time.monotonic()) or make_client(*args)  # type: ignore[method-assign]
    board.moved(7, "backward")
    board.start()
    try:
        time.sleep(PUBLISH_S)  # a heartbeat with nothing on the port
        assert clients == []
        store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
        deadline = time.monotonic() + 3 * PUBLISH_S
        while not store.check([f"{board.prefix}1"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert '"step": 7' in store.get(f"{board.prefix}1").decode()
    finally:
        board.stop()


def test_a_failure_after_a_peers_firing_is_raised_as_the_hang() -> None:
    """train() turns a collective's failure into PeerHungError when the watchdog read a firing."""
    import pytest

    from purrsight.distributed.watchdog import ProgressWatchdog, raise_for_peer_firing, transport_failure
    from purrsight.errors import PeerHungError

    assert transport_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:26506"))
    assert not transport_failure(RuntimeError("CUDA error: an illegal memory access"))  # its own error, said as it is
    assert not transport_failure(KeyError("step"))
    watchdog = ProgressWatchdog(timeout_s=20)
    raise_for_peer_firing([watchdog], RuntimeError("Connection closed by peer"))  # none fired: nothing raised
    watchdog.peer_firing = "rank 2 (node 1) made no progress for 21 s; hang: rank 3 stopped answering"
    with pytest.raises(PeerHungError, match="rank 3 stopped answering"):
        raise_for_peer_firing([watchdog], RuntimeError("Connection closed by peer"))
