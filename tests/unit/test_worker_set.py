"""prepare's worker set (purrsight/datasets/worker_set.py): real forked processes, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil
import pytest

from purrsight.datasets.worker_set import WorkerLostError, run_unordered
from purrsight.errors import UserError


def _nothing() -> None:
    pass


def _square(n: int) -> int:
    return n * n


def _refuse(n: int) -> int:
    if n == 3:
        raise UserError("sample 3 is bad", problems=["a.jsonl:3: bad", "a.jsonl:4: bad"])
    return n


def _die_on(n: int) -> int:
    if n == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
    time.sleep(0.05)
    return n


def _broken_start() -> None:
    raise UserError("no tokenizer in /nowhere")


def _pid(_: int) -> int:
    time.sleep(0.2)
    return os.getpid()


_BEFORE: set[int] = set()  # this process's children when the test began: a session's fork servers, not ours


@pytest.fixture(autouse=True)
def _children_before() -> None:
    _BEFORE.clear()
    _BEFORE.update(c.pid for c in psutil.Process().children())


def _children() -> list[psutil.Process]:
    """The live children the test made: its workers."""
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.pid not in _BEFORE and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
    return found


@pytest.mark.parametrize(("tasks", "processes"), [(7, 3), (2, 5), (1, 1), (0, 2)])
def test_every_task_answers_once_whatever_the_counts(tasks: int, processes: int) -> None:
    got = list(run_unordered(_square, range(tasks), processes, _nothing, (), str))
    assert sorted(got) == [n * n for n in range(tasks)]
    assert _children() == []


def test_a_task_error_arrives_whole_in_the_parent_and_ends_the_others() -> None:
    with pytest.raises(UserError) as raised:
        list(run_unordered(_refuse, range(8), 2, _nothing, (), str))
    assert raised.value.lines() == ["a.jsonl:3: bad", "a.jsonl:4: bad"]
    assert _children() == []


def test_a_start_error_is_raised_as_the_first_task_error() -> None:
    with pytest.raises(UserError, match="no tokenizer in /nowhere"):
        list(run_unordered(_square, range(4), 2, _broken_start, (), str))


def test_a_worker_killed_mid_task_is_named_instead_of_waited_for() -> None:
    """multiprocessing.Pool lost the task of a worker the OOM killer ended and waited forever."""
    started = time.monotonic()
    with pytest.raises(WorkerLostError, match=r"working on task 2 was killed by SIGKILL \(often the kernel's OOM killer"):
        list(run_unordered(_die_on, range(6), 2, _nothing, (), lambda n: f"task {n}"))
    assert time.monotonic() - started < 10
    assert _children() == []


def test_leaving_early_ends_every_worker_at_once() -> None:
    results = run_unordered(_pid, range(50), 3, _nothing, (), str)
    first = next(results)
    workers = [psutil.Process(c.pid) for c in _children()]
    assert first in {w.pid for w in workers} and len(workers) == 3
    started = time.monotonic()
    results.close()  # what a stop signal's exception in the parent does
    assert time.monotonic() - started < 5 and _children() == []


def test_workers_die_of_sigterm_and_ignore_sigint_whatever_the_parents_handlers() -> None:
    """A forked worker inherits the parent's Python handlers; a scheduler's SIGTERM to the group
    must end it at once (not run the parent's stop handler inside it) and a terminal's Ctrl-C
    must leave it to the parent."""
    ran_in: list[int] = []
    previous = {sig: signal.signal(sig, lambda *_: ran_in.append(os.getpid())) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        results = run_unordered(_pid, range(40), 2, _nothing, (), lambda n: f"task {n}")
        next(results)
        first, second = _children()
        first.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert first.is_running() and first.status() != psutil.STATUS_ZOMBIE
        second.send_signal(signal.SIGTERM)
        with pytest.raises(WorkerLostError, match="was killed by SIGTERM"):
            list(results)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert ran_in == [] and _children() == []


def test_every_worker_killed_while_taking_tasks_still_ends_within_seconds() -> None:
    """multiprocessing.Pool's shape of prepare's hang: workers SIGTERMed while they pass tiny tasks
    through the shared queues; Pool.terminate() then hung on a lock a dead worker held (3 of 5
    tries here, by the same steps). Five tries, each must end."""
    for _ in range(5):
        results = run_unordered(_square, range(100_000), 2, _nothing, (), str)
        next(results)
        for worker in _children():
            worker.send_signal(signal.SIGTERM)
        started = time.monotonic()
        with pytest.raises(WorkerLostError, match="killed by SIGTERM"):
            list(results)
        assert time.monotonic() - started < 5 and _children() == []
