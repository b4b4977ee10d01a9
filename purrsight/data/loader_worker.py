"""A loader worker's start: the trainer's process-wide settings, which a worker forked from the
fork server (not from the trainer) does not inherit.

- stop signals left to the trainer (loader_fork_server.py says why), after torch's worker loop
  installed its SIGTERM handler: ignored, then released from the hold the worker was born with
  (one that arrived while the worker started is dropped, not fatal);
- our log format and the warnings we silence (cli.setup_logging): a worker's lines read like
  the trainer's;
- the seeds Lightning's own init function sets (it adds it only to loaders that have none).

Two more travel by other ways: Pillow's pixel limit with the image decoder (it sets it again
when unpickled, media.py) and one intra-op thread, which torch's worker loop sets.
tests/unit/test_loader_workers.py looks inside a real worker for each.

The fork server preloads this module and Lightning's seeding (training/datamodule.py): the
init function is unpickled in every worker, and importing Lightning there cost each worker
seconds of CPU.
"""

from __future__ import annotations

import signal

from lightning_fabric.utilities.seed import pl_worker_init_function

from purrsight.cli import setup_logging

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals() -> None:
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)


def hold_stop_signals() -> None:
    """Block both: a held signal waits (a blocked mask survives fork) until released."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def init_loader_worker(worker_id: int, rank: int, seed_workers: bool) -> None:
    ignore_stop_signals()
    release_stop_signals()
    setup_logging()
    if seed_workers:
        pl_worker_init_function(worker_id, rank)
