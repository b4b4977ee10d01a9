"""Turn the config (and the launch environment) into a configured pl.Trainer."""

from __future__ import annotations

import inspect
import os
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.environments import ClusterEnvironment, TorchElasticEnvironment
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

from purrsight.config import Config
from purrsight.distributed.preflight_callback import Preflight
from purrsight.distributed.watchdog import ProgressWatchdog
from purrsight.errors import UserError
from purrsight.internals.lightning_loops import (
    check_layout,
    leave_stops_to_the_stop_vote,
    skip_empty_batch_hooks,
    validate_at_optimizer_steps,
)
from purrsight.observability.loggers import build_loggers
from purrsight.observability.profiler import StepProfiler
from purrsight.observability.progress_bar import StepBar, StepLines, use_progress_bar
from purrsight.observability.step_numbering import FitStepNumbering
from purrsight.observability.telemetry import Telemetry
from purrsight.placement import Placement, decide, from_launcher
from purrsight.runs.attempts import AttemptRecorder
from purrsight.runs.checkpoint_saver import AtomicCheckpointIO, CheckpointSaver
from purrsight.runs.step_windows import StepWindows
from purrsight.training.fsdp import ShardedFrozenBase


def resolve_placement(config: Config) -> Placement:
    """The launcher's (or the Ray driver's) decision when one was made, else this process's own."""
    launched = from_launcher(os.environ)
    if launched is not None:
        return launched
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return decide(config.trainer.accelerator, config.distributed.backend, gpus)


