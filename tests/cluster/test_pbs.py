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


def run_pbs(tmp: Path, synthetic_dir: Path, **extra_env: str) -> tuple[subprocess.CompletedProcess[str], float]:
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
        "PBS_O_WORKDIR": str(REPO),
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
