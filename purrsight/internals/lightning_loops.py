"""Lightning's loop state: the one place PurrSight reads or sets it.

Lightning restores its count of the epoch's batches from a checkpoint as saved, in the saving
run's micro-batches, and ends the epoch when the count reaches the loader's length. After a
change of world size or batch shape that count must be derived again from our data position
(data_position.py); Lightning has no public way to set it, so a resume rewrites the counters
in the checkpoint's loop state before Lightning restores them. ``check_layout`` runs when the
trainer is built, so a Lightning upgrade that moves them stops the start with one line instead
of resuming with a wrong count.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from purrsight.errors import UserError

FIT_LOOP = "fit_loop"
BATCH_PROGRESS = "epoch_loop.batch_progress"  # the epoch loop's batch counters in the fit loop's state
COUNTERS = ("ready", "started", "processed", "completed")
LOADER_STATES = "combined_loader"  # loaders' own states, written by earlier PurrSight versions


class LightningLayoutError(UserError):
    """The installed Lightning keeps its loop state where this PurrSight does not expect it."""


def _layout_error(where: str) -> LightningLayoutError:
    return LightningLayoutError(
        f"pytorch_lightning {pl.__version__} keeps no fit-loop batch counters at {where}, which a resume sets; "
        "install the version requirements.txt names"
    )


def check_layout(trainer: pl.Trainer) -> None:
    """Refuse a Lightning whose fit loop does not keep the batch counters a resume sets."""
    current = trainer.fit_loop.state_dict().get(BATCH_PROGRESS, {}).get("current", {})
    if not all(counter in current for counter in COUNTERS):
        raise _layout_error(f"loops.{FIT_LOOP}.{BATCH_PROGRESS}.current")


def epoch_batches(checkpoint: dict[str, Any]) -> dict[str, int]:
    """The counters of the saved epoch's batches inside a loaded checkpoint."""
    try:
        current = checkpoint["loops"][FIT_LOOP][BATCH_PROGRESS]["current"]
    except (KeyError, TypeError):
        raise _layout_error(f"checkpoint['loops'][{FIT_LOOP!r}][{BATCH_PROGRESS!r}]") from None
    if not all(counter in current for counter in COUNTERS):
        raise _layout_error(f"checkpoint['loops'][{FIT_LOOP!r}][{BATCH_PROGRESS!r}]['current']")
    return current  # type: ignore[no-any-return]  # the checkpoint's own dict, changed in place by the caller


def set_batches_done(checkpoint: dict[str, Any], done: int) -> None:
    """Make Lightning count ``done`` of the epoch's batches as taken when it restores this checkpoint.

    Every counter moves by the same amount: their offsets to each other say at which point of
    a batch the checkpoint was saved, and Lightning's restore reads them.
    """
    current = epoch_batches(checkpoint)
    shift = done - current["ready"]
    for counter in COUNTERS:
        current[counter] += shift


def drop_loader_states(checkpoint: dict[str, Any]) -> None:
    """Remove loader states an earlier version saved: today's loaders keep none, and Lightning
    refuses to restore states for loaders that take none."""
    fit_loop = checkpoint.get("loops", {}).get(FIT_LOOP, {})
    fit_loop.get("state_dict", {}).pop(LOADER_STATES, None)
