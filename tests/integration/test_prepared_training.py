"""Training from a prepared set on real ranks (torchrun, gloo): exact resume, and resumes on other world sizes.

120 samples (the synthetic set's first 120), 4 per rank and step, in the shipped real config's
shape: 2 loader workers per rank and 2 micro-batches of 2 per optimizer step (the position is
kept by the trainer, not read from the loader, whose sampler runs ahead of training by the
prefetched batches, nor from Lightning's micro-batch counts). Both tests resume from the
step-5 checkpoint of one uninterrupted 10-step run on 2 ranks, the periodic checkpoint a
requeue finds. Epoch 0 is cut as a requeue onto other node counts would cut it: 5 steps on 2
ranks (40 samples), 5 on 1 rank (20), then the remaining 60 on 3 ranks, 20 each; then the job
moves back to 1 rank mid-epoch 1. Every sample of every epoch must be trained exactly once.
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
from tests.helpers import DEFAULT_CONFIG, REPO, free_port, python_env, tiny_config, tiny_overrides

PROBE = REPO / "tests" / "integration" / "ddp_probe.py"
SAMPLES, BATCH, ACCUMULATION, WORKERS = 120, 2, 2, 2


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
    ranks: int, out: Path, synthetic_dir: Path, prepared: tuple[Path, Path], resume: str | None = None, **extra: object
) -> tuple[str, list[dict[str, Any]]]:
    """ddp_probe.py on ``ranks`` processes (torchrun; a plain process for one); its log and each rank's record."""
    index, folder = prepared
    overrides = tiny_overrides(
        synthetic_dir,
        out,
        data__train_index=index,
        data__prepared=folder,
        data__batch_size=BATCH,
        data__num_workers=WORKERS,
        trainer__accumulate_grad_batches=ACCUMULATION,
        trainer__val_every_n_steps=1000,
        checkpoint__every_n_steps=5,
        checkpoint__keep_last=10,
        run__deterministic="true",
        **extra,
    )
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1"]
        launch += ["--master-port", str(free_port())]
    env = {**python_env(), "OMP_NUM_THREADS": "1", **({"PURRSIGHT_RESUME": resume} if resume else {})}
    done = subprocess.run(
        [*launch, str(PROBE), str(out), str(DEFAULT_CONFIG), *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


@pytest.fixture(scope="module")
def uninterrupted(
    synthetic_dir: Path, prepared: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[dict[str, Any]]]:
    """Two ranks, 10 steps, never stopped: (its step-5 checkpoint, each rank's record)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _, probes = probed_run(2, out, synthetic_dir, prepared, trainer__max_steps=10)
    return out / "phase2-tiny" / "checkpoints" / "step-00000005.ckpt", probes


def ids_of_epoch(probes: list[dict[str, Any]], epoch: int) -> list[str]:
    return [sample for probe in probes for seen_epoch, ids in probe["seen"] for sample in ids if seen_epoch == epoch]


def test_resumes_on_one_then_three_then_one_rank_train_every_sample_of_each_epoch_once(
    synthetic_dir: Path, prepared: tuple[Path, Path], uninterrupted: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    checkpoint, whole = uninterrupted
    two = [{"seen": probe["seen"][: 5 * ACCUMULATION]} for probe in whole]  # the 5 steps on 2 ranks before the checkpoint
    log_one, one = probed_run(1, tmp_path / "b", synthetic_dir, prepared, resume=str(checkpoint), trainer__max_steps=10)
    assert "resuming on 1 processes, saved on 2: epoch 0 continues at sample 40 of 120" in log_one
    assert "global batch 8 -> 4 samples per optimizer step" in log_one and "optim.lr is not rescaled" in log_one
    log_three, three = probed_run(3, tmp_path / "b", synthetic_dir, prepared, resume="auto", trainer__max_steps=17)
    assert "resuming on 3 processes, saved on 1: epoch 0 continues at sample 60 of 120" in log_three
    # Back to one rank at step 17 (2 steps into epoch 1 on 3 ranks): the rest of epoch 1, a whole
    # epoch 2 (30 steps of 4) and one step of epoch 3. A length counted in the other world's batches
    # would end epoch 1 or 2 early (samples left out) or run past the sampler.
    _, last = probed_run(1, tmp_path / "b", synthetic_dir, prepared, resume="auto", trainer__max_steps=72)

    every = {json.loads(line)["id"] for line in prepared[0].read_text().splitlines()}
    for epoch, runs in ((0, two + one + three), (1, three + last), (2, last)):
        taken = ids_of_epoch(runs, epoch)
        twice = [sample for sample, count in Counter(taken).items() if count > 1]
        assert not twice, f"trained twice in epoch {epoch}: {twice}"
        assert set(taken) == every, f"left out of epoch {epoch}: {sorted(every - set(taken))}"
    assert [len(p["seen"]) for p in three] == [7 * ACCUMULATION] * 3  # 5 steps end epoch 0, then 2 steps of epoch 1
    assert [epoch for epoch, _ in last[0]["seen"]] == [1] * 24 * ACCUMULATION + [2] * 30 * ACCUMULATION + [3] * ACCUMULATION
    for probes in (one, three, last):  # every optimizer step after each resume took whole accumulations
        assert all(probe["micro_batches"] == [ACCUMULATION] * len(probe["micro_batches"]) for probe in probes)


def test_a_mid_epoch_resume_from_a_prepared_set_matches_an_uninterrupted_run(
    synthetic_dir: Path, prepared: tuple[Path, Path], uninterrupted: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Two ranks: resumed from step 5 of 10 == never stopped (same samples, same weights)."""
    checkpoint, whole = uninterrupted
    _, resumed = probed_run(2, tmp_path / "resumed", synthetic_dir, prepared, resume=str(checkpoint), trainer__max_steps=10)
    for rank in (0, 1):
        assert resumed[rank]["seen"] == whole[rank]["seen"][5 * ACCUMULATION :]
        assert resumed[rank]["micro_batches"] == whole[rank]["micro_batches"][5:] == [ACCUMULATION] * 5
        for name, weight in whole[rank]["weights"].items():
            assert torch.allclose(resumed[rank]["weights"][name], weight, atol=1e-6, rtol=0), name
