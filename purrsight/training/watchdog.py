"""A step-progress watchdog: a rank that makes no progress dumps its stacks and exits.

Collective timeouts catch a peer that died, but not one that is alive and stuck (a
SIGSTOPped process, a deadlocked loader, a GPU that stopped answering): the others wait in
a collective for the whole process-group timeout, or forever in code outside one. Each
rank runs this thread; when no training step, validation batch or checkpoint has finished
for ``distributed.progress_timeout_s``, it writes every thread's stack to the log
(faulthandler) and exits with ExitCode.WATCHDOG, so torchrun restarts the job or ends it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytorch_lightning as pl

from purrsight.errors import ExitCode, record_exit_code

log = logging.getLogger(__name__)


def reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether ``address`` answers at all: a refused connection is an answer, a silent one is not.

    Port 9 (discard) is almost never open, so a live host replies with a reset at once; a
    host behind a cut link or a dead node lets the connection attempt time out.
    """
    try:
        with socket.create_connection((address, 9), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def unreachable_nodes(peers: dict[int, str], timeout_s: float = 2.0) -> list[str]:
    """``node N (address)`` for each peer that does not answer, probed all at once.

    One at a time, a cut rack of 64 silent nodes would cost 64 timeouts before the verdict;
    in parallel the verdict takes one timeout whatever the node count.
    """
    if not peers:
        return []
    nodes = sorted(peers.items())
    with ThreadPoolExecutor(max_workers=min(len(nodes), 128), thread_name_prefix="watchdog-probe") as pool:
        answers = list(pool.map(lambda node: reachable(node[1], timeout_s), nodes))
    return [f"node {node} ({addr})" for (node, addr), answered in zip(nodes, answers, strict=True) if not answered]


def node_addresses(trainer: pl.Trainer) -> dict[int, str]:
    """{node rank: address} of the other nodes, as the launcher exported them (PURRSIGHT_NODE_ADDR)."""
    import torch.distributed as dist

    if trainer.world_size == 1 or not dist.is_initialized():
        return {}
    mine = (int(os.environ.get("GROUP_RANK", "0")), os.environ.get("PURRSIGHT_NODE_ADDR"))
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, mine)
    return {node: addr for node, addr in gathered if addr and node != mine[0]}


class ProgressWatchdog(pl.Callback):
    def __init__(self, timeout_s: float, poll_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.peers: dict[int, str] = {}  # node rank -> address, filled once the process group exists
        self._last = time.monotonic()
        self._where = "start of training"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _progress(self, where: str) -> None:
        self._last = time.monotonic()
        self._where = where

    def _watch(self, rank: int) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                lost = unreachable_nodes(self.peers)
                verdict = f"unreachable: {', '.join(lost)}" if lost else "every node answers: a rank is hung or stuck"
                log.error(
                    "watchdog: rank %d made no progress for %.0f s (last: %s); %s. "
                    "Stacks of every thread of this process follow; exiting with code %d",
                    rank,
                    idle,
                    self._where,
                    verdict,
                    ExitCode.WATCHDOG,
                )
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                record_exit_code(ExitCode.WATCHDOG)
                os._exit(ExitCode.WATCHDOG)  # no clean-up: it could block on the same stuck collective

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._progress("start of training")
        self.peers = node_addresses(trainer)
        self._thread = threading.Thread(target=self._watch, args=(trainer.global_rank,), name="progress-watchdog", daemon=True)
        self._thread.start()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._progress(f"training step {trainer.global_step}")

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._progress(f"validation at step {trainer.global_step}")

    def on_save_checkpoint(self, trainer: pl.Trainer, *args: Any) -> None:
        self._progress(f"checkpoint at step {trainer.global_step}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop.set()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop.set()
