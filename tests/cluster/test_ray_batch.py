"""slurm/ray.sbatch and slurm/prepare.sbatch on the real three-node SLURM cluster (see conftest.py).

Each job starts real Ray (a head and a worker node, `ray start` on the test nodes' own loopback
addresses), submits the training through purrsight.ray_engine.submit and stops its Ray at the end.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from purrsight.launcher.ray_node import JobPorts, ray_processes, temp_dir
from tests.cluster.conftest import SlurmCluster
from tests.cluster.test_slurm import batch_output, job_env, sbatch, submit
from tests.helpers import REPO, check_every_sample_once, log_time, rank0_steps, record_samples_env, tiny_overrides

pytest.importorskip("ray", reason="slurm/ray.sbatch needs the ray extra (scripts/test.sh installs it)")
pytestmark = pytest.mark.root  # SLURM's daemons run as root here

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}
# Memory per node: SLURM's limit sizes each node's object store (30% of it), and keeps four
# Ray nodes on this machine from claiming /dev/shm four times over.
RAY_ALLOCATION = ("--mem=1000",)


def no_ray_left(job: str, slots: int = 2) -> None:
    for slot in range(slots):
        temp = temp_dir(job, slot)
        assert ray_processes(temp) == [] and not temp.exists(), f"job {job}'s Ray left on slot {slot}"


def test_two_ray_jobs_on_the_same_nodes_one_from_a_set_prepared_by_an_array_and_a_stop_that_checkpoints(
    slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path
) -> None:
    """docs/DATA.md's array (slurm/prepare.sbatch, 2 parts), then two ray.sbatch jobs at once on
    node0 and node1: A trains from the index to its end, B from the prepared set until, well after
    A has ended, SIGTERM to its batch script (`scancel --batch --signal=TERM`) stops it.

    Each job's ports come from its own id, each node's Ray is sized from the allocation and logs
    to its own file; A's teardown leaves B's Ray training on the same nodes; B's stop leaves a
    checkpoint on every worker and no requeue; neither leaves a Ray process or temp dir behind.
    """
    env = job_env(slurm, tmp_path)
    prepared = tmp_path / "prepared"
    array = sbatch(
        slurm, env, "--array=0-1", "--cpus-per-task=1", "--time=20", f"--output={tmp_path}/prepare-%A_%a.out",
        "slurm/prepare.sbatch", "config/train_config.yaml", str(prepared), "--shard-size", "32",
        *tiny_overrides(synthetic_dir, tmp_path / "runs"),
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while slurm.run("squeue", "-h", "-j", array, check=False).strip():
        assert time.monotonic() < deadline, slurm.run("squeue", check=False)
        time.sleep(1)
    parts = [(tmp_path / f"prepare-{array}_{task}.out").read_text() for task in (0, 1)]
    assert "part 0/2" in parts[0] and "part 1/2" in parts[1], parts
    assert json.loads((prepared / "manifest.json").read_text()), parts

    on_shared_nodes = ("--nodelist=node0,node1", *RAY_ALLOCATION)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first = submit(
        slurm, tmp_path / "a", synthetic_dir, script="slurm/ray.sbatch", sbatch_args=on_shared_nodes, trainer__max_steps=20,
    )  # fmt: skip
    second = submit(
        slurm, tmp_path / "b", synthetic_dir, script="slurm/ray.sbatch", sbatch_args=on_shared_nodes,
        trainer__max_steps=100000, checkpoint__every_n_steps=100000, data__prepared=str(prepared),
    )  # fmt: skip
    assert slurm.wait_state(first, ENDED, timeout=400) == "COMPLETED", batch_output(tmp_path / "a", first, "purrsight-ray")[-3000:]
    out_b = tmp_path / "b" / f"purrsight-ray-{second}.out"
    (a_down,) = [line for line in batch_output(tmp_path / "a", first, "purrsight-ray").splitlines() if "Ray on every node" in line]
    deadline = time.monotonic() + 300
    # B trains on after A's teardown: two of its steps stamped after it.
    while len([when for when, _ in rank0_steps(out_b.read_text(errors="replace")) if when > log_time(a_down)]) < 2:
        assert time.monotonic() < deadline, out_b.read_text(errors="replace")[-3000:]
        time.sleep(1)
    slurm.run("scancel", "--batch", "--signal=TERM", second)
    slurm.wait_state(second, ENDED, timeout=300)
    outs = {job: batch_output(tmp_path / name, job, "purrsight-ray") for job, name in ((first, "a"), (second, "b"))}

    for job, name in ((first, "a"), (second, "b")):
        out = outs[job]
        assert f"submit --address http://127.0.1.1:{JobPorts.of(job).dashboard} " in out, out[-3000:]
        assert "all 2 node(s) up: node0, node1" in out
        for node, address in (("node0", "127.0.1.1"), ("node1", "127.0.1.2")):
            log = (tmp_path / name / "logs" / f"ray-{job}" / f"{node}.log").read_text()
            sized = re.search(rf"at {address}: \d+ CPUs \(affinity mask\), 0 GPUs \(SLURM\), object store 0\.3 GiB", log)
            assert sized, log[-2000:]
            assert f"stopping this job's Ray on {node}" in log
        no_ray_left(job)
    assert JobPorts.of(first).base != JobPorts.of(second).base
    assert "training finished" in outs[first]
    assert (tmp_path / "a" / "runs" / "phase2-tiny" / "checkpoints" / "step-00000020.ckpt").exists()
    assert f"data: 128 train samples (prepared {prepared})" in outs[second]
    stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint", outs[second])
    assert stopped, outs[second][-3000:]
    assert (tmp_path / "b" / "runs" / "phase2-tiny" / "checkpoints" / f"step-{int(stopped.group(1)):08d}.ckpt").exists()
    assert "stopped by SIGTERM (scancel or preemption): not requeueing; the checkpoints are kept" in outs[second]
    assert slurm.job_field(second, "Restarts") == "0"


def failing_ray_on_the_second_node(folder: Path) -> Path:
    """A VENV whose `ray` fails to start on the job's second node, on the first run only.

    Stands in for a node whose Ray cannot start (a full /tmp, a broken install), which this
    one-machine cluster cannot have; every other start runs the real `ray`.
    """
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "activate").write_text(f'source {REPO / ".venv" / "bin" / "activate"}\nPATH="{folder / "bin"}:$PATH"\n')
    fake = folder / "bin" / "ray"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'second="$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | sed -n 2p)"\n'
        'if [[ "$1" == start && "${SLURMD_NODENAME}" == "${second}" && "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then\n'
        '  echo "ray: cannot start on ${SLURMD_NODENAME} (test)" >&2\n'
        "  exit 1\n"
        "fi\n"
        f'exec {REPO / ".venv" / "bin" / "ray"} "$@"\n'
    )
    fake.chmod(0o755)
    return folder


def test_a_node_whose_ray_fails_to_start_is_excluded_then_usr1_requeues_and_the_run_resumes(
    slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path
) -> None:
    """In the shipped real config's shape: 2 loader workers per rank, 2 micro-batches per step.

    Run 1: the second node's Ray fails to start; the wait ends at once, names it (exit 3), and
    the job requeues without it. Run 2, on the two other nodes, trains until USR1 (what
    --signal=B:USR1@120 sends before the time limit) stops it with a checkpoint and requeues.
    Run 3 resumes from that checkpoint and finishes; across the runs every epoch trains every
    sample once (each Ray Train worker records what it trains).
    """
    steps = 80
    records = tmp_path / "samples"
    extra = {**record_samples_env(records, slurm.env), "VENV": str(failing_ray_on_the_second_node(tmp_path / "venv"))}
    job = submit(
        slurm, tmp_path, synthetic_dir, extra_env=extra, script="slurm/ray.sbatch", sbatch_args=RAY_ALLOCATION,
        trainer__max_steps=steps, checkpoint__every_n_steps=20,
        data__num_workers=2, data__batch_size=4, trainer__accumulate_grad_batches=2,
    )  # fmt: skip
    checkpoints = tmp_path / "runs" / "phase2-tiny" / "checkpoints"
    deadline = time.monotonic() + 400
    while not (checkpoints / "step-00000040.ckpt").exists():
        running = time.monotonic() < deadline and slurm.job_field(job, "JobState") not in ENDED
        assert running, batch_output(tmp_path, job, "purrsight-ray")[-3000:]
        time.sleep(0.5)
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    state = slurm.wait_state(job, ENDED, timeout=500)
    out = batch_output(tmp_path, job, "purrsight-ray")
    assert state == "COMPLETED", out[-4000:] + slurm.log("slurmctld")

    named = re.search(r"error: node (node\d)'s Ray step ended before the cluster was up", out)
    assert named, out[-3000:]
    bad = named.group(1)
    assert f"node {bad} failed its health checks (ray start): excluding it from this job" in out
    assert f"requeueing without {bad}; the next run resumes" in out
    assert slurm.job_field(job, "ExcNodeList") == bad and slurm.job_field(job, "Restarts") == "2"
    assert "received SIGUSR1: stopping the training (every worker saves a checkpoint)" in out
    assert "run ended with code 143 after SIGUSR1: requeueing; the next run resumes" in out
    stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint", out)
    resumed = re.search(r"resume=auto: continuing from .*step-(\d+)\.ckpt", out)
    assert stopped and resumed and resumed.group(1) == f"{int(stopped.group(1)):08d}", out[-3000:]
    assert (checkpoints / f"step-{steps:08d}.ckpt").exists()
    # 128 samples, 2 workers x 4 x 2 per step: 8 steps an epoch, 10 epochs in 80 steps.
    every_id = {json.loads(line)["id"] for line in (synthetic_dir / "train.jsonl").read_text().splitlines()}
    check_every_sample_once(records, every_id, whole_epochs=10, accumulation=2)
    no_ray_left(job)
