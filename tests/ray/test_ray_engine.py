"""The Ray engine end to end: `ray job submit` to a real two-node Ray cluster (conftest.py).

Every job is submitted as the README says: the repository as --working-dir, relative paths
in the config taken from ray.shared_dir (a folder both "nodes" see, as NFS would be).
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from purrsight.runs.attempts import read_attempts, summarize
from tests.helpers import log_time, read_metrics, trainable_state
from tests.launcher.conftest import wait_for
from tests.ray.cluster import RayCluster, job_info, submission_id
from tests.wandb_files import wandb_history

# A training step line of a job's log: its time and step ("2026-11-28 15:18:48.808 ... step 15/24 ...").
STEP_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) .*?\bstep (\d+)/\d+ ")


def ray_args(shared: Path, name: str, **extra: object) -> list[str]:
    values: dict[str, object] = {
        "ray.shared_dir": shared,
        "run.name": name,
        "run.deterministic": True,
        "data.synthetic.num_train": 128,
        "data.synthetic.num_val": 32,
        "trainer.max_steps": 40,
        "trainer.val_every_n_steps": 20,
        "checkpoint.every_n_steps": 10,
        "logging.progress": "lines",
        "logging.every_n_steps": 5,
        "distributed.timeout_s": 120,
        # Length-grouped batches in every Ray run: the restarted run below ends with the uninterrupted
        # run's weights, so grouping's exact resume holds under this engine too (docs/DATA.md).
        "data.group_by_length": True,
        "data.length_group_size": 32,  # batch 16 x 2 workers: each step one group
        "data.length_group_window": 4,
    }
    values.update({key.replace("__", "."): value for key, value in extra.items()})
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster: RayCluster, shared: Path) -> subprocess.CompletedProcess[str]:
    """The reference run, sharded: FSDP on Ray Train's two workers (one per node). The killed DDP run
    below must end with its weights, which checks both that a restarted group resumes exactly and that
    FSDP trains as DDP under this engine (one Ray job for the two, merged: tests/README.md)."""
    return ray_cluster.submit_and_follow(*ray_args(shared, "whole", distributed__strategy="fsdp"))


def train_worker_on(node: psutil.Process) -> psutil.Process:
    for process in node.children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(process.cmdline()):
                return process
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no Ray Train worker found on the node")


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return trainable_state(run_dir / "checkpoints" / "last.ckpt")


def test_submit_trains_fsdp_on_two_nodes_and_writes_the_usual_run_folder(
    uninterrupted: subprocess.CompletedProcess[str], shared: Path
) -> None:
    """distributed.strategy=fsdp, as under torchrun: the frozen weights sharded over the two workers."""
    output = uninterrupted.stdout + uninterrupted.stderr
    assert uninterrupted.returncode == 0, output[-4000:]
    assert "frozen weights sharded over 2 ranks" in output, output[-3000:]
    assert re.search(r"job raysubmit_\w+ SUCCEEDED: exit 0", output), output[-2000:]
    run_dir = shared / "runs" / "whole"  # run.output_dir's default "runs", taken from ray.shared_dir
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.ckpt"))
    assert checkpoints == ["step-00000020.ckpt", "step-00000030.ckpt", "step-00000040.ckpt"]  # keep_last 3
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert sorted(p.name for p in (run_dir / "telemetry").glob("node*.csv")) == ["node0.csv", "node1.csv"]
    machines = {tuple(row["node_addr"] for row in csv.DictReader(path.open())) for path in (run_dir / "telemetry").iterdir()}
    assert {rows[0] for rows in machines} == {"127.0.0.2", "127.0.0.3"} and all(len(set(rows)) == 1 for rows in machines)
    assert (run_dir / "report.md").is_file() and (run_dir / "resolved_config.yaml").is_file()
    steps = [int(row["step"]) for row in read_metrics(run_dir) if row.get("train/loss")]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40]
    # Ray keeps the newest keep_last reports, each naming our checkpoint file.
    reported = sorted(p.name for p in (run_dir / "ray").glob("*/step-*"))
    assert reported == ["step-00000020", "step-00000030", "step-00000040"]
    # Rank-prefixed progress lines from both workers, as under torchrun.
    assert re.search(r"\[rank 0\] INFO purrsight\.progress: step 40/40", output), output[-3000:]
    assert "[rank 1]" in output
    assert "RESUME " not in output  # no disassembly leaking from a library's captured print
    for noise in ("Reporting training result", "Checkpoint successfully created", "PreemptionWatcher", "WebSocket closed"):
        assert noise not in output, noise  # Ray's lines a user cannot act on (ray_noise.py, submit.py)


def trained_past(run_dir: Path, step: int) -> bool:
    """metrics.csv has a training row past ``step`` (read while the trainer may rewrite it)."""
    try:
        return any(row.get("train/loss") and float(row["step"]) > step for row in read_metrics(run_dir))
    except (OSError, KeyError, TypeError, ValueError):  # not written yet, or caught mid-rewrite
        return False


def saved_since(run_dir: Path, when: float) -> bool:
    """A checkpoint written after ``when`` (the rotation may delete a file between the listing and its stat)."""
    for path in (run_dir / "checkpoints").glob("step-*.ckpt"):
        try:
            if path.stat().st_mtime > when:
                return True
        except FileNotFoundError:
            continue
    return False


def test_bad_config_ends_in_the_driver_with_exit_2_before_any_worker(ray_cluster: RayCluster, shared: Path) -> None:
    submitted = ray_cluster.submit(*ray_args(shared, "bad", data__batch_size=0))
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 1  # `ray job submit` reports a failed job as 1; the driver's own code follows
    job = submission_id(output)
    info = job_info(ray_cluster, job)
    assert info["status"] == "FAILED" and info["driver_exit_code"] == 2, info
    assert "data.batch_size" in output
    assert "RayTrainWorker" not in output and "Traceback" not in output
    # The scriptable way (submit.py) exits with the driver's own code: the next test checks it.


def test_a_cluster_too_small_exits_3_and_leaves_no_run_folder(ray_cluster: RayCluster, shared: Path) -> None:
    submitted = ray_cluster.submit_and_follow(*ray_args(shared, "toobig", ray__num_workers=3))
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 3, output[-3000:]
    assert "ray.num_workers=3" in output and "needs CPU 3 (the cluster has 2)" in output
    assert not (shared / "runs" / "toobig").exists()  # absent stays absent: nothing for the next submit to trip on


def test_a_bad_sample_in_a_worker_is_not_retried(
    ray_cluster: RayCluster, shared: Path, uninterrupted: subprocess.CompletedProcess[str]
) -> None:
    """A user error inside the workers: Ray would restart the group up to max_failures times.

    One worker: the decision not to train again is each worker's own (the error's record in the
    run folder), and a second worker would add a Ray Train worker's start to each attempt, no check."""
    source = shared / "data" / "synthetic"
    assert (source / "train.jsonl").is_file()  # made by the uninterrupted run's driver
    broken = shared / "broken"
    shutil.copytree(source, broken)
    for image in broken.glob("**/*.png"):
        image.write_bytes(b"not a picture")
    submitted = ray_cluster.submit(
        *ray_args(
            shared,
            "badsample",
            data__synthetic_dir="null",
            data__train_index="broken/train.jsonl",
            data__val_index="null",
            model__llm__tokenizer="data/synthetic/tokenizer",
            ray__num_workers=1,
            ray__max_failures=3,
        )
    )
    output = submitted.stdout + submitted.stderr
    info = job_info(ray_cluster, submission_id(output))
    assert info["status"] == "FAILED" and info["driver_exit_code"] == 2, output[-4000:]
    assert re.search(r"error: .*broken/.*\.png", output), output[-4000:]
    assert output.count("training from step 0") <= 1  # rank 0 started training once, never again
    assert "not training again" in output  # the restarted group returned at once
    # Ray reports the failed attempt with the traceback of our one frame that raised the one-line
    # error, never the data loader's wall. (How many times it shows it depends on when its log
    # deduplication flushes, so the reports are checked, not counted.)
    lines = output.splitlines()
    reports = [lines[n + 1 : n + 8] for n, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    ours = [report for report in reports if any("purrsight/" in line for line in report)]
    assert ours, output[-4000:]
    for report in ours:
        end = next((n for n, line in enumerate(report) if "Error:" in line), len(report))
        frames = [line for line in report[:end] if 'File "' in line]
        assert len(frames) == 1 and "purrsight/ray_engine/worker.py" in frames[0], report


def test_a_killed_worker_restarts_the_group_a_lost_node_shrinks_it_with_the_global_batch_kept_and_ray_job_stop_checkpoints(
    ray_cluster: RayCluster, shared: Path, uninterrupted: subprocess.CompletedProcess[str]
) -> None:
    """One run through four attempts, each a way a Ray run loses its workers or goes on.

    SIGKILL of the worker on the second node: Ray restarts the group, which resumes from the
    newest checkpoint and ends with the uninterrupted run's weights (that run sharded with FSDP,
    this one DDP: the same schedule, the same weights). Then the finished run is resubmitted with
    --resume, a longer horizon and ray.num_workers=[1, 2] (Ray Train's ScalingConfig(num_workers=(1,
    2))). Past its step-50 checkpoint the second node is lost whole (its raylet, agents and worker,
    SIGKILL at once): Ray Train restarts the group with what the cluster still fits, one worker,
    which resumes from step 50 at 1 x 16 x 2 samples a step where two trained 2 x 16 x 1
    (trainer.global_batch_size=32). Once that worker has saved a checkpoint of its own, `ray job
    stop`: the driver relays the stop, the worker checkpoints, the job ends STOPPED. The history and
    the W&B run (offline) hold every step once, and the attempt record names all four attempts.
    The node is started again for the tests after (this one runs last: a lost node is still on the
    head's books for a while).

    Merged (tests/README.md): the elastic loss was a Ray job of its own, trained from step 0.
    """
    run_dir = shared / "runs" / "killed"
    job_settings = {"logging__wandb_project": "purrsight-ray", "logging__every_n_steps": 1}
    submitted = ray_cluster.submit(*ray_args(shared, "killed", **job_settings), no_wait=True)
    assert submitted.returncode == 0, submitted.stderr
    job = submission_id(submitted.stdout + submitted.stderr)
    # Killed past the step-10 checkpoint, as a node dies mid-interval: the restarted group redoes
    # steps 11 on. (A checkpoint is written after its step's metrics row: runs/checkpoint_saver.py.)
    assert wait_for(lambda: trained_past(run_dir, 10), timeout=300, interval=0.1), "the job never trained past step 10"
    train_worker_on(ray_cluster.nodes[1]).kill()  # the worker on the second node, with SIGKILL
    followed = ray_cluster.job("logs", "--follow", job)  # the README's way to follow a job
    assert job_info(ray_cluster, job)["status"] == "SUCCEEDED", followed.stdout[-4000:]
    assert "resuming from" in followed.stdout
    expected = final_weights(shared / "runs" / "whole")
    got = final_weights(run_dir)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.allclose(expected[key], got[key], atol=1e-5, rtol=0), key  # FSDP's reduce-scatter sums in its own order

    # The finished run continued to a horizon it will not reach, elastic; a node lost on the way.
    elastic = {"ray__num_workers": "[1,2]", "trainer__global_batch_size": 32, "trainer__max_steps": 400}
    # Ray Train waits this long for a group to start before it resizes (60 s by default): after the
    # loss it first asks for two workers again, the lost node's CPU still on its books (docs/RAY.md).
    resize_sooner = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "25"}
    longer = ray_cluster.submit(
        "--resume", *ray_args(shared, "killed", **elastic, **job_settings), no_wait=True, env_vars=resize_sooner
    )
    job = submission_id(longer.stdout + longer.stderr)
    try:
        assert wait_for(lambda: trained_past(run_dir, 50), timeout=300, interval=0.1), "the resumed run never trained past step 50"
        killed = time.time()
        ray_cluster.kill_worker_node()
        # The one worker's own checkpoint (every 10 steps: step 60 at the earliest), then the stop.
        saved = wait_for(lambda: saved_since(run_dir, killed), timeout=300, interval=0.2)
        assert saved, ray_cluster.job("logs", job).stdout[-4000:]
        stopped = ray_cluster.job("stop", job, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        info = job_info(ray_cluster, job)
    finally:
        ray_cluster.start_worker_node()
    assert info["status"] == "STOPPED", info
    logs = ray_cluster.job("logs", job).stdout
    again = [log_time(when) for when, step in STEP_LINE.findall(logs) if int(step) > 50 and log_time(when) > killed]
    assert again, logs[-3000:]
    print(f"a node lost past step 50: one worker trained again {again[0] - killed:.1f} s after the kill")
    continued = re.search(r"trainer\.max_steps 40 -> 400: the learning rate continues from (\S+) at step 40", logs)
    assert continued, logs[-3000:]
    assert "starting 1 to 2 Ray Train workers (elastic: goes on while 1 remain)" in logs, logs[-3000:]
    assert "global batch 32 = 2 processes x 16 (data.batch_size) x 1 micro-batches per step" in logs, logs[-3000:]
    assert "global batch 32 = 1 processes x 16 (data.batch_size) x 2 micro-batches per step" in logs, logs[-3000:]
    assert re.search(r"resuming from .*step-00000050\.ckpt", logs), logs[-3000:]
    assert "received SIGTERM" in logs
    stop = re.search(r"stopped by SIGTERM at step (\d+); checkpoint: (\S+)", logs)
    assert stop, logs[-3000:]
    stop_step = int(stop.group(1))
    assert 60 <= stop_step < 400, stop_step
    assert Path(stop.group(2)) == run_dir / "checkpoints" / f"step-{stop_step:08d}.ckpt"
    assert Path(stop.group(2)).is_file()

    rows = read_metrics(run_dir)
    steps = [int(row["step"]) for row in rows if row.get("train/loss")]
    assert steps == list(range(1, stop_step + 1)), "every step once: a redone step replaces its row"
    lr = {int(row["step"]): float(row["train/lr"]) for row in rows if row.get("train/lr")}
    # Step 41 uses the rate step 40 left (printed to 3 digits), not the new horizon's cosine at step 41.
    assert lr[41] == pytest.approx(float(continued.group(1)), rel=0.005), lr
    ids, wandb_rows = wandb_history(run_dir)
    assert ids == {json.loads((run_dir / "trackers.json").read_text())["wandb"]["run_id"]}  # one W&B run, all attempts
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 4
    logged = [int(row["trainer/global_step"]) for row in wandb_rows if "train/loss" in row]
    # Once each, in order, and every step from the checkpoint each restart resumed on. W&B writes its
    # log about once a second, and Ray's restart SIGKILLs the whole group (the node's loss, rank 0's
    # process too): the points of rank 0's last second that the checkpoint already covers are gone,
    # and are not sent again (docs/RELIABILITY.md).
    assert logged == sorted(set(logged)) and set(range(11, 41)) | set(range(51, stop_step + 1)) <= set(logged), logged
    killed_worker, restarted, resumed, shrunk = summarize(read_attempts(run_dir)).splits
    assert killed_worker.how == "first start" and restarted.how.startswith("restart 1 of the launch"), (killed_worker, restarted)
    assert restarted.end == "finished" and restarted.steps[1] == 40, restarted
    assert resumed.how == "new launch, resumed" and resumed.steps[0] == 40, resumed
    assert shrunk.how.startswith("restart 1 of the launch") and shrunk.end == "stopped by signal 15", shrunk
    assert shrunk.steps == (50, stop_step), shrunk
    report = (run_dir / "report.md").read_text()
    assert "| 2 x 16 x 1 = 32 |" in report and "| 1 x 16 x 2 = 32 |" in report, report
    # Every report Ray still holds names a checkpoint that exists (the earlier jobs' stale ones were
    # pruned by the next job: pointer.prune_stale), but one: after the group's restart, Ray's
    # checkpoint manager kept the report it resumed from (step 50) beside its keep_last newest, and
    # our rotation has deleted that file. A later job into the folder prunes it.
    pointers = list((run_dir / "ray").glob("*/step-*/purrsight_checkpoint.json"))
    assert len(pointers) >= 2, pointers  # step 50 and the one worker's own at least: the check below reads something
    dangling = {pointer.parent.name for pointer in pointers if not Path(json.loads(pointer.read_text())["path"]).is_file()}
    assert dangling <= {"step-00000050"}, dangling
