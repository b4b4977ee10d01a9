"""The watchdog's verdict on which nodes are gone: every peer probed at once, real sockets where they can be."""

from __future__ import annotations

import threading

import pytest

from purrsight.distributed import watchdog
from purrsight.distributed.watchdog import reachable, unreachable_nodes


def test_a_refused_connection_is_an_answer() -> None:
    assert reachable("127.0.0.1", timeout_s=2.0)  # nothing listens on port 9 here: a reset comes back at once


def test_peers_are_probed_at_the_same_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fake probe waits for all the others: probed one by one, the barrier breaks and the test fails."""
    peers = {node: f"10.0.0.{node}" for node in range(1, 41)}
    barrier = threading.Barrier(len(peers), timeout=10)
    silent = {"10.0.0.7", "10.0.0.33"}

    def probe(address: str, timeout_s: float = 2.0) -> bool:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return True  # a sequential probe ends here, and no node is reported: the assertion below fails
        return address not in silent

    monkeypatch.setattr(watchdog, "reachable", probe)
    assert unreachable_nodes(peers) == ["node 7 (10.0.0.7)", "node 33 (10.0.0.33)"]


def test_no_peers_no_probe() -> None:
    assert unreachable_nodes({}) == []
