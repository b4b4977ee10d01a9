"""Preloaded by the loader workers' fork server (training/datamodule.py): stop signals are the trainer's.

A preemption's SIGTERM and a terminal's Ctrl-C reach the whole process group: the fork server
and the loader workers too. A worker that died of it, or whose fork server did (torch's workers
exit when the process that forked them is gone), failed the trainer with "DataLoader worker
exited unexpectedly" before it could save its stop checkpoint. Imported in the fork server,
this module makes the server ignore both signals, and the workers it forks inherit that, except
for the SIGTERM handler torch's worker loop installs (ignore_stop_signals undoes it, as the
worker's init function); the trainer finishes its step, saves, and its exit ends them.

The fork server also holds (blocks) both signals, and its workers are born with them held:
between a worker's start and its init function torch's worker loop installs a SIGTERM handler
that ends the worker, and a preemption's SIGTERM in that window killed a worker that was still
starting. The init function ignores them first, then releases them, which discards a held one.

Nothing happens when any other process imports it: a trainer that ignored SIGTERM would never
checkpoint on a preemption.
"""

from __future__ import annotations

import signal
import traceback

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals() -> None:
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)


def hold_stop_signals() -> None:
    """Block both: a held signal waits (a blocked mask survives fork) until released."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _imported_by_the_fork_server() -> bool:
    return any(frame.filename.endswith("multiprocessing/forkserver.py") for frame in traceback.extract_stack())


if _imported_by_the_fork_server():
    ignore_stop_signals()
    hold_stop_signals()
