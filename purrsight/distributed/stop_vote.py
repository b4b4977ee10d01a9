"""A graceful stop: SIGTERM/SIGINT (or an engine's relay) is recorded, and all ranks agree on it.

The checkpoint saver reads the agreed outcome at each step end, so every rank stops after
the same step and the checkpoint it writes holds that step on all of them.
"""

from __future__ import annotations

import logging
import signal
import threading
from datetime import timedelta
from types import FrameType
from typing import Any

import torch

log = logging.getLogger("purrsight.runs.checkpoint_saver")  # the saver's lines and these belong together


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
    synchronisation point besides DDP's gradient all-reduce, bench/results/launch.md).

    The flag lives in host memory and travels over gloo (the default group when it is gloo, a
    gloo side group beside NCCL): reading a flag reduced on the GPU would make the host wait
    for every kernel queued before it, each step, and the host could never run ahead.
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.timeout = timeout  # the job's collective timeout (distributed.timeout_s), not torch's 30 minutes
        self._group: Any = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._outcome = self._flag.numpy()  # a view of the same host memory, read without torch
        self._pending: Any = None

    def setup(self) -> None:
        """Create the gloo group; every rank calls this at the same point (train start)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or self._group is not None:
            return
        self._group = vote_group(torch.distributed.get_backend(), self.timeout)

    def exchange(self, local_stop: bool) -> bool:
        """Start this step's vote; return the previous step's outcome (False at the first)."""
        if self._group is None:
            return local_stop
        previous = self.finish()
        self._outcome[0] = int(local_stop)  # the previous vote is done with the buffer
        self._pending = torch.distributed.all_reduce(
            self._flag, op=torch.distributed.ReduceOp.MAX, group=self._group, async_op=True
        )
        return previous

    def finish(self) -> bool:
        """Wait for the vote in flight, if any; its outcome."""
        if self._pending is None:
            return False
        self._pending.wait()
        self._pending = None
        return bool(self._outcome[0])


def vote_group(default_backend: str, timeout: timedelta | None) -> Any:
    """The group the stop vote runs in: the default one when it is gloo (its timeout is the job's,
    set when the process group started), else a new gloo group with the job's timeout."""
    if default_backend == "gloo":
        return torch.distributed.group.WORLD
    return torch.distributed.new_group(backend="gloo", timeout=timeout)
