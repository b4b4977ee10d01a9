"""Name the rank a hang waits for, from the step every rank publishes to the job's store.

The ranks waiting in a collective cannot tell which rank never arrived, and the stuck rank
cannot speak for itself. So each rank publishes, from a thread of its own, a ``RankStep``:
the last step it finished, the phase it is in and a heartbeat. A watchdog that fires reads
every record twice, ``OBSERVE_S`` apart, and names the ranks whose heartbeat did not move
(frozen, or their node is gone), else the ranks furthest behind (alive but stuck).

Ages are measured on one clock each (a heartbeat's movement on the reader's, a phase's age on
the writer's): hosts' clocks disagree. The store is the process group's, reached through
connections of our own with a short timeout; its host lingers ``LINGER_S`` after its own
watchdog fires so the others can still read it. docs/OBSERVABILITY.md, "Hangs".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from purrsight.distributed.process_group import hosts_the_store

log = logging.getLogger(__name__)

PUBLISH_S = 2.0  # the heartbeat: a small store write per rank every 2 s, and on progress...
MIN_INTERVAL_S = 0.5  # ...at most every 0.5 s (2,048 writes/s for 1,024 ranks, a fraction of what a TCPStore serves)
OBSERVE_S = 3 * PUBLISH_S  # a heartbeat that does not move in this long: the process stopped answering
STORE_TIMEOUT_S = 10.0
LINGER_S = STORE_TIMEOUT_S  # the store's host stays this long after its watchdog fires (the others' second read)
FIRING_READ_S = 2.0  # a failed rank asks whether a watchdog fired: a short wait on its way out
PHASES = ("start", "forward", "backward", "step done", "validation", "checkpoint")


@dataclass
class RankStep:
    rank: int
    node: int
    host: str
    step: int  # the last training step this rank finished
    phase: str  # one of PHASES: where it is now
    phase_at: float  # when it entered that phase (Unix time)
    beat: float = 0.0  # when it last published (Unix time)


def rank_ranges(ranks: list[int]) -> str:
    """0,1,2,4,6,7 -> '0-2,4,6-7'."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _position(progress: RankStep) -> tuple[int, int]:
    """How far a rank got: steps finished, then the phase within the next step."""
    order = {"start": 0, "forward": 1, "backward": 2, "step done": 3, "validation": 4, "checkpoint": 4}
    # "step done" is the same place as the next step's beginning: count it as step + 1, before forward.
    if progress.phase == "step done":
        return progress.step + 1, 0
    return progress.step + 1, order.get(progress.phase, 0)


def _where(progress: RankStep) -> str:
    if progress.phase in ("step done", "start"):
        return f"after step {progress.step}"
    return (
        f"in step {progress.step + 1} ({progress.phase})" if progress.phase in ("forward", "backward") else f"in {progress.phase}"
    )


def _rank_name(progress: RankStep) -> str:
    return f"rank {progress.rank} (node {progress.node}, {progress.host})"


def _waiting(ranks: list[int], where: str) -> str:
    return f"rank {ranks[0]} waits {where}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)} wait {where}"


def culprit_line(before: dict[int, RankStep | None], after: dict[int, RankStep | None], world_size: int, window_s: float) -> str:
    """One line naming the ranks a hang waits for, and where the others wait, from every rank's
    record read twice, ``window_s`` apart (by the reader's clock)."""
    records = {rank: after.get(rank) or before.get(rank) for rank in range(world_size)}
    missing = [rank for rank in range(world_size) if records[rank] is None]
    known = [record for record in records.values() if record is not None]
    stale = [record for record in known if (earlier := before.get(record.rank)) is not None and earlier.beat == record.beat]
    if stale:
        culprits = stale
    elif known:
        behind = min(_position(record) for record in known)
        culprits = [record for record in known if _position(record) == behind] if len(known) > 1 else []
        if len({_position(record) for record in known}) == 1:
            culprits = []  # all at the same place: nobody is behind
    else:
        culprits = []
    parts = []
    for record in sorted(culprits, key=lambda r: r.rank):
        in_phase = record.beat - record.phase_at  # both on the writer's clock
        finished = f"{_rank_name(record)} last finished training step {record.step}"
        if record in stale:
            parts.append(
                f"{finished}, {in_phase:.0f} s before its last heartbeat, "
                f"and stopped answering (no heartbeat for {window_s:.0f} s: frozen, or its node is gone)"
            )
        else:
            parts.append(f"{finished}, {in_phase:.0f} s ago, and is still {_where(record)}")
    if missing:
        parts.append(f"rank(s) {rank_ranges(missing)} published no step")
    others = [record for record in known if record not in culprits]
    groups: dict[str, list[int]] = {}
    for record in others:
        groups.setdefault(_where(record), []).append(record.rank)
    waits = "; ".join(_waiting(ranks, where) for where, ranks in sorted(groups.items()))
    if not parts:
        return f"no rank is behind: {waits}" if waits else "no rank published a step"
    return "; ".join(parts) + (f"; {waits}" if waits else "")


