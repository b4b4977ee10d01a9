"""slurm/train.sbatch on a real three-node SLURM cluster (see conftest.py); jobs take two of its nodes."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from purrsight.runs.attempts import read_attempts, summarize
from tests.cluster.conftest import SlurmCluster
from tests.helpers import (
    REPO,
    check_every_sample_once,
    fault_env,
    held_marker,
    hold_env,
    log_time,
    record_samples_env,
    tiny_overrides,
)
from tests.launcher.conftest import kill_whole

# The test nodes have 2 CPUs and no GPUs: these (and --nodes, 2 unless a test says) override the script's #SBATCH defaults.
SMALL_ALLOCATION = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=20"]


def launcher_of_node_2(cmdline: list[str], run_folder: Path) -> bool:
    """Whether ``cmdline`` is node 2's launcher of the elastic job training into ``run_folder``:
    bash [path/]cluster_train.sh CONFIG 2:3 2 ... run.output_dir=RUN_FOLDER (not another test's
    elastic launcher, as tests/launcher/test_elastic.py's beside it in the suite)."""
    at = next((i for i, arg in enumerate(cmdline[:3]) if arg.endswith("cluster_train.sh")), None)
    mine = f"run.output_dir={run_folder}" in cmdline
    return mine and at is not None and cmdline[at + 1 : at + 4] == ["config/train_config.yaml", "2:3", "2"]


pytestmark = pytest.mark.root  # SLURM's daemons run as root here


def job_env(slurm: SlurmCluster, tmp: Path, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(slurm.env, LOG_DIR=str(tmp / "logs"), OMP_NUM_THREADS="1", PATH=f"{REPO / '.venv' / 'bin'}:{slurm.env['PATH']}")
    return env | (extra_env or {})


def sbatch(slurm: SlurmCluster, env: dict[str, str], *args: str) -> str:
    """``sbatch ARGS`` from the repo, as a user submits; the job id."""
    done = subprocess.run(["sbatch", "--parsable", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def submit(
    slurm: SlurmCluster,
    tmp: Path,
    synthetic_dir: Path,
    extra_env: dict[str, str] | None = None,
    nodes: int = 2,
    script: str = "slurm/train.sbatch",
    sbatch_args: tuple[str, ...] = (),
    **overrides: object,
) -> str:
    return sbatch(
        slurm,
        job_env(slurm, tmp, extra_env),
        *SMALL_ALLOCATION,
        f"--nodes={nodes}",
        f"--output={tmp}/%x-%j.out",
        *sbatch_args,
        script,
        "config/train_config.yaml",
        *tiny_overrides(synthetic_dir, tmp / "runs", **overrides),
    )


def batch_output(tmp: Path, job: str, name: str = "purrsight-phase2") -> str:
    return (tmp / f"{name}-{job}.out").read_text(errors="replace")


def test_usr1_checkpoints_requeues_and_resumes(slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path) -> None:
    """USR1 to the batch script (what --signal=B:USR1@120 sends before the time limit), in the
    shipped real config's shape: 2 loader workers per rank, 2 micro-batches per optimizer step.

    Every epoch of the job, across the stop and the requeue, trains every sample once, and every
    optimizer step takes 2 micro-batches (each process records what it trains). The run's
    attempt record splits the job's wall time into its parts: they add up, within 2%, to the wall
    time the batch script's own log shows, from its first line to rank 0's "done" line. The job is
    held at step 40 until the stop releases it (tests/helpers.hold_env): USR1 finds it training
    however fast this machine is.
    """
    steps = 48
    real_shape: dict[str, Any] = {"data__num_workers": 2, "data__batch_size": 4, "trainer__accumulate_grad_batches": 2}
    records = tmp_path / "samples"
    never = tmp_path / "released-only-by-a-stop"
    gate = hold_env({40: never}, slurm.env)
    job = submit(
        slurm, tmp_path, synthetic_dir, {**record_samples_env(records, slurm.env), **gate},
        trainer__max_steps=steps, checkpoint__every_n_steps=20, **real_shape,
    )  # fmt: skip
    checkpoints = tmp_path / "runs" / "phase2-tiny" / "checkpoints"
    deadline = time.monotonic() + 300
    while not held_marker(never).exists():
        assert time.monotonic() < deadline, batch_output(tmp_path, job)[-3000:]
        time.sleep(0.5)
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    state = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=500)
    out = batch_output(tmp_path, job)
    assert state == "COMPLETED", out[-4000:] + slurm.log("slurmctld")
    assert "received SIGUSR1: telling every node to checkpoint and stop" in out
    assert "requeueing; the next run resumes" in out and "run 1 after a requeue" in out
    log = (tmp_path / "logs" / "latest_node0.log").read_text()
    resumed = re.search(r"resume=auto: continuing from .*step-(\d+)\.ckpt", log)
    # Signalled while held after step 40: with 2 micro-batches a step the vote started at step 41's
    # first is read at its second, so the stop lands at 41 at the latest; at 40 when step 40's
    # validation pass, which reads the vote at each batch, comes first (docs/RELIABILITY.md).
    assert resumed and 40 <= int(resumed.group(1)) <= 41, log[-3000:]
    assert (checkpoints / f"step-{steps:08d}.ckpt").exists()
    # 128 samples, 2 ranks x 4 x 2 per step: 8 steps an epoch, 6 epochs in 48 steps.
    every_id = {json.loads(line)["id"] for line in (synthetic_dir / "train.jsonl").read_text().splitlines()}
    check_every_sample_once(records, every_id, whole_epochs=6, accumulation=2)
    summary = summarize(read_attempts(tmp_path / "runs" / "phase2-tiny"))
    stopped, requeued = summary.splits
    assert (stopped.how, stopped.end) == ("first start", "stopped by signal 15")
    assert requeued.how == f"new launch, resumed (SLURM job {job}, requeue 1)" and requeued.end == "finished"
    assert requeued.steps == (stopped.steps[1], steps) and stopped.lost == 0  # a stop with a checkpoint loses nothing
    assert requeued.waiting_before > 10  # SLURM's wait before a requeued job may start again (cred_expire)
    # From the batch script's first line to rank 0's last ("done: step 48"): what comes after it,
    # torchrun's agents noticing their workers' exit and leaving the rendezvous (1 s idle, 4 s on a
    # loaded machine), is no attempt's and is left out.
    first = log_time(out.splitlines()[0])
    (done,) = [line for line in out.splitlines() if f"INFO purrsight: done: step {steps}" in line]
    last = log_time(done.split("] ", 1)[1])
    wall = last - first
    total = sum(split.total for split in summary.splits)
    assert abs(total - wall) <= 0.02 * wall, (total, wall, summary)


def test_a_job_that_fails_right_after_each_start_stops_requeueing(slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path) -> None:
    """Every run dies at its first checkpoint write (fault injection) within seconds of starting.

    One node: the count of quick ends is the batch script's, whatever the job's size."""
    fault = {**fault_env("kill_during_checkpoint_write:1", slurm.env), "MAX_RESTARTS": "0", "MAX_QUICK_REQUEUES": "2"}
    job = submit(slurm, tmp_path, synthetic_dir, extra_env=fault, nodes=1, trainer__max_steps=40)
    state = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=400)
    out = batch_output(tmp_path, job)
    assert state == "FAILED", out[-3000:] + slurm.log("slurmctld")
    assert out.count("requeueing; the next run resumes") == 1
    assert "not requeueing: 2 runs in a row ended within 300 s (MAX_QUICK_REQUEUES)" in out
    assert slurm.job_field(job, "Restarts") == "1"


def test_scancel_checkpoints_on_every_node_and_does_not_requeue(slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path) -> None:
    """Plain `scancel`: SLURM sends SIGTERM to every step, then SIGKILL after KillWait (60 s here)."""
    job = submit(slurm, tmp_path, synthetic_dir, trainer__max_steps=100000, checkpoint__every_n_steps=100000)
    logs = [tmp_path / "logs" / f"latest_node{n}.log" for n in (0, 1)]
    deadline = time.monotonic() + 300
    while not (logs[0].exists() and "step 20/" in logs[0].read_text(errors="replace")):
        assert time.monotonic() < deadline, batch_output(tmp_path, job)[-3000:]
        time.sleep(0.5)
    slurm.run("scancel", job)
    assert slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=120) == "CANCELLED"
    while set(slurm.run("sinfo", "-h", "-o", "%T").split()) != {"idle"}:  # the steps have ended
        assert time.monotonic() < deadline, slurm.log("slurmctld")
        time.sleep(1)
    checkpoints = sorted((tmp_path / "runs" / "phase2-tiny" / "checkpoints").glob("step-*.ckpt"))
    assert len(checkpoints) == 1, checkpoints  # no periodic checkpoint was due: this is the signal's
    step = int(checkpoints[0].stem.split("-")[1])
    for log in logs:
        assert f"stopped by SIGTERM at step {step}" in log.read_text(errors="replace"), log.read_text()[-3000:]
    assert "stopped by SIGTERM (scancel or preemption): not requeueing" in batch_output(tmp_path, job)
    assert slurm.job_field(job, "Restarts") == "0"


def unhealthy_second_node_venv(folder: Path) -> Path:
    """A VENV for the launcher whose python fails the disk health check on the job's node 1, on its first run only.

    The check itself is the real one (purrsight.launcher.health, in the node plan); only its threshold is raised
    past any disk, as a full scratch disk would fail it. The wrapper stands in for a node that
    is really broken, which this one-machine cluster cannot have.
    """
    (folder / "bin").mkdir(parents=True)
    real = REPO / ".venv" / "bin" / "python"
    wrapper = folder / "bin" / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$*" == *purrsight.launcher.node_plan* && "${SLURM_NODEID}" == 1 && "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then\n'
        f'  exec {real} "$@" --min-free-gb 1e12\n'
        "fi\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    (folder / "bin" / "activate").write_text(f'source {REPO / ".venv" / "bin" / "activate"}\nPATH="{folder / "bin"}:$PATH"\n')
    return folder


def test_a_node_that_fails_its_health_checks_is_excluded_and_the_job_completes_on_two_good_nodes(
    slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path
) -> None:
    """Also the plain two-node job: the requeued run, on the two good nodes, trains and finishes as any job does."""
    venv = unhealthy_second_node_venv(tmp_path / "venv")
    job = submit(slurm, tmp_path, synthetic_dir, extra_env={"VENV": str(venv)}, trainer__max_steps=20)
    state = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=400)
    out = batch_output(tmp_path, job)
    assert state == "COMPLETED", out[-4000:] + slurm.log("slurmctld")
    named = re.search(r"node (node\d) failed its health checks \(disk\): excluding it from this job", out)
    assert named, out[-3000:]
    bad = named.group(1)
    assert f"requeueing without {bad}; the next run resumes" in out
    assert slurm.job_field(job, "ExcNodeList") == bad
    assert slurm.job_field(job, "Restarts") == "1"
    second_run = slurm.run("scontrol", "show", "hostnames", slurm.job_field(job, "NodeList")).split()
    assert len(second_run) == 2 and bad not in second_run, second_run
    assert (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / "step-00000020.ckpt").exists()
    # The run that completed is an ordinary two-node job: one rank per node, in node order.
    logs = [(tmp_path / "logs" / f"latest_node{n}.log").read_text() for n in (0, 1)]
    assert "process group ready: global rank 0 of 2" in logs[0]
    assert "process group ready: global rank 1 of 2" in logs[1]
    assert re.search(r"2 node\(s\) \S+; master 127\.0\.1\.\d:\d+", out) and "training finished" in out


