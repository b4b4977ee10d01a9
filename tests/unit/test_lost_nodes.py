"""purrsight/launcher/lost_nodes.py: an elastic job's agent kills its workers once a node of the
running round has been missing from it (neither a participant nor waiting for the next round) for
CONFIRM_S, once per round; never for a node restarting its workers on its way to the next round,
a node missing for a moment, a round that only began, or a node in the exit barrier. The workers
here are real processes, each leading a session of its own as forked workers do (with a child
standing in for a loader process). CONFIRM_S is shortened to 0.2 s here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from purrsight.internals.torch_elastic import RoundView
from purrsight.launcher import lost_nodes
from purrsight.launcher.lost_nodes import LostNodeStop

THREE = {"10.0.0.1_11_0": "10.0.0.1", "10.0.0.2_12_0": "10.0.0.2", "10.0.0.3_13_0": "10.0.0.3"}
NODE_2 = "10.0.0.3_13_0"


CONFIRM_S = 0.2


@pytest.fixture(autouse=True)
def short_confirmation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lost_nodes, "CONFIRM_S", CONFIRM_S)


def view(round_: int, participants: dict[str, str], waiting: tuple[str, ...] = (), ending: bool = False) -> RoundView:
    return RoundView(round_, participants, frozenset([*participants, *waiting]), lambda: ending)


def without_node_2() -> dict[str, str]:
    return {node: address for node, address in THREE.items() if node != NODE_2}


def worker_with_a_loader() -> subprocess.Popen[bytes]:
    """A process in a session of its own, with a child (its 'loader') in the same process group."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def watching(workers: list[subprocess.Popen[bytes]]) -> LostNodeStop:
    stop = LostNodeStop()
    stop.checked(SimpleNamespace(workers=[SimpleNamespace(id=proc.pid) for proc in workers] + [SimpleNamespace(id=None)]))
    return stop


def test_a_node_missing_long_enough_kills_the_workers_and_their_loaders_once(capsys: pytest.CaptureFixture[str]) -> None:
    workers = [worker_with_a_loader(), worker_with_a_loader()]
    try:
        stop = watching(workers)
        stop(view(4, THREE))
        stop(view(4, THREE))  # every node still there: nothing
        stop(view(4, without_node_2()))  # missing: perhaps between two writes of a restart
        stop(view(4, without_node_2()))
        assert all(proc.poll() is None for proc in workers)
        time.sleep(CONFIRM_S)
        stop(view(4, without_node_2(), ending=True))  # missing long enough, but in the exit barrier
        assert all(proc.poll() is None for proc in workers)
        stop(view(4, without_node_2()))  # missing long enough: lost
        assert [proc.wait(timeout=10) for proc in workers] == [-9, -9]
        deadline = time.monotonic() + 10
        while any(group_alive(proc.pid) for proc in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(group_alive(proc.pid) for proc in workers)  # the loaders went with them
        stop(view(4, without_node_2()))  # the same round read again: said and done once
        err = capsys.readouterr().err
        assert err.count("torchrun: node(s) 10.0.0.3 stopped sending keep-alives and left rendezvous round 4: lost") == 1, err
    finally:
        for proc in workers:
            proc.kill()
            proc.wait()


def test_a_node_restarting_into_the_next_round_and_a_new_round_are_not_losses(capsys: pytest.CaptureFixture[str]) -> None:
    """A node that left the participants for the wait list (its workers restarting), at any number
    of reads; a node missing once and back; the round after a loss, smaller from its start."""
    worker = worker_with_a_loader()
    try:
        stop = watching([worker])
        stop(view(4, THREE))
        for _ in range(3):
            stop(view(4, without_node_2(), waiting=(NODE_2,)))
            time.sleep(CONFIRM_S)
        stop(view(4, without_node_2()))  # missing for a moment, between two writes
        stop(view(4, THREE))
        time.sleep(CONFIRM_S)
        stop(view(4, without_node_2()))  # missing again since it came back: not yet long
        two = dict(list(THREE.items())[:2])
        stop(view(5, two))
        time.sleep(CONFIRM_S)
        stop(view(5, two))
        assert worker.poll() is None and capsys.readouterr().err == ""
    finally:
        worker.kill()
        worker.wait()
