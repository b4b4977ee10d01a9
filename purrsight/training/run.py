"""One training run: agree how it starts (start.py), build the parts, fit, report."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.strategies import Strategy

from purrsight.config import Config, ConfigError, write_resolved
from purrsight.distributed import flight_recorder
from purrsight.distributed.lost_peer import raise_for_lost_peer
from purrsight.distributed.preflight_callback import Preflight
from purrsight.distributed.process_group import TORCHRUN_RANK, agreed_max, init_process_group, worker_generation
from purrsight.distributed.watchdog import raise_for_peer_firing
from purrsight.global_batch import GlobalBatch, resolve_global_batch
from purrsight.observability.report import write_report
from purrsight.observability.trackers import close_trackers
from purrsight.run_folder import checkpoint_dir
from purrsight.runs.attempts import AttemptRecorder
from purrsight.runs.checkpoint_files import training_position
from purrsight.runs.checkpoint_saver import CheckpointSaver
from purrsight.runs.data_position import DataPosition
from purrsight.runs.start import agreed_plan, prepare_agreed
from purrsight.training.auto_settings import settle_auto_settings
from purrsight.training.datamodule import Phase2DataModule
from purrsight.training.module import Phase2Module
from purrsight.training.trainer_builder import build_trainer, resolve_placement

log = logging.getLogger(__name__)


def global_batch_change(saved: DataPosition | None, config: Config, world: int) -> str | None:
    """A line naming a change of the global batch between a checkpoint and this start, or None.

    Samples per optimizer step = data.batch_size x accumulate_grad_batches x processes. The
    learning rate is not rescaled with it (no rule is applied): the line says so.
    """
    if saved is None:
        return None  # saved before any training: nothing to compare
    now = config.data.micro_batch * config.trainer.accumulate_grad_batches * world
    if saved.global_batch == now:
        return None
    return (
        f"global batch {saved.global_batch} -> {now} samples per optimizer step (data.batch_size {saved.batch_size} -> "
        f"{config.data.micro_batch}, accumulate_grad_batches {saved.accumulation} -> {config.trainer.accumulate_grad_batches}, "
        f"processes {saved.world_size} -> {world}); "
        f"optim.lr is not rescaled ({config.optim.lr:g}): scale it yourself if you want a rule"
    )


@dataclass
class TrainOutcome:
    run_dir: Path
    final_step: int
    checkpoint: Path | None
    stopped_by_signal: int | None


def refuse_graphs_with_accumulation(config: Config, global_batch: GlobalBatch) -> None:
    """trainer.cuda_graphs only where a step is one micro-batch. The graphs' backward writes the
    gradients into their memory pool, a parameter whose .grad is None takes that tensor as its
    .grad, and the next micro-batch's replay overwrites it: accumulation would add to overwritten
    gradients (torch names the case in cudagraph_trees.py's error on it). Known here, before the
    run folder is touched: every rank computes the same accumulation and refuses alike."""
    if config.trainer.cuda_graphs and config.trainer.accumulate_grad_batches > 1:
        raise ConfigError(
            [
                f"trainer.cuda_graphs needs one micro-batch per optimizer step and this start has "
                f"{config.trainer.accumulate_grad_batches} ({global_batch.product}); set data.batch_size to "
                "the global batch / processes, or trainer.cuda_graphs=false"
            ]
        )


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
    placement = resolve_placement(config)
    backend = placement.backend
    flight_recorder.enable(config.run.run_dir)  # before the process group starts: it reads the settings then
    # Our own process group (Lightning skips its init when one exists): node-ordered ranks,
    # and a collective decision about resuming, so no rank starts over while others resume.
    timeout = timedelta(seconds=config.distributed.timeout_s)  # every collective's: the process group's, the stop vote's
    distributed = init_process_group(backend, timeout)
    if generation is None:
        generation = worker_generation(os.environ)
    if distributed:
        order = (
            f"ranks ordered by node, torchrun rank {os.environ[TORCHRUN_RANK]}"
            if TORCHRUN_RANK in os.environ
            else "ranks as torchrun or Ray set them"
        )
        log.info(
            "process group ready: global rank %s of %s (%s, %s; store %s:%s; pid %d)",
            os.environ["RANK"],
            os.environ["WORLD_SIZE"],
            backend,
            order,
            os.environ["MASTER_ADDR"],
            os.environ["MASTER_PORT"],
            os.getpid(),  # which process is which rank: a forked worker's /proc/PID/environ is its server's
        )
        generation = agreed_max(generation, backend)
    plan = agreed_plan(config, resume or os.environ.get("PURRSIGHT_RESUME") or None, generation, distributed)
    ckpt = plan.checkpoint
    # The micro-batch and checkpointing left auto (chosen for this device, or kept from the
    # checkpoint), then the accumulation this world needs for trainer.global_batch_size, before
    # anything reads them (the data, the model, the trainer): an elastic restart keeps the global batch.
    # The folder is prepared after: a start the choice refuses leaves it as it was.
    config = settle_auto_settings(config, ckpt, placement.accelerator, backend, distributed)
    config, global_batch = resolve_global_batch(config, int(os.environ.get("WORLD_SIZE", "1")))
    refuse_graphs_with_accumulation(config, global_batch)
    prepare_agreed(config, plan, distributed)
    if int(os.environ.get("RANK", "0")) == 0:
        (log.info if global_batch.exact else log.warning)(global_batch.line())
    pl.seed_everything(config.run.seed, workers=True, verbose=False)
    if int(os.environ.get("RANK", "0")) == 0:
        write_resolved(config, config.run.run_dir)
    timeout = timedelta(seconds=config.distributed.timeout_s)
    saver = CheckpointSaver(
        checkpoint_dir(config.run.run_dir), config.checkpoint.every_n_steps, config.checkpoint.keep_last, timeout
    )
    module = Phase2Module(config)
    if ckpt is not None and int(os.environ.get("RANK", "0")) == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        change = global_batch_change(training_position(ckpt, world), config, world)
        if change:
            log.warning(change)
    data = Phase2DataModule(config)
    recorder = AttemptRecorder(config.run.run_dir, generation, lambda: saver.seconds_saving, global_batch.product)
    trainer = build_trainer(
        config, saver, callbacks, resumed_step=plan.step, strategy=strategy, recorder=recorder, generation=generation
    )
    if ckpt is not None:
        log.info("resuming from checkpoint %s", ckpt)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=str(ckpt) if ckpt else None)
    except RuntimeError as error:
        raise_for_peer_firing(trainer.callbacks, error)  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if saver.stopped_by_signal is None:  # during a stop a peer may end first, its checkpoint written
            raise_for_lost_peer(error)
        raise
    validated_at_end = trainer.global_step % config.trainer.val_every_n_steps == 0
    if saver.stopped_by_signal is None and data.val_set is not None and not validated_at_end:
        trainer.validate(module, datamodule=data, verbose=False)
    signal_name = f"stopped by signal {saver.stopped_by_signal}" if saver.stopped_by_signal is not None else None
    recorder.end(signal_name or "finished")  # before the report, which shows this attempt
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.save()  # the report reads the metrics file
        close_trackers(trainer.loggers)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, not declared
        preflight = next((c.report for c in callbacks if isinstance(c, Preflight)), None)
        report = write_report(config.run.run_dir, preflight.table() if preflight else None)
        log.info("run report: %s", report)
    return TrainOutcome(config.run.run_dir, trainer.global_step, saver.last_saved_path, saver.stopped_by_signal)
