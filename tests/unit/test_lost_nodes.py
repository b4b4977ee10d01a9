"""purrsight/launcher/lost_nodes.py: an elastic job's agent kills its workers once a node of the
running round has left it for want of keep-alives, once per round, and never for a round that
only began. The workers here are real processes, each leading a session of its own as forked
workers do (with a child standing in for a loader process)."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from purrsight.launcher.lost_nodes import LostNodeStop

THREE = {"10.0.0.1_11_0": "10.0.0.1", "10.0.0.2_12_0": "10.0.0.2", "10.0.0.3_13_0": "10.0.0.3"}


def worker_with_a_loader() -> subprocess.Popen[bytes]:
    """A process in a session of its own, with a child (its 'loader') in the same process group."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def group_alive(pgid: int) -> bool:
    import os

    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_node_gone_from_the_running_round_kills_the_workers_and_their_loaders_once(capsys: pytest.CaptureFixture[str]) -> None:
    workers = [worker_with_a_loader(), worker_with_a_loader()]
    try:
        stop = LostNodeStop()
        stop.checked(SimpleNamespace(workers=[SimpleNamespace(id=proc.pid) for proc in workers] + [SimpleNamespace(id=None)]))
        stop(4, THREE)
        stop(4, THREE)  # every node still there: nothing
        assert all(proc.poll() is None for proc in workers)
        without_node_2 = {node: address for node, address in THREE.items() if address != "10.0.0.3"}
        stop(4, without_node_2)
        assert [proc.wait(timeout=10) for proc in workers] == [-9, -9]
        deadline = time.monotonic() + 10
        while any(group_alive(proc.pid) for proc in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(group_alive(proc.pid) for proc in workers)  # the loaders went with them
        stop(4, without_node_2)  # the same round read again: said and done once
        err = capsys.readouterr().err
        assert err.count("torchrun: node(s) 10.0.0.3 stopped sending keep-alives and left rendezvous round 4: lost") == 1, err
    finally:
        for proc in workers:
            proc.kill()
            proc.wait()


def test_a_new_round_with_fewer_nodes_is_not_a_loss(capsys: pytest.CaptureFixture[str]) -> None:
    """The round after a loss starts with the nodes left: compared with its own first read, not the last round's."""
    worker = worker_with_a_loader()
    try:
        stop = LostNodeStop()
        stop.checked(SimpleNamespace(workers=[SimpleNamespace(id=worker.pid)]))
        stop(4, THREE)
        two = dict(list(THREE.items())[:2])
        stop(5, two)
        stop(5, two)
        assert worker.poll() is None and capsys.readouterr().err == ""
    finally:
        worker.kill()
        worker.wait()
