"""Faults injected into the real stack (cluster_train.sh -> torchrun -> trainer, gloo on CPU).

Each test says which fault it injects and how; none of them fakes the part that fails.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import torch

from tests.helpers import check_every_sample_once, fault_env, record_samples_env, run_trainer, tiny_overrides, train_tiny
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
