"""The training sampler: one order per epoch for the whole job, resumable on any world size.

Each epoch is one permutation of the whole set (seeded by ``seed + epoch``), consumed in order
by all ranks together: rank ``r`` of ``W`` takes positions ``start + r``, ``start + r + W``, ...
After every rank trained ``y`` samples the job has consumed exactly the first ``start + y * W``
positions, so a checkpoint keeps that *global* count (runs/data_position.py), not one
rank's position in its own shard. A resume on another world size derives each rank's new
shard from the count: no sample of the epoch is trained twice, none is left out (torchdata's
StatefulDistributedSampler stores rank 0's count in its own shard, which on another world size
points into a different shard layout).

At ``start = 0`` the order equals torch's ``DistributedSampler(shuffle=True, drop_last=True)``
for the same seed, so runs and checkpoints made before this sampler continue unchanged.

With ``lengths`` (``data.group_by_length``) the epoch's order is that permutation regrouped by
length within windows (below, "Length-grouped batches"): still one order per (seed, epoch) for the whole
job, whatever the world size, so the position logic above holds unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
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
    def __init__(
        self,
        size: int,
        num_replicas: int,
        rank: int,
        seed: int,
        lengths: np.ndarray | None = None,
        group_size: int = 256,
        window_groups: int = 64,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is out of range for {num_replicas} replicas")
        if lengths is not None and len(lengths) != size:
            raise ValueError(f"{len(lengths)} lengths for {size} samples")
        self.lengths = lengths  # None: no grouping by length
        self.group_size = group_size
        self.window_groups = window_groups
        self.size = size
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.start = 0  # global position this pass over the epoch starts at (> 0 after a mid-epoch resume)
        self.pass_samples = 0  # samples this rank takes in this pass (from `start` to the epoch's end)
        self._pending: tuple[int, int] | None = None  # (epoch, consumed) to resume at, applied when that epoch begins

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _apply_pending(self) -> None:
        self.start = 0
        if self._pending is None:
            return
        epoch, consumed = self._pending
        if epoch > self.epoch:  # iterated before the trainer set the resumed epoch: keep it for that epoch
            return
        self._pending = None
        if epoch < self.epoch:
            log.warning("sampler position in epoch %d ignored in epoch %d: the epoch starts over", epoch, self.epoch)
            return
        self.start = consumed

    def __iter__(self) -> Iterator[int]:
        self._apply_pending()
        order = self.epoch_order()
        self.pass_samples = max(0, self.size - self.start) // self.num_replicas  # the tail short of one sample per rank waits
        end = self.start + self.pass_samples * self.num_replicas
        yield from (order[position] for position in range(self.start + self.rank, end, self.num_replicas))

    def epoch_order(self) -> list[int]:
        """The whole job's order of this epoch: a function of (seed, epoch) and the lengths alone."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()  # Python ints: no tensor read per sample
        if self.lengths is not None:  # the groups' shuffle continues the same generator: still (seed, epoch) alone
            order = grouped_order(order, self.lengths, self.group_size, self.window_groups, generator)
        return order

    def __len__(self) -> int:
        # A whole epoch, also the resumed one: the trainer counts the batches done before the
        # resume in this world's units (batches_done), so that count plus what this pass yields
        # is the epoch, whatever world size the checkpoint was saved on.
        return self.size // self.num_replicas

    def resume_at(self, epoch: int, consumed: int, saved_world: int) -> None:
        """Start ``epoch``, when it begins, after the first ``consumed`` samples of its order.

        The position is the whole job's (how many samples all ranks took), not this rank's:
        with no loader workers the sampler could count it itself, but with workers it runs
        ahead of training by the prefetched batches, so the trainer counts what it trained.
        """
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
        self._pending = (epoch, consumed)


