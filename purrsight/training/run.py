"""One training run: choose the checkpoint to resume, build the parts, fit, report."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.strategies import Strategy

from purrsight.cluster.distributed import (
    TORCHRUN_RANK,
    agreed_max,
    from_rank_zero,
    init_process_group,
    worker_generation,
)
from purrsight.config import Config, write_resolved
from purrsight.training.checkpoints import CheckpointReadError, CheckpointSaver, newest_checkpoint, saved_step
from purrsight.training.datamodule import Phase2DataModule
from purrsight.training.factory import build_trainer, resolve_backend
from purrsight.training.module import Phase2Module
from purrsight.training.preflight_callback import Preflight
from purrsight.training.report import write_report
from purrsight.training.run_folder import (
    RunFolderError,
    checkpoint_dir,
    clear_for_new_run,
    launch_id,
    launched_here,
    record_launch,
    set_aside_later_checkpoints,
)

log = logging.getLogger(__name__)
NEWEST = "newest"
AUTO = "auto"  # the newest checkpoint when one exists, else a fresh start (PURRSIGHT_RESUME=auto)


class ResumeError(ValueError):
    """--resume names nothing usable."""


@dataclass
class TrainOutcome:
    run_dir: Path
    final_step: int
    checkpoint: Path | None
    stopped_by_signal: int | None


@dataclass(frozen=True)
class StartPlan:
    checkpoint: Path | None  # None: a new run from step 0
    step: int  # the step training continues after; the history is kept up to it


def _from(found: tuple[Path, int] | None) -> StartPlan:
    return StartPlan(*found) if found else StartPlan(None, 0)


def choose_start(config: Config, resume: str | None, generation: int = 0) -> StartPlan:
    """Where this run starts, decided here and logged (never guessed by Lightning), on rank 0.

    ``resume`` is a path, NEWEST, AUTO or None. Workers that torchrun started again
    (``generation`` > 0, agreed over all ranks) resume from the newest checkpoint by
    themselves, but only when this launch did start training here: restarts of a start that
    was refused must be refused too. Prepares the run folder for the decision
    (run_folder.py): a new run may not mix with an earlier one; a resume from an older
    checkpoint sets the later ones aside.
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
        plan = StartPlan(path, _step_of(path))
        if path.resolve().parent != folder.resolve():
            clear_for_new_run(run_dir, config.run.if_exists)  # another run's checkpoint: a new lineage here
    else:
        clear_for_new_run(run_dir, config.run.if_exists)
        plan = StartPlan(None, 0)
    if plan.checkpoint is not None and plan.checkpoint.resolve().parent == folder.resolve():
        set_aside_later_checkpoints(plan.checkpoint, plan.step)
    record_launch(run_dir, launch)
    return plan


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


def agreed_start(config: Config, resume: str | None, generation: int, distributed: bool) -> StartPlan:
    """Rank 0's plan on every rank; rank 0's refusal raised on every rank (all exit 2 together)."""
    plan: StartPlan | None = None
    problem: Exception | None = None
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            plan = choose_start(config, resume, generation)
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


def train(
    config: Config,
    resume: str | None = None,
    callbacks: list[pl.Callback] | None = None,
    generation: int | None = None,
    strategy: Strategy | None = None,
) -> TrainOutcome:
    """Train one run in this process (one rank of many under torchrun or Ray).

    ``generation`` (earlier starts of this rank in this launch) and ``strategy`` come from
    an engine that tracks them itself (Ray); by default torchrun's restart count and a
    strategy built for torchrun or a single process.
    """
    backend = resolve_backend(config)
    # Our own process group (Lightning skips its init when one exists): node-ordered ranks,
    # and a collective decision about resuming, so no rank starts over while others resume.
    distributed = init_process_group(backend, timedelta(seconds=config.distributed.timeout_s))
    if generation is None:
        generation = worker_generation(os.environ)
    if distributed:
        order = (
            f"ranks ordered by node, torchrun rank {os.environ[TORCHRUN_RANK]}"
            if TORCHRUN_RANK in os.environ
            else "ranks as torchrun or Ray set them"
        )
        log.info(
            "process group ready: global rank %s of %s (%s, %s; store %s:%s)",
            os.environ["RANK"],
            os.environ["WORLD_SIZE"],
            backend,
            order,
            os.environ["MASTER_ADDR"],
            os.environ["MASTER_PORT"],
        )
        generation = agreed_max(generation, backend)
    plan = agreed_start(config, resume or os.environ.get("PURRSIGHT_RESUME") or None, generation, distributed)
    ckpt = plan.checkpoint
    pl.seed_everything(config.run.seed, workers=True, verbose=False)
    if int(os.environ.get("RANK", "0")) == 0:
        write_resolved(config, config.run.run_dir)
    saver = CheckpointSaver(checkpoint_dir(config.run.run_dir), config.checkpoint.every_n_steps, config.checkpoint.keep_last)
    module = Phase2Module(config)
    data = Phase2DataModule(config)
    trainer = build_trainer(config, saver, callbacks, resumed_step=plan.step, strategy=strategy)
    if ckpt is not None:
        log.info("resuming from checkpoint %s", ckpt)
    trainer.fit(module, datamodule=data, ckpt_path=str(ckpt) if ckpt else None)
    validated_at_end = trainer.global_step % config.trainer.val_every_n_steps == 0
    if saver.stopped_by_signal is None and data.val_set is not None and not validated_at_end:
        trainer.validate(module, datamodule=data, verbose=False)
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.save()  # the report reads the metrics file
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, not declared
        preflight = next((c.report for c in callbacks if isinstance(c, Preflight)), None)
        report = write_report(config.run.run_dir, preflight.table() if preflight else None)
        log.info("run report: %s", report)
    return TrainOutcome(config.run.run_dir, trainer.global_step, saver.last_saved_path, saver.stopped_by_signal)
