"""One placement decision (purrsight/placement.py) for the launcher, the trainer and the Ray driver."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from purrsight.placement import Placement, PlacementError, decide, from_launcher
from purrsight.training.trainer_builder import build_strategy, resolve_placement
from tests.helpers import tiny_config


@pytest.mark.parametrize(
    ("accelerator", "backend", "gpus", "expected"),
    [
        ("auto", "auto", 8, Placement("gpu", "nccl")),
        ("auto", "auto", 0, Placement("cpu", "gloo")),
        ("auto", "gloo", 8, Placement("cpu", "gloo")),  # BACKEND=gloo on a GPU node: the help's CPU example
        ("gpu", "gloo", 8, Placement("gpu", "gloo")),  # gloo on GPUs, asked for explicitly
        ("auto", "nccl", 2, Placement("gpu", "nccl")),
        ("cpu", "auto", 8, Placement("cpu", "gloo")),
    ],
)
def test_decide(accelerator: str, backend: str, gpus: int, expected: Placement) -> None:
    assert decide(accelerator, backend, gpus) == expected


def test_impossible_placements_name_the_fix() -> None:
    with pytest.raises(PlacementError, match="backend nccl needs GPUs but no GPU is visible here; use BACKEND=gloo"):
        decide("auto", "nccl", 0)
    with pytest.raises(PlacementError, match=r"backend nccl needs GPUs but trainer\.accelerator=cpu"):
        decide("cpu", "nccl", 8)
    with pytest.raises(PlacementError, match=r"trainer\.accelerator=gpu but no GPU is visible"):
        decide("gpu", "auto", 0)


def test_the_trainer_takes_the_launchers_decision(synthetic_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config that says nccl, under a launcher that decided gloo on CPU (BACKEND=gloo): the
    worker's strategy uses gloo, as the launcher printed, and does not decide again."""
    config = tiny_config(synthetic_dir, tmp_path, distributed__backend="nccl")
    monkeypatch.setenv("PURRSIGHT_ACCELERATOR", "cpu")
    monkeypatch.setenv("PURRSIGHT_BACKEND", "gloo")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    placement = resolve_placement(config)
    assert placement == from_launcher(os.environ) == Placement("cpu", "gloo")
    assert build_strategy(config, placement)._process_group_backend == "gloo"  # type: ignore[attr-defined]
    monkeypatch.delenv("PURRSIGHT_BACKEND")
    with pytest.raises(PlacementError):  # no launcher: this CPU process decides, and nccl cannot work here
        resolve_placement(config)
