"""A graceful stop: SIGTERM/SIGINT (or an engine's relay) is recorded, and all ranks agree on it.

The checkpoint saver reads the agreed outcome at each step end, so every rank stops after
the same step and the checkpoint it writes holds that step on all of them.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import torch

log = logging.getLogger("purrsight.training.checkpoints")  # the saver's lines and these belong together


class StopRequest:
    """Records SIGTERM/SIGINT instead of dying mid-step; the saver acts on it at step end."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # Signal handlers live in the main thread only. An engine that runs training in
            # another thread (Ray Train) relays stops through request() instead.
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.request(signum)

    def request(self, signum: int) -> None:
        """Stop as if ``signum`` had arrived (safe from any thread)."""
        if self.signum is None:
            log.warning("received %s: finishing this step, then saving a checkpoint", signal.Signals(signum).name)
        self.signum = signum


class StopVote:
    """Whether any rank received a stop signal, agreed by all ranks one step late.

    Each step starts an all-reduce (MAX) of this rank's flag without waiting for it and
    reads the previous step's result, which has long arrived: every rank calls the same
    collectives in the same order and reaches the same decision at the same step. A
    blocking vote each step cost about 3% of a small model's step time (a second
    synchronisation point besides DDP's gradient all-reduce, bench/README.md).
    """

    def __init__(self) -> None:
        self._pending: tuple[Any, torch.Tensor] | None = None

    def exchange(self, local_stop: bool, device: torch.device) -> bool:
        """Start this step's vote; return the previous step's outcome (False at the first)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return local_stop
        previous = self.finish()
        flag = torch.tensor([int(local_stop)], device=device)
        work = torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        self._pending = (work, flag)
        return previous

    def finish(self) -> bool:
        """Wait for the vote in flight, if any; its outcome."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return bool(flag.item())
