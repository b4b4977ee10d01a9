"""A kill -9 of a worker, torchrun's restart and a resume: the weights, the history, one tracker run;
a W&B service that stops answering at a run's start or end (real parts).

The job is two launchers on loopback, one rank each. The killed worker is node 0's (rank 0,
which also keeps the attempt record): torchrun's restart must span both nodes, as it must
when one machine's process dies, and node 1's healthy worker is restarted with it.

MLflow: a real ``mlflow server`` (sqlite backend) on loopback, read back through MLflow's
client. W&B: offline mode (no network here), its ``.wandb`` files read back record by record.
The weights are compared with the same job run without a kill (CPU, deterministic).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient

from purrsight.runs.attempts import read_attempts, summarize
from tests.helpers import REPO, free_port, python_env, read_metrics, tiny_config, train_tiny, trainable_state
from tests.launcher.conftest import Cluster, wait_for
from tests.launcher.test_launcher import workers
from tests.mlflow_server import kill_server, start_mlflow
from tests.preloaded import PreloadedTrainer
from tests.wandb_files import wandb_history

QUEUED_S = 5
# The first launch's job: 35 steps, checkpoints every 15, so a kill after step 26 redoes 11.
JOB = {"run__deterministic": "true", "checkpoint__every_n_steps": 15, "checkpoint__keep_last": 10}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, synthetic_dir: Path) -> dict[str, torch.Tensor]:
    """The reference: the first launch's two-node job, never interrupted, with no tracker."""
    reference = Cluster(tmp_path_factory.mktemp("reference"), synthetic_dir)
    launchers = [reference.start(2, node, trainer__max_steps=35, **JOB) for node in (0, 1)]
    assert [launcher.wait(timeout=300) for launcher in launchers] == [0, 0], launchers[0].text()[-3000:]
    return trainable_state(reference.run_dir / "checkpoints" / "last.ckpt")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    server = start_mlflow(tmp_path_factory.mktemp("mlflow"), port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_server(server)


def test_a_killed_worker_resumes_to_the_same_weights_with_one_history_and_one_tracker_run(
    cluster: Cluster, mlflow_server: str, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """SIGKILL of node 0's worker after step 26 (torchrun restarts both nodes' from step 15), then RESUME=auto to step 45.

    The restarted job ends with the weights of the job never killed. Steps 16-26 at least are
    trained twice; the metrics history and each tracker must hold every step once, in one run.
    """
    trackers = {
        "logging__mlflow_tracking_uri": mlflow_server,
        "logging__mlflow_experiment": "kill-and-resume",
        "logging__wandb_project": "purrsight-tests",
        "logging__every_n_steps": 1,
    }
    started = time.time()
    master, worker = (cluster.start(2, node, trainer__max_steps=35, **JOB, **trackers) for node in (0, 1))
    link = cluster.log_dir / "latest_node0.log"
    assert wait_for(lambda: link.exists() and "step 26/" in cluster.node_log(0), timeout=240, interval=0.1)
    (victim,) = workers(master.proc.pid)
    victim.send_signal(signal.SIGKILL)
    assert master.wait(timeout=300) == 0, master.text()[-3000:]
    assert worker.wait(timeout=120) == 0, worker.text()[-3000:]  # its healthy worker restarted too, not given up
    assert re.search(r"torchrun restart 1: resuming from .*step-00000015\.ckpt", cluster.node_log(0)), cluster.node_log(0)[-3000:]
    restarted = trainable_state(cluster.run_dir / "checkpoints" / "last.ckpt")
    assert restarted.keys() == uninterrupted.keys()
    for key in restarted:
        assert torch.allclose(restarted[key], uninterrupted[key], atol=1e-6, rtol=0), key
    time.sleep(QUEUED_S)  # as a requeued job waits in the queue
    resumed = [cluster.start(2, node, env={"RESUME": "auto"}, trainer__max_steps=45, **JOB, **trackers) for node in (0, 1)]
    # The job's end: the run report's line, the last thing rank 0 does (its process exit follows).
    assert wait_for(lambda: "run report:" in resumed[0].text(), timeout=300, interval=0.05), resumed[0].text()[-3000:]
    wall = time.time() - started
    assert [launcher.wait(timeout=120) for launcher in resumed] == [0, 0], resumed[0].text()[-3000:]
    # one history: the rows before each resumed step kept, the redone ones once
    history = read_metrics(cluster.run_dir)
    assert [int(float(row["step"])) for row in history if row.get("train/loss")] == list(range(1, 46))
    check_attempts(cluster, wall)
    ledger = json.loads((cluster.run_dir / "trackers.json").read_text())

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("kill-and-resume")
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [ledger["mlflow"]["run_id"]]
    steps = [point.step for point in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 46)), steps  # every step, once
    assert runs[0].data.params["trainer.max_steps"] == "35"  # the parameters of the run's first start

    ids, rows = wandb_history(cluster.run_dir)
    assert ids == {ledger["wandb"]["run_id"]}
    assert len(list((cluster.run_dir / "wandb").glob("offline-run-*"))) == 3  # first start, torchrun restart, resume
    trained = [int(row["trainer/global_step"]) for row in rows if "train/loss" in row]
    assert trained == list(range(1, 46)), trained  # once each, in order across the attempts
    assert all(row["_step"] == row["trainer/global_step"] for row in rows if "trainer/global_step" in row)


def check_attempts(cluster: Cluster, wall: float) -> None:
    """The effective-time record of the same job: three attempts whose parts add up to the wall time measured here."""
    summary = summarize(read_attempts(cluster.run_dir))
    killed, restarted, resumed = summary.splits
    assert (killed.how, killed.end, killed.steps[0]) == ("first start", "killed (no end recorded)", 0)
    assert 15 <= killed.steps[1] <= 26 + 10  # the last heartbeat's step (written at most 2 s before the kill)
    assert killed.lost == pytest.approx((killed.lost + killed.training) * (killed.steps[1] - 15) / killed.steps[1])
    assert (restarted.how, restarted.end, restarted.steps) == ("restart 1 of the launch", "finished", (15, 35))
    assert (resumed.how, resumed.end, resumed.steps) == ("new launch, resumed", "finished", (35, 45))
    assert resumed.waiting_before >= QUEUED_S
    total = sum(split.total for split in summary.splits)
    assert total == pytest.approx(summary.wall)
    assert abs(total - wall) <= 0.02 * wall, (total, wall)
    assert killed.wind_down == 0 and restarted.wind_down > 0 and resumed.wind_down > 0  # a kill leaves no end to wind down from
    report = (cluster.run_dir / "report.md").read_text()
    # The report is written during the last attempt's wind-down: it saw that attempt end where training ended.
    as_reported = read_attempts(cluster.run_dir)
    as_reported[-1].ended_at = as_reported[-1].training_ended_at
    shown = re.search(r"Effective training time: \*\*([0-9.]+)%\*\*", report)
    assert shown and float(shown.group(1)) == pytest.approx(summarize(as_reported).effective * 100, abs=0.051), report
    assert (cluster.run_dir / "attempts.png").is_file()


def test_an_unreachable_tracker_is_one_line_before_training(
    synthetic_dir: Path, tmp_path: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    done = train_tiny(synthetic_dir, tmp_path, preloaded=preloaded_trainer, logging__mlflow_tracking_uri=nobody)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"logging.mlflow_tracking_uri: cannot use {nobody}" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "step 1/" not in done.stderr
    assert not (tmp_path / "phase2-tiny" / "trackers.json").exists()


def frozen_wandb(when: str, out: str, synthetic_dir: str) -> None:
    """A child process's run: W&B's service process (wandb-core) frozen with SIGSTOP before the
    tracker's start, or before its end, as a hung service. Prints what the parent checks."""
    from purrsight.config import ConfigError
    from purrsight.observability import trackers

    def freeze_service() -> None:
        (service,) = [c for c in psutil.Process().children(recursive=True) if c.name().startswith("wandb-core")]
        service.suspend()
        print(f"frozen service {service.pid}", flush=True)

    config = tiny_config(Path(synthetic_dir), Path(out), logging__wandb_project="purrsight-tests")
    run_dir = Path(out) / "phase2-tiny"
    run_dir.mkdir(parents=True)
    if when == "start":
        import wandb

        trackers.WANDB_START_TIMEOUT_S = 3.0  # the test's patience, not the minute a real start gets

        wandb.setup(wandb.Settings(mode="offline"))  # W&B's service process, started as its init would start it
        freeze_service()
    started = time.monotonic()
    try:
        (logger,) = trackers.build_trackers(config, run_dir)
    except ConfigError as error:
        print(f"error: {error.problems[0]} after {time.monotonic() - started:.1f} s", flush=True)
        raise SystemExit(2) from None
    logger.log_metrics({"train/loss": 1.0}, 1)
    freeze_service()
    started = time.monotonic()
    trackers.close_trackers([logger])
    print(f"closed after {time.monotonic() - started:.1f} s", flush=True)


def test_a_frozen_wandb_service_holds_neither_the_start_nor_the_end(synthetic_dir: Path, tmp_path: Path) -> None:
    """W&B's init and finish wait for its service process without a limit (W&B 0.31: a SIGSTOPped
    wandb-core held either past 30 s, and its exit hook then held the process's exit for good).
    Both now run off the training thread with a bound: a start that does not answer stops the
    run with one line (exit 2), an end that does not answer is a warning; the frozen service is
    ended either way, so the process exits and leaves no process behind."""
    script = "from tests.faults.test_trackers import frozen_wandb; frozen_wandb(*{!r})"
    children, logs = {}, {when: tmp_path / f"{when}.log" for when in ("start", "end")}
    for when, log in logs.items():
        command = [sys.executable, "-c", script.format((when, str(tmp_path / when), str(synthetic_dir)))]
        with log.open("w") as sink:  # a file, not a pipe: a frozen service holding a pipe open would hold the reader
            children[when] = subprocess.Popen(command, cwd=REPO, env=python_env(), stdout=sink, stderr=subprocess.STDOUT)
    try:
        for child in children.values():
            child.wait(timeout=120)
        outputs = {when: log.read_text() for when, log in logs.items()}
        survivors = [pid for pid in frozen_services(outputs.values()) if alive(pid)]
    finally:
        for child in children.values():
            child.kill()
        for pid in frozen_services(log.read_text() for log in logs.values()):
            with contextlib.suppress(psutil.Error):  # on the old code a frozen service outlived its parent
                psutil.Process(pid).kill()
    assert children["start"].returncode == 2, outputs["start"][-3000:]
    took = re.search(r"error: logging.wandb_project: W&B did not start within 3 s .* after ([0-9.]+) s", outputs["start"])
    assert took and float(took.group(1)) < 3 + 5, outputs["start"][-3000:]
    assert children["end"].returncode == 0, outputs["end"][-3000:]
    took = re.search(r"closed after ([0-9.]+) s", outputs["end"])
    assert took and float(took.group(1)) < 10 + 5, outputs["end"][-3000:]
    assert "wandb: the run's finish did not return within 10 s" in outputs["end"], outputs["end"][-3000:]
    assert "Traceback" not in outputs["start"] + outputs["end"]
    assert len(frozen_services(outputs.values())) == 2 and survivors == []  # no process left behind


def frozen_services(outputs: Iterable[str]) -> list[int]:
    return [int(pid) for text in outputs for pid in re.findall(r"frozen service (\d+)", text)]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
