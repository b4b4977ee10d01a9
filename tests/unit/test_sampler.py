"""The training sampler: DistributedSampler's order, and a position that survives a change of world size."""

from __future__ import annotations

import pytest
from torch.utils.data.distributed import DistributedSampler

from purrsight.data.sampler import GlobalPositionSampler, batches_done


@pytest.mark.parametrize(("size", "world"), [(128, 1), (128, 2), (130, 3), (97, 4)])
def test_a_fresh_epoch_is_distributed_samplers_order(size: int, world: int) -> None:
    """Runs and checkpoints made with DistributedSampler(shuffle, drop_last) continue unchanged."""
    for epoch in (0, 3):
        for rank in range(world):
            ours = GlobalPositionSampler(size, world, rank, seed=1234)
            theirs = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=True, seed=1234, drop_last=True)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def take(samplers: list[GlobalPositionSampler], per_rank: int, epoch: int) -> tuple[list[int], dict[str, int]]:
    """``per_rank`` samples from every rank (as lockstep DDP steps take them); what they were, and the
    position a checkpoint then records (the trainer's count: start + samples trained x ranks)."""
    taken = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        iterator = iter(sampler)
        taken += [next(iterator) for _ in range(per_rank)]
    first = samplers[0]
    return taken, {"epoch": epoch, "consumed": first.start + per_rank * first.num_replicas, "world_size": first.num_replicas}


def world(size: int, count: int, state: dict[str, int] | None) -> list[GlobalPositionSampler]:
    samplers = [GlobalPositionSampler(size, count, rank, seed=7) for rank in range(count)]
    for sampler in samplers:
        if state is not None:
            sampler.resume_at(state["epoch"], state["consumed"], state["world_size"])
    return samplers


def test_resumes_on_two_then_one_then_three_ranks_take_every_sample_once() -> None:
    size, batch = 120, 4
    first, state = take(world(size, 2, None), 5 * batch, epoch=2)  # 5 steps on 2 ranks: 40 samples
    assert state["consumed"] == 40 and state["world_size"] == 2
    one = world(size, 1, state)
    assert len(one[0]) == 120  # an epoch on this world size; the trainer counts 10 batches of 4 as done
    assert batches_done(size, 1, batch, state["consumed"]) == 10
    second, state = take(one, 5 * batch, epoch=2)  # 5 steps on 1 rank: 20 more
    assert state["consumed"] == 60
    three = world(size, 3, state)
    assert [len(s) for s in three] == [40] * 3 and batches_done(size, 3, batch, 60) == 5
    third, _ = take(three, 20, epoch=2)  # the rest of the epoch: 60 samples, 20 a rank
    epoch = first + second + third
    assert sorted(epoch) == list(range(size))  # none twice, none missing


def test_the_order_continues_exactly_as_one_uninterrupted_job() -> None:
    """On the same world size, a resume yields what the uninterrupted sampler would have."""
    size = 64
    whole = [list(GlobalPositionSampler(size, 2, rank, seed=7)) for rank in range(2)]
    _, state = take(world(size, 2, None), 10, epoch=0)
    resumed = world(size, 2, state)
    for rank, sampler in enumerate(resumed):
        sampler.set_epoch(0)
        assert list(sampler) == whole[rank][10:]


def test_a_position_waits_for_its_epoch_and_is_dropped_after_it(caplog: pytest.LogCaptureFixture) -> None:
    """Lightning iterates the loader once before it sets the resumed epoch: that pass must not
    use up the position; a position of an epoch already past is dropped, with a warning."""
    sampler = GlobalPositionSampler(32, 2, 0, seed=3)
    sampler.resume_at(epoch=1, consumed=10, saved_world=2)
    assert len(list(sampler)) == 16 and sampler.start == 0  # epoch 0, iterated early: the whole epoch
    sampler.set_epoch(1)
    assert len(list(sampler)) == 11 and sampler.start == 10 and sampler.pass_samples == 11
    assert len(list(sampler)) == 16  # applied once: the next pass starts the epoch over
    sampler.resume_at(epoch=0, consumed=30, saved_world=2)
    with caplog.at_level("WARNING", logger="purrsight.data.sampler"):
        assert len(list(sampler)) == 16
    assert "sampler position in epoch 0 ignored in epoch 1" in caplog.text


def test_the_next_epoch_starts_from_its_beginning() -> None:
    sampler = GlobalPositionSampler(32, 2, 0, seed=3)
    sampler.resume_at(epoch=0, consumed=30, saved_world=2)
    assert len(list(sampler)) == 1
    sampler.set_epoch(1)
    assert len(list(sampler)) == 16 and sampler.start == 0 and sampler.pass_samples == 16


@pytest.mark.parametrize(("size", "world", "batch", "consumed"), [(120, 1, 4, 40), (120, 3, 4, 60), (130, 3, 8, 0), (97, 4, 5, 64)])
def test_batches_done_plus_those_to_come_make_the_epoch(size: int, world: int, batch: int, consumed: int) -> None:
    samplers = world_at(size, world, consumed)
    to_come = len(list(samplers[0])) // batch
    assert batches_done(size, world, batch, consumed) + to_come == len(samplers[0]) // batch


def world_at(size: int, count: int, consumed: int) -> list[GlobalPositionSampler]:
    return world(size, count, {"epoch": 0, "consumed": consumed, "world_size": 2})


def test_a_change_of_world_size_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    sampler = GlobalPositionSampler(64, 1, 0, seed=3)
    with caplog.at_level("WARNING", logger="purrsight.data.sampler"):
        sampler.resume_at(epoch=0, consumed=20, saved_world=2)
        GlobalPositionSampler(64, 2, 0, seed=3).resume_at(epoch=0, consumed=20, saved_world=2)  # same world: quiet
    assert [r.getMessage() for r in caplog.records] == [
        "resuming on 1 processes, saved on 2: epoch 0 continues at sample 20 of 64, "
        "every rank's shard derived from that position (no sample repeated or left out)"
    ]
