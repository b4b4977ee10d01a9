"""Two real ranks under torchrun (gloo, CPU) on this machine."""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from tests.helpers import (
    CHANCE_ACCURACY,
    DEFAULT_CONFIG,
    LEARNED_NATS,
    REPO,
    column,
    noise_in,
    python_env,
    read_metrics,
    tiny_overrides,
    torchrun_job,
)


def train_two_probed_ranks(run_dir: Path, overrides: list[str]) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """ddp_probe.py on two ranks under torchrun; the run's output and each rank's probe record."""
    command = torchrun_job(REPO / "tests" / "integration" / "ddp_probe.py", str(run_dir), str(DEFAULT_CONFIG), *overrides)
    result = subprocess.run(command, cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result, [torch.load(run_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


def test_two_ranks_train_on_disjoint_shards_with_identical_weights_and_all_reduce_once_per_optimizer_step(
    synthetic_dir: Path, tmp_path: Path
) -> None:
    """Learning under DDP, with docs/SCALING.md's settings at 128 nodes: accumulate_grad_batches,
    bucket_cap_mb, the process-group timeout. Checkpointing is left to the start (auto): the two
    ranks agree on the smallest memory and rank 0's choice, said once."""
    overrides = tiny_overrides(
        synthetic_dir,
        tmp_path,
        trainer__max_steps=120,  # the tokens projector passes chance + 0.2 between steps 80 and 120 here
        trainer__val_every_n_steps=40,
        trainer__accumulate_grad_batches=2,  # 2 x 4 samples per optimizer step and rank, as 8 without accumulation
        data__batch_size=4,  # 16 micro-batches per epoch and rank: every optimizer step whole
        distributed__bucket_cap_mb=100,
        distributed__timeout_s=1234,
        checkpoint__every_n_steps=40,
        model__llm__gradient_checkpointing="auto",
    )
    result, ranks = train_two_probed_ranks(tmp_path, overrides)
    assert noise_in(result.stdout + result.stderr) == []
    chosen = re.findall(r"\[rank (\d)\] INFO purrsight\.training\.auto_settings: (.*)", result.stderr)
    assert [(rank, line.split(" (", 1)[0]) for rank, line in chosen] == [("0", "model.llm.gradient_checkpointing auto: off")], (
        chosen
    )
    assert "host memory / 2 processes" in chosen[0][1]  # the node's memory shared by its two ranks

    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name]), f"{name} differs between ranks"

    per_epoch: list[dict[int, set[str]]] = [defaultdict(set), defaultdict(set)]
    for rank, probe in enumerate(ranks):
        assert len(probe["seen"]) == 240  # micro-batches: both ranks take the same number
        assert probe["allreduces"] == 120  # optimizer steps: the other micro-batches skip the all-reduce (no_sync)
        # and no broadcast: Lightning's of its SIGTERM flag (one before each micro-batch, with a host
        # read) is skipped; ranks agree on a stop by the stop vote's asynchronous all-reduce
        assert probe["broadcasts"] == 0
        assert probe["bucket_bytes"] == 100 * 2**20
        assert probe["timeout_s"] == 1234
        for epoch, ids in probe["seen"]:
            per_epoch[rank][epoch].update(ids)
    for epoch in per_epoch[0]:
        assert per_epoch[0][epoch] and not per_epoch[0][epoch] & per_epoch[1][epoch], f"epoch {epoch} shards overlap"

    rows = read_metrics(tmp_path / "phase2-tiny")
    losses = column(rows, "train/loss")
    assert losses[0] - sum(losses[-2:]) / 2 > LEARNED_NATS, losses
    assert column(rows, "val/accuracy")[-1] > CHANCE_ACCURACY + 0.2
    assert (tmp_path / "phase2-tiny" / "checkpoints" / "step-00000120.ckpt").is_file()
