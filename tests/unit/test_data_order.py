"""What decides the training order, compared at a resume (runs/data_order.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from purrsight.runs.data_order import ORDER_KEY, DataChangedError, differences, only_the_grouping_version
from purrsight.runs.data_position import DataPosition
from purrsight.training.datamodule import Phase2DataModule
from tests.helpers import tiny_config

SAVED = {"samples": 128, "content": "index:" + "a" * 64, "seed": 1234, "group_by_length": True, "length_group_size": 256,
         "length_group_window": 64, "grouping": 2}  # fmt: skip


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


def test_a_checkpoint_of_the_first_grouping_resumes_where_its_order_is_the_same_and_is_refused_where_not(
    synthetic_dir: Path, tmp_path: Path
) -> None:
    """Version 2 of the length grouping (data/sampler.py) changed the order of sets under two windows
    and of raw conversations. A checkpoint recorded before it (no "grouping" key) resumes where this
    set's order is the same, and is refused, naming the version, where it is not."""
    version_1 = {key: value for key, value in SAVED.items() if key != "grouping"}
    assert differences(version_1, SAVED) == ["the length grouping's version (data/sampler.py, GROUPING_VERSION): 1 -> 2"]
    assert only_the_grouping_version(version_1, SAVED)
    assert not only_the_grouping_version({**version_1, "seed": 1}, SAVED)
    position = DataPosition(1, 32, 2, 8, 1)
    # 128 samples: windows of 8 x 8 = 64 are half the set, as in version 1; 8 x 16 = 128 are not.
    for window, same in ((8, True), (16, False)):
        config = tiny_config(synthetic_dir, tmp_path, data__group_by_length=True, data__length_group_size=8)
        config.data.length_group_window = window
        data = Phase2DataModule(config)
        data.setup("fit")
        old = {key: value for key, value in data.data_order().items() if key != "grouping"}
        if same:
            assert data._order_checked({"purrsight": {ORDER_KEY: old}}, position) == position
        else:
            with pytest.raises(DataChangedError, match=r"the length grouping's version .*: 1 -> 2"):
                data._order_checked({"purrsight": {ORDER_KEY: old}}, position)
    # A raw LLaVA file of the same 128 samples, at the windows that kept the order above: its lengths
    # were its JSON's in version 1 (whatever its records read as now): refused.
    from tests.format_sets import items_of, write_llava

    llava = write_llava(tmp_path, items_of(synthetic_dir, 128))
    config = tiny_config(
        synthetic_dir, tmp_path, data__group_by_length=True, data__length_group_size=8, data__train_index=str(llava)
    )
    config.data.length_group_window = 8
    data = Phase2DataModule(config)
    data.setup("fit")
    old = {key: value for key, value in data.data_order().items() if key != "grouping"}
    with pytest.raises(DataChangedError, match=r"the length grouping's version .*: 1 -> 2"):
        data._order_checked({"purrsight": {ORDER_KEY: old}}, position)
