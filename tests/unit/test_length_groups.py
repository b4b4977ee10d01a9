"""Length-grouped order (data/sampler.py, "length-grouped batches"): a permutation of the plain epoch order within each
window, a function of (seed, epoch) alone, and as exact across resumes on other world sizes as the
plain order (the whole fit loop: test_position_properties.py's grouped example)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purrsight.data.dataset import MultiModalDataset
from purrsight.data.index import RecordTable, SampleIndex, read_index
from purrsight.data.prepared import PreparedSplit, sample_row, write_shard
from purrsight.data.sampler import (
    GlobalPositionSampler,
    batches_done,
    grouped_order,
    grouping_fit,
    grouping_window,
    sample_lengths,
)
from tests.sample_ids import SampleIds


def lengths_of(size: int, seed: int) -> np.ndarray:
    """Log-normal, several-fold spread, ties included (rounded): the shape of instruction data."""
    return np.maximum(1, np.round(np.random.default_rng(seed).lognormal(4.0, 0.6, size) / 8)).astype(np.int64)


def _epoch(size: int, seed: int, epoch: int, lengths: np.ndarray | None, group: int = 4, window: int = 3) -> list[int]:
    sampler = GlobalPositionSampler(size, 1, 0, seed, lengths, group, window)
    sampler.set_epoch(epoch)
    return sampler.epoch_order()


def assert_groups_are_length_bands(window: list[int], lengths: np.ndarray, group: int) -> None:
    """Each group of a window holds neighbours in its length order: no two groups' lengths overlap but at equal lengths."""
    members = [lengths[window[g : g + group]] for g in range(0, len(window), group)]
    bands = sorted((int(band.min()), int(band.max())) for band in members)
    assert all(following[0] >= current[1] for current, following in itertools.pairwise(bands)), bands


settings_fast = settings(max_examples=60, deadline=None)


