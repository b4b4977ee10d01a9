"""A tracker's network calls on a thread of their own: a slow or dead server never holds training.

The training thread only queues (never blocks, never raises). The sender thread sends in
order; queued points travel together, up to ``BATCH_LIMIT`` in one request (after an outage the
queue drains in a few requests, not one per step); a failed call is retried with our own backoff (the tracker
client's retries are turned off: MLflow's run for minutes on the calling thread). A failed
request may still have reached the server (it stored the points, then the answer was lost or
came after the client gave up), so ``send_points`` is told when it sends points again after a
failure: it asks the server what it holds first. A call counts as sent when it returned, and
only then does ``on_sent`` run. The queue is bounded: in a long outage the oldest points give way
(``on_dropped`` names them). What is still queued when the sender closes is handed back to the
caller, which keeps it on disk for the next attempt (trackers.py, tracker_journal.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

CAPACITY = 20_000  # queued calls; at one call per logged step, hours of a typical run's logging
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 30.0
CLOSE_TIMEOUT_S = 10.0  # the most a run's end waits for a reachable server to take what is queued
WARN_EVERY_N_FAILURES = 20  # a server down for hours must not flood the log
BATCH_LIMIT = 100  # points per request: a few metrics each, well inside MLflow's 1,000 per log_batch


@dataclass
class Call:
    send: Callable[[], None]
    step: int | None  # the training step it carries, for the log and the lost-points record
    on_sent: Callable[[], None] | None = None
    point: Any = None  # a point's payload: queued neighbours go together through the sender's send_points


@dataclass
class Tally:
    """A count of points and the steps they span, for the log, ``trackers.json`` and the report."""

    count: int = 0
    first_step: int | None = None
    last_step: int | None = None

    def add(self, step: int | None) -> None:
        self.count += 1
        self._widen(step)

    def add_all(self, other: Tally) -> None:
        self.count += other.count
        self._widen(other.first_step)
        self._widen(other.last_step)

    def _widen(self, step: int | None) -> None:
        if step is not None:
            self.first_step = step if self.first_step is None else min(self.first_step, step)
            self.last_step = step if self.last_step is None else max(self.last_step, step)

    def as_dict(self) -> dict[str, int | None]:
        return {"count": self.count, "first_step": self.first_step, "last_step": self.last_step}

    def __str__(self) -> str:
        steps = f" (steps {self.first_step}-{self.last_step})" if self.first_step is not None else ""
        return f"{self.count} point{'s' if self.count != 1 else ''}{steps}"


class BackgroundSender:
    def __init__(
        self,
        name: str,
        capacity: int = CAPACITY,
        retry_first_s: float = RETRY_FIRST_S,
        send_points: Callable[[list[Any], bool], None] | None = None,
        on_dropped: Callable[[Call], None] | None = None,
    ) -> None:
        self.name = name
        # Sends several points' payloads in one request; its flag: the last try failed, so the
        # server may hold some of them already.
        self.send_points = send_points
        self.on_dropped = on_dropped  # a call the overflow gave up (runs on the caller's thread)
        self.capacity = capacity
        self.retry_first_s = retry_first_s
        self.lost = Tally()  # calls the overflow gave up
        self.failures = 0
        self._queue: deque[Call] = deque()
        self._changed = threading.Condition()
        self._closing = False
        self._close_requested = threading.Event()  # ends a retry's wait early (new points do not)
        self._failing = False  # the last call failed: the server is unreachable now
        self._tried_since_close = False  # a call was tried (and failed) after close() began
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def put(self, call: Call) -> bool:
        """Queue a call; returns at once, False after close() (not queued). Full: the oldest queued
        call gives way (counted in ``lost``, handed to ``on_dropped``)."""
        dropped = None
        with self._changed:
            if self._closing:
                return False
            if len(self._queue) >= self.capacity:
                dropped = self._queue.popleft()
                self.lost.add(dropped.step)
            self._queue.append(call)
            self._changed.notify_all()
        if dropped is not None and self.on_dropped is not None:
            self.on_dropped(dropped)
        return True

    def pending(self) -> int:
        with self._changed:
            return len(self._queue)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> list[Call]:
        """Wait (at most ``timeout_s``) for the queue to be sent; returns the calls left unsent, in order.

        A server already failing gets one more try of the call at the head, not the whole wait:
        a stop during an outage (a preemption's grace period) ends as promptly as without a tracker.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._closing = True
            self._close_requested.set()
            self._changed.notify_all()
            while self._queue and time.monotonic() < deadline and not (self._failing and self._tried_since_close):
                self._changed.wait(timeout=max(0.0, deadline - time.monotonic()))
            left = list(self._queue)
            self._queue.clear()
            self._changed.notify_all()
        return left

    def _next_calls(self) -> list[Call]:
        """The head of the queue: one call, or the run of points at its head (lock held)."""
        head = self._queue[0]
        if head.point is None or self.send_points is None:
            return [head]
        calls: list[Call] = []
        for call in self._queue:
            if call.point is None or len(calls) == BATCH_LIMIT:
                break
            calls.append(call)
        return calls

    def _send(self, calls: list[Call], after_failure: bool) -> None:
        if calls[0].point is not None and self.send_points is not None:
            self.send_points([call.point for call in calls], after_failure)
        else:
            calls[0].send()

    def _run(self) -> None:
        backoff = self.retry_first_s
        while True:
            with self._changed:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if not self._queue:
                    return
                calls = self._next_calls()
                after_failure = self._failing
            try:
                self._send(calls, after_failure)
            except Exception as error:  # any failure of the tracker client: retried, never raised into training
                self._note_failure(calls[0], error)
                with self._changed:
                    self._failing = True
                    self._tried_since_close = self._closing
                    self._changed.notify_all()
                self._close_requested.wait(timeout=backoff)  # close() ends the wait for one last try
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            backoff = self.retry_first_s
            with self._changed:
                for call in calls:
                    if self._queue and self._queue[0] is call:  # not dropped by an overflow while it was sent
                        self._queue.popleft()
                if self._failing:
                    log.info("%s: reachable again; sending the %d queued calls", self.name, len(self._queue) + len(calls))
                self._failing = False
                self._changed.notify_all()
            for call in calls:
                if call.on_sent is not None:
                    call.on_sent()

    def _note_failure(self, call: Call, error: Exception) -> None:
        if self.failures % WARN_EVERY_N_FAILURES == 0:
            log.warning(
                "%s: could not send step %s (%s: %s); training goes on, %d calls queued and retried "
                "(metrics/metrics.csv keeps every point)",
                self.name,
                call.step,
                type(error).__name__,
                str(error)[:200],
                self.pending(),
            )
        self.failures += 1
