"""What decides the training order, compared at a resume (runs/data_order.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from purrsight.runs.data_order import ORDER_KEY, DataChangedError, differences
from purrsight.runs.data_position import DataPosition
from purrsight.training.datamodule import Phase2DataModule
from tests.helpers import tiny_config

SAVED = {"samples": 128, "content": "index:" + "a" * 64, "seed": 1234, "group_by_length": True, "length_group_size": 256,
         "length_group_window": 64}  # fmt: skip


def test_each_difference_is_named_with_then_and_now() -> None:
    now = {**SAVED, "seed": 7, "length_group_window": 32, "content": "prepared:" + "b" * 64}
    assert differences(SAVED, now) == [
        f"content: index {'a' * 12} -> prepared {'b' * 12}",
        "run.seed: 1234 -> 7",
        "data.length_group_window: 64 -> 32",
    ]
    assert differences(SAVED, dict(SAVED)) == []


def test_group_shapes_count_only_while_grouping_is_on_at_both_ends() -> None:
    ungrouped = {key: SAVED[key] for key in ("samples", "content", "seed")} | {"group_by_length": False}
    assert differences(SAVED, ungrouped) == ["data.group_by_length: True -> False"]
    assert differences(ungrouped, {**ungrouped}) == []


def test_an_old_checkpoint_without_the_record_resumes_unchecked_and_a_new_one_is_checked(
    synthetic_dir: Path, tmp_path: Path
) -> None:
    data = Phase2DataModule(tiny_config(synthetic_dir, tmp_path))
    data.setup("fit")
    position = DataPosition(1, 32, 2, 8, 1)
    assert data._order_checked({"purrsight": {}}, position) == position  # written before 2026-11-27
    assert data._order_checked({"purrsight": {ORDER_KEY: data.data_order()}}, position) == position
    with pytest.raises(DataChangedError, match=r"training samples: 100 -> 128"):
        data._order_checked({"purrsight": {ORDER_KEY: {**data.data_order(), "samples": 100}}}, position)
    data.config.data.on_data_change = "next_epoch"
    moved = data._order_checked({"purrsight": {ORDER_KEY: {**data.data_order(), "samples": 100}}}, position)
    assert (moved.epoch, moved.consumed) == (2, 0) and data.resume_note and "epoch 2 from sample 0" in data.resume_note
    at_boundary = DataPosition(3, 0, 2, 8, 1)  # an epoch not begun: it is the next one
    assert data._order_checked({"purrsight": {ORDER_KEY: {**data.data_order(), "seed": 1}}}, at_boundary).epoch == 3
