"""pbs/train.pbs under a simulated PBS job.

No PBS server can be installed on these machines, so this stands in for one: a PBS_NODEFILE
with each host repeated per core (as PBS writes it), PBS_O_WORKDIR and PBS_JOBID set as qsub
sets them, and tests/cluster/fake_pbsdsh as `pbsdsh`, which runs each node's command on this
machine with PBS_NODENUM set. Everything the script starts after that is real: the launchers,
torchrun, gloo and the trainer.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil

from tests.helpers import REPO, tiny_overrides


def run_pbs(
    tmp: Path, synthetic_dir: Path, workdir: Path = REPO, **extra_env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    fake_bin = tmp / "bin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "pbsdsh").unlink(missing_ok=True)
    (fake_bin / "pbsdsh").symlink_to(REPO / "tests" / "cluster" / "fake_pbsdsh")
    nodefile = tmp / "nodefile"
    nodefile.write_text("127.0.0.1\n127.0.0.1\nlocalhost\nlocalhost\n")  # two hosts, two cores each
    overrides = tiny_overrides(synthetic_dir, tmp / "runs", trainer__max_steps=20)
    env = {
        "PATH": f"{fake_bin}:{REPO / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp),
        "PBS_NODEFILE": str(nodefile),
        "PBS_O_WORKDIR": str(workdir),
        "PBS_JOBID": "4242.pbs-server",
        "CONFIG": "config/train_config.yaml",
        "OVERRIDES": " ".join(overrides),
        "LOG_DIR": str(tmp / "logs"),
        "OMP_NUM_THREADS": "1",
        "RDZV_TIMEOUT": "120",
        "FAKE_PBSDSH_CALLS": str(tmp / "calls"),
        **extra_env,
    }
    spooled = tmp / "4242.pbs-server.SC"  # PBS runs a copy of the script from its spool folder
    spooled.write_text((REPO / "pbs" / "train.pbs").read_text())
    start = time.monotonic()
    done = subprocess.run(["bash", str(spooled)], cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    return done, time.monotonic() - start


def test_every_node_gets_its_rank_and_training_completes(synthetic_dir: Path, tmp_path: Path) -> None:
    done, _ = run_pbs(tmp_path, synthetic_dir)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "2 node(s): 127.0.0.1 localhost; master 127.0.0.1:24242" in done.stdout  # 20000 + job id 4242
    assert sorted((tmp_path / "calls").read_text().split()) == ["0", "2"]  # first vnode of each host
    assert "process group ready: global rank 0 of 2" in (tmp_path / "logs" / "latest_node0.log").read_text()
    assert "process group ready: global rank 1 of 2" in (tmp_path / "logs" / "latest_node1.log").read_text()
    assert (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / "step-00000020.ckpt").exists()
    assert "training finished on all 2 node(s)" in done.stdout


def test_one_failing_node_fails_the_job_and_stops_the_others(synthetic_dir: Path, tmp_path: Path) -> None:
    done, elapsed = run_pbs(tmp_path, synthetic_dir, FAKE_PBSDSH_FAIL_INDEX="2")
    assert done.returncode == 7, (done.stdout + done.stderr)[-4000:]
    assert "node 1 failed with exit code 7: stopping the other nodes" in done.stdout
    assert elapsed < 60, elapsed  # node 0 was stopped, not left waiting for its rendezvous timeout
    time.sleep(2)
    leftover = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or []) and "cluster_train" in " ".join(p.info["cmdline"] or [])
    ]
    assert leftover == []


def test_the_jobs_environment_reaches_every_node(synthetic_dir: Path, tmp_path: Path) -> None:
    """What the job exported arrives on each node, by name and by family (NCCL_*, TORCH_*, ...).

    The launcher on the nodes is replaced by a script that writes its environment to a file:
    this test is about what train.pbs hands over (the tests above run the real launcher).
    fake_pbsdsh starts each task in a bare environment, as pbsdsh does.
    """
    workdir = tmp_path / "work"
    (workdir / "pbs").mkdir(parents=True)
    for name in ("train.pbs", "nodes.sh", "node_task.sh"):
        (workdir / "pbs" / name).write_bytes((REPO / "pbs" / name).read_bytes())
        (workdir / "pbs" / name).chmod(0o755)
    dump = workdir / "cluster_train.sh"
    dump.write_text('#!/bin/sh\nenv > "$PWD/env.node$3"\n')
    dump.chmod(0o755)
    sent = {
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "NCCL_SOCKET_IFNAME": "ib0",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "HF_HOME": "/shared/hf cache",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "LD_LIBRARY_PATH": "/opt/nccl/lib",
        "MAX_RESTARTS": "5",
    }
    done, _ = run_pbs(tmp_path, synthetic_dir, workdir=workdir, UNRELATED_SETTING="stays", **sent)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for rank in (0, 1):
        received = dict(line.split("=", 1) for line in (workdir / f"env.node{rank}").read_text().splitlines() if "=" in line)
        assert {key: received.get(key) for key in sent} == sent
        assert "UNRELATED_SETTING" not in received  # forwarded by name or family only
        assert received["PBS_NODENUM"] in {"0", "2"}
