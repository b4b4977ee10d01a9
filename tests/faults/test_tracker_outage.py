"""A tracker server that dies mid-run, comes back, or answers too late: training never waits for it,
and every point reaches it once (real parts).

A real ``mlflow server`` in its own process group, SIGKILLed as a whole (the server and its
workers, as when its machine dies), then started again on the same store and port (mid-attempt
too: the server killed then restarted while one attempt trains is the last attempt of the
three-attempt test, merged there as it only added checks to a run that test already makes). The trainer
is the tiny default in one process, every step logged. Three tests drive the MLflow logger in
this process instead of a trainer, where the case is one call of it: Lightning's call on an
error in training, a request whose answer a loopback relay holds back, and a start with points
left while the relay slows every answer.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from purrsight.observability.tracker_journal import QUEUE_DIR, QueuedPoint
from purrsight.observability.trackers import RunMLflowLogger
from tests.helpers import DEFAULT_CONFIG, REPO, free_port, hold_env, python_env, tiny_config, tiny_overrides
from tests.launcher.conftest import wait_for
from tests.mlflow_server import kill_server, start_mlflow

EVERY = 10  # checkpoints in the test of three attempts: a kill redoes at most 10 steps
LAST = 200  # that test's last step


def start_training(
    synthetic_dir: Path,
    out: Path,
    uri: str,
    steps: int,
    log_name: str = "trainer.log",
    resume: bool = False,
    env: dict[str, str] | None = None,
    **extra: object,
) -> tuple[subprocess.Popen[str], Path]:
    log = out / log_name
    out.mkdir(parents=True, exist_ok=True)
    settings: dict[str, object] = {"checkpoint__every_n_steps": 50, **extra}
    overrides = tiny_overrides(
        synthetic_dir, out, trainer__max_steps=steps, logging__every_n_steps=1, trainer__val_every_n_steps=1000,
        logging__mlflow_tracking_uri=uri, logging__mlflow_experiment="outage", **settings,
    )  # fmt: skip
    command = [sys.executable, str(REPO / "train_phase2.py"), "--config", str(DEFAULT_CONFIG), *overrides]
    with log.open("w") as sink:
        trainer = subprocess.Popen(
            command + (["--resume"] if resume else []),
            cwd=REPO, env={**python_env(), "OMP_NUM_THREADS": "1", **(env or {})}, stdout=sink, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
    return trainer, log


def at_step(log: Path, step: int) -> bool:
    return f"step {step}/" in log.read_text(errors="replace")


def steps_on_server(uri: str, experiment: str = "outage") -> tuple[list[int], str]:
    """The steps of ``train/loss`` the server holds (repeats included), and the run's status."""
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment} on the server"
    (run,) = client.search_runs([found.experiment_id])
    return [point.step for point in client.get_metric_history(run.info.run_id, "train/loss")], run.info.status


def missing_or_repeated(steps: list[int], last: int) -> str:
    return f"missing {sorted(set(range(1, last + 1)) - set(steps))}, repeated {sorted({s for s in steps if steps.count(s) > 1})}"


