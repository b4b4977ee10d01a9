"""Where the job stands in its data, kept in our own checkpoint entry.

A checkpoint records the epoch and how many of its samples the whole job trained (a global
count: every epoch is one order consumed by all ranks together, data/sampler.py), with the
world size and batch shape that trained them. A resume hands that position to the training
sampler and derives Lightning's in-epoch batch count from it (lightning_loops.py).

Why our own entry: the loader's state and Lightning's counters change layout and units with
loader workers (the sampler runs ahead of training by the prefetched batches) and with
gradient accumulation; the number of micro-batches the training loop actually took is the
one count that means the same thing in every configuration.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from purrsight.config import safe_yaml_load
from purrsight.errors import UserError

log = logging.getLogger(__name__)

POSITION_KEY = "position"  # inside the checkpoint's "purrsight" section


class PositionError(UserError):
    """A checkpoint's data position is unreadable (hand-edited or from another program)."""


class InexactPositionError(PositionError):
    """A checkpoint whose counts cannot place its position exactly; ``epoch`` is the epoch it stopped in
    (data.on_data_change=next_epoch starts the one after it at sample 0)."""

    def __init__(self, message: str, epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    consumed: int  # samples of `epoch` the whole job trained, in the epoch's order
    world_size: int
    batch_size: int  # per rank and micro-batch
    accumulation: int  # micro-batches per optimizer step

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step."""
        return self.batch_size * self.accumulation * self.world_size

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: Any) -> DataPosition:
        try:
            position = cls(**{name: int(saved[name]) for name in cls.__dataclass_fields__})
        except (KeyError, TypeError, ValueError):
            raise PositionError(f"checkpoint data position {saved!r} is not one PurrSight writes") from None
        if position.epoch < 0 or position.consumed < 0 or min(position.world_size, position.batch_size, position.accumulation) < 1:
            raise PositionError(f"checkpoint data position {saved!r} is out of range")
        return position


SAVED_WORLD_VARIABLE = "PURRSIGHT_SAVED_WORLD_SIZE"


def saved_position(checkpoint: dict[str, Any], world_now: int, size: int | None = None) -> DataPosition | None:
    """The data position a loaded checkpoint holds; None when it holds none (not a fit's checkpoint).

    ``world_now`` and ``size`` (the training set's samples) serve the earliest layouts, which kept
    no world size: it is derived from their step count (saving_world). Without ``size`` such a
    checkpoint gives None (the caller only wanted to compare batch shapes).
    """
    meta = checkpoint.get("purrsight")
    if isinstance(meta, dict) and POSITION_KEY in meta:
        return DataPosition.from_dict(meta[POSITION_KEY])
    return _position_before_this_entry(checkpoint, world_now, size)


def _position_before_this_entry(checkpoint: dict[str, Any], world_now: int, size: int | None) -> DataPosition | None:
    """The position in a checkpoint of a PurrSight that kept it in the loader's state, or nowhere.

    The layouts, newest first (each PurrSight version's DataModule wrote one):

    - our training sampler's state in torchdata's StatefulDataLoader state, without loader
      workers: ``{epoch, consumed, world_size}``, exact;
    - the same inside the workers' snapshot, taken ahead of training: then the fit loop's count
      of the epoch's batches, in the saving world's units, gives the position; exact when the step
      count can be that epoch on that world after whole epochs on it or this run's world
      (_epoch_kept_its_world), else refused (InexactPositionError): the epoch may have changed world
      size, which with workers those versions miscounted;
    - torchdata's StatefulDistributedSampler, ``{"yielded": N}`` (rank 0's count in its own
      shard), or no loader state at all (torch's DistributedSampler): both drew the order our
      sampler draws from position 0, and kept no world size. The fit loop's batch count gives the
      position in the world that saved it, which saving_world derives (or refuses to guess).

    The batch shape comes from the run config saved beside it.
    """
    loops = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(loops, dict):
        return None
    saved = checkpoint.get("purrsight", {}).get("config")
    config = safe_yaml_load(saved) if isinstance(saved, str) else {}
    config = config if isinstance(config, dict) else {}
    batch_size = int(config.get("data", {}).get("batch_size", 1))
    accumulation = int(config.get("trainer", {}).get("accumulate_grad_batches", 1))
    epoch = int(checkpoint.get("epoch", 0))
    loader_states = loops.get("state_dict", {}).get("combined_loader") or [{}]
    in_process = loader_states[0].get("_sampler_iter_state", {}).get("sampler_state")  # no loader workers
    if isinstance(in_process, dict) and "consumed" in in_process:
        epoch, consumed, world = (int(in_process[k]) for k in ("epoch", "consumed", "world_size"))
        return DataPosition(epoch, consumed, world, batch_size, accumulation)
    ready = loops.get("epoch_loop.batch_progress", {}).get("current", {}).get("ready")
    if ready is None:
        return None
    snapshot = _find_sampler_state(loader_states)
    steps = int(checkpoint.get("global_step", 0))
    if snapshot is not None:
        world = int(snapshot["world_size"])
        fits = _epoch_kept_its_world(size, batch_size, accumulation, epoch, int(ready), steps, world, world_now) if size else True
        if not fits:
            # The batch count is in the saving world's micro-batches only if the epoch kept one world.
            raise InexactPositionError(
                f"this checkpoint, from a PurrSight before 2026-11-25 with loader workers, changed its number of "
                f"processes during epoch {epoch}: its batch count ({ready} micro-batches, step {steps}) cannot place "
                "the data position. Resume from a checkpoint of an earlier epoch, or set data.on_data_change=next_epoch "
                f"to start epoch {epoch + 1} at sample 0",
                epoch,
            )
    elif size is None:
        return None
    else:
        world = saving_world(size, batch_size, accumulation, epoch, int(ready), steps, world_now)
    return DataPosition(epoch, int(ready) * batch_size * world, world, batch_size, accumulation)


def steps_after(ready: int, epoch_batches: int, accumulation: int) -> int:
    """Optimizer steps Lightning took in an epoch of ``epoch_batches`` micro-batches after ``ready`` of them:
    one at every ``accumulation``-th, and one at the epoch's last when its window is short. A save
    between a step's micro-batches (a stop before 2026-11-25) counts only the steps before it."""
    return ready // accumulation + (1 if ready == epoch_batches and epoch_batches % accumulation else 0)


def _epoch_kept_its_world(
    size: int, batch: int, accumulation: int, epoch: int, ready: int, steps: int, world: int, world_now: int
) -> bool:
    """Whether ``steps`` can be ``ready`` micro-batches of ``epoch`` on ``world`` processes after
    ``epoch`` whole epochs on that world or on this run's (a resume at an epoch's end may have
    changed it). A count that cannot was made across a change of world inside this epoch, or over a
    third world size, which the checkpoint cannot tell apart: refused, data.on_data_change=next_epoch
    starts the next epoch."""
    epoch_batches = (size // world) // batch
    before = steps - steps_after(ready, epoch_batches, accumulation)
    if ready > epoch_batches or before < 0:
        return False
    saved, now = (-(-((size // w) // batch) // accumulation) for w in (world, world_now))
    if saved == now:
        return epoch * saved == before
    # on_saved epochs of `saved` steps and the rest of `now`: on_saved = (before - epoch * now) / (saved - now)
    on_saved, remainder = divmod(before - epoch * now, saved - now)
    return remainder == 0 and 0 <= on_saved <= epoch


def saving_world(size: int, batch: int, accumulation: int, epoch: int, ready: int, steps: int, world_now: int) -> int:
    """The number of processes that saved a checkpoint which did not record it.

    Its optimizer step count is ``epoch`` whole epochs plus the steps of ``ready`` micro-batches
    (steps_after: a save inside a window counts the steps before it), and an epoch's steps depend
    on the world size: the sizes that fit are the candidates. This run's is taken when it is one;
    another single candidate is named; with nothing to go on (epoch 0 fits every size) the resume
    is refused: PURRSIGHT_SAVED_WORLD_SIZE names it. A last step saved where Lightning had already
    closed its epoch (before 2026-11-23) is reopened before this count (lightning_loops.reopen_closed_epoch).
    """
    given = os.environ.get(SAVED_WORLD_VARIABLE)
    if given:
        if not given.isdigit() or int(given) < 1:
            raise PositionError(f"{SAVED_WORLD_VARIABLE}={given!r} is not a number of processes")
        return int(given)
    what = "this checkpoint, from a PurrSight before 2026-11-23, did not record how many processes saved it"
    if epoch == 0:
        raise PositionError(
            f"{what}, and its step count in epoch 0 cannot tell; set {SAVED_WORLD_VARIABLE} to the number of "
            "processes (nodes x GPUs) of the job that saved it and resume again"
        )
    candidates = [
        world
        for world in range(1, min(size // batch, 1 << 16) + 1)
        if _epoch_kept_its_world(size, batch, accumulation, epoch, ready, steps, world, world)  # one world throughout
    ]
    if world_now in candidates:
        if len(candidates) > 1:
            log.warning("%s: its step count fits %s processes; taking this run's %d", what, candidates, world_now)
        return world_now
    if len(candidates) == 1:
        raise PositionError(
            f"{what}; its step count says {candidates[0]} and this run has {world_now}: resume it once on "
            f"{candidates[0]} processes (its next checkpoint records the number), or set {SAVED_WORLD_VARIABLE}"
        )
    raise PositionError(f"{what}, and its step count fits {candidates or 'no number'}; set {SAVED_WORLD_VARIABLE}")


def _find_sampler_state(value: Any) -> dict[str, Any] | None:
    """Our training sampler's state ({epoch, consumed, world_size}) wherever a loader state nests it."""
    if isinstance(value, dict):
        if {"consumed", "world_size", "epoch"} <= value.keys():
            return value
        children = list(value.values())
    elif isinstance(value, list):
        children = value
    else:
        return None
    for child in children:
        found = _find_sampler_state(child)
        if found is not None:
            return found
    return None
