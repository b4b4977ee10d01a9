"""``data.batch_size: auto`` and ``model.llm.gradient_checkpointing: auto`` through the trainer (one
CPU process: the device is the host's memory), then resumed: kept, then overridden.

The search and the rules over all numbers: tests/unit/test_auto_fit.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import yaml

from tests.helpers import train_tiny
from tests.preloaded import PreloadedTrainer

AUTO = {"data__batch_size": "auto", "model__llm__gradient_checkpointing": "auto", "trainer__global_batch_size": 20}
QUIET = {"trainer__val_every_n_steps": 1000, "checkpoint__every_n_steps": 2, "logging__every_n_steps": 1}


def chosen_lines(stderr: str) -> list[str]:
    return re.findall(r"INFO purrsight\.training\.auto_settings: (.*)", stderr)


def test_auto_fills_the_global_batch_and_a_resume_keeps_the_choice_until_a_value_is_given(
    synthetic_dir: Path, tmp_path: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    """20 samples a step on one process: the host holds them all in one micro-batch of the tiny
    model, without checkpointing; the log's first lines say the three. The resume keeps both as its
    checkpoint's run chose them; a micro-batch of 7 given on the next resume wins (3 of them: 21,
    the nearest to 20), checkpointing still kept, and training goes on from the position."""
    run = tmp_path / "phase2-tiny"
    first = train_tiny(synthetic_dir, tmp_path, preloaded=preloaded_trainer, trainer__max_steps=4, **AUTO, **QUIET)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = chosen_lines(first.stderr)
    assert len(lines) == 2, first.stderr[-3000:]
    assert re.fullmatch(
        r"data\.batch_size auto: 20 \(the estimate 0\.\d\d GB a device, of [\d.]+ GB on host memory; .*\)", lines[0]
    )
    assert lines[1] == "model.llm.gradient_checkpointing auto: off (not needed at this micro-batch)"
    assert "global batch 20 = 1 processes x 20 (data.batch_size) x 1 micro-batches per step" in first.stderr
    saved = torch.load(run / "checkpoints" / "step-00000004.ckpt", map_location="cpu", weights_only=True)["purrsight"]
    assert saved["auto_chosen"] == ["data.batch_size", "model.llm.gradient_checkpointing"]
    assert yaml.safe_load(saved["config"])["data"]["batch_size"] == 20
    assert yaml.safe_load((run / "resolved_config.yaml").read_text())["model"]["llm"]["gradient_checkpointing"] is False

    kept = train_tiny(
        synthetic_dir, tmp_path, "--resume", "newest", preloaded=preloaded_trainer, trainer__max_steps=6, **AUTO, **QUIET
    )
    assert kept.returncode == 0, kept.stderr[-3000:]
    kept_from = "as the checkpoint's run chose it (give a value to choose again)"
    assert chosen_lines(kept.stderr) == [
        f"data.batch_size auto: 20, {kept_from}",
        f"model.llm.gradient_checkpointing auto: off, {kept_from}",
    ]

    overridden = {**AUTO, "data__batch_size": 7}
    given = train_tiny(
        synthetic_dir, tmp_path, "--resume", "newest", preloaded=preloaded_trainer, trainer__max_steps=9, **overridden, **QUIET
    )
    assert given.returncode == 0, given.stderr[-3000:]
    assert chosen_lines(given.stderr) == [f"model.llm.gradient_checkpointing auto: off, {kept_from}"]
    assert "global batch 21 = 1 processes x 7 (data.batch_size) x 3 micro-batches per step: the nearest to" in given.stderr
    assert "global batch 20 -> 21 samples per optimizer step" in given.stderr  # the change, said as any change is
    assert torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 9
