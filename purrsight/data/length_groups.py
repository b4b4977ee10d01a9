"""Length-grouped batches (``data.group_by_length``): samples of similar length in one batch.

A batch pads to its longest sample; instruction data's lengths vary several-fold, so a batch
drawn at random trains mostly padding. Grouping reorders each epoch's random order
(data/sampler.py) and nothing else:

1. the epoch's order is cut into windows of ``group_size x window_groups`` samples;
2. each window is sorted by length, longest first (ties keep their random order);
3. the sorted window is cut into groups of ``group_size`` samples, and the groups are shuffled
   (a short last group, in the epoch's last window, stays last).

So every sample stays in its window (a permutation of the same samples, drawn from the same
seed and epoch), a group holds neighbours in length, and which lengths come when is still random
from one step to the next (HF Trainer's ``LengthGroupedSampler`` sorts its windows the same way but
keeps them longest-first, so every window's steps shrink in length in turn).

Why the sizes are in samples, not in batches: the order must be the same on every world size, so
that a resume on another continues it (the position is a count of samples of this order). A rank's
micro-batch takes every W-th sample of ``batch x W`` consecutive positions, so a group that is a
multiple of ``batch x W`` holds whole micro-batches of every rank (grouping_fit warns otherwise).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def grouped_order(
    order: list[int], lengths: np.ndarray, group_size: int, window_groups: int, generator: torch.Generator
) -> list[int]:
    """``order`` with each window sorted by length, cut into groups, the groups shuffled (module docstring)."""
    if group_size < 1 or window_groups < 1:
        raise ValueError(f"group_size {group_size} and window_groups {window_groups} must be at least 1")
    positions = np.asarray(order, dtype=np.int64)
    window = group_size * window_groups
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
