"""Reading checkpoint files: which step a file holds, and the one a resume takes.

No Lightning, and torch only once a file is read: the Ray engine's driver decides how a run
starts (start.py) before any worker runs, and a fresh start reads no checkpoint at all.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from purrsight.errors import UserError
from purrsight.run_folder import LAST_NAME, step_checkpoints
from purrsight.runs.data_position import DataPosition, saved_position

log = logging.getLogger(__name__)


class CheckpointReadError(UserError):
    """A checkpoint could not be read at all (permissions, I/O error, stale NFS handle)."""


def mapped(path: Path) -> Any:
    """A checkpoint file loaded memory-mapped, safely: the few small entries the start reads leave
    the disk, not the whole file, whatever the checkpoint's size."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def saved_step(path: Path) -> int | None:
    """The optimizer step a PurrSight checkpoint was saved at; None when it is torn or not one.

    Only a file that reads but does not parse is corrupt. A file that cannot be read at
    all (permissions, an I/O error, a stale NFS handle) says nothing about its contents:
    skipping it would resume an older checkpoint, or start over, while it may be whole,
    so that raises CheckpointReadError naming the file and the cause.
    """
    try:
        state = mapped(path)  # a truncated file fails here as when read whole: its zip directory, at the end, is missing
    except OSError as err:
        raise CheckpointReadError(
            f"cannot read checkpoint {path}: {err.strerror or err}; fix access to it (or move it away) and start again"
        ) from None
    except Exception:  # a torn zip, a truncated pickle, objects that weights_only refuses
        return None
    if not (isinstance(state, dict) and "purrsight" in state and "state_dict" in state):
        return None
    return int(state.get("global_step", 0))


def newest_checkpoint(folder: Path) -> tuple[Path, int] | None:
    """(path, step) of the checkpoint a resume takes: the newest intact step file, else last.ckpt.

    A newest file that is corrupted or truncated (a disk that filled, a bad copy) is skipped
    with a warning: a run never restarts from scratch while a good checkpoint exists.
    """
    candidates = [path for _, path in reversed(step_checkpoints(folder))]
    last = folder / LAST_NAME
    if last.is_file():
        candidates.append(last)
    for path in candidates:
        step = saved_step(path)
        if step is not None:
            return path, step
        log.warning("checkpoint %s is unreadable (corrupted or truncated): trying the previous one", path)
    return None


def training_position(path: Path, world_now: int) -> DataPosition | None:
    """The data position in a checkpoint file (None when it holds none); ``world_now`` as saved_position takes it."""
    return saved_position(mapped(path), world_now)


# A checkpoint's run config (its resolved YAML, parsed) and the settings its start chose itself.
SavedSettings = tuple[dict[str, Any], frozenset[str]]
AUTO_CHOSEN_KEY = "auto_chosen"


def saved_settings(path: Path) -> SavedSettings | None:
    """The config a checkpoint's run trained with and the settings it chose at start (none before
    2026-11-29); None where the file keeps no config."""
    import yaml

    meta = mapped(path).get("purrsight")
    text = meta.get("config") if isinstance(meta, dict) else None
    try:
        settings = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError:
        return None
    if not isinstance(settings, dict):
        return None
    chosen = meta.get(AUTO_CHOSEN_KEY)  # meta is a dict: its config text was read
    return settings, frozenset(key for key in chosen or [] if isinstance(key, str))