@settings_fast
@given(st.integers(1, 300), st.integers(0, 2**31), st.integers(0, 5), st.integers(1, 9), st.integers(1, 6))
def test_grouped_order_permutes_the_plain_order_within_each_window(
    size: int, seed: int, epoch: int, group: int, window: int
) -> None:
    lengths = lengths_of(size, seed)
    plain = _epoch(size, seed, epoch, None)
    grouped = _epoch(size, seed, epoch, lengths, group, window)
    span = grouping_window(size, group, window)
    assert span % group == 0 and group <= span <= group * window and (span <= size // 2 or span == group)
    for start in range(0, size, span):
        assert sorted(grouped[start : start + span]) == sorted(plain[start : start + span]), f"window at {start}"
        assert_groups_are_length_bands(grouped[start : start + span], lengths, group)


@settings_fast
@given(st.integers(8, 400), st.integers(0, 2**31))
def test_a_set_smaller_than_two_windows_gets_other_groups_each_epoch(size: int, seed: int) -> None:
    """Version 1 sorted such a set whole every epoch: the same groups, only their order shuffled.
    Distinct lengths, so only the window's cut can change a group."""
    group, window = 4, 200  # a window of 800 samples, more than the set
    lengths = np.random.default_rng(seed).permutation(size).astype(np.int64) + 1
    groups = [
        {frozenset(order[g : g + group]) for g in range(0, size - size % group, group)}
        for order in (_epoch(size, seed, epoch, lengths, group, window) for epoch in range(3))
    ]
    assert groups[0] != groups[1] or groups[1] != groups[2]  # two epochs in a row with the very same groups: at most once


@settings_fast
@given(st.integers(1, 200), st.integers(0, 2**31), st.integers(0, 5))
def test_grouped_order_is_a_function_of_seed_and_epoch(size: int, seed: int, epoch: int) -> None:
    lengths = lengths_of(size, seed)
    first = _epoch(size, seed, epoch, lengths)
    assert first == _epoch(size, seed, epoch, lengths.copy())
    # Another process, another world size and rank: the same global order.
    sampler = GlobalPositionSampler(size, 3, 2, seed, lengths, 4, 3)
    sampler.set_epoch(epoch)
    assert sampler.epoch_order() == first


def take(samplers: list[GlobalPositionSampler], per_rank: int, epoch: int) -> list[int]:
    """``per_rank`` samples from every rank in lockstep, in the order of the job's positions."""
    taken: list[list[int]] = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        iterator = iter(sampler)
        taken.append([next(iterator) for _ in range(per_rank)])
    return [sample for step in zip(*taken, strict=True) for sample in step]


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 400),
    st.integers(0, 2**31),
    st.integers(0, 3),
    st.lists(st.tuples(st.integers(1, 8), st.integers(1, 6)), min_size=1, max_size=4),
)
def test_resumes_on_any_world_sizes_train_every_sample_once_per_epoch(
    size: int, seed: int, epoch: int, shapes: list[tuple[int, int]]
) -> None:
    """Stops after any number of steps on one world, resumed on the next of ``shapes`` (world, batch):
    the samples trained are the grouped order's positions, none twice, fewer than one micro-batch of
    the last world left out."""
    lengths = lengths_of(size, seed)
    order = _epoch(size, seed, epoch, lengths, group=8, window=4)
    trained: list[int] = []
    consumed = 0
    for number, (world, batch) in enumerate(shapes):
        samplers = [GlobalPositionSampler(size, world, rank, seed, lengths, 8, 4) for rank in range(world)]
        for sampler in samplers:
            sampler.resume_at(epoch, consumed, saved_world=world)
        left = (size - consumed) // world // batch  # whole micro-batches left this epoch for this world
        steps = left if number == len(shapes) - 1 else min(left, (seed >> number) % (left + 1))
        taken = take(samplers, steps * batch, epoch)
        consumed_after = consumed + steps * batch * world  # the trainer's count (datamodule.position)
        # The job consumed exactly the next positions of the grouped order, in rank-interleaved order.
        assert taken == order[consumed:consumed_after]
        epoch_batches = (size // world) // batch
        assert batches_done(size, world, batch, consumed_after) == epoch_batches - ((size - consumed_after) // world) // batch
        trained += taken
        consumed = consumed_after
    assert len(trained) == len(set(trained))
    world, batch = shapes[-1]
    assert size - len(trained) < world * batch  # drop_last: less than one micro-batch of all ranks left out


def test_a_group_that_fits_the_world_keeps_each_micro_batch_in_one_group() -> None:
    """Groups of 16, 2 ranks x 4: every micro-batch of all ranks is 8 consecutive positions of one group."""
    size, lengths = 160, lengths_of(160, 1)
    order = grouped_order(list(range(size)), lengths, 16, 5, torch.Generator().manual_seed(0))
    for window in (order[:80], order[80:]):
        assert_groups_are_length_bands(window, lengths, 16)
    assert grouping_fit(16, 4, 2) is None
    assert grouping_fit(16, 3, 2) == (
        "data.length_group_size 16 is no multiple of data.batch_size x processes (3 x 2 = 6): some micro-batches "
        "mix two groups' lengths (more padding; the order is exact all the same); set it to a multiple of 6"
    )


def test_a_prepared_set_reports_its_stored_tokens_and_a_raw_index_its_characters(tmp_path: Path) -> None:
    """The lengths grouping sorts by (docs/DATA.md): a prepared shard's ``input_ids`` per sample; a raw
    index's characters of prompt + response, or of a conversation's turns."""
    rows = [sample_row(f"s{n}", n, list(range(n + 1)), [0] * (n + 1), None, None) for n in (4, 0, 9)]
    write_shard(tmp_path / "train-00000.arrow", rows)
    assert PreparedSplit(tmp_path, [{"name": "train-00000", "rows": 3}], None, None).lengths() == [5, 1, 10]

    turns = [{"role": "user", "content": "¿qué?"}, {"role": "assistant", "content": "sí"}, {"role": "user", "content": '"y"\n'}]
    messages = [*turns, {"role": "assistant", "content": "no"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"id": "b", "messages": messages}) + "\n")
    records = [{"id": "a", "prompt": "abc", "response": "de", "line": 1}, *read_index(tmp_path / "chat.jsonl")]
    index = SampleIndex(tmp_path / "index.jsonl", RecordTable(records))
    lengths = MultiModalDataset(index, text=None, image=None, audio=None).lengths()  # type: ignore[arg-type]
    assert lengths == [5, 5 + 2 + 4 + 2]  # characters, not the escaped JSON's (version 1 counted 60 here)
    assert sample_lengths(SampleIds(4)).tolist() == SampleIds(4).lengths()
