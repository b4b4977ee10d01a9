"""The GPU path, where CUDA GPUs exist (skipped, saying so, elsewhere; CI has none).

Everything else in the suite hides the GPUs (tests/conftest.py), so these are the tests
that see them: the probe and health checks, the launcher's choices, bf16 training on one
GPU, and NCCL across two.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import gpu_env, host_gpu_count
from tests.helpers import DEFAULT_CONFIG, REPO, free_port, noise_in, read_metrics, tiny_overrides


def with_repo(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONPATH": str(REPO), "PATH": f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"}


@pytest.mark.gpu
def test_probe_and_health_see_every_gpu() -> None:
    code = (
        "import purrsight.launcher.probe as p, purrsight.launcher.health as h; "
        "print(p.probe().gpus); print(h.check_gpus(expect_gpus=True))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=with_repo(gpu_env()), timeout=120)
    assert done.returncode == 0, done.stderr
    count, health = done.stdout.splitlines()[:2]
    assert int(count) == host_gpu_count()
    assert health.startswith(f"{host_gpu_count()} GPU(s), CUDA ") and "NCCL " in health


@pytest.mark.gpu
def test_launcher_starts_one_process_per_gpu_with_nccl(tmp_path: Path) -> None:
    env = {**with_repo(gpu_env()), "LOG_DIR": str(tmp_path / "logs")}
    env.pop("BACKEND", None)
    env.pop("NPROC_PER_NODE", None)
    done = subprocess.run(["./cluster_train.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"--nproc-per-node {host_gpu_count()}" in done.stdout
    assert "NCCL_" in done.stdout  # the NCCL settings block is exported for the nccl backend


@pytest.mark.gpu
def test_bf16_training_on_one_gpu(synthetic_dir: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(synthetic_dir, tmp_path, trainer__precision="bf16-mixed", trainer__max_steps=20)
    command = [sys.executable, str(REPO / "train_phase2.py"), "--config", str(DEFAULT_CONFIG), *overrides]
    env = {**with_repo(gpu_env()), "CUDA_VISIBLE_DEVICES": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GPU available: True (cuda), used: True" in done.stderr
    assert noise_in(done.stdout + done.stderr) == []
    losses = [float(row["train/loss"]) for row in read_metrics(tmp_path / "phase2-tiny") if row.get("train/loss")]
    assert losses and all(loss == loss for loss in losses)  # finite: no NaN from the bf16 path


@pytest.mark.gpu(count=2)
def test_two_ranks_with_nccl(synthetic_dir: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(synthetic_dir, tmp_path, trainer__max_steps=20, distributed__backend="nccl")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(free_port()), str(REPO / "train_phase2.py"), "--config", str(DEFAULT_CONFIG), *overrides]
    env = {**with_repo(gpu_env()), "CUDA_VISIBLE_DEVICES": "0,1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "process group ready: global rank 1 of 2 (nccl" in done.stderr
    assert (tmp_path / "phase2-tiny" / "checkpoints" / "step-00000020.ckpt").is_file()


@pytest.mark.gpu
def test_a_training_step_on_a_gpu_never_synchronises(tmp_path: Path) -> None:
    """CUDA's sync debug mode set to error for step 12 of a bf16 run on one GPU (the stop vote in
    a one-rank gloo group): any call that makes the host wait for the device fails the run. The
    data: a LLaVA file in length-grouped batches, media placed at their placeholders.
    On CUDA the optimizer is the fused AdamW, whose step counters stay on the device."""
    code = (
        "import sys, torch; from pathlib import Path; "
        "from tests.host_syncs import CudaSyncsFail, count_step; "
        "from purrsight.training.optim import build_optimizer; from purrsight.config import OptimConfig; "
        "opt, _ = build_optimizer([torch.nn.Parameter(torch.ones(2, device='cuda'))], OptimConfig(), 10); "
        "assert opt.defaults['fused'], 'AdamW is not fused on CUDA'; "
        "counter = count_step(Path(sys.argv[1]), 14, 12, ['trainer.precision=bf16-mixed'], [CudaSyncsFail(11)]); "
        "assert 'media_at' in counter.batch_keys, counter.batch_keys; print(counter.report())"
    )
    env = {**with_repo(gpu_env()), "CUDA_VISIBLE_DEVICES": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
