"""A loader worker's start: the trainer's process-wide settings, which a worker forked from the
fork server (not from the trainer) does not inherit.

- stop signals left to the trainer (loader_fork_server.py says why), after torch's worker loop
  installed its SIGTERM handler: ignored, then released from the hold the worker was born with
  (one that arrived while the worker started is dropped, not fatal);
- our log format and the warnings we silence (cli.setup_logging): a worker's lines read like
  the trainer's;
- the seeds Lightning's own init function sets (it adds it only to loaders that have none): the
  same numbers, computed here (seed_like_lightning).

Two more travel by other ways: Pillow's pixel limit with the image decoder (it sets it again
when unpickled, media.py) and one intra-op thread, which torch's worker loop sets.
tests/unit/test_loader_workers.py looks inside a real worker for each.

The fork server preloads this module (training/datamodule.py): the init function is unpickled in
every worker, so whatever it imports each worker would import again. Lightning is not among it:
`lightning_fabric.utilities.seed` imports the whole of lightning_fabric (its loggers, torch._dynamo),
1.9 of the server's 3.4 CPU-seconds at each trainer's start, for three seeds (2026-11-28).
"""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import torch

from purrsight.cli import setup_logging
from purrsight.parent_death import die_with_parent, process_ended

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals() -> None:
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)


def hold_stop_signals() -> None:
    """Block both: a held signal waits (a blocked mask survives fork) until released."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def init_loader_worker(worker_id: int, rank: int, seed_workers: bool, trainer: int | None = None) -> None:
    # Killed with its fork server, which dies with the trainer (loader_fork_server.py). torch's own
    # check (its parent changed) missed a worker still starting when its server died (it took the
    # new parent for its manager), and one that noticed could wait at exit for good on its queue's
    # feeder thread, blocked on a full pipe: a SIGKILLed trainer left such workers behind (a fresh
    # clone's suite, 2026-11-28). So: the signal first, then whether the trainer is still there.
    die_with_parent()
    if trainer is not None and process_ended(trainer):  # a zombie trainer too: gone, not yet reaped
        os._exit(0)
    ignore_stop_signals()
    release_stop_signals()
    setup_logging()
    if seed_workers:
        seed_like_lightning(worker_id, rank)


_MASK_64 = (1 << 64) - 1


def seed_like_lightning(worker_id: int, rank: int) -> None:
    """torch's, Python's and NumPy's generators seeded as Lightning's ``pl_worker_init_function``
    seeds them (lightning_fabric 2.x; tests/unit/test_loader_workers.py compares the three states
    with Lightning's own over ranks, ids and seeds): a run keeps the augmentations it had.

    torch seeded the worker with the loader's base seed plus its id; the base, the id and the rank
    are mixed by MurmurHash3's finaliser, then an LCG (Knuth's multiplier) draws the seeds."""
    base_seed = torch.initial_seed() - worker_id
    mixed = (base_seed << 32) | (worker_id << 16) | rank
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        mixed ^= mixed >> 33
        mixed = (mixed * multiplier) & _MASK_64
    mixed ^= mixed >> 33
    seeds = []
    for _ in range(3):
        mixed = (mixed * 6364136223846793005 + 1) & _MASK_64
        seeds.append(mixed)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 32) | seeds[2])
    np.random.seed(np.random.SeedSequence([base_seed, worker_id, rank]).generate_state(4))
