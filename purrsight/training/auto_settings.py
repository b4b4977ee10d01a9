"""The ``auto`` settings settled once at start: the same on every rank, kept across a resume.

``data.batch_size: auto`` and ``model.llm.gradient_checkpointing: auto`` are decided by
estimate/auto_fit.py for the smallest device memory among the ranks, on rank 0, and sent to the
others. A resume keeps what its checkpoint's run chose by itself, so a job moved to other GPUs,
or one that lost a node, does not change its micro-batch under it (the position logic handles a
change either way):

- the kept micro-batch is cut again for this world's share of the global batch (fewer nodes: the
  same micro-batch and more of them; more nodes: a smaller one), never made larger;
- it is priced on this device: where the estimate says it no longer fits, both are chosen again;
- the run chooses again where the checkpoint's run was given a value (the user now asks for
  auto), or where the user changed what the choice was made for (the global batch,
  ``data.max_length``).

A value given always wins. Where nothing is auto, nothing of the estimate is imported.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from purrsight.config import Config
from purrsight.distributed.process_group import agreed_max, computed_on_rank_zero
from purrsight.launcher.cgroups import memory_limit
from purrsight.runs.checkpoint_files import SavedSettings, saved_settings
from purrsight.training.trainer_builder import resolve_precision

log = logging.getLogger(__name__)
BATCH, CHECKPOINTING = "data.batch_size", "model.llm.gradient_checkpointing"
KEPT = "give a value to choose again"


def kept_settings(config: Config, saved: SavedSettings | None) -> dict[str, Any]:
    """The auto settings of ``config`` its checkpoint's run chose itself, for what this run still asks."""
    if saved is None:
        return {}
    values, chosen = saved
    try:
        batch, checkpointing = values["data"]["batch_size"], values["model"]["llm"]["gradient_checkpointing"]
        asked_alike = (
            values["trainer"].get("global_batch_size") == config.trainer.global_batch_size
            and values["data"]["max_length"] == config.data.max_length
        )
    except (KeyError, TypeError, AttributeError):
        return {}
    if not asked_alike:
        return {}
    kept: dict[str, Any] = {}
    if BATCH in chosen and type(batch) is int and batch >= 1:
        kept[BATCH] = batch
    if CHECKPOINTING in chosen and isinstance(checkpointing, bool):
        kept[CHECKPOINTING] = checkpointing
    return {key: value for key, value in kept.items() if key in config.left_auto}


@dataclass(frozen=True)
class Settled:
    batch: int
    checkpointing: bool
    lines: list[str]
    warnings: list[str] = field(default_factory=list)


def _shown(key: str, value: Any) -> str:
    return ("on" if value else "off") if key == CHECKPOINTING else str(value)


def _decide(config: Config, checkpoint: Path | None, accelerator: str, world: int, memory: int, device: str) -> Settled:
    """The auto settings decided, and the log's lines for them (rank 0)."""
    from purrsight.estimate.auto_fit import auto_choice, even_micro_batch, with_choices

    precision = resolve_precision(config, accelerator)  # the estimate counts bf16 or fp32 by it
    kept = kept_settings(config, saved_settings(checkpoint) if checkpoint is not None else None)
    lines = []
    if BATCH in kept and config.trainer.global_batch_size is not None:
        batch = even_micro_batch(config.trainer.global_batch_size, world, kept[BATCH])  # this world's share
        how = (
            "as the checkpoint's run chose it"
            if batch == kept[BATCH]
            else f"the checkpoint run's {kept[BATCH]} cut for {world} processes"
        )
        lines.append(f"{BATCH} auto: {batch}, {how} ({KEPT})")
        kept[BATCH] = batch
    if CHECKPOINTING in kept:
        lines.append(
            f"{CHECKPOINTING} auto: {_shown(CHECKPOINTING, kept[CHECKPOINTING])}, as the checkpoint's run chose it ({KEPT})"
        )
    if kept:
        batch_now, checkpointing_now = config.data.batch_size, config.model.llm.gradient_checkpointing
        given = with_choices(config, kept.get(BATCH, batch_now), kept.get(CHECKPOINTING, checkpointing_now))
        choice = auto_choice(given, world, memory, device, precision)
        if choice.fits:
            return Settled(choice.batch_size, choice.gradient_checkpointing, lines + choice.lines())
        lines = [
            f"the checkpoint's run chose {', '.join(f'{key} {_shown(key, value)}' for key, value in kept.items())}: "
            f"it does not fit here by the estimate ({choice.per_device / 1e9:.2f} GB a device, of {memory / 1e9:.1f} GB "
            f"on {device}); chosen again"
        ]
    choice = auto_choice(config, world, memory, device, precision)
    return Settled(choice.batch_size, choice.gradient_checkpointing, lines + choice.lines(), [w for w in [choice.warning()] if w])


def host_memory() -> int:
    """Bytes this host can still give its processes: MemAvailable, or the job's cgroup limit where
    lower (a SLURM or container job: launcher/cgroups.py finds its own cgroup, v1 or v2)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass  # sysconf's figure stands
    limit = memory_limit()
    return max(0, min(available, limit) if limit is not None else available)


def device_memory(accelerator: str) -> tuple[int, str]:
    """(bytes, what they are) of the device this process trains on: its GPU, else its share of the host."""
    if accelerator == "gpu":
        import torch

        index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        properties = torch.cuda.get_device_properties(index)
        return int(properties.total_memory), properties.name
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return host_memory() // local, "host memory" + (f" / {local} processes" if local > 1 else "")


def settle_auto_settings(config: Config, checkpoint: Path | None, accelerator: str, backend: str, distributed: bool) -> Config:
    """``config`` with no ``auto`` left in data.batch_size or model.llm.gradient_checkpointing,
    and the keys that were (``Config.auto_chosen``: the checkpoints record them).

    Every rank calls it (a collective finds the smallest device); rank 0 decides and logs, and
    whatever it raises (a refusal: not one sample fits) is raised on every rank, so all end together.
    """
    keys = config.left_auto
    if not keys:
        return config  # the estimate's model code stays unimported (tests/unit/test_start_imports.py)
    from purrsight.estimate.auto_fit import with_choices

    memory, device = device_memory(accelerator)
    if distributed:
        smallest = -agreed_max(-memory, backend)
        device = device if smallest == memory else f"the smallest of the ranks' {device}"
        memory = smallest
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if distributed:
        import torch.distributed as dist

        group = dist.group.WORLD
    settled = computed_on_rank_zero(lambda: _decide(config, checkpoint, accelerator, world, memory, device), group)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in settled.lines:
            log.info(line)
        for line in settled.warnings:
            log.warning(line)
    return with_choices(config, settled.batch, settled.checkpointing).with_auto_chosen(keys)
