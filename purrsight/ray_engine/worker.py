"""What each Ray Train worker runs: Ray's ranks, device and checkpoints mapped onto training.run.

Ray Train V2 starts the workers, the process group (backend and timeout from our config,
via TorchConfig) and restarts after failures; it sets RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, NODE_RANK and MASTER_ADDR/PORT as torchrun does. Here we add what our
parts read besides (GROUP_RANK for telemetry and the watchdog, the launch id for the run
folder), give Lightning Ray's ranks and device, relay a stop from the driver, and report
every checkpoint our CheckpointSaver writes to Ray, so that Ray's restore after a failure
and our own resume agree.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch

from purrsight.cli import setup_logging, user_error_lines
from purrsight.config import Config
from purrsight.errors import UserError
from purrsight.ray_engine.pointer import read_pointer
from purrsight.ray_engine.ray_noise import quiet_checkpoint_reports

log = logging.getLogger("purrsight.ray_engine")


class WorkerInputError(RuntimeError):
    """A bad input found by a worker; the driver prints it and exits 2 (the message is in the coordinator)."""


def restored_checkpoint() -> str | None:
    """Our checkpoint file behind the newest checkpoint Ray restored after a failure, if any."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        path, step = read_pointer(Path(folder))
    if not path.is_file():
        log.warning("Ray restored %s (step %d), which is gone: resuming from the newest checkpoint", path, step)
        return None
    return str(path)


def train_on_worker(settings: dict[str, Any]) -> dict[str, Any]:
    """The Ray Train worker function; ``settings`` come from the driver (driver.py)."""
    context = ray.train.get_context()
    os.environ["GROUP_RANK"] = str(context.get_node_rank())  # our node index (telemetry, watchdog)
    os.environ["PURRSIGHT_LAUNCH_ID"] = settings["launch"]
    os.environ["PURRSIGHT_NODE_ADDR"] = ray.util.get_node_ip_address()
    os.environ.update(settings["placement"])  # the driver's decision, taken as the launcher's is
    setup_logging(force=True)  # rank-prefixed lines like under torchrun, not Ray's format
    quiet_checkpoint_reports()  # Ray's INFO lines for its own log files would now reach ours
    rank = context.get_world_rank()
    coordinator = settings["coordinator"]
    earlier_starts = ray.get(coordinator.worker_started.remote(rank))
    log.info(
        "Ray Train worker %d of %d on node %d (%s), start %d of this job",
        rank,
        context.get_world_size(),
        context.get_node_rank(),
        os.environ["PURRSIGHT_NODE_ADDR"],
        earlier_starts + 1,
    )
    stopped_by_user_error = ray.get(coordinator.user_error.remote())
    if stopped_by_user_error:
        # Ray restarts the worker group after any failure; a bad input would fail again.
        log.warning("not training again: an earlier attempt stopped on: %s", stopped_by_user_error[0])
        return {}
    # Lightning, transformers and peft load here, after the line above (timed as ours).
    from purrsight.ray_engine.callbacks import RayTrainEnvironment, RelayedStop, ReportCheckpointsToRay
    from purrsight.training.run import train
    from purrsight.training.trainer_builder import build_strategy, resolve_placement

    config = Config.model_validate(settings["config"])
    resume = restored_checkpoint() or (settings["resume"] if earlier_starts == 0 else None)
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    strategy = build_strategy(config, resolve_placement(config), RayTrainEnvironment(), device)
    callbacks = [RelayedStop(coordinator), ReportCheckpointsToRay(Path(settings["ray_root"]), settings["launch"])]
    try:
        outcome = train(config, resume, callbacks, generation=earlier_starts, strategy=strategy)
    except UserError as err:
        lines = user_error_lines(err)
        ray.get(coordinator.record_user_error.remote(lines))
        # Ray logs the traceback of whatever a worker raises: a short one for a user error.
        raise WorkerInputError(lines[0]) from None
    return {
        "final_step": outcome.final_step,
        "checkpoint": str(outcome.checkpoint) if outcome.checkpoint else None,
        "stopped_by_signal": outcome.stopped_by_signal,
    }
