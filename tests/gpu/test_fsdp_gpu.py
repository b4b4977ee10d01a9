"""distributed.strategy=fsdp on CUDA GPUs, where they exist (skipped, saying so, elsewhere).

The CPU suite runs FSDP on gloo under 32-true (tests/integration/test_fsdp.py); here the path a
real run takes: NCCL and bf16-mixed, whose MixedPrecisionPolicy gathers trainable weights in
bf16 and reduces their gradients in fp32. Two ranks need two GPUs (NCCL refuses two ranks on
one); the policy's dtypes are checked on one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import gpu_env
from tests.helpers import DEFAULT_CONFIG, REPO, column, free_port, noise_in, read_metrics, tiny_overrides, trainable_state

RUN = "phase2-tiny"


def with_repo(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONPATH": str(REPO), "PATH": f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"}


POLICY_ON_ONE_GPU = """
import json, sys, torch, torch.distributed as dist
from pathlib import Path
from torch.distributed.device_mesh import init_device_mesh
from tests.fsdp_watch import bf16_policy_dtypes
from tests.helpers import tiny_config
from purrsight.training.datamodule import Phase2DataModule
from purrsight.training.model_builder import build_model

dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
config = tiny_config(Path(sys.argv[1]), Path(sys.argv[2]))
data = Phase2DataModule(config)
data.setup("fit")
batch = next(iter(data.train_dataloader()))
model = build_model(config, torch.bfloat16).model
seen = bf16_policy_dtypes(torch.device("cuda", 0), init_device_mesh("cuda", (1,)), model, batch)
seen["device"] = str(next(model.parameters()).device)
dist.destroy_process_group()
print(json.dumps(seen))
"""


@pytest.mark.gpu(count=1)
def test_bf16_mixed_gathers_trainables_in_bf16_and_reduces_in_fp32_on_a_gpu(synthetic_dir: Path, tmp_path: Path) -> None:
    """One rank (an NCCL group of one) on GPU 0: the tiny model sharded under bf16-mixed's
    policy, one forward under autocast and a backward."""
    env = {**with_repo(gpu_env()), "CUDA_VISIBLE_DEVICES": "0"}
    done = subprocess.run(
        [sys.executable, "-c", POLICY_ON_ONE_GPU, str(synthetic_dir), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "lora_gathered": "torch.bfloat16",
        "projector_gathered": "torch.bfloat16",
        "trainable_sharded": "torch.float32",
        "gradients": "torch.float32",
        "frozen": "torch.bfloat16",
        "loss_finite": "True",
        "device": "cuda:0",
    }


def two_gpus(script: Path, out: Path, synthetic_dir: Path, *args: str, **overrides: object) -> str:
    """``script`` on two GPUs under torchrun, NCCL and bf16-mixed; its output."""
    settings = {"trainer__precision": "bf16-mixed", "distributed__backend": "nccl", "logging__every_n_steps": 1, **overrides}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(free_port()), str(script), *args, *tiny_overrides(synthetic_dir, out, **settings)]
    env = {**with_repo(gpu_env()), "CUDA_VISIBLE_DEVICES": "0,1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.gpu(count=2)
def test_fsdp_on_two_gpus_reduces_once_per_window_in_bf16_mixed_as_ddp_trains(synthetic_dir: Path, tmp_path: Path) -> None:
    """tests/integration/test_fsdp.py's window test on NCCL under bf16-mixed: windows of 3, 3 and 2
    micro-batches, one reduce-scatter per unit with trainable parameters per window, LoRA gathered
    in bf16, one unit at a time gathered, and losses and weights near DDP's under the same
    precision (bf16 rounds differently in the two: the policy casts once per gather, autocast at
    each op)."""
    run = {"trainer__accumulate_grad_batches": 3, "trainer__max_steps": 6, "trainer__val_every_n_steps": 100}
    run |= {"checkpoint__every_n_steps": 6}
    two_gpus(REPO / "train_phase2.py", tmp_path / "ddp", synthetic_dir, "--config", str(DEFAULT_CONFIG), **run)
    probe = REPO / "tests" / "integration" / "fsdp_probe.py"
    out = tmp_path / "fsdp"
    output = two_gpus(probe, out, synthetic_dir, str(out), str(DEFAULT_CONFIG), distributed__strategy="fsdp", **run)
    assert noise_in(output) == []
    assert "process group ready: global rank 1 of 2 (nccl" in output
    for rank in (torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)):
        assert rank["micro_batches"] == [3, 3, 2, 3, 3, 2]
        assert rank["reduce_scatters"] == [rank["units_with_gradients"]] * 6 and rank["units_with_gradients"] == 4
        assert rank["lora_gathered"] == "torch.bfloat16"
        assert 0 < rank["gathered_peak"] <= rank["one_unit_bound"]
    ours, theirs = (column(read_metrics(tmp_path / name / RUN), "train/loss") for name in ("fsdp", "ddp"))
    assert len(ours) == 6 and all(loss == loss for loss in ours)  # finite
    assert ours == pytest.approx(theirs, rel=2e-2)
    step6 = Path(RUN) / "checkpoints" / "step-00000006.ckpt"
    mine, reference = trainable_state(tmp_path / "fsdp" / step6), trainable_state(tmp_path / "ddp" / step6)
    assert mine.keys() == reference.keys()
    for name in mine:
        assert torch.allclose(mine[name].float(), reference[name].float(), atol=2e-2), name
