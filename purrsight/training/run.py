"""One training run: choose the checkpoint to resume, build the parts, fit, report."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytorch_lightning as pl

from purrsight.config import Config, write_resolved
from purrsight.training.checkpoints import CheckpointSaver, newest_checkpoint
from purrsight.training.datamodule import Phase2DataModule
from purrsight.training.factory import build_trainer
from purrsight.training.module import Phase2Module

log = logging.getLogger(__name__)
NEWEST = "newest"


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


def choose_resume(config: Config, resume: str | None) -> Path | None:
    """The checkpoint to start from, decided here and logged, never guessed by Lightning.

    ``resume`` is a path, NEWEST, or None. A worker restarted by torchrun
    (TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest checkpoint by itself.
    """
    folder = checkpoint_dir(config)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if resume is None and restarts > 0:
        found = newest_checkpoint(folder)
        log.warning(
            "torchrun restart %d: %s",
            restarts,
            f"resuming from {found}" if found else f"no checkpoint in {folder} yet, starting from step 0",
        )
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
        return path
    return None


def train(config: Config, resume: str | None = None, callbacks: list[pl.Callback] | None = None) -> TrainOutcome:
    ckpt = choose_resume(config, resume)
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
    return TrainOutcome(config.run.run_dir, trainer.global_step, saver.last_saved_path, saver.stopped_by_signal)
