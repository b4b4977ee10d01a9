"""How a run starts: a new run into a free folder, or a resume from which checkpoint.

Decided once, on rank 0 (or by the Ray engine's driver before any worker starts), and
logged; never guessed by Lightning. Free of Lightning, so the driver starts fast.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from purrsight.config import Config
from purrsight.distributed.process_group import from_rank_zero
from purrsight.errors import UserError
from purrsight.run_folder import (
    RunFolderError,
    checkpoint_dir,
    clear_for_new_run,
    launch_id,
    launched_here,
    record_launch,
    refuse_mixing,
    set_aside_later_checkpoints,
)
from purrsight.runs.checkpoint_files import CheckpointReadError, newest_checkpoint, saved_step

log = logging.getLogger(__name__)
NEWEST = "newest"
AUTO = "auto"  # the newest checkpoint when one exists, else a fresh start (PURRSIGHT_RESUME=auto)


class ResumeError(UserError):
    """--resume names nothing usable."""


@dataclass(frozen=True)
class StartPlan:
    checkpoint: Path | None  # None: a new run from step 0
    step: int  # the step training continues after; the history is kept up to it
    new_lineage: bool = False  # the folder must be cleared for it first (run.if_exists)


def _from(found: tuple[Path, int] | None) -> StartPlan:
    return StartPlan(*found) if found else StartPlan(None, 0)


def choose_start(config: Config, resume: str | None, generation: int = 0) -> StartPlan:
    """Where this run starts (``plan_start``), with the run folder prepared for it; on rank 0."""
    plan = plan_start(config, resume, generation)
    prepare_run_folder(config, plan)
    return plan


def plan_start(config: Config, resume: str | None, generation: int = 0) -> StartPlan:
    """Where this run starts, decided here and logged (never guessed by Lightning); changes nothing.

    ``resume`` is a path, NEWEST, AUTO or None. Workers that torchrun started again
    (``generation`` > 0, agreed over all ranks) resume from the newest checkpoint by
    themselves, but only when this launch did start training here: restarts of a start that
    was refused must be refused too. Every refusal is raised here, so a caller that has
    more to check (the Ray engine: the cluster) can refuse with the folder as it was.
    """
    run_dir = config.run.run_dir
    folder = checkpoint_dir(run_dir)
    launch = launch_id()
    if resume is None and generation > 0 and not launched_here(run_dir, launch):
        log.warning("torchrun restart %d: this launch has not trained in %s yet; starting as the first time", generation, run_dir)
        generation = 0
    if resume is None and generation > 0:
        plan = _from(newest_checkpoint(folder))
        where = f"resuming from {plan.checkpoint}" if plan.checkpoint else f"no checkpoint in {folder} yet, starting from step 0"
        log.warning("torchrun restart %d: %s", generation, where)
    elif resume == AUTO:
        plan = _from(newest_checkpoint(folder))
        where = f"continuing from {plan.checkpoint}" if plan.checkpoint else f"no checkpoint in {folder}, starting fresh"
        log.info("resume=auto: %s", where)
    elif resume == NEWEST:
        plan = _from(newest_checkpoint(folder))
        if plan.checkpoint is None:
            raise ResumeError(f"--resume: no checkpoint in {folder}; start without --resume or pass a checkpoint path")
    elif resume is not None:
        path = Path(resume)
        step = _step_of(path)
        plan = StartPlan(path, step, new_lineage=path.resolve().parent != folder.resolve())  # another run's: a new lineage
    else:
        plan = StartPlan(None, 0, new_lineage=True)
    if plan.new_lineage:
        refuse_mixing(run_dir, config.run.if_exists)
    return plan


def prepare_run_folder(config: Config, plan: StartPlan) -> None:
    """Make the run folder ready for ``plan`` (run_folder.py): a new run may not mix with an
    earlier one; a resume from an older checkpoint sets the later ones aside."""
    run_dir = config.run.run_dir
    if plan.new_lineage:
        clear_for_new_run(run_dir, config.run.if_exists)
    if plan.checkpoint is not None and plan.checkpoint.resolve().parent == checkpoint_dir(run_dir).resolve():
        set_aside_later_checkpoints(plan.checkpoint, plan.step)
    record_launch(run_dir, launch_id())


def _step_of(path: Path) -> int:
    if not path.is_file():
        raise ResumeError(f"--resume: checkpoint {path} does not exist")
    step = saved_step(path)
    if step is None:
        raise ResumeError(
            f"--resume: {path} is not a readable PurrSight checkpoint (corrupted, truncated, or holding "
            "objects that weights_only=True refuses to unpickle)"
        )
    return step


def agreed_plan(config: Config, resume: str | None, generation: int, distributed: bool) -> StartPlan:
    """Rank 0's plan (``plan_start``: nothing changed yet) on every rank; its refusal raised on every
    rank (all exit 2 together). ``prepare_agreed`` acts on it, once what else may refuse the start
    has spoken (training/run.py: the auto settings)."""
    plan: StartPlan | None = None
    problem: Exception | None = None
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            plan = plan_start(config, resume, generation)
        except (ResumeError, RunFolderError, CheckpointReadError) as err:
            problem = err
    if distributed:  # even a slow filesystem that disagrees cannot split the ranks
        plan, message = from_rank_zero((plan, str(problem) if problem else None))
        if message and problem is None:
            raise ResumeError(message)
    if problem is not None:
        raise problem
    assert plan is not None
    return plan


def prepare_agreed(config: Config, plan: StartPlan, distributed: bool) -> None:
    """Rank 0 prepares the run folder for ``plan`` (``prepare_run_folder``) while the others wait,
    so none writes into a folder that is then cleared; a failure is raised on every rank."""
    problem: str | None = None
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            prepare_run_folder(config, plan)
        except (RunFolderError, OSError) as err:
            problem = str(err)
    if distributed:
        problem = from_rank_zero(problem)
    if problem is not None:
        raise RunFolderError(problem)
