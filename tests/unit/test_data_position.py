"""The data position in our checkpoint entry, and Lightning's loop counters derived from it."""

from __future__ import annotations

from typing import Any

import pytest

from purrsight.config import dump_config, load_config
from purrsight.internals.lightning_loops import BATCH_PROGRESS
from purrsight.runs.data_position import DataPosition, InexactPositionError, PositionError, saved_position
from purrsight.training.datamodule import Phase2DataModule
from tests.helpers import DEFAULT_CONFIG


def checkpoint_with(current_ready: int, epoch: int = 0, **purrsight: Any) -> dict[str, Any]:
    """The parts of a Lightning checkpoint saved at a training batch's end that a resume reads."""
    current = {"ready": current_ready, "started": current_ready, "processed": current_ready, "completed": current_ready - 1}
    return {"epoch": epoch, "purrsight": purrsight, "loops": {"fit_loop": {"state_dict": {}, BATCH_PROGRESS: {"current": current}}}}


def test_positions_round_trip_and_refuse_nonsense() -> None:
    position = DataPosition(epoch=2, consumed=40, world_size=4, batch_size=8, accumulation=4)
    assert DataPosition.from_dict(position.as_dict()) == position and position.global_batch == 128
    for bad in ({"epoch": 0}, {**position.as_dict(), "world_size": 0}, "consumed=3"):
        with pytest.raises(PositionError):
            DataPosition.from_dict(bad)


