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
        self.seen_before = 0  # samples each rank took in this epoch before `start`, as the trainer's loop counts them
        self.yielded = 0  # samples this rank took since `start`
        self._pending: dict[str, int] | None = None  # a loaded state, applied when its epoch begins

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _apply_pending(self) -> None:
        self.start, self.seen_before = 0, 0
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending["epoch"] != self.epoch:
            log.warning("sampler state of epoch %d ignored in epoch %d: the epoch starts over", pending["epoch"], self.epoch)
            return
        self.start, self.seen_before = pending["consumed"], pending["seen"]

    def _remaining_per_rank(self) -> int:
        return max(0, self.size - self.start) // self.num_replicas  # the tail short of one sample per rank waits for the next epoch

    def __iter__(self) -> Iterator[int]:
        self._apply_pending()
        self.yielded = 0
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator)
        first = self.start + self.rank
        stop = self.start + self._remaining_per_rank() * self.num_replicas
        for position in range(first, stop, self.num_replicas):
            self.yielded += 1
            yield int(order[position])

    def __len__(self) -> int:
        # What the trainer's loop counts for this epoch: the samples taken before a resume plus
        # those still to come. Lightning restores its in-epoch batch count and ends the epoch
        # when it reaches len(loader), so on another world size the length must be this sum.
        pending = self._pending  # loaded before the trainer sets the epoch: it is the resumed one
        if pending is not None:
            return pending["seen"] + max(0, self.size - pending["consumed"]) // self.num_replicas
        return self.seen_before + self._remaining_per_rank()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.start + self.yielded * self.num_replicas,  # global: survives a change of world size
            "seen": self.seen_before + self.yielded,
            "world_size": self.num_replicas,
            "yielded": self.seen_before + self.yielded,  # the name torchdata's sampler used (same meaning)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "consumed" in state:
            consumed, seen, saved_world = int(state["consumed"]), int(state["seen"]), int(state["world_size"])
        elif "yielded" in state:
            # Saved by StatefulDistributedSampler (before this sampler), which only resumed on the
            # same world size: its per-rank count times this world is the global position.
            seen = int(state["yielded"])
            consumed, saved_world = seen * self.num_replicas, self.num_replicas
        else:
            raise ValueError(f"not a sampler state: {sorted(state)}")
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
        self._pending = {"epoch": epoch, "consumed": consumed, "seen": seen}
