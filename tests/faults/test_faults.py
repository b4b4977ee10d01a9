"""Faults injected into the real stack (cluster_train.sh -> torchrun -> trainer, gloo on CPU).

Each test says which fault it injects and how; none of them fakes the part that fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from purrsight.atomic_file import stale_temp_files
from tests.helpers import (
    DEFAULT_CONFIG,
    REPO,
    check_every_sample_once,
    fault_env,
    python_env,
    record_samples_env,
    run_trainer,
    tiny_overrides,
    train_tiny,
)
from tests.launcher.conftest import Cluster
from tests.preloaded import PreloadedTrainer


def test_kill_during_checkpoint_write_uses_the_previous_checkpoint(cluster: Cluster, synthetic_dir: Path) -> None:
    """The worker is killed with SIGKILL half way through its 2nd checkpoint write (step 20; tests/fault_injection).

    One rank: a torn write is the writer's own; the other ranks' part in a kill (torchrun ending
    and restarting them) is the tracker kill test's (tests/faults/test_trackers.py). In the shipped
    real config's shape (2 loader workers, 2 micro-batches per step): the restart redoes steps 11-20
    and then trains on, and across both attempts every step took 2 micro-batches and no epoch
    trained a sample twice (epoch 0, 16 steps of 8 samples, every sample once)."""
    records = cluster.tmp / "samples"
    env = {"NPROC_PER_NODE": "1", **fault_env("kill_during_checkpoint_write:2", cluster.env())}
    launcher = cluster.start(
        1,
        0,
        env={**env, **record_samples_env(records, env)},
        trainer__max_steps=30,
        checkpoint__every_n_steps=10,
        data__num_workers=2,
        data__batch_size=4,
        trainer__accumulate_grad_batches=2,
    )
    assert launcher.wait(timeout=300) == 0, launcher.text()[-3000:]
    log = cluster.node_log(0)
    assert re.search(r"torchrun restart 1: resuming from .*step-00000010\.ckpt", log), log[-3000:]
    # the step-20 write's own temp file, torn (a whole one would have been renamed to step-00000020.ckpt)
    assert re.search(r"removing \S*/\.step-00000020\.ckpt\.\S+\.tmp, left by an interrupted checkpoint write", log), log[-3000:]
    folder = cluster.run_dir / "checkpoints"
    assert (folder / "step-00000030.ckpt").exists() and not list(folder.glob(".*.tmp"))
    every_id = {json.loads(line)["id"] for line in (synthetic_dir / "train.jsonl").read_text().splitlines()}
    check_every_sample_once(records, every_id, whole_epochs=1, accumulation=2)


def test_corrupted_newest_checkpoint_falls_back(
    synthetic_dir: Path, tmp_path_with_a_finished_run: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    """The session's finished 20-step run, its newest checkpoint truncated: the resume takes the one before."""
    tmp_path = tmp_path_with_a_finished_run
    folder = tmp_path / "phase2-tiny" / "checkpoints"
    newest = folder / "step-00000020.ckpt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a full disk or a bad copy
    (folder / "last.ckpt").unlink()
    again = train_tiny(synthetic_dir, tmp_path, "--resume", preloaded=preloaded_trainer, trainer__max_steps=30)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "step-00000020.ckpt is unreadable (corrupted or truncated)" in again.stderr
    assert f"resuming from checkpoint {folder / 'step-00000010.ckpt'}" in again.stderr
    assert (folder / "step-00000030.ckpt").is_file()


def test_full_disk_stops_with_a_clear_error_and_keeps_earlier_checkpoints(synthetic_dir: Path, tmp_path: Path) -> None:
    """A 2 MiB tmpfs mounted on the checkpoint folder: the first checkpoint (~1.1 MB) fits, the second does not."""
    folder = tmp_path / "phase2-tiny" / "checkpoints"
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True, text=True)
    assert mounted.returncode == 0, f"cannot mount a small filesystem (the test needs root): {mounted.stderr}"
    try:
        done = run_trainer(*tiny_overrides(synthetic_dir, tmp_path, trainer__max_steps=40))
        assert done.returncode == 2, done.stderr[-2000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "No space left on device" in errors[0] and "are intact" in errors[0], errors
        assert "Traceback" not in done.stderr
        state = torch.load(folder / "step-00000010.ckpt", weights_only=True)
        assert state["global_step"] == 10  # the earlier checkpoint is whole
        assert not list(folder.glob(".*.tmp"))
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def default_stop_signals() -> None:
    """In the child before exec: SIGINT and SIGTERM at their defaults, whatever this test inherited.

    A shell hands a background job SIGINT as ignored, and an ignored SIGINT stays ignored in the
    child (prepare keeps it so, as a background job should): the stop would then never arrive.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_during_prepare_ends_every_worker_at_once_and_a_second_prepare_continues(
    stop: signal.Signals, synthetic_dir: Path, tmp_path: Path
) -> None:
    """SIGINT (a terminal's Ctrl-C) or SIGTERM (a scheduler's stop) to prepare's process group with
    2 processes and 32 shards of 2 s each queued, each spent inside the shard's write
    (tests/fault_injection: slow_prepare_shard): every process ends within seconds instead of after
    the queue (30 s), exit 128+N, the shards done keep their receipts, the shards cut short leave no
    temp file, nothing is half-published (a shard whose receipt is missing is not done), and the
    same command then finishes the set."""
    out = tmp_path / "set"
    command = [sys.executable, str(REPO / "train_phase2.py"), "prepare", "--config", str(DEFAULT_CONFIG), "--out", str(out)]
    command += ["--num-proc", "2", "--shard-size", "4", *tiny_overrides(synthetic_dir, tmp_path, data__val_index="null")]
    env = {**python_env(), **fault_env("slow_prepare_shard:2")}
    prepare = subprocess.Popen(
        command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_stop_signals
    )
    assert prepare.stderr is not None
    for line in prepare.stderr:
        if "shard 1/32 done" in line:
            break
    group = [prepare.pid, *(child.pid for child in psutil.Process(prepare.pid).children(recursive=True))]
    stopped = time.monotonic()
    os.killpg(prepare.pid, stop)
    rest = prepare.communicate(timeout=60)[1]  # before the fix: hung here, waiting for the queued shards' workers
    assert prepare.returncode == 128 + stop, rest[-3000:]  # before the fix, SIGTERM: -15, killed with nothing cleaned
    assert time.monotonic() - stopped < 10, rest[-3000:]
    assert not [pid for pid in group if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert f"prepare interrupted by {stop.name}: the shards done are kept" in rest and "Traceback" not in rest, rest[-3000:]
    assert stale_temp_files(out / "train") == []  # before the fix: each worker's shard cut short, left hidden
    receipts = sorted((out / "train").glob("*.json"))
    assert 1 <= len(receipts) < 32 and not (out / "manifest.json").exists()
    shards = {p.stem for p in (out / "train").glob("*.arrow")}
    # Every receipt has its shard. A worker ended between its shard's rename and its receipt
    # leaves a shard without a receipt (at most one per process): not done, so redone below.
    assert {p.stem for p in receipts} <= shards and len(shards - {p.stem for p in receipts}) <= 2
    again = subprocess.run(command, cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "prepared set complete" in again.stdout, again.stderr[-3000:]
    assert f"{32 - len(receipts)} shards to do" in again.stderr
