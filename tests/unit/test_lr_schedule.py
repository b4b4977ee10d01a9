"""The learning-rate schedule across resumes (purrsight/training/optim.py), with torch's own LambdaLR and AdamW.

A resume restores the scheduler from the checkpoint's state dict, as Lightning does, into
a scheduler built from the (possibly changed) config; ``continue_schedule`` then joins them.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from purrsight.config import Config, load_config
from purrsight.training.optim import LRSchedule, build_optimizer, continue_schedule, warmup_cosine
from tests.helpers import DEFAULT_CONFIG


def config(**overrides: object) -> Config:
    return load_config(DEFAULT_CONFIG, [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()], check_paths=False)


def trained(cfg: Config, steps: int) -> tuple[dict, list[float]]:  # type: ignore[type-arg]
    """The scheduler's state after ``steps`` optimizer steps, and the LR each step used."""
    optimizer, scheduler = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg.optim, cfg.trainer.max_steps)
    used = []
    for _ in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, used


def resumed(cfg: Config, state: dict, step: int) -> tuple[torch.optim.lr_scheduler.LambdaLR, list[str]]:  # type: ignore[type-arg]
    optimizer, scheduler = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg.optim, cfg.trainer.max_steps)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return scheduler, continue_schedule(scheduler, cfg, step)


def lrs_after(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> list[float]:
    used = []
    for _ in range(steps):
        used.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return used


def test_a_fresh_schedule_is_warmup_then_cosine() -> None:
    schedule = LRSchedule(2e-3, 10, 150, 0.1)
    assert [schedule(s) for s in (0, 9, 10, 80, 150, 200)] == [warmup_cosine(s, 10, 150, 0.1) for s in (0, 9, 10, 80, 150, 200)]


def test_a_plain_resume_changes_nothing() -> None:
    cfg = config(trainer__max_steps=2000)
    state, _ = trained(cfg, 320)
    scheduler, lines = resumed(cfg, state, 320)
    assert lines == []
    assert lrs_after(scheduler, 3) == pytest.approx(trained(cfg, 323)[1][320:])


@pytest.mark.parametrize("new_total", [400, 5000])
def test_a_changed_horizon_continues_the_lr_and_ends_at_the_new_floor(new_total: int) -> None:
    """The issue's case: 2000 total steps, resumed at 320 with 400 (and the other way round)."""
    old = config(trainer__max_steps=2000)
    state, used = trained(old, 320)
    new = config(trainer__max_steps=new_total)
    scheduler, lines = resumed(new, state, 320)
    assert len(lines) == 1 and f"trainer.max_steps 2000 -> {new_total}" in lines[0]
    assert f"cosine decay now ends at step {new_total}" in lines[0]
    after = lrs_after(scheduler, new_total - 320 + 1)
    assert after[0] == pytest.approx(used[-1], rel=0.02)  # the first step after the resume: no jump
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(after))  # still decaying, never back up
    assert after[-1] == pytest.approx(new.optim.lr * new.optim.min_lr_ratio)  # the new floor at the new end


def test_a_second_resume_keeps_the_joined_schedule() -> None:
    state, _ = trained(config(trainer__max_steps=2000), 320)
    new = config(trainer__max_steps=400)
    scheduler, _ = resumed(new, state, 320)
    lrs_after(scheduler, 30)
    again, lines = resumed(new, {"optimizer": scheduler.optimizer.state_dict(), "scheduler": scheduler.state_dict()}, 350)
    assert lines == []  # the saved schedule already has this config's target
    assert lrs_after(again, 5) == pytest.approx(lrs_after(scheduler, 5))


def test_a_new_peak_lr_or_warmup_is_joined_too() -> None:
    state, used = trained(config(trainer__max_steps=200, optim__lr=2e-3), 100)
    scheduler, lines = resumed(config(trainer__max_steps=200, optim__lr=1e-3), state, 100)
    assert "optim.lr 0.002 -> 0.001" in lines[0]
    after = lrs_after(scheduler, 101)
    assert after[0] == pytest.approx(used[-1], rel=0.02) and after[-1] == pytest.approx(1e-4)
    # Resumed in warmup with a longer warmup: a straight line up to the peak, then the cosine.
    old = config(optim__warmup_steps=10, optim__lr=2e-3)
    state, _ = trained(old, 5)
    scheduler, lines = resumed(config(optim__warmup_steps=20, optim__lr=2e-3), state, 5)
    assert "optim.warmup_steps 10 -> 20" in lines[0]
    after = lrs_after(scheduler, 20)
    assert after[0] == pytest.approx(trained(old, 6)[1][5])  # where the earlier schedule was at this step
    assert after[0] < after[10] < after[15] == pytest.approx(2e-3, rel=0.3)
