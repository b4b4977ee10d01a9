"""Training from a prepared set on real ranks (torchrun, gloo): exact resume, and resumes on other
world sizes, batch sizes and accumulations, with numbers that do not divide.

118 samples (the synthetic set's first 118) in the shipped real config's shape: 2 loader workers
per rank (the position is kept by the trainer, not read from the loader, whose sampler runs ahead
of training by the prefetched batches). The uninterrupted run: 2 ranks x 3 samples x 2
micro-batches; 59 samples a rank, so 19 micro-batches an epoch (one sample a rank left out),
10 optimizer steps of which the last takes one micro-batch. Its step-10 checkpoint is written as
epoch 0 ends, its step-5 checkpoint in the middle of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from purrsight.datasets.prepare_job import prepare_set
from tests.helpers import DEFAULT_CONFIG, REPO, python_env, read_metrics, tiny_config, tiny_overrides, torchrun_job

PROBE = REPO / "tests" / "integration" / "ddp_probe.py"
SAMPLES, BATCH, ACCUMULATION, WORKERS = 118, 3, 2, 2
EPOCH_MICRO_BATCHES = (SAMPLES // 2) // BATCH  # 19 on 2 ranks


@pytest.fixture(scope="module")
def prepared(synthetic_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the 120-line index, its prepared set)."""
    root = tmp_path_factory.mktemp("prepared")
    for name in ("images", "audio"):
        (root / name).symlink_to(synthetic_dir / name)
    index = root / "train.jsonl"
    index.write_text("\n".join((synthetic_dir / "train.jsonl").read_text().splitlines()[:SAMPLES]) + "\n")
    config = tiny_config(synthetic_dir, root, data__train_index=str(index))
    assert prepare_set(config, root / "set", processes=2, part=(0, 1), shard_size=32) is not None
    return index, root / "set"


def probed_run(
    ranks: int,
    out: Path,
    synthetic_dir: Path,
    prepared: tuple[Path, Path],
    resume: str | None = None,
    batch: int = BATCH,
    accumulation: int = ACCUMULATION,
    **extra: object,
) -> tuple[str, list[dict[str, Any]]]:
    """ddp_probe.py on ``ranks`` processes (torchrun; a plain process for one); its log and each rank's record."""
    index, folder = prepared
    overrides = tiny_overrides(
        synthetic_dir,
        out,
        data__train_index=index,
        data__prepared=folder,
        data__batch_size=batch,
        trainer__accumulate_grad_batches=accumulation,
        data__num_workers=WORKERS,
        trainer__val_every_n_steps=1000,
        checkpoint__every_n_steps=5,
        checkpoint__keep_last=10,
        run__deterministic="true",
        **extra,
    )
    return run_probe(ranks, out, overrides, resume)


