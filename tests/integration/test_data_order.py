"""A resume onto a training set, seed or grouping other than its checkpoint's (runs/data_order.py):
refused with one line naming each difference, or, with data.on_data_change=next_epoch, the next
epoch from sample 0 on the set as it is now, every sample of it once, said in the log and report.md."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tests.helpers import record_samples_env, train_tiny
from tests.preloaded import PreloadedTrainer


def index_copy(synthetic_dir: Path, path: Path, extra: int = 0) -> set[str]:
    """The synthetic training index at ``path`` (media paths made absolute), with ``extra`` more
    samples (copies under new ids); the ids it holds."""
    records = [json.loads(line) for line in (synthetic_dir / "train.jsonl").read_text().splitlines()]
    records += [{**records[i % len(records)], "id": f"added-{i}"} for i in range(extra)]
    for record in records:
        for media in ("image", "audio"):
            if media in record:
                record[media] = str(synthetic_dir / record[media])
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return {record["id"] for record in records}


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def test_a_resume_onto_changed_data_is_refused_by_name_or_starts_the_next_epoch_on_the_new_set(
    synthetic_dir: Path, tmp_path: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    """128 samples, 8 a step: stopped at step 20, 4 steps into epoch 1. 20 samples appended
    (148: 18 whole steps an epoch, 4 samples left out by design), then length grouping; each
    resume is refused naming what changed, and the checkpoints stay. With next_epoch, epoch 2
    trains 144 of the 148 samples, each once, from sample 0."""
    index = tmp_path / "train.jsonl"
    index_copy(synthetic_dir, index)
    common = {"data__train_index": str(index), "checkpoint__keep_last": 5}
    first = train_tiny(synthetic_dir, tmp_path, preloaded=preloaded_trainer, trainer__max_steps=20, **common)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = tmp_path / "phase2-tiny" / "checkpoints"
    kept = sorted(path.name for path in checkpoints.iterdir())

    every_id = index_copy(synthetic_dir, index, extra=20)
    grown = train_tiny(synthetic_dir, tmp_path, "--resume", preloaded=preloaded_trainer, trainer__max_steps=40, **common)
    assert grown.returncode == 2, grown.stderr[-3000:]
    (line,) = errors(grown.stderr)
    assert "training samples: 128 -> 148" in line and "content: index " in line and "data.on_data_change=next_epoch" in line, line
    assert "run.seed" not in line and "Traceback" not in grown.stderr

    index_copy(synthetic_dir, index)  # the set as it was, byte for byte; grouped by length now
    grouped = train_tiny(
        synthetic_dir, tmp_path, "--resume", preloaded=preloaded_trainer, trainer__max_steps=40, data__group_by_length="true",
        **common,
    )  # fmt: skip
    assert grouped.returncode == 2, grouped.stderr[-3000:]
    (line,) = errors(grouped.stderr)
    assert "data.group_by_length: False -> True" in line and "training samples" not in line and "content" not in line, line
    every_id = index_copy(synthetic_dir, index, extra=20)
    assert sorted(path.name for path in checkpoints.iterdir()) == kept  # nothing written, nothing lost

    records = tmp_path / "samples"
    records.mkdir()
    steps = 20 + 18  # the rest of the run: epoch 2 whole on the grown set
    onward = train_tiny(
        synthetic_dir, tmp_path, "--resume", trainer__max_steps=steps, data__on_data_change="next_epoch",
        env=record_samples_env(records), **common,
    )  # fmt: skip
    assert onward.returncode == 0, onward.stderr[-3000:]
    assert "resume: the training order changed since the checkpoint (training samples: 128 -> 148; content: index" in onward.stderr
    assert "epoch 2 starts at sample 0" in onward.stderr
    taken = [
        sample
        for path in records.glob("*.jsonl")
        for record in map(json.loads, path.read_text().splitlines())
        if "ids" in record
        for sample in record["ids"]
    ]
    assert not [sample for sample, count in Counter(taken).items() if count > 1]
    assert len(taken) == 18 * 8 and set(taken) <= every_id and any(sample.startswith("added-") for sample in taken)
    report = (tmp_path / "phase2-tiny" / "report.md").read_text()
    assert "data changed (training samples: 128 -> 148" in report and "epoch 2 from sample 0" in report
