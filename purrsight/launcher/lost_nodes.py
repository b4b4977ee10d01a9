"""An elastic job's agent stops its workers once a node of the running round goes silent.

A node that dies without closing its connections (its power, its kernel, its cable) leaves the
others' workers waiting in a collective until it times out (``distributed.timeout_s``) or their
watchdog fires (``distributed.progress_timeout_s``): 30 min by default. Their agents know within
seconds: a node that sent no keep-alive for ``keep_alive_interval`` x ``keep_alive_max_attempt``
(1 s x 3 in an elastic job, cluster_train.sh) is dropped from the round's participants at their
next read of the rendezvous state (torchelastic's ``_sanitize``), though torchelastic itself acts
on it only at the next rendezvous. Here, the agent's poll a second after the drop kills its workers
(SIGKILL: stuck in a collective with the lost node, they could neither finish their step nor save),
so the agent restarts them into a round without that node at once, and they resume from the last
checkpoint with the global batch kept, as after a node lost with its connections reset.

Only elastic jobs (MIN < MAX): a fixed-size job cannot meet again without the node anyway.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from purrsight.internals.torch_elastic import RoundView

CONFIRM_S = 1.0  # missing this long: more than a node restarting takes between its two writes


class LostNodeStop:
    """``on_round`` and ``on_checked`` for purrsight.internals.torch_elastic's watchers.

    A node counts as lost once it has been missing from the round (neither a participant nor
    waiting for the next) for ``CONFIRM_S`` by this agent's clock: a node restarting its workers
    is missing only between two of its writes, a lost one stays missing. Not while a node is in
    the round's exit barrier: its keep-alives stop there (the barrier's wait holds the store's
    client) while the others finish their last step's work, rank 0's report among it."""

    def __init__(self) -> None:
        self.first_seen: dict[int, dict[str, str]] = {}  # round -> its participants at this agent's first read
        self.missing_since: dict[int, dict[str, float]] = {}  # round -> node -> when first read missing
        self.stopped_rounds: set[int] = set()
        self.worker_pids: list[int] = []

    def checked(self, worker_group: Any) -> None:
        """The agent's workers, from its last check of them."""
        self.worker_pids = [worker.id for worker in worker_group.workers if isinstance(worker.id, int)]

    def __call__(self, view: RoundView) -> None:
        round_, now = view.round, time.monotonic()
        first = self.first_seen.setdefault(round_, view.participants)
        since = self.missing_since.setdefault(round_, {})
        for node in first:
            if node in view.present:
                since.pop(node, None)
            else:
                since.setdefault(node, now)
        lost = {node for node, when in since.items() if now - when >= CONFIRM_S}
        if not lost or round_ in self.stopped_rounds or view.ending():
            return
        self.stopped_rounds.add(round_)
        gone = sorted({first[node] for node in lost})
        print(
            f"torchrun: node(s) {', '.join(gone)} stopped sending keep-alives and left rendezvous round {round_}: "
            "lost; stopping this node's workers (SIGKILL) to meet again without them",
            file=sys.stderr,
            flush=True,
        )
        for pid in self.worker_pids:
            kill_worker(pid)


def kill_worker(pid: int) -> None:
    """SIGKILL a worker and, where it leads a process group of its own (forked workers start a
    session each: purrsight/launcher/forked_workers.py), its loader processes with it."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # ended meanwhile
        pass