def test_a_stop_and_a_kill_during_outages_leave_the_queue_on_disk_and_the_next_attempts_send_it(
    synthetic_dir: Path, tmp_path: Path
) -> None:
    """Three attempts of one run, checkpoints every 10 steps:

    1. The server dies at step 20; a SIGTERM at step 60 checkpoints and exits 143 within seconds,
       and the log, trackers.json and the run report name the points kept on disk.
    2. The server is back on its store; a resume sends them and trains on. The server dies again
       at step 80 and the trainer is SIGKILLed at step 100: nothing of ours runs, as on the
       watchdog's exit (``os._exit``) or a node's death.
    3. The server is back; a resume sends what the killed attempt left. The server is killed at
       step 120 and started again on its store at step 180 (it takes some 15 s to come up):
       training goes on at full speed meanwhile (held at step 190 until the sender has found the
       server back by itself), and what was queued in the outage is sent once it is back.

    The server then holds steps 1-200, each once: none lost, none sent twice (steps 91-100 or so
    were trained twice, and the tracker keeps the first values), and the run marked finished
    (its end went through the queue too).
    """
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run" / "phase2-tiny"
    server = start_mlflow(tmp_path / "mlflow", port)
    trainer: subprocess.Popen[str] | None = None
    try:
        trainer, log = start_training(synthetic_dir, tmp_path / "run", uri, steps=100_000, checkpoint__every_n_steps=EVERY)
        assert wait_for(lambda: at_step(log, 20), timeout=240, interval=0.05), log.read_text()[-3000:]
        kill_server(server)
        assert wait_for(lambda: at_step(log, 60), timeout=120, interval=0.05), log.read_text()[-3000:]
        stopped = time.monotonic()
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=60) == 143, log.read_text()[-3000:]
        assert time.monotonic() - stopped < 20  # the close waits for one more try, not for MLflow's backoff
        check_kept(log, run_dir)

        server = start_mlflow(tmp_path / "mlflow", port)
        trainer, log = start_training(
            synthetic_dir, tmp_path / "run", uri, 100_000, "resumed.log", True, checkpoint__every_n_steps=EVERY
        )
        assert wait_for(lambda: at_step(log, 80), timeout=240, interval=0.05), log.read_text()[-3000:]
        assert "mlflow: the last attempt left" in log.read_text()
        kill_server(server)
        assert wait_for(lambda: at_step(log, 100), timeout=120, interval=0.05), log.read_text()[-3000:]
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        assert list((run_dir / QUEUE_DIR / "mlflow").glob("*.jsonl"))  # what it queued is on disk

        server = start_mlflow(tmp_path / "mlflow", port)
        server_back = tmp_path / "server-back"
        trainer, log = start_training(
            synthetic_dir, tmp_path / "run", uri, LAST, "last.log", True, hold_env({LAST - 10: server_back}, python_env()),
            checkpoint__every_n_steps=EVERY,
        )  # fmt: skip
        assert wait_for(lambda: at_step(log, 120), timeout=240, interval=0.05), log.read_text()[-3000:]
        assert "mlflow: the last attempt left" in log.read_text()
        kill_server(server)
        killed_at = time.monotonic()
        assert wait_for(lambda: at_step(log, 180), timeout=120, interval=0.05), log.read_text()[-3000:]
        # 60 steps during the outage at training speed: MLflow's own retries (5, 8, 16, 33, 64 s...)
        # on the training thread took minutes per step.
        assert time.monotonic() - killed_at < 60
        server = start_mlflow(tmp_path / "mlflow", port)
        # The sender finds the server back by itself, while training still runs (its backoff: up to 30 s).
        assert wait_for(lambda: "mlflow: reachable again" in log.read_text(), timeout=90), log.read_text()[-3000:]
        server_back.touch()
        assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
        steps, status = steps_on_server(uri)
    finally:
        if trainer is not None:
            trainer.kill()
        kill_server(server)
    text = log.read_text()
    assert "mlflow: could not send step" in text and "mlflow: reachable again" in text, text[-3000:]
    assert sorted(steps) == list(range(1, LAST + 1)), missing_or_repeated(steps, LAST)
    assert status == "FINISHED"
    entry = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert "kept" not in entry and "lost" not in entry, entry
    assert not list((run_dir / QUEUE_DIR / "mlflow").glob("*.jsonl"))  # nothing left waiting
    assert "## Tracker points" not in (run_dir / "report.md").read_text()


def check_kept(log: Path, run_dir: Path) -> None:
    """The stopped attempt names what the server never got, in the log, trackers.json and the report."""
    text = log.read_text()
    assert "checkpoint saved" in text.split("mlflow: could not send step")[-1]  # a checkpoint after the outage began
    kept = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["kept"]
    # From where the sender was when the server died (at step 20, or earlier when a loaded machine
    # kept it a few points behind training) through the stop's step.
    assert kept["count"] > 0 and kept["first_step"] <= 22 and kept["last_step"] >= 60, kept
    named = f"{kept['count']} points (steps {kept['first_step']}-{kept['last_step']})"
    assert f"mlflow: {named} not on the server when the run ended: kept in {run_dir / QUEUE_DIR / 'mlflow'}" in text, text[-3000:]
    report = (run_dir / "report.md").read_text()
    assert "## Tracker points waiting to be sent" in report and named in report, report


