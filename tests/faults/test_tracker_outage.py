"""A tracker server that dies mid-run, and one that comes back: training never waits for it (real parts).

A real ``mlflow server`` (sqlite store) in its own process group, SIGKILLed as a whole (the
server and its workers, as when its machine dies), then in the first case started again on
the same store and port. The trainer is the tiny default in one process, every step logged.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.helpers import DEFAULT_CONFIG, REPO, free_port, python_env, tiny_overrides
from tests.launcher.conftest import wait_for
from tests.mlflow_server import kill_server, start_mlflow


def start_training(synthetic_dir: Path, out: Path, uri: str, steps: int) -> tuple[subprocess.Popen[str], Path]:
    log = out / "trainer.log"
    out.mkdir(parents=True, exist_ok=True)
    overrides = tiny_overrides(
        synthetic_dir, out, trainer__max_steps=steps, logging__every_n_steps=1, checkpoint__every_n_steps=50,
        trainer__val_every_n_steps=1000, logging__mlflow_tracking_uri=uri, logging__mlflow_experiment="outage",
    )  # fmt: skip
    with log.open("w") as sink:
        trainer = subprocess.Popen(
            [sys.executable, str(REPO / "train_phase2.py"), "--config", str(DEFAULT_CONFIG), *overrides],
            cwd=REPO, env={**python_env(), "OMP_NUM_THREADS": "1"}, stdout=sink, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    return trainer, log


def at_step(log: Path, step: int) -> bool:
    return f"step {step}/" in log.read_text(errors="replace")


def test_a_server_killed_then_restarted_on_its_store_gets_every_step_once(synthetic_dir: Path, tmp_path: Path) -> None:
    """Killed at step 40 of 600, started again at step 100 (it takes some 15 s to come up): the run
    ends 0 without waiting for it, and the points queued meanwhile are sent once it is back. The
    server then holds every step at most once, and any step it lacks is named as lost (the run's
    end waits a bounded time for the queue: on a loaded machine it may not drain in time)."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow(tmp_path / "mlflow", port)
    trainer, log = start_training(synthetic_dir, tmp_path / "run", uri, steps=600)
    try:
        assert wait_for(lambda: at_step(log, 40), timeout=240, interval=0.05), log.read_text()[-3000:]
        kill_server(server)
        killed_at = time.monotonic()
        assert wait_for(lambda: at_step(log, 100), timeout=120, interval=0.05), log.read_text()[-3000:]
        # 60 steps during the outage at training speed: MLflow's own retries (5, 8, 16, 33, 64 s...)
        # on the training thread took minutes per step.
        assert time.monotonic() - killed_at < 60
        server = start_mlflow(tmp_path / "mlflow", port)
        assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        trainer.kill()
        kill_server(server)
    text = log.read_text()
    assert "mlflow: could not send step" in text and "mlflow: reachable again" in text, text[-3000:]
    run_dir = tmp_path / "run" / "phase2-tiny"
    lost = json.loads((run_dir / "trackers.json").read_text())["mlflow"].get("lost")
    server = start_mlflow(tmp_path / "mlflow", port)
    try:
        client = MlflowClient(uri)
        (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
        steps = [point.step for point in client.get_metric_history(run.info.run_id, "train/loss")]
    finally:
        kill_server(server)
    assert len(steps) == len(set(steps)), "a step sent twice"
    missing = set(range(1, 601)) - set(steps)
    assert len(missing) < 600 - 100, "nothing queued during the outage was sent after it"
    if missing:  # named: in trackers.json, the log and the report
        assert lost and missing <= set(range(lost["first_step"], lost["last_step"] + 1)), (sorted(missing), lost)
        assert "never reached the server before the run ended" in text
        assert "## Tracker points never delivered" in (run_dir / "report.md").read_text()
    else:
        assert lost is None and run.info.status == "FINISHED"  # the run's end went through the queue too


def test_a_stop_during_an_outage_checkpoints_promptly_and_names_the_lost_points(synthetic_dir: Path, tmp_path: Path) -> None:
    """The server dies at step 20 for good; a SIGTERM at step 60 checkpoints and exits 143 within
    seconds, and the log, trackers.json and the run report name the points that never arrived."""
    port = free_port()
    server = start_mlflow(tmp_path / "mlflow", port)
    trainer, log = start_training(synthetic_dir, tmp_path / "run", f"http://127.0.0.1:{port}", steps=100_000)
    try:
        assert wait_for(lambda: at_step(log, 20), timeout=240, interval=0.05), log.read_text()[-3000:]
        kill_server(server)
        assert wait_for(lambda: at_step(log, 60), timeout=120, interval=0.05), log.read_text()[-3000:]
        stopped = time.monotonic()
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=60) == 143, log.read_text()[-3000:]
        assert time.monotonic() - stopped < 20  # the close waits for one more try, not for MLflow's backoff
    finally:
        trainer.kill()
    text = log.read_text()
    run_dir = tmp_path / "run" / "phase2-tiny"
    assert "checkpoint saved" in text.split("mlflow: could not send step")[-1]  # a checkpoint after the outage began
    lost = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["lost"]
    # From where the sender was when the server died (at step 20, or earlier when a loaded machine
    # kept it a few points behind training) through the stop's step.
    assert lost["count"] > 0 and lost["first_step"] <= 22 and lost["last_step"] >= 60, lost
    assert f"mlflow: {lost['count']} calls (steps {lost['first_step']}-{lost['last_step']}) never reached the server" in text
    assert f"{lost['count']} calls (steps {lost['first_step']}-{lost['last_step']})" in (run_dir / "report.md").read_text()
