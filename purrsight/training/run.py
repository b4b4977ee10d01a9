"""One training run: choose the checkpoint to resume, build the parts, fit, report."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl

from purrsight.cluster.distributed import (
    TORCHRUN_RANK,
    agreed_max,
    from_rank_zero,
    init_process_group_in_node_order,
    worker_generation,
)
from purrsight.config import Config, write_resolved
from purrsight.training.checkpoints import CheckpointSaver, is_loadable, newest_checkpoint
from purrsight.training.datamodule import Phase2DataModule
from purrsight.training.factory import build_trainer, resolve_backend
from purrsight.training.module import Phase2Module
from purrsight.training.preflight_callback import Preflight
from purrsight.training.report import write_report

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


def checkpoint_dir(config: Config) -> Path:
    return config.run.run_dir / "checkpoints"


def choose_resume(config: Config, resume: str | None, generation: int = 0) -> Path | None:
    """The checkpoint to start from, decided here and logged, never guessed by Lightning.

    ``resume`` is a path, NEWEST, AUTO or None. Workers that torchrun started again
    (``generation`` > 0, agreed over all ranks) resume from the newest checkpoint by themselves.
    """
    folder = checkpoint_dir(config)
    if resume is None and generation > 0:
        found = newest_checkpoint(folder)
        log.warning(
            "torchrun restart %d: %s",
            generation,
            f"resuming from {found}" if found else f"no checkpoint in {folder} yet, starting from step 0",
        )
        return found
    if resume == AUTO:
        found = newest_checkpoint(folder)
        log.info("resume=auto: %s", f"continuing from {found}" if found else f"no checkpoint in {folder}, starting fresh")
        return found
    if resume == NEWEST:
        found = newest_checkpoint(folder)
        if found is None:
            raise ResumeError(f"--resume: no checkpoint in {folder}; start without --resume or pass a checkpoint path")
        return found
    if resume is not None:
        path = Path(resume)
        if not path.is_file():
            raise ResumeError(f"--resume: checkpoint {path} does not exist")
        if not is_loadable(path):
            raise ResumeError(
                f"--resume: {path} is not a readable PurrSight checkpoint (corrupted, truncated, or holding "
                "objects that weights_only=True refuses to unpickle)"
            )
        return path
    return None


def train(config: Config, resume: str | None = None, callbacks: list[pl.Callback] | None = None) -> TrainOutcome:
    backend = resolve_backend(config)
    # Our own process group (Lightning skips its init when one exists): node-ordered ranks,
    # and a collective decision about resuming, so no rank starts over while others resume.
    distributed = init_process_group_in_node_order(backend, timedelta(seconds=config.distributed.timeout_s))
    generation = worker_generation(os.environ)
    if distributed:
        log.info(
            "process group ready: global rank %s of %s (%s, ranks ordered by node; store %s:%s, torchrun rank %s)",
            os.environ["RANK"],
            os.environ["WORLD_SIZE"],
            backend,
            os.environ["MASTER_ADDR"],
            os.environ["MASTER_PORT"],
            os.environ.get(TORCHRUN_RANK),
        )
        generation = agreed_max(generation, backend)
    ckpt = choose_resume(config, resume or os.environ.get("PURRSIGHT_RESUME") or None, generation)
    if distributed:
        ckpt = from_rank_zero(ckpt)  # one file for all ranks, even if a slow filesystem disagrees
    pl.seed_everything(config.run.seed, workers=True, verbose=False)
    if int(os.environ.get("RANK", "0")) == 0:
        write_resolved(config, config.run.run_dir)
    saver = CheckpointSaver(checkpoint_dir(config), config.checkpoint.every_n_steps, config.checkpoint.keep_last)
    module = Phase2Module(config)
    data = Phase2DataModule(config)
    trainer = build_trainer(config, saver, callbacks)
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