def test_an_error_in_training_names_the_queue_it_leaves_and_the_next_attempt_sends_it(
    synthetic_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning calls ``finalize("failed")`` on its loggers when training raises
    (pytorch_lightning/trainer/call.py), then the process ends. With the server down that call
    returns within seconds and names the points it leaves on disk; the next attempt sends them."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as the logger sets them, undone after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow(tmp_path / "mlflow", port)
    config = tiny_config(synthetic_dir, tmp_path, logging__mlflow_tracking_uri=uri, logging__mlflow_experiment="outage")
    run_dir = tmp_path / "phase2-tiny"
    run_dir.mkdir()
    try:
        failed = RunMLflowLogger(config, run_dir)
        failed.attach()
        log_losses(failed, range(1, 6))
        assert wait_for(lambda: failed.ledger.through_step == 5, timeout=30, interval=0.05)
        kill_server(server)
        log_losses(failed, range(6, 11))
        started = time.monotonic()
        failed.finalize("failed")
        assert time.monotonic() - started < 10  # one more try of a refused connection, not the 10 s wait
        kept = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["kept"]
        assert kept == {"count": 5, "first_step": 6, "last_step": 10}

        server = start_mlflow(tmp_path / "mlflow", port)
        resumed = RunMLflowLogger(config, run_dir)  # the next attempt, resumed from step 8's checkpoint
        resumed.attach()
        log_losses(resumed, range(9, 13))  # steps 9 and 10 again: the first attempt's values are kept
        resumed.close()
        steps, _ = steps_on_server(uri)
    finally:
        kill_server(server)
    assert sorted(steps) == list(range(1, 13)), steps
    assert "kept" not in json.loads((run_dir / "trackers.json").read_text())["mlflow"]


def log_losses(logger: RunMLflowLogger, steps: range) -> None:
    for step in steps:
        logger.log_metrics({"train/loss": 1.0 / step}, step)


class LateAnswers:
    """A loopback relay in front of the server that can hold one answer back, slow every answer, or
    answer for the server: a real TCP hop, the fault planted in the network between client and
    server, not in either. Armed, the next request whose first line names ``path`` reaches the
    server, which stores it and answers; the answer is held past the client's timeout, then the
    connection is closed unanswered. ``delay_s``: every answer waits that long (a slow server or
    link). ``refuse``: requests whose first line names it get a 404 from the relay (a server of
    an MLflow that lacks the endpoint). ``answered``: bytes of answer per request path."""

    def __init__(self, upstream: int, hold_s: float, delay_s: float = 0.0, refuse: str | None = None) -> None:
        self.upstream, self.hold_s, self.delay_s = upstream, hold_s, delay_s
        self.refuse = refuse.encode() if refuse else None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.armed: bytes | None = None
        self.held = threading.Event()  # the server answered the armed request: it stored it
        self.requests: list[str] = []  # every request's first line, in order
        self.answered: dict[str, int] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_next(self, path: str) -> None:
        self.armed = path.encode()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        """One client connection, kept open until the client closes it (or an answer is withheld); each
        request on it goes up on a connection of its own, so the server closing an idle one never
        closes the client's under a request it is sending (its retries are off)."""
        holding = threading.Event()
        path = [""]  # the path of the request under way
        server: socket.socket | None = None

        def answers(server: socket.socket) -> None:
            first = True
            while data := receive(server):
                if holding.is_set():
                    self.held.set()
                    time.sleep(self.hold_s)
                    client.close()
                    break
                if first:
                    time.sleep(self.delay_s)
                    first = False
                self.answered[path[0]] = self.answered.get(path[0], 0) + len(data)
                try:
                    client.sendall(data)
                except OSError:
                    break
            server.close()

        while data := receive(client):
            line = data.split(b"\r\n", 1)[0]
            if line.split(b" ", 1)[0] in (b"GET", b"POST", b"PATCH", b"PUT", b"DELETE"):  # not a body's next part
                self.requests.append(line.decode(errors="replace"))
                path[0] = line.split(b" ")[1].split(b"?")[0].decode(errors="replace")
                if self.refuse is not None and self.refuse in line:
                    client.sendall(b"HTTP/1.1 404 NOT FOUND\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found")
                    break
                if self.armed is not None and self.armed in line:
                    self.armed = None
                    holding.set()
                server = socket.create_connection(("127.0.0.1", self.upstream))
                threading.Thread(target=answers, args=(server,), daemon=True).start()
            try:
                if server is not None:
                    server.sendall(data)
            except OSError:  # the server is gone: the client sees its connection closed
                break
        client.close()

    def close(self) -> None:
        self.listener.close()


def receive(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


@pytest.mark.parametrize("server", ["current", "without-range-question"])
def test_a_batch_the_server_stored_but_answered_too_late_is_not_sent_again(
    synthetic_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, server: str
) -> None:
    """A ``log_batch`` the server stored, its answer held past the client's timeout (2 s here): the
    retry asks the server what it holds and sends only the rest. The server keeps MLflow's file
    store, which keeps every point it is sent (its SQL stores drop an exact repeat).
    ``without-range-question``: the relay answers 404 for get-history-bulk-interval, as a server of
    an MLflow without it would: the retry asks for the whole histories instead, and says so once."""
    port = free_port()
    mlflow_server = start_mlflow(tmp_path / "mlflow", port, store="file")
    relay = LateAnswers(port, hold_s=4, refuse="get-history-bulk-interval" if server == "without-range-question" else None)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as the logger sets it, undone after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    config = tiny_config(synthetic_dir, tmp_path, logging__mlflow_tracking_uri=relay.url, logging__mlflow_experiment="late")
    run_dir = tmp_path / "phase2-tiny"
    run_dir.mkdir()
    try:
        logger = RunMLflowLogger(config, run_dir)
        logger.attach()
        log_losses(logger, range(1, 6))
        assert wait_for(lambda: logger.ledger.through_step == 5, timeout=30, interval=0.05)
        relay.hold_next("/runs/log-batch")
        log_losses(logger, range(6, 11))
        assert wait_for(lambda: logger.ledger.through_step == 10, timeout=60, interval=0.05)
        assert relay.held.is_set() and logger.sender is not None and logger.sender.failures == 1
        logger.close()
        steps, _ = steps_on_server(f"http://127.0.0.1:{port}", "late")
    finally:
        relay.close()
        kill_server(mlflow_server)
    assert sorted(steps) == list(range(1, 11)), steps
    asked = [line for line in relay.requests if "/metrics/get-history" in line]
    if server == "current":
        assert asked and all("get-history-bulk-interval" in line for line in asked), asked
    else:
        assert any("/metrics/get-history?" in line for line in asked), asked
        assert caplog.text.count("cannot answer for a range of steps") == 1, caplog.text


def test_a_start_with_points_left_asks_a_slow_server_nothing_and_the_sender_asks_only_their_steps(
    synthetic_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last attempt left 200 points (steps 3001-3200, three metrics each) of which the server
    took the first 100 before the kill (between its answers and the ledger's record); the server
    holds 3,000 steps of history before them. Every answer comes 2 s late (a relay in front of a
    real server on MLflow's file store, which keeps a point sent twice).

    The start (rank 0's: every rank waits for it) asks the server nothing about the points: it
    asked for each metric's whole history first, 2 s and a full history each. The sender asks,
    for the steps in question only (a few KB where the histories are ~1 MB), and sends the rest:
    each point is on the server once."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as the logger sets them, undone after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    port = free_port()
    server = start_mlflow(tmp_path / "mlflow", port, store="file")
    relay = LateAnswers(port, hold_s=0)
    config = tiny_config(synthetic_dir, tmp_path, logging__mlflow_tracking_uri=relay.url, logging__mlflow_experiment="slow")
    run_dir = tmp_path / "phase2-tiny"
    run_dir.mkdir()
    keys = ("train/loss", "train/lr", "epoch")
    direct = MlflowClient(f"http://127.0.0.1:{port}")
    try:
        last = RunMLflowLogger(config, run_dir)  # the last attempt: its run, its history, what it left
        last.attach()
        assert last.sender is not None
        last.sender.close()
        run_id = str(last.run_id)
        history = [metric(key, step) for step in range(1, 3001) for key in keys]
        for first in range(0, len(history), 1000):
            direct.log_batch(run_id, metrics=history[first : first + 1000], synchronous=True)
        last.ledger.acknowledge(dict.fromkeys(keys, 0.0), 3000)
        for step in range(3001, 3201):
            last.journal.append(QueuedPoint(step, 1_700_000_000_000 + step, {key: float(step) for key in keys}))
        direct.log_batch(run_id, metrics=[metric(key, step) for step in range(3001, 3101) for key in keys], synchronous=True)

        relay.delay_s = 2.0
        asked_before = len(relay.requests)
        resumed = RunMLflowLogger(config, run_dir)
        started = time.monotonic()
        resumed.attach()
        start_s = time.monotonic() - started
        at_start = relay.requests[asked_before:]
        assert wait_for(lambda: resumed.ledger.through_step == 3200, timeout=120, interval=0.1)
        resumed.close()
        points = direct.get_metric_history(run_id, "train/loss")
    finally:
        relay.close()
        kill_server(server)
    assert not [line for line in at_start if "/metrics/get-history" in line], at_start
    # Three requests at most (the run, its update), each answered 2 s late; 5 s more for a loaded
    # 2-core machine (a fresh-clone CI run took 8.4 s). Asking for the histories was 3 more requests.
    assert len(at_start) <= 3, at_start
    assert start_s < 3 * relay.delay_s + 5, f"the start took {start_s:.1f} s: {at_start}"
    read = sum(size for path, size in relay.answered.items() if "/metrics/get-history" in path)
    assert 0 < read < 100_000, relay.answered  # a whole history of 3,200 points is some 300 KB a metric
    assert sorted(point.step for point in points) == list(range(1, 3201)), missing_or_repeated([p.step for p in points], 3200)


def metric(key: str, step: int) -> Metric:
    return Metric(key=key, value=float(step), timestamp=1_700_000_000_000 + step, step=step)
