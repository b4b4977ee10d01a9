"""The ``auto`` settings settled once at start: the same on every rank, kept across a resume.

``data.batch_size: auto`` and ``model.llm.gradient_checkpointing: auto`` are decided by
estimate/auto_fit.py for the smallest device memory among the ranks, on rank 0, and sent to the
others. A resume keeps what its checkpoint's run chose by itself, so a job moved to another GPU
type, or one that lost a node, keeps its micro-batch and raises its accumulation instead (the
position logic handles either). It chooses again where the checkpoint's run was given a value
(the user now asks for auto), where the user changed what the choice was made for (the global
batch, ``data.max_length``), or where the kept micro-batch is over this world's share of the
global batch. A value given always wins. Where nothing is auto, nothing of the estimate is imported.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from purrsight.config import AUTO, Config
from purrsight.distributed.process_group import agreed_max, from_rank_zero
from purrsight.errors import UserError
from purrsight.runs.checkpoint_files import SavedSettings, saved_settings
from purrsight.training.trainer_builder import resolve_precision

log = logging.getLogger(__name__)
BATCH, CHECKPOINTING = "data.batch_size", "model.llm.gradient_checkpointing"


def auto_keys(config: Config) -> list[str]:
    """The settings ``config`` leaves to the start."""
    return [
        key
        for key, value in ((BATCH, config.data.batch_size), (CHECKPOINTING, config.model.llm.gradient_checkpointing))
        if value == AUTO
    ]


def kept_settings(config: Config, world: int, saved: SavedSettings | None) -> dict[str, Any]:
    """The auto settings a resume keeps from its checkpoint (the module docstring): key -> value."""
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
    asked = config.trainer.global_batch_size
    share = math.ceil(asked / world) if asked is not None else None
    if BATCH in chosen and type(batch) is int and batch >= 1 and (share is None or batch <= max(1, share)):
        kept[BATCH] = batch
    if CHECKPOINTING in chosen and isinstance(checkpointing, bool):
        kept[CHECKPOINTING] = checkpointing
    return {key: value for key, value in kept.items() if key in auto_keys(config)}


@dataclass(frozen=True)
class Settled:
    batch: int
    checkpointing: bool
    lines: list[str]


def _shown(key: str, value: Any) -> str:
    return ("on" if value else "off") if key == CHECKPOINTING else str(value)


def _decide(config: Config, checkpoint: Path | None, accelerator: str, world: int, memory: int, device: str) -> Settled:
    """The auto settings decided, and the log's lines for them (rank 0)."""
    from purrsight.estimate.auto_fit import auto_choice, with_choices

    kept = kept_settings(config, world, saved_settings(checkpoint) if checkpoint is not None else None)
    lines = [
        f"{key} auto: {_shown(key, value)}, as the checkpoint's run chose it (give a value to choose again)"
        for key, value in kept.items()
    ]
    given = config
    if kept:
        given = with_choices(
            config, kept.get(BATCH, config.data.batch_size), kept.get(CHECKPOINTING, config.model.llm.gradient_checkpointing)
        )
    if not auto_keys(given):
        return Settled(given.data.micro_batch, given.model.llm.checkpointing, lines)
    precision = resolve_precision(config, accelerator)  # the estimate counts bf16 or fp32 by it
    priced = given.model_copy(update={"trainer": given.trainer.model_copy(update={"precision": precision})})
    choice = auto_choice(priced, world, memory, device)
    return Settled(choice.batch_size, choice.gradient_checkpointing, lines + choice.lines())


def settle_auto_settings(config: Config, checkpoint: Path | None, accelerator: str, backend: str, distributed: bool) -> Config:
    """``config`` with no ``auto`` left in data.batch_size or model.llm.gradient_checkpointing,
    and the keys that were (``Config.auto_chosen``: the checkpoints record them).

    Every rank calls it (a collective finds the smallest device); rank 0 decides and logs, and a
    refusal (not one sample fits) is raised on every rank, so all exit 2 together.
    """
    keys = auto_keys(config)
    if not keys:
        return config  # the estimate's model code stays unimported (tests/unit/test_start_imports.py)
    from purrsight.estimate.auto_fit import device_memory, with_choices

    memory, device = device_memory(accelerator)
    if distributed:
        smallest = -agreed_max(-memory, backend)
        device = device if smallest == memory else f"the smallest of the ranks' {device}"
        memory = smallest
    world = int(os.environ.get("WORLD_SIZE", "1"))
    settled: Settled | None = None
    problem: str | None = None
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            settled = _decide(config, checkpoint, accelerator, world, memory, device)
        except UserError as err:
            problem = str(err)
    if distributed:
        settled, problem = from_rank_zero((settled, problem))
    if problem is not None:
        raise UserError(problem)
    assert settled is not None
    if int(os.environ.get("RANK", "0")) == 0:
        for line in settled.lines:
            log.info(line)
    return with_choices(config, settled.batch, settled.checkpointing).with_auto_chosen(keys)
