"""cluster_train.sh end to end: real launchers as nodes on loopback, real torchrun, real gloo."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import held_marker, hold_env, python_env, read_metrics
from tests.host_scan import SecretWatch
from tests.launcher.conftest import Cluster, descendants, wait_for

# Credentials a user exports for the trackers (W&B, MLflow) and the hub: they reach every rank
# through the environment, never a command line or a file other users may read.
SECRETS = {
    "WANDB_API_KEY": "wandb-0123456789abcdef-secret",
    "MLFLOW_TRACKING_PASSWORD": "mlflow-password-secret-42",
    "MLFLOW_TRACKING_TOKEN": "mlflow-token-secret-43",
    "HF_TOKEN": "hf_tokensecret44",
}


def workers(launcher_pid: int) -> list[psutil.Process]:
    """The training processes under a launcher (torchrun's own command line names the script too)."""
    found = []
    for process in descendants(launcher_pid):
        command = " ".join(process.cmdline())
        if "train_phase2.py" in command and "purrsight.launcher.torchrun" not in command:
            found.append(process)
    return found


def test_unreachable_master_exits_3(cluster: Cluster) -> None:
    start = time.monotonic()
    worker = cluster.start(2, 1, env={"RDZV_TIMEOUT": "3"})
    assert worker.wait(timeout=120) == 3
    elapsed = time.monotonic() - start
    text = worker.text()
    assert f"Cannot connect to master node at 127.0.0.1:{cluster.port}" in text
    assert "firewall" in text and "health: FAIL  master reachable" in text
    assert elapsed < 60, elapsed
    assert not (cluster.run_dir / "checkpoints").exists()


def test_sigterm_checkpoints_within_the_next_step_and_leaves_no_process(cluster: Cluster) -> None:
    """Two ranks held after step 5 (a gate: tests/helpers.hold_env) take the SIGTERM there; the stop
    lands at the end of the step in progress or of the next one, never later (the ranks' vote is
    read a micro-batch late: docs/RELIABILITY.md), with its checkpoint."""
    gate = cluster.tmp / "released-only-by-a-stop"
    env = {"NPROC_PER_NODE": "2", "BACKEND": "gloo", **hold_env({5: gate}, python_env())}
    launcher = cluster.start(1, 0, env=env, trainer__max_steps=100000, logging__every_n_steps=1)
    assert wait_for(lambda: held_marker(gate, 0).exists() and held_marker(gate, 1).exists(), timeout=240), launcher.text()
    children = descendants(launcher.proc.pid)
    assert len(workers(launcher.proc.pid)) == 2
    launcher.proc.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=120)
    assert code == 128 + signal.SIGTERM  # stopped on request, after a checkpoint
    time.sleep(1)
    alive = [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], alive
    log = cluster.node_log(0)
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", log)
    assert stopped and "received SIGTERM" in log, log[-3000:]
    assert 5 <= int(stopped.group(1)) <= 5 + 2, stopped.group(0)  # one micro-batch a step: the vote of 6 is read at 7
    assert (cluster.run_dir / "checkpoints" / f"step-{int(stopped.group(1)):08d}.ckpt").is_file()


def test_two_nodes_worker_first_train_one_job_refuse_a_second_run_and_resume_on_fewer_ranks(
    cluster: Cluster, request: pytest.FixtureRequest
) -> None:
    """Node 1 starts 10 s before its master and waits for it; both then train one job, 2 ranks each.

    Node 0 advertises 127.0.0.3 and node 1 127.0.0.2 (both loopback), so torchrun's
    rendezvous, which orders nodes by address, makes node 1 its group rank 0 (ranks 0 and 1);
    the trainer must still give node 0 global ranks 0 and 1. Both nodes see the same
    run.output_dir: a second start is refused on each before torchrun, RESUME=auto continues
    the run on one rank per node, and the metrics history runs from the first step to the last.
    (A kill of one node's worker and torchrun's restart of both: tests/faults/test_trackers.py.)
    Both nodes hold tracker and hub credentials in their environment: no process of the job shows
    one on its command line, and no file of the job's, nor a launcher's temp file, lets others read one.
    """
    # The launchers' temp files (their plan files) in a folder of this test's own: the scan reads
    # what this test made, not every /tmp/purrsight-* of other programs (which slowed it to one
    # pass in three on a busy machine). A short one: sockets (multiprocessing's fork servers) live
    # in TMPDIR, and a path under pytest's tmp_path overran AF_UNIX's 108 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="ps-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    two_ranks = {"NPROC_PER_NODE": "2", "BACKEND": "gloo", "TMPDIR": str(scratch), **SECRETS}
    with SecretWatch(lambda: list(SECRETS.values()), lambda: [cluster.tmp, scratch]) as watch:
        worker = cluster.start(2, 1, env={"NODE_ADDR": "127.0.0.2", **two_ranks}, trainer__max_steps=10)
        time.sleep(10)
        assert worker.proc.poll() is None, worker.text()  # still waiting for the master, not failed
        master = cluster.start(2, 0, env={"NODE_ADDR": "127.0.0.3", **two_ranks}, trainer__max_steps=10)
        assert master.wait(timeout=300) == 0, master.text()[-3000:]
        assert worker.wait(timeout=120) == 0, worker.text()[-3000:]
    watch.assert_clean(set(SECRETS.values()))
    logs = [cluster.node_log(0), cluster.node_log(1)]
    for node, log in enumerate(logs):
        for local in (0, 1):
            rank, assigned = 2 * node + local, 2 * (1 - node) + local  # node order, not rendezvous order
            assert f"global rank {rank} (torchrun assigned {assigned})" in log, log[-3000:]
            assert f"process group ready: global rank {rank} of 4" in log  # one process group of four
            assert f"[node{node} rank{rank}]" in log
    assert re.search(r"master reachable +127\.0\.0\.1:\d+ answered after (\d+) attempt", logs[1])
    assert "step 10/10" in logs[0]
    for rank in (0, 1):
        link = cluster.log_dir / f"latest_node{rank}.log"
        assert link.is_symlink() and re.fullmatch(rf"cluster_train_\d{{8}}_\d{{6}}_node{rank}\.log", os.readlink(link))
    saved = sorted(p.name for p in (cluster.run_dir / "checkpoints").iterdir())
    assert "step-00000010.ckpt" in saved  # one global step count for the job

    start = time.monotonic()
    refused = [cluster.start(2, node, trainer__max_steps=20) for node in (0, 1)]
    assert [launcher.wait(timeout=120) for launcher in refused] == [2, 2]
    assert time.monotonic() - start < 60  # no node waits for the rendezvous timeout
    for launcher in refused:
        assert "already holds a run (checkpoints up to step 10" in launcher.text()
    assert sorted(p.name for p in (cluster.run_dir / "checkpoints").iterdir()) == saved

    resumed = [cluster.start(2, node, env={"RESUME": "auto"}, trainer__max_steps=20) for node in (0, 1)]
    assert [launcher.wait(timeout=300) for launcher in resumed] == [0, 0], resumed[0].text()[-3000:]
    assert "resume=auto: continuing from" in cluster.node_log(0)
    assert "process group ready: global rank 1 of 2" in cluster.node_log(1)  # four ranks saved it, two resume it
    assert [int(float(r["step"])) for r in read_metrics(cluster.run_dir) if r.get("train/loss")] == [5, 10, 15, 20]
