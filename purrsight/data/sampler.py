"""The training sampler: one order per epoch for the whole job, resumable on any world size.

Each epoch is one permutation of the whole set (seeded by ``seed + epoch``), consumed in order
by all ranks together: rank ``r`` of ``W`` takes positions ``start + r``, ``start + r + W``, ...
After every rank took ``y`` samples the job has consumed exactly the first ``start + y * W``
positions, so the checkpointed state is that *global* count, not one rank's position in its
own shard. A resume on another world size derives each rank's new shard from the count: no
sample of the epoch is trained twice, none is left out (torchdata's StatefulDistributedSampler
stores rank 0's count in its own shard, which on another world size points into a different
shard layout).

At ``start = 0`` the order equals torch's ``DistributedSampler(shuffle=True, drop_last=True)``
for the same seed, so runs and checkpoints made before this sampler continue unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

log = logging.getLogger(__name__)


def batches_done(size: int, world: int, batch_size: int, consumed: int) -> int:
    """How many of an epoch's batches a rank counts as done when the job has consumed ``consumed``.

    An epoch is ``size // world`` samples per rank, ``batch_size`` at a time (the last short
    batch dropped); those still to come are the rank's share of what remains. A trainer that
    resumes on another world size counts its position in the epoch in these units, so the
    epoch ends exactly when the sampler runs out.
    """
    remaining = max(0, size - consumed) // world
    return (size // world) // batch_size - remaining // batch_size


class GlobalPositionSampler(Sampler[int]):
    def __init__(self, size: int, num_replicas: int, rank: int, seed: int) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is out of range for {num_replicas} replicas")
        self.size = size
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.start = 0  # global position this pass over the epoch starts at (> 0 after a mid-epoch resume)
        self.yielded = 0  # samples this rank took since `start`
        self._pending: dict[str, int] | None = None  # a loaded state, applied when its epoch begins

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _apply_pending(self) -> None:
        self.start = 0
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending["epoch"] != self.epoch:
            log.warning("sampler state of epoch %d ignored in epoch %d: the epoch starts over", pending["epoch"], self.epoch)
            return
        self.start = pending["consumed"]

    def __iter__(self) -> Iterator[int]:
        self._apply_pending()
        self.yielded = 0
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()  # Python ints: no tensor read per sample
        remaining = max(0, self.size - self.start) // self.num_replicas  # the tail short of one sample per rank waits
        for position in range(self.start + self.rank, self.start + remaining * self.num_replicas, self.num_replicas):
            self.yielded += 1
            yield order[position]

    def __len__(self) -> int:
        # A whole epoch, also the resumed one: the trainer counts the batches done before the
        # resume in this world's units (batches_done), so that count plus what this pass yields
        # is the epoch, whatever world size the checkpoint was saved on.
        return self.size // self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.start + self.yielded * self.num_replicas,  # global: survives a change of world size
            "world_size": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        consumed, saved_world = resumed_position(state, self.num_replicas)
        epoch = int(state.get("epoch", self.epoch))
        if saved_world != self.num_replicas and self.rank == 0:
            log.warning(
                "resuming on %d processes, saved on %d: epoch %d continues at sample %d of %d, "
                "every rank's shard derived from that position (no sample repeated or left out)",
                self.num_replicas,
                saved_world,
                epoch,
                consumed,
                self.size,
            )
        self._pending = {"epoch": epoch, "consumed": consumed}


def resumed_position(state: dict[str, Any], world: int) -> tuple[int, int]:
    """(samples of the epoch the job consumed, the world size it ran on) from a saved sampler state."""
    if "consumed" in state:
        return int(state["consumed"]), int(state["world_size"])
    if "yielded" in state:
        # Saved by torchdata's StatefulDistributedSampler (before this sampler), which only resumed
        # on the same world size: its per-rank count times this world is the global position.
        return int(state["yielded"]) * world, world
    raise ValueError(f"not a sampler state: {sorted(state)}")