class StepBoard:
    """This rank's progress, published to the job's store by a thread; and every rank's, read back."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, node: int, generation: int) -> None:
        self.address = (host, port)
        self.rank, self.world_size = rank, world_size
        self.prefix = f"purrsight/rank-steps/{generation}/"  # a restart's ranks do not read the last one's
        self.fired_key = f"purrsight/watchdog-fired/{generation}"
        self.hosts_store = hosts_the_store(os.environ)
        self.mine = RankStep(rank=rank, node=node, host=socket.gethostname(), step=0, phase="start", phase_at=time.time())
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_this_process(cls, rank: int, world_size: int, generation: int) -> StepBoard | None:
        """A board on the store at MASTER_ADDR:MASTER_PORT, or None for one process or no such store."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world_size < 2 or not host or not port:
            return None
        node = int(os.environ.get("GROUP_RANK", os.environ.get("PURRSIGHT_NODE_RANK", "0")))
        return cls(host, int(port), rank, world_size, node, generation)

    def _client(self, timeout_s: float = STORE_TIMEOUT_S) -> Any:
        import torch.distributed as dist

        host, port = self.address
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)

    def moved(self, step: int, phase: str) -> None:
        """Called by the training thread: only attributes are set, the publisher thread sends them."""
        self.mine.step, self.mine.phase, self.mine.phase_at = step, phase, time.time()
        self._changed.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._publish, name="step-publisher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    def _publish(self) -> None:
        store = None
        while True:
            try:
                # A new connection only where the port takes one: the client's own retries log a C++
                # stack each, for its whole timeout, at every heartbeat of a node cut off the network.
                if store is None and self._answers():
                    store = self._client()
                if store is not None:
                    self.mine.beat = time.time()
                    store.set(f"{self.prefix}{self.rank}", json.dumps(asdict(self.mine)))
            except Exception as error:  # a store that stopped answering: try again next time, never crash training
                log.debug("progress not published: %s", error)
                store = None
            if self._stop.wait(MIN_INTERVAL_S):
                return
            self._changed.wait(PUBLISH_S - MIN_INTERVAL_S)  # progress wakes it early: the record lags by 0.5 s at most
            self._changed.clear()
            if self._stop.is_set():
                return

    def _try_connecting(self) -> None:
        """Raises OSError where the store's port does not take a connection now (one attempt,
        FIRING_READ_S at most): the TCPStore client retries a refused or unreachable address with
        backoff for its whole timeout, and logs each try's C++ stack."""
        with socket.create_connection(self.address, timeout=FIRING_READ_S):
            pass

    def _answers(self) -> bool:
        try:
            self._try_connecting()
            return True
        except OSError:
            return False

    def announce_firing(self, line: str) -> None:
        """Say in the store that this rank's watchdog fired, and why: its peers, whose collectives
        then fail, report the hang instead of the transport's error. Best effort, one short try."""
        try:
            if self._answers():
                self._client(FIRING_READ_S).set(self.fired_key, line)
        except Exception as error:  # the store is gone or frozen: the peers report their own error
            log.debug("watchdog firing not announced: %s", error)

    def firing(self) -> str | None:
        """The line a rank's watchdog announced in this generation, or None (none fired, or no store)."""
        try:
            if not self._answers():
                return None
            store = self._client(FIRING_READ_S)
            return bytes(store.get(self.fired_key)).decode() if store.check([self.fired_key]) else None
        except Exception as error:
            log.debug("watchdog firing not read: %s", error)
            return None

    def read_all(self) -> dict[int, RankStep | None]:
        """Every rank's last record; raises when the store does not answer."""
        self._try_connecting()
        store = self._client()
        keys = [f"{self.prefix}{rank}" for rank in range(self.world_size)]
        present = [key for key in keys if store.check([key])]
        values = dict(zip(present, store.multi_get(present), strict=True)) if present else {}
        return {
            rank: RankStep(**json.loads(bytes(values[key]).decode())) if key in values else None for rank, key in enumerate(keys)
        }

    def verdict(self, first_read: tuple[float, dict[int, RankStep | None]] | None = None) -> str:
        """The culprit line, from two reads of every record at least ``OBSERVE_S`` apart: ``first_read``
        (when, by time.monotonic(), and what; a watchdog takes it before it fires) and one now;
        without one, this call reads, waits ``OBSERVE_S`` and reads again."""
        try:
            if first_read is None:
                first_read = (time.monotonic(), self.read_all())
            read_at, before = first_read
            time.sleep(max(0.0, read_at + OBSERVE_S - time.monotonic()))
            after = self.read_all()
        except Exception as error:
            host, port = self.address
            where = f"the job's store at {host}:{port}, hosted by the training process torchrun made rank 0 on node 0,"
            if "refused" in str(error).lower():
                return f"{where} is gone: that process exited (its own log says why)"
            reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
            return f"{where} does not answer ({reason}): that process is frozen, node 0 is gone, or this node's network is cut"
        return culprit_line(before, after, self.world_size, OBSERVE_S)
