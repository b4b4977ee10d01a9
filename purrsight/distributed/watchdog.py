"""A step-progress watchdog: a rank that makes no progress dumps its stacks and exits.

Collective timeouts catch a peer that died, but not one that is alive and stuck (a
SIGSTOPped process, a deadlocked loader, a GPU that stopped answering): the others wait in
a collective for the whole process-group timeout, or forever in code outside one. Each
rank runs this thread; when no training step, validation batch or checkpoint has finished
for ``distributed.progress_timeout_s``, it names the culprit (hang_culprit.py: the ranks
the others wait for, from the progress every rank publishes to the job's store), writes
every thread's stack to the log (faulthandler) and exits with ExitCode.WATCHDOG, so torchrun
restarts the job or ends it. The culprit's line also goes to ``runs/<name>/hangs.log`` and,
on rank 0, into the attempt's record (the run report's attempts table).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from purrsight.distributed import flight_recorder
from purrsight.distributed.hang_culprit import LINGER_S, OBSERVE_S, StepBoard
from purrsight.errors import ExitCode, PeerHungError
from purrsight.run_folder import HANGS_LOG

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
    def __init__(
        self,
        timeout_s: float,
        run_dir: Path | None = None,
        generation: int = 0,
        on_fire: Callable[[str], None] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.run_dir = run_dir
        self.generation = generation
        self.on_fire = on_fire  # rank 0's attempt record takes the verdict
        self.poll_s = poll_s
        self.peers: dict[int, str] = {}  # node rank -> address, filled once the process group exists
        self.board: StepBoard | None = None
        self._last = time.monotonic()
        self._where = "start of training"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first_read: tuple[float, dict[int, Any]] | None = None  # (when, every rank's record) before a possible firing
        self.peer_firing: str | None = None  # another rank's watchdog fired, and this rank's training failed since

    def _progress(self, where: str, step: int, phase: str) -> None:
        self._last = time.monotonic()
        self._where = where
        if self.board is not None:
            self.board.moved(step, phase)

    def _verdict(self, rank: int) -> str:
        lost = unreachable_nodes(self.peers)
        if lost:
            return f"unreachable: {', '.join(lost)}"
        if self.board is None:
            return "every node answers: a rank is hung or stuck"
        return f"hang: {self.board.verdict(self._first_read)}"

    def _read_ahead(self, idle: float) -> None:
        """The verdict's first read of every record, taken OBSERVE_S before the timeout while idle,
        so that firing takes only the second read (no firing is delayed by the observation)."""
        if self.board is None or idle < self.timeout_s - OBSERVE_S:
            self._first_read = None  # progress since: a later firing reads afresh
            return
        if self._first_read is None:
            try:
                self._first_read = (time.monotonic(), self.board.read_all())
            except Exception as error:  # the store does not answer: the verdict says so when it fires
                log.debug("progress records not read ahead: %s", error)

    def _record(self, rank: int, line: str) -> None:
        if self.on_fire is not None:
            self.on_fire(f"watchdog: {line}")
        if self.run_dir is not None:
            try:
                with (self.run_dir / HANGS_LOG).open("a") as hangs:
                    hangs.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} seen by rank {rank}: {line}\n")
            except OSError as error:
                log.warning("could not write %s: %s", self.run_dir / HANGS_LOG, error)

    def _watch(self, rank: int) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            self._read_ahead(idle)
            if idle > self.timeout_s:
                verdict = self._verdict(rank)
                log.error(
                    "watchdog: rank %d made no progress for %.0f s (last: %s); %s. "
                    "Stacks of every thread of this process follow; exiting with code %d",
                    rank,
                    idle,
                    self._where,
                    verdict,
                    ExitCode.WATCHDOG,
                )
                self._record(rank, verdict)
                if self.run_dir is not None and self.board is not None:
                    dumped = flight_recorder.dump(self.run_dir, rank)
                    if dumped is not None:
                        log.error("watchdog: this rank's last collectives (flight recorder): %s", dumped)
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                if self.board is not None and "the job's store" not in verdict:  # not when the store is the trouble
                    node = self.board.mine.node
                    self.board.announce_firing(f"rank {rank} (node {node}) made no progress for {idle:.0f} s; {verdict}")
                if self.board is not None and self.board.hosts_store:
                    time.sleep(LINGER_S)  # the other ranks' watchdogs are reading the store this process hosts
                os._exit(ExitCode.WATCHDOG)  # no clean-up: it could block on the same stuck collective

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peers = node_addresses(trainer)
        self.board = StepBoard.for_this_process(trainer.global_rank, trainer.world_size, self.generation)
        if self.board is not None:
            self.board.start()
        self._progress("start of training", trainer.global_step, "start")
        self._thread = threading.Thread(target=self._watch, args=(trainer.global_rank,), name="progress-watchdog", daemon=True)
        self._thread.start()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._progress(f"training step {trainer.global_step + 1} started", trainer.global_step, "forward")

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._progress(f"training step {trainer.global_step + 1}, backward", trainer.global_step, "backward")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._progress(f"training step {trainer.global_step}", trainer.global_step, "step done")

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._progress(f"validation at step {trainer.global_step}", trainer.global_step, "validation")

    def on_save_checkpoint(self, trainer: pl.Trainer, *args: Any) -> None:
        self._progress(f"checkpoint at step {trainer.global_step}", trainer.global_step, "checkpoint")

    def _finish(self) -> None:
        self._stop.set()
        if self.board is not None:
            self.board.stop()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish()
        if self.board is not None and transport_failure(exception):
            self.peer_firing = self.board.firing()  # train() raises it as PeerHungError: one line, exit 86
            if self.peer_firing is not None:  # this rank's own error, in one line beside the hang's
                log.error(
                    "this rank's collective failed after another rank's watchdog fired: %s: %s", type(exception).__name__, exception
                )


# What a collective raises when a peer's process is gone: gloo's RuntimeError texts, NCCL's DistBackendError.
TRANSPORT_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def transport_failure(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective's failure because a peer went away (not this rank's own bug)."""
    import torch.distributed as dist

    if isinstance(exception, dist.DistBackendError):
        return True
    return isinstance(exception, RuntimeError) and any(text in str(exception) for text in TRANSPORT_FAILURES)


def raise_for_peer_firing(callbacks: list[pl.Callback], error: BaseException) -> None:
    """Raise PeerHungError when ``error`` followed another rank's watchdog firing (see ProgressWatchdog.on_exception)."""
    for callback in callbacks:
        if isinstance(callback, ProgressWatchdog) and callback.peer_firing is not None:
            raise PeerHungError(callback.peer_firing) from error