def test_an_elastic_job_that_loses_a_node_goes_on_with_the_others_and_completes_without_a_requeue(
    slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path
) -> None:
    """MIN_NODES=2 on three nodes (`sbatch --no-kill`): a step per node (slurm/train.sbatch), so one
    node's end is its own. Held at the end of step 8, node 2's task is killed whole (its launcher,
    torchrun's agent, the fork server and the worker, SIGKILL at once: what a node whose GPU fell
    off the bus leaves); its step ends, the job does not, and the two others resume from the step-5
    checkpoint with the global batch kept (12: 3 x 2 x 2, then 2 x 2 x 3) and finish. The data
    position and every sample once per epoch across such a loss: tests/launcher/test_elastic.py."""
    gate = tmp_path / "released-after-the-kill"
    steps = 14
    job = submit(
        slurm, tmp_path, synthetic_dir, {**hold_env({8: gate}, slurm.env), "MIN_NODES": "2"}, nodes=3,
        sbatch_args=("--no-kill",), trainer__max_steps=steps, checkpoint__every_n_steps=5, data__batch_size=2,
        trainer__global_batch_size=12, trainer__val_every_n_steps=1000,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not all(held_marker(gate, rank).exists() for rank in range(3)):
        assert time.monotonic() < deadline and slurm.job_field(job, "JobState") in {"PENDING", "RUNNING"}, batch_output(
            tmp_path, job
        )[-3000:]
        time.sleep(0.5)
    launchers = [p for p in psutil.process_iter(["cmdline"]) if launcher_of_node_2(p.info["cmdline"] or [], tmp_path / "runs")]
    assert len(launchers) == 1, [
        p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if "cluster_train" in str(p.info["cmdline"])
    ]
    kill_whole(launchers[0].pid)
    gate.touch()

    state = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=400)
    out = batch_output(tmp_path, job)
    assert state == "COMPLETED", out[-4000:] + slurm.log("slurmctld")
    assert "3 node(s) node[0-2] (elastic: goes on while 2 remain)" in out
    assert re.search(r"node 2 \(node2\) ended with exit code \d+: the job goes on with 2 of 3 nodes \(MIN_NODES=2\)", out), out
    assert slurm.job_field(job, "Restarts") == "0" and "requeueing" not in out
    log = (tmp_path / "logs" / "latest_node0.log").read_text()
    assert "global batch 12 = 3 processes x 2 (data.batch_size) x 2 micro-batches per step" in log
    assert "global batch 12 = 2 processes x 2 (data.batch_size) x 3 micro-batches per step" in log, log[-3000:]
    assert re.search(r"resuming from checkpoint .*step-00000005\.ckpt", log), log[-3000:]
    assert (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / f"step-{steps:08d}.ckpt").exists()
