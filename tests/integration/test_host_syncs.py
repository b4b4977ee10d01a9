"""The training step never makes the host wait for the device (tests/host_syncs.py: how it is counted)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.host_syncs import count_step, counting


def test_the_counter_sees_the_patterns_that_stall_a_gpu() -> None:
    """What the step used to do (a mask read to skip empty encodes, boolean selection, a vote read
    with .item()) is counted, so a zero below means none of it happens."""
    present = torch.tensor([True, False, True])
    features = torch.zeros(3, 2)
    with counting() as counter:
        counter.active = True
        if present.any():
            features[present] = torch.ones(2, 2)
        int(present.sum())
        torch.tensor([1]).item()
    names = sorted(name for name, _ in counter.calls)
    assert names == ["__bool__", "__int__", "__setitem__", "item"], counter.report()


def test_a_training_step_makes_no_host_synchronisation(tmp_path: Path) -> None:
    """Step 12 of the tiny run (no logging, telemetry, checkpoint or validation at it), with the
    stop vote running in a one-rank gloo group: forward, backward, optimizer step and every
    per-step hook make no call that would wait for a GPU, media placed at their placeholders too."""
    counter = count_step(tmp_path, steps=14, step=12, overrides=[])
    assert "media_at" in counter.batch_keys, counter.batch_keys  # the step placed media in the text
    assert counter.total() > 0, "nothing counted: the counting window missed the step"  # the optimizer's counters at least
    assert not counter.device_reads(), "host synchronisations in a training step:\n" + counter.report()
