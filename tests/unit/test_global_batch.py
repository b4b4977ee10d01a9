"""trainer.global_batch_size: each world gets the accumulation whose global batch is nearest the one
asked, exactly where it divides; the config's own accumulation holds when it is unset."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from purrsight.config import ConfigError, load_config
from purrsight.global_batch import accumulation_for, resolve_global_batch
from tests.helpers import DEFAULT_CONFIG


@given(asked=st.integers(1, 4096), world=st.integers(1, 128), batch=st.integers(1, 64))
@example(asked=48, world=3, batch=8)  # 2 exactly
@example(asked=64, world=3, batch=8)  # 64/24 = 2.67: 3 (72) is nearer than 2 (48)
@example(asked=36, world=3, batch=8)  # 1.5: a tie, the smaller (24), the shorter step
@example(asked=8, world=16, batch=8)  # below one micro-batch each: 1 at least
def test_the_accumulation_gives_the_nearest_global_batch_and_the_exact_one_where_it_divides(
    asked: int, world: int, batch: int
) -> None:
    chosen = accumulation_for(asked, world, batch)
    assert chosen >= 1
    distance = abs(chosen * world * batch - asked)
    # No other count is nearer, and a count as near is not smaller (ties take the shorter step).
    for other in range(1, asked // (world * batch) + 3):
        assert abs(other * world * batch - asked) > distance or (abs(other * world * batch - asked) == distance and other >= chosen)
    if asked % (world * batch) == 0:
        assert chosen * world * batch == asked


def test_an_elastic_world_keeps_the_global_batch_and_names_it_in_one_line(tmp_path: Path) -> None:
    config = load_config(DEFAULT_CONFIG, ["data.batch_size=8", "trainer.global_batch_size=48"])
    three, made = resolve_global_batch(config, 3)
    assert three.trainer.accumulate_grad_batches == 2 and made.samples == 48 and made.product == "3 x 8 x 2 = 48"
    line = "global batch 48 = 3 processes x 8 (data.batch_size) x 2 micro-batches per step (trainer.global_batch_size 48)"
    assert made.line() == line
    two, made = resolve_global_batch(config, 2)  # a node of three lost: the accumulation rises
    assert two.trainer.accumulate_grad_batches == 3 and made.samples == 48
    five, made = resolve_global_batch(config, 5)  # 48 / 40: not a whole count, the nearest
    assert five.trainer.accumulate_grad_batches == 1 and made.samples == 40
    assert made.line().endswith("the nearest to trainer.global_batch_size 48, which 5 x 8 does not divide") and not made.exact
    both = ["data.batch_size=8", "trainer.global_batch_size=48", "trainer.accumulate_grad_batches=4"]
    configured = load_config(DEFAULT_CONFIG, both)
    assert resolve_global_batch(configured, 3)[1].line().endswith("; trainer.accumulate_grad_batches 4 is not used")
    assert config.trainer.accumulate_grad_batches == 1  # the loaded config is left as it was

    unset = load_config(DEFAULT_CONFIG, ["data.batch_size=8", "trainer.accumulate_grad_batches=4"])
    same, made = resolve_global_batch(unset, 2)
    assert same is unset and made.samples == 64
    assert made.line() == "global batch 64 = 2 processes x 8 (data.batch_size) x 4 (trainer.accumulate_grad_batches)"


@pytest.mark.parametrize("value", ["0", "-8", '"64"'])
def test_a_global_batch_that_is_no_positive_count_is_refused_by_name(value: str) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.global_batch_size"):
        load_config(DEFAULT_CONFIG, [f"trainer.global_batch_size={value}"])


def test_the_memory_estimate_counts_the_accumulation_the_global_batch_sets() -> None:
    """4 GPUs x 8 samples for 64 a step: 2 micro-batches, so fsdp keeps a window's whole gradients."""
    from purrsight.estimate.memory import estimate

    plain = estimate(load_config(DEFAULT_CONFIG, ["data.batch_size=8"]), 4).per_gpu["fsdp"]
    accumulating = estimate(load_config(DEFAULT_CONFIG, ["data.batch_size=8", "trainer.accumulate_grad_batches=2"]), 4)
    asked = estimate(load_config(DEFAULT_CONFIG, ["data.batch_size=8", "trainer.global_batch_size=64"]), 4)
    assert asked.per_gpu["fsdp"] == accumulating.per_gpu["fsdp"] != plain