# ---------------------------------------------------------------- length-grouped batches
#
# Length-grouped batches (``data.group_by_length``): samples of similar length in one batch.
#
# A batch pads to its longest sample; instruction data's lengths vary several-fold, so a batch
# drawn at random trains mostly padding. Grouping reorders each epoch's random order
# (data/sampler.py) and nothing else:
#
# 1. the epoch's order is cut into windows of ``group_size x window_groups`` samples (at most half
#    the epoch, in whole groups: grouping_window);
# 2. each window is sorted by length, longest first (ties keep their random order);
# 3. the sorted window is cut into groups of ``group_size`` samples, and the groups are shuffled
#    (a short last group, in the epoch's last window, stays last).
#
# So every sample stays in its window (a permutation of the same samples, drawn from the same
# seed and epoch), a group holds neighbours in length, and which lengths come when is still random
# from one step to the next (HF Trainer's ``LengthGroupedSampler`` sorts its windows the same way but
# keeps them longest-first, so every window's steps shrink in length in turn).
#
# Why the sizes are in samples, not in batches: the order must be the same on every world size, so
# that a resume on another continues it (the position is a count of samples of this order). A rank's
# micro-batch takes every W-th sample of ``batch x W`` consecutive positions, so a group that is a
# multiple of ``batch x W`` holds whole micro-batches of every rank (grouping_fit warns otherwise).


#
# Version 2 (2026-11-27) of the grouping, recorded in each checkpoint's data order (runs/data_order.py):
# a window is at most half the epoch, in whole groups. In version 1 a set smaller than one window
# was one window, sorted whole every epoch: the same groups every epoch, only their order shuffled.
# Two windows at least cut the set into random halves each epoch, so the groups change. (The raw
# length proxy changed with it: a conversation's characters, no longer its escaped JSON's.)
GROUPING_VERSION = 2


def grouping_window(samples: int, group_size: int, window_groups: int) -> int:
    """The samples of one window: ``group_size x window_groups``, at most half of ``samples`` in whole
    groups, one group at least."""
    half = (samples // 2) // group_size * group_size
    return min(group_size * window_groups, max(group_size, half))


def grouped_order(
    order: list[int], lengths: np.ndarray, group_size: int, window_groups: int, generator: torch.Generator
) -> list[int]:
    """``order`` with each window sorted by length, cut into groups, the groups shuffled (module docstring)."""
    if group_size < 1 or window_groups < 1:
        raise ValueError(f"group_size {group_size} and window_groups {window_groups} must be at least 1")
    positions = np.asarray(order, dtype=np.int64)
    window = grouping_window(len(positions), group_size, window_groups)
    grouped: list[np.ndarray] = []
    for start in range(0, len(positions), window):
        samples = positions[start : start + window]
        # Stable: equal lengths keep the epoch's random order, so the result depends on nothing else.
        by_length = samples[np.argsort(-lengths[samples], kind="stable")]
        groups = [by_length[first : first + group_size] for first in range(0, len(by_length), group_size)]
        # A short group (the epoch's last window only) stays last: shuffled in, it would shift every
        # later group off the micro-batches' boundaries.
        whole = len(by_length) // group_size
        shuffled = torch.randperm(whole, generator=generator).tolist()
        grouped.extend(groups[k] for k in shuffled)
        grouped.extend(groups[whole:])
    return np.concatenate(grouped).tolist() if grouped else []


def sample_lengths(dataset: Any) -> np.ndarray:
    """Each sample's length, as the dataset reports it (``lengths()``): stored tokens for a prepared set,
    characters of the text for a raw index (a proxy that needs no tokenizer pass, docs/DATA.md)."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        raise TypeError(f"data.group_by_length: {type(dataset).__name__} does not report its samples' lengths")
    values = np.asarray(lengths(), dtype=np.int64)
    if values.shape != (len(dataset),):
        raise ValueError(f"{type(dataset).__name__}.lengths() gave {values.shape[0]} lengths for {len(dataset)} samples")
    return values


def grouping_fit(group_size: int, batch_size: int, world: int) -> str | None:
    """Why ``group_size`` wastes padding on this world (a micro-batch of all ranks straddles two groups); None when it fits."""
    across = batch_size * world
    if group_size % across == 0:
        return None
    return (
        f"data.length_group_size {group_size} is no multiple of data.batch_size x processes ({batch_size} x {world} = {across}): "
        f"some micro-batches mix two groups' lengths (more padding; the order is exact all the same); "
        f"set it to a multiple of {across}"
    )