def resolve_precision(config: Config, accelerator: str) -> str:
    if config.trainer.precision != "auto":
        return config.trainer.precision
    if accelerator == "gpu" and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def launch_world() -> tuple[int, int]:
    """(processes on this node, nodes) as torchrun set them; (1, 1) in a plain process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return local, max(1, world // max(1, local))


class DDPOnDevice(DDPStrategy):
    """DDP on the device an engine assigned (Ray gives each worker its GPU), not devices[local_rank]."""

    def __init__(self, device: torch.device, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._assigned_device = device

    @property
    def root_device(self) -> torch.device:
        return self._assigned_device


def buffer_sync(every_forward: bool) -> dict[str, bool]:
    """DDP's keyword for re-sending rank 0's buffers before each forward.

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (the old name now
    warns on every rank); the new one still syncs once at wrap time, which is harmless here.
    """
    if "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters:
        return {"forward_sync_buffers": every_forward}
    return {"broadcast_buffers": every_forward}


def build_strategy(
    config: Config, placement: Placement, environment: ClusterEnvironment | None = None, device: torch.device | None = None
) -> Strategy:
    """Single device or DDP with our settings.

    ``environment`` and ``device`` come from an engine that placed the processes itself
    (Ray); by default torchrun's environment and devices[LOCAL_RANK].
    """
    local, nodes = launch_world()
    io = AtomicCheckpointIO()
    if local * nodes == 1:
        if config.distributed.strategy == "fsdp":
            raise UserError(
                "distributed.strategy=fsdp shards the frozen weights over several processes and this run has one; "
                "start 2 or more (NPROC_PER_NODE, NUM_NODES, ray.num_workers) or set distributed.strategy=ddp"
            )
        if device is None:
            device = torch.device("cuda", 0) if placement.accelerator == "gpu" else torch.device("cpu")
        return SingleDeviceStrategy(device=device, checkpoint_io=io)
    dist = config.distributed
    if dist.strategy == "fsdp":
        return ShardedFrozenBase(
            environment or TorchElasticEnvironment(), placement.backend, timedelta(seconds=dist.timeout_s), device
        )
    # torchrun started us: Lightning must take torchrun's ranks, even inside a SLURM
    # allocation where it would otherwise read SLURM's (one task per node, not per GPU).
    settings: dict[str, Any] = dict(
        cluster_environment=environment or TorchElasticEnvironment(),
        process_group_backend=placement.backend,
        timeout=timedelta(seconds=dist.timeout_s),
        bucket_cap_mb=dist.bucket_cap_mb,
        gradient_as_bucket_view=dist.gradient_as_bucket_view,
        static_graph=dist.static_graph,
        find_unused_parameters=dist.find_unused_parameters,
        **buffer_sync(dist.broadcast_buffers),
        checkpoint_io=io,
    )
    return DDPOnDevice(device, **settings) if device is not None else DDPStrategy(**settings)


def build_trainer(
    config: Config,
    saver: CheckpointSaver,
    extra_callbacks: list[pl.Callback] | None = None,
    resumed_step: int = 0,
    strategy: Strategy | None = None,
    recorder: AttemptRecorder | None = None,
    generation: int = 0,
) -> pl.Trainer:
    """The trainer for a run that continues after ``resumed_step`` (0: a new run).

    ``strategy``: an engine's own (Ray); by default built for torchrun or a single process.
    ``recorder`` keeps this attempt's record (attempts.py); ``generation``: earlier starts of
    this rank in this launch (its hang-progress records are apart from theirs).
    """
    placement = resolve_placement(config)
    local, nodes = launch_world()
    run_dir = config.run.run_dir
    bar = use_progress_bar(config.logging.progress)
    callbacks: list[pl.Callback] = [saver, FitStepNumbering(), StepWindows(), *(extra_callbacks or [])]
    if recorder is not None:
        callbacks.append(recorder)
        saver.after_save.append(recorder.after_save)
    callbacks.append(Preflight(config.preflight))
    if config.profiler.enabled:
        callbacks.append(StepProfiler(run_dir / "profiler", config.profiler.start_step, config.profiler.end_step))
    telemetry = config.telemetry
    if telemetry.enabled:
        prefix = config.model.prefix_tokens * sum(getattr(config.model, f"{m}_encoder").enabled for m in ("image", "audio"))
        meter = Telemetry(
            run_dir,
            telemetry.every_n_steps,
            telemetry.barrier_every,
            telemetry.peak_tflops,
            seq_len=config.data.max_length + prefix,
        )
        callbacks.append(meter)
        saver.after_save.append(meter.after_save)
    if config.distributed.progress_timeout_s is not None:
        on_fire = recorder.end if recorder is not None else None
        callbacks.append(ProgressWatchdog(config.distributed.progress_timeout_s, run_dir, generation, on_fire))
    callbacks.append(StepBar(config.logging.every_n_steps) if bar else StepLines(config.logging.every_n_steps))
    trainer_cfg = config.trainer
    trainer = pl.Trainer(
        accelerator=placement.accelerator,
        devices=local,
        num_nodes=nodes,
        strategy=strategy or build_strategy(config, placement),
        precision=resolve_precision(config, placement.accelerator),  # type: ignore[arg-type]
        max_steps=trainer_cfg.max_steps,
        max_epochs=-1,  # max_steps decides; epochs just repeat the (re-shuffled) data
        accumulate_grad_batches=trainer_cfg.accumulate_grad_batches,
        gradient_clip_val=trainer_cfg.gradient_clip_val,
        # Lightning's own count (micro-batches) is replaced below by validate_at_optimizer_steps;
        # given here so that its checks and progress bars see the same interval.
        val_check_interval=trainer_cfg.val_every_n_steps * trainer_cfg.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        # No validation set: no validation loop at all (an empty loader makes Lightning warn on every run).
        limit_val_batches=0 if config.data.val_index is None else trainer_cfg.limit_val_batches,
        num_sanity_val_steps=0,
        deterministic=config.run.deterministic,
        use_distributed_sampler=False,  # the DataModule builds its own DistributedSampler
        enable_checkpointing=False,  # CheckpointSaver owns checkpointing
        enable_progress_bar=bar,
        enable_model_summary=False,
        log_every_n_steps=config.logging.every_n_steps,
        logger=build_loggers(config, run_dir, resumed_step) or False,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
    )
    check_layout(trainer)  # a resume sets its loop counters: an upgrade that moved them stops here
    validate_at_optimizer_steps(trainer, trainer_cfg.val_every_n_steps)
    leave_stops_to_the_stop_vote(trainer)  # no collective and host read before each micro-batch
    skip_empty_batch_hooks(trainer.callbacks)  # type: ignore[attr-defined]  # no call of an empty hook a micro-batch
    return trainer
