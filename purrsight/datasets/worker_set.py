"""Forked processes that each take one task at a time over a pipe of their own: prepare's pool.

Why not ``multiprocessing.Pool``: its workers share one task queue and one result queue, each
behind a process-shared lock. A SIGTERM to the process group (a scheduler's stop) that lands
while a worker holds one of them (taking its next task, posting a result) leaves it held
forever, and ``Pool.terminate`` waits for both (``_help_stuff_finish`` takes the task queue's,
the result sentinel needs the other's): a prepare stopped at that moment hung instead of ending.
A worker the kernel's OOM killer ends takes its task with it and ``imap`` waits for it forever.
Here no lock is shared: each worker has its own pipe, the parent alone reads and writes the
parent's ends, and a worker's end shows on its pipe (EOF) the moment it happens.

Stop signals are the parent's alone: workers start with SIGTERM and SIGINT blocked (no window in
which a fork still runs the parent's Python handler), then take SIGTERM's default (the parent
ends them with it, and a scheduler's SIGTERM to the group ends them at once) and ignore SIGINT
(a terminal's Ctrl-C reaches the whole group; the parent says so in one line, not N tracebacks).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Generic, TypeVar

Task = TypeVar("Task")
Result = TypeVar("Result")
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
END_GRACE_S = 10.0  # a worker SIGTERM has not ended by then (stuck in the kernel) gets SIGKILL


class WorkerLostError(RuntimeError):
    """A worker ended without answering: killed (the OOM killer, a user) or crashed in C code."""


@dataclass
class _Worker(Generic[Task]):
    process: BaseProcess
    pipe: Connection
    task: Task | None = None  # the task it holds; None while idle


def run_unordered(
    function: Callable[[Task], Result],
    tasks: Iterable[Task],
    processes: int,
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
    describe: Callable[[Task], str],
) -> Generator[Result, None, None]:
    """``function`` over ``tasks`` in ``processes`` forked workers, results as they finish.

    A task's exception is raised here (the others' workers are ended); ``describe`` names a task
    in the error when its worker ends without an answer. Leaving the iteration early (a stop
    signal's exception, an error, ``close()``) ends every worker before it returns.
    """
    queue = iter(tasks)
    context = multiprocessing.get_context("fork")
    workers: list[_Worker[Task]] = []
    try:
        for _ in range(processes):
            _start(context, function, initializer, initargs, workers)
        while True:
            for worker in (w for w in workers if w.task is None):
                if (task := next(queue, None)) is None:
                    break
                worker.task = task
                with contextlib.suppress(OSError):  # it ended while idle: its pipe reads EOF below, _answer says how
                    worker.pipe.send(task)
            busy = [w for w in workers if w.task is not None]
            if not busy:
                return
            ready = wait([w.pipe for w in busy])
            for worker in (w for w in busy if w.pipe in ready):
                yield _answer(worker, describe)
                worker.task = None
    finally:
        _end(workers)


def _start(
    context: Any,
    function: Callable[[Any], Any],
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
    workers: list[_Worker[Any]],
) -> None:
    """Fork one worker into ``workers``: listed before a stop held across the fork is let in, so
    the stop's exception (raised as the mask is restored) finds it and _end ends it."""
    ours, theirs = context.Pipe()
    process = context.Process(target=_serve, args=(theirs, function, initializer, initargs), daemon=True)
    # Blocked across the fork: a stop arriving now waits in the parent until the child is ours
    # to end, and never runs the parent's handler in the child.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        process.start()
        theirs.close()
        workers.append(_Worker(process, ours))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _answer(worker: _Worker[Task], describe: Callable[[Task], str]) -> Any:
    try:
        ok, value = worker.pipe.recv()
    except (EOFError, OSError):  # a reset (it died with our task unread), or an answer cut off mid-way
        worker.process.join()
        code = worker.process.exitcode or 0
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        if code == -signal.SIGKILL:
            how += " (often the kernel's OOM killer: fewer processes use less memory)"
        assert worker.task is not None
        raise WorkerLostError(f"the process working on {describe(worker.task)} {how}") from None
    if not ok:
        raise value
    return value


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal: no name in the enum
        return f"signal {number}"


def _serve(pipe: Connection, function: Callable[[Any], Any], initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    failed: Exception | None = None
    try:
        initializer(*initargs)
    except Exception as err:  # answered to every task: the parent raises it as the first task's error
        failed = err
    while True:
        try:
            task = pipe.recv()
        except EOFError:  # the parent is gone
            return
        if task is None:
            return
        try:
            if failed is not None:
                raise failed
            answer: tuple[bool, Any] = (True, function(task))
        except Exception as err:
            answer = (False, err)
        try:
            pipe.send(answer)
        except Exception as err:  # an answer pickle refuses: nothing was sent yet (send pickles first)
            pipe.send((False, RuntimeError(f"{answer[1]!r} (not sent whole: {err})")))


def _end(workers: list[_Worker[Any]]) -> None:
    """Idle workers are told to leave; busy ones (an early stop) get SIGTERM, then SIGKILL."""
    for worker in workers:
        if worker.task is None and worker.process.is_alive():
            with contextlib.suppress(OSError):  # already gone
                worker.pipe.send(None)
        else:
            worker.process.terminate()
    for worker in workers:
        worker.process.join(END_GRACE_S)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.pipe.close()
