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
from dataclasses import asdict, dataclass
from typing import Any

from purrsight.config import safe_yaml_load
from purrsight.errors import UserError

log = logging.getLogger(__name__)

POSITION_KEY = "position"  # inside the checkpoint's "purrsight" section


class PositionError(UserError):
    """A checkpoint's data position is unreadable (hand-edited or from another program)."""


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


def saved_position(checkpoint: dict[str, Any], world_now: int) -> DataPosition | None:
    """The data position a loaded checkpoint holds; None when it holds none (not a fit's checkpoint).

    ``world_now``: the processes of the run that resumes, taken as the saving run's for the one
    earlier layout that kept no world size (it is said in a warning).
    """
    meta = checkpoint.get("purrsight")
    if isinstance(meta, dict) and POSITION_KEY in meta:
        return DataPosition.from_dict(meta[POSITION_KEY])
    return _position_before_this_entry(checkpoint, world_now)


def _position_before_this_entry(checkpoint: dict[str, Any], world_now: int) -> DataPosition | None:
    """The position in a checkpoint of a PurrSight that kept it in the loader's state, or nowhere.

    The layouts, newest first (each PurrSight version's DataModule wrote one):

    - our training sampler's state in torchdata's StatefulDataLoader state, without loader
      workers: ``{epoch, consumed, world_size}``, exact;
    - the same inside the workers' snapshot, taken ahead of training: then the fit loop's count
      of the epoch's batches, in the saving world's units, gives the position (exact unless that
      epoch had already changed world size, which with workers those versions miscounted anyway);
    - torchdata's StatefulDistributedSampler, ``{"yielded": N}`` (rank 0's count in its own
      shard), or no loader state at all (torch's DistributedSampler): both drew the order our
      sampler draws from position 0, and kept no world size. The fit loop's batch count gives the
      position in the world that saved it, taken to be this one, and a warning says so: on the
      same number of processes the resume is exact.

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
    if snapshot is not None:
        world = int(snapshot["world_size"])
        log.warning("checkpoint from an earlier PurrSight with loader workers: data position taken from its batch count")
    else:
        world = world_now
        log.warning(
            "checkpoint from a PurrSight before 2026-11-23 (torchdata's sampler state, or none): it keeps no world size; "
            "taking it as saved on %d process(es), as this run has: resume it on the number of processes that saved it, "
            "or its epoch %d continues at another sample",
            world,
            epoch,
        )
    return DataPosition(epoch, int(ready) * batch_size * world, world, batch_size, accumulation)


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