def run_probe(ranks: int, out: Path, overrides: list[str], resume: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """ddp_probe.py with ``overrides`` on ``ranks`` processes (torchrun; a plain process for one):
    its log and each rank's record."""
    args = [str(out), str(DEFAULT_CONFIG), *overrides]
    command = torchrun_job(PROBE, *args, ranks=ranks) if ranks > 1 else [sys.executable, str(PROBE), *args]
    env = {**python_env(), "OMP_NUM_THREADS": "1", **({"PURRSIGHT_RESUME": resume} if resume else {})}
    done = subprocess.run(
        command,
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


@pytest.fixture(scope="module")
def uninterrupted(
    synthetic_dir: Path, prepared: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[dict[str, Any]]]:
    """Two ranks, 20 steps (two epochs), never stopped: (its checkpoint folder, each rank's record)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _, probes = probed_run(2, out, synthetic_dir, prepared, trainer__max_steps=20)
    return out / "phase2-tiny" / "checkpoints", probes


def ids_of_epoch(probes: list[dict[str, Any]], epoch: int) -> list[str]:
    return [sample for probe in probes for seen_epoch, ids in probe["seen"] for sample in ids if seen_epoch == epoch]


def test_a_resume_from_an_epochs_last_step_with_loader_workers_matches_an_uninterrupted_run(
    synthetic_dir: Path, prepared: tuple[Path, Path], uninterrupted: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Two ranks, resumed from step 10 (epoch 0's last, a window of one micro-batch) to 20 == never
    stopped: the same samples at every micro-batch of epoch 1, the same weights. Loader workers
    once drew epoch 0's order again here (Lightning builds the iterator before it moves on)."""
    checkpoints, whole = uninterrupted
    epoch_end = checkpoints / "step-00000010.ckpt"
    assert torch.load(epoch_end, weights_only=True)["purrsight"]["position"]["epoch"] == 1
    _, resumed = probed_run(2, tmp_path / "resumed", synthetic_dir, prepared, resume=str(epoch_end), trainer__max_steps=20)
    for rank in (0, 1):
        assert [epoch for epoch, _ in resumed[rank]["seen"]] == [1] * EPOCH_MICRO_BATCHES
        assert resumed[rank]["seen"] == whole[rank]["seen"][EPOCH_MICRO_BATCHES:]
        assert resumed[rank]["micro_batches"] == whole[rank]["micro_batches"][10:] == [2] * 9 + [1]
        for name, weight in whole[rank]["weights"].items():
            assert torch.allclose(resumed[rank]["weights"][name], weight, atol=1e-6, rtol=0), name


def test_resumes_on_other_ranks_batches_and_accumulations_train_every_sample_of_each_epoch_once(
    synthetic_dir: Path, prepared: tuple[Path, Path], uninterrupted: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """From the step-5 checkpoint (60 of epoch 0's samples trained) onto 3 ranks x 3 x 3, then at
    step 11 (mid epoch 1) onto 1 rank x 4 x 2, to step 32 (one step into epoch 3). Each epoch: no
    sample twice, fewer than one micro-batch of the world that ended it left out; each window
    whole but the first after a change and an epoch's last; the logged step the optimizer step."""
    checkpoints, whole = uninterrupted
    before = [{"seen": probe["seen"][: 5 * ACCUMULATION]} for probe in whole]  # the 5 steps before the checkpoint
    step5 = str(checkpoints / "step-00000005.ckpt")
    log_three, three = probed_run(
        3, tmp_path / "b", synthetic_dir, prepared, resume=step5, batch=3, accumulation=3, trainer__max_steps=11
    )
    assert "resuming on 3 processes, saved on 2: epoch 0 continues at sample 60 of 118" in log_three
    assert "global batch 12 -> 27 samples per optimizer step" in log_three
    _, one = probed_run(1, tmp_path / "b", synthetic_dir, prepared, resume="auto", batch=4, accumulation=2, trainer__max_steps=32)

    every = {json.loads(line)["id"] for line in prepared[0].read_text().splitlines()}
    for epoch, runs, left_below in ((0, before + three, 3 * 3), (1, three + one, 4), (2, one, 4)):
        taken = ids_of_epoch(runs, epoch)
        twice = [sample for sample, count in Counter(taken).items() if count > 1]
        assert not twice, f"trained twice in epoch {epoch}: {twice}"
        assert len(every - set(taken)) < left_below, f"left out of epoch {epoch}: {sorted(every - set(taken))}"
    # 3 ranks: 13 micro-batches an epoch, 7 counted done at sample 60: windows [7, 9) [9, 12) [12, 13),
    # then epoch 1's first three. 1 rank: 29 an epoch, 20 done at sample 81 of epoch 1.
    assert all(probe["micro_batches"] == [2, 3, 1, 3, 3, 3] for probe in three)
    assert one[0]["micro_batches"] == [2, 2, 2, 2, 1] + [2] * 14 + [1] + [2]
    logged = [int(row["step"]) for row in read_metrics(tmp_path / "b" / "phase2-tiny") if row.get("train/loss")]
    assert logged and all(step % 5 == 0 for step in logged), logged  # logging.every_n_steps=5 of optimizer steps
    assert {10, 15, 20, 25, 30} <= set(logged)