def test_checkpoints_of_the_landed_main_give_their_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before this entry the position lay in torchdata's loader state: in the training sampler's own
    state without loader workers (exact), inside a worker snapshot with them (then the fit loop's
    batch count, in the saving world's units, is the position)."""
    saved_shape: dict[str, Any] = {"config": dump_config(load_config(DEFAULT_CONFIG, ["data.batch_size=4"], check_paths=False))}
    in_process = checkpoint_with(5, **saved_shape)
    sampler = {"epoch": 0, "consumed": 40, "world_size": 2}
    in_process["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [{"_sampler_iter_state": {"sampler_state": sampler}}]
    assert saved_position(in_process, 1) == DataPosition(0, 40, 2, 4, 1)
    shape = ["data.batch_size=2", "trainer.accumulate_grad_batches=2"]
    with_workers = checkpoint_with(6, epoch=1, config=dump_config(load_config(DEFAULT_CONFIG, shape, check_paths=False)))
    snapshot = {"_snapshot": {"_main_snapshot": {"_sampler_iter_state": {"sampler_state": {**sampler, "consumed": 64}}}}}
    with_workers["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [snapshot]
    assert saved_position(with_workers, 1) == DataPosition(1, 6 * 2 * 2, 2, 2, 2)
    # Before torchdata's loader state, or with torchdata's own sampler ({"yielded": N}): no world
    # size kept. Without the set's size no position (the caller only compares batch shapes); in
    # epoch 0 the step count cannot tell the world: refused until PURRSIGHT_SAVED_WORLD_SIZE says.
    no_loader_state = checkpoint_with(3, **saved_shape)
    assert saved_position(no_loader_state, 2) is None
    with pytest.raises(PositionError, match="set PURRSIGHT_SAVED_WORLD_SIZE"):
        saved_position(no_loader_state, 2, size=64)
    monkeypatch.setenv("PURRSIGHT_SAVED_WORLD_SIZE", "2")
    assert saved_position(no_loader_state, 3, size=64) == DataPosition(0, 3 * 4 * 2, 2, 4, 1)
    monkeypatch.setenv("PURRSIGHT_SAVED_WORLD_SIZE", "two")
    with pytest.raises(PositionError, match="PURRSIGHT_SAVED_WORLD_SIZE='two' is not a number of processes"):
        saved_position(no_loader_state, 3, size=64)
    monkeypatch.delenv("PURRSIGHT_SAVED_WORLD_SIZE")
    # Epoch 1, 3 micro-batches into it, step 11: 64 samples in batches of 4 make 8 steps an epoch on 2
    # processes (16 on 1, 5 on 3): only 2 fits.
    later = checkpoint_with(3, epoch=1, **saved_shape)
    later["global_step"] = 11
    later["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [{"_sampler_iter_state": {"yielded": 12}}]
    assert saved_position(later, 2, size=64) == DataPosition(1, 3 * 4 * 2, 2, 4, 1)
    with pytest.raises(PositionError, match="its step count says 2 and this run has 3"):
        saved_position(later, 3, size=64)
    assert saved_position({"epoch": 0, "purrsight": {}}, 1) is None  # not a fit's checkpoint


@pytest.mark.parametrize(
    ("saved", "epoch", "done"),
    [
        (DataPosition(0, 40, 2, 2, 2), 0, 20),  # 40 samples on 1 rank in batches of 2: 10 steps of 2
        (DataPosition(0, 42, 3, 2, 1), 0, 21),  # exact: Lightning finds the epoch's last batch by this count
        (DataPosition(1, 0, 2, 2, 2), 0, 60),  # saved as epoch 0 ended: Lightning counts the whole epoch
    ],
)
def test_a_resume_counts_done_batches_in_this_runs_units(saved: DataPosition, epoch: int, done: int) -> None:
    """One rank, batches of 2, 2 micro-batches per optimizer step, 120 samples: 60 batches an epoch."""
    config = load_config(DEFAULT_CONFIG, ["data.batch_size=2", "trainer.accumulate_grad_batches=2"], check_paths=False)
    data = Phase2DataModule(config)
    data.train_set = list(range(120))  # type: ignore[assignment]  # only its length is read
    saved_ready = saved.consumed // (saved.batch_size * saved.world_size) or 7  # the saving run's count, at a step end
    checkpoint = checkpoint_with(saved_ready, epoch, position=saved.as_dict(), config=dump_config(config))
    checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [{"an earlier version's": "loader state"}]
    data.resume_from(checkpoint)
    assert checkpoint["loops"]["fit_loop"][BATCH_PROGRESS]["current"]["ready"] == done
    assert "combined_loader" not in checkpoint["loops"]["fit_loop"]["state_dict"]  # today's loaders take none
    sampler = data.train_dataloader().sampler
    sampler.set_epoch(saved.epoch)  # type: ignore[attr-defined]
    assert len(list(sampler)) == 120 - saved.consumed  # type: ignore[arg-type]


def test_a_loader_workers_checkpoint_is_exact_after_world_changes_at_epoch_ends_and_refused_after_one_inside() -> None:
    """The worker-snapshot layout (before 2026-11-25) counts its epoch's micro-batches in its world's
    units. 40 samples in batches of 10 make 4 steps an epoch on 1 process, 2 on 2: saved on 2 at
    epoch 2, one micro-batch into it, and resumed on 1, step 7 is two whole epochs on 1 and 2
    processes (4 + 2: the world changed at an epoch's end) plus 1, exact; step 6 is no such count
    (5 from two epochs of 4 or 2 steps), refused by name."""
    shape = dump_config(load_config(DEFAULT_CONFIG, ["data.batch_size=10"], check_paths=False))

    def snapshot(steps: int) -> dict[str, Any]:
        checkpoint = checkpoint_with(1, epoch=2, config=shape)
        checkpoint["global_step"] = steps
        state = {"epoch": 2, "consumed": 40, "world_size": 2}
        checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [
            {"_snapshot": {"_main_snapshot": {"_sampler_iter_state": {"sampler_state": state}}}}
        ]
        return checkpoint

    assert saved_position(snapshot(7), 1, size=40) == DataPosition(2, 1 * 10 * 2, 2, 10, 1)
    with pytest.raises(InexactPositionError, match="changed its number of processes during epoch 2"):
        saved_position(snapshot(6), 1, size=40)
