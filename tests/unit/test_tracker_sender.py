"""The tracker's sender thread (purrsight/observability/tracker_sender.py): training never waits for it.

The "server" here is a function that fails, hangs or answers as each test needs; the real
MLflow server dying and coming back is tests/faults/test_tracker_outage.py.
"""

from __future__ import annotations

import threading
import time

from purrsight.observability.tracker_sender import BackgroundSender, Call


class Server:
    def __init__(self) -> None:
        self.up = threading.Event()
        self.received: list[int] = []

    def call(self, step: int) -> Call:
        def send() -> None:
            if not self.up.is_set():
                raise ConnectionError("connection refused")
            self.received.append(step)

        return Call(send, step)


def wait_until(condition, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_points_queued_during_an_outage_are_sent_in_order_once_the_server_is_back() -> None:
    server = Server()
    sender = BackgroundSender("test", retry_first_s=0.05)
    acknowledged: list[int] = []
    started = time.monotonic()
    for step in range(1, 101):
        call = server.call(step)
        call.on_sent = lambda step=step: acknowledged.append(step)  # type: ignore[misc]
        sender.put(call)
    assert time.monotonic() - started < 1.0  # queued, not sent: the caller never waited for the server
    assert wait_until(lambda: sender.failures >= 2) and server.received == []
    server.up.set()
    assert wait_until(lambda: len(server.received) == 100)
    assert server.received == acknowledged == list(range(1, 101))
    assert sender.close() == []


def test_a_full_queue_drops_the_oldest_and_counts_them_lost() -> None:
    server = Server()
    dropped: list[int | None] = []
    sender = BackgroundSender("test", capacity=10, retry_first_s=0.05, on_dropped=lambda call: dropped.append(call.step))
    for step in range(1, 31):
        sender.put(server.call(step))
    assert sender.lost.count == 20 and (sender.lost.first_step, sender.lost.last_step) == (1, 20)
    assert dropped == list(range(1, 21))  # handed back to be recorded as given up
    server.up.set()
    assert wait_until(lambda: len(server.received) == 10)
    assert server.received == list(range(21, 31))


def test_close_during_an_outage_gives_up_after_one_more_try_and_hands_back_what_is_left() -> None:
    server = Server()
    sender = BackgroundSender("test", retry_first_s=60)  # would wait a minute before its next try
    for step in (5, 6, 7):
        sender.put(server.call(step))
    assert wait_until(lambda: sender.failures >= 1)
    started = time.monotonic()
    left = sender.close(timeout_s=30)
    assert time.monotonic() - started < 5  # one more try, not the 30 s nor the minute's backoff
    assert [call.step for call in left] == [5, 6, 7] and sender.lost.count == 0
    assert not sender.put(server.call(8))  # closed: the caller keeps it (on disk, for the next attempt)


def test_close_waits_a_bounded_time_for_a_server_that_hangs() -> None:
    """A call that never returns (a server that accepts and never answers) holds only the sender's thread."""
    hang = threading.Event()
    sender = BackgroundSender("test")
    sender.put(Call(hang.wait, 1))
    sender.put(Call(lambda: None, 2))
    started = time.monotonic()
    left = sender.close(timeout_s=0.5)
    assert 0.4 < time.monotonic() - started < 3 and [call.step for call in left] == [1, 2]
    hang.set()


def test_queued_points_travel_together_and_other_calls_alone_in_order() -> None:
    """After an outage the queue drains in a few requests, not one per step."""
    requests: list[list[object]] = []
    up = threading.Event()

    def send_points(points: list[object], after_failure: bool) -> None:
        if not up.is_set():
            raise ConnectionError("connection refused")
        requests.append(points)

    sender = BackgroundSender("test", retry_first_s=0.05, send_points=send_points)
    acknowledged: list[int] = []
    for step in range(1, 251):
        sender.put(Call(lambda: None, step, lambda step=step: acknowledged.append(step), point=step))  # type: ignore[misc]
    ended: list[str] = []
    sender.put(Call(lambda: ended.append("run ended"), None))  # not a point: sent by itself, after them
    assert wait_until(lambda: sender.failures >= 1)
    up.set()
    assert wait_until(lambda: ended == ["run ended"])
    assert [len(points) for points in requests] == [100, 100, 50]
    assert [point for points in requests for point in points] == acknowledged == list(range(1, 251))


def test_points_sent_again_after_a_failure_are_marked_so_the_server_is_asked_first() -> None:
    """A request that failed may have reached the server anyway (it stored the points and the answer
    was lost): its retry says so, and the sender's client asks the server before sending again.
    The real server answering after the client gave up is tests/faults/test_tracker_outage.py."""
    tries: list[tuple[list[object], bool]] = []

    def send_points(points: list[object], after_failure: bool) -> None:
        tries.append((points, after_failure))
        if len(tries) == 1:
            raise TimeoutError("read timed out")

    sender = BackgroundSender("test", retry_first_s=0.05, send_points=send_points)
    sender.put(Call(lambda: None, 1, point=1))
    assert wait_until(lambda: len(tries) == 2)
    sender.put(Call(lambda: None, 2, point=2))
    assert wait_until(lambda: len(tries) == 3)
    assert tries == [([1], False), ([1], True), ([2], False)]  # only the retry asks
    assert sender.close() == []
