"""Lightning's loop state: the one place PurrSight reads or sets it.

Lightning restores its count of the epoch's batches from a checkpoint as saved, in the saving
run's micro-batches, and ends the epoch when the count reaches the loader's length. After a
change of world size or batch shape that count must be derived again from our data position
(data_position.py); Lightning has no public way to set it, so a resume rewrites the counters
in the checkpoint's loop state before Lightning restores them.

More of the loops' private parts are ours to set:

- the count its loggers take as the step (``_batches_that_stepped``): Lightning never rewrites it
  on a resume whose first window is partial, and it stayed one behind the optimizer step for good;
- its decision to validate (``_should_check_val_fx``): Lightning counts micro-batches
  (``val_check_interval``), which after a partial window falls inside a window, and it validates
  whenever ``should_stop`` is set, so a stop signal ran a whole validation pass before the exit;
- when the logger connector hands a step's metrics to the loggers (``update_train_step_metrics``):
  after every ``on_train_batch_end`` hook, where checkpoints are written (``log_step_then``);
- its callbacks' per-batch hooks: Lightning calls each hook on every callback, the base class's
  empty ones included, each inside a profiler context (``skip_empty_batch_hooks``);
- its broadcast of rank 0's SIGTERM flag before every training micro-batch of a multi-process run
  (``_broadcast_sigterm_tensor``, Lightning 2.5.2 on): a blocking collective and a host read of its
  result at each micro-batch, for a flag only Lightning's own SIGTERM handler sets, which the stop
  vote's replaces once training starts (``leave_stops_to_the_stop_vote``); a SIGTERM Lightning's
  handler noted before that becomes the stop vote's (``take_over_a_noted_sigterm``).

``check_layout`` runs when the trainer is built, so a Lightning upgrade that moves any of them
stops the start with one line instead of resuming with a wrong count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import pytorch_lightning as pl

from purrsight.errors import UserError

FIT_LOOP = "fit_loop"
BATCH_PROGRESS = "epoch_loop.batch_progress"  # the epoch loop's batch counters in the fit loop's state
EPOCH_PROGRESS = "epoch_progress"  # the fit loop's epoch counters
COUNTERS = ("ready", "started", "processed", "completed")
LOADER_STATES = "combined_loader"  # loaders' own states, written by earlier PurrSight versions


class LightningLayoutError(UserError):
    """The installed Lightning keeps its loop state where this PurrSight does not expect it."""


def _layout_error(where: str) -> LightningLayoutError:
    return LightningLayoutError(
        f"pytorch_lightning {pl.__version__} keeps no fit-loop batch counters at {where}, which a resume sets; "
        "install the version requirements.txt names"
    )


EPOCH_LOOP_PARTS = ("_batches_that_stepped", "_should_check_val_fx", "_should_check_val_epoch", "_should_accumulate")
SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"  # the epoch loop's per-micro-batch broadcast (Lightning >= 2.5.2)
SIGNAL_CONNECTOR = "_signal_connector"  # the trainer's, whose received_sigterm Lightning's handler sets
LOGGER_CONNECTOR_STEP = "update_train_step_metrics"


def check_layout(trainer: pl.Trainer) -> None:
    """Refuse a Lightning whose fit loop does not keep the batch counters a resume sets."""
    current = trainer.fit_loop.state_dict().get(BATCH_PROGRESS, {}).get("current", {})
    if not all(counter in current for counter in COUNTERS):
        raise _layout_error(f"loops.{FIT_LOOP}.{BATCH_PROGRESS}.current")
    missing = [part for part in EPOCH_LOOP_PARTS if not hasattr(trainer.fit_loop.epoch_loop, part)]
    if missing:
        raise LightningLayoutError(
            f"pytorch_lightning {pl.__version__}'s training epoch loop has no {', '.join(missing)}, which PurrSight sets; "
            "install the version requirements.txt names"
        )
    if not callable(getattr(trainer._logger_connector, LOGGER_CONNECTOR_STEP, None)):
        raise LightningLayoutError(
            f"pytorch_lightning {pl.__version__}'s logger connector has no {LOGGER_CONNECTOR_STEP}, which PurrSight calls; "
            "install the version requirements.txt names"
        )


def validate_at_optimizer_steps(trainer: pl.Trainer, every_n_steps: int) -> None:
    """Validate right after every ``every_n_steps``-th optimizer step, and never once a stop is agreed.

    Replaces the epoch loop's decision, which counts micro-batches and validates when
    ``should_stop`` is set. Lightning calls it after each micro-batch (and once when it restarts
    from a checkpoint, to skip a validation that belongs to the saved step).
    """
    loop = trainer.fit_loop.epoch_loop

    def should_validate(data_fetcher: Any) -> bool:
        if not loop._should_check_val_epoch() or trainer.should_stop:
            return False
        stepped = not loop._should_accumulate()  # this micro-batch closed its window: the optimizer stepped
        return stepped and trainer.global_step > 0 and trainer.global_step % every_n_steps == 0

    loop._should_check_val_fx = should_validate  # type: ignore[method-assign]


def leave_stops_to_the_stop_vote(trainer: pl.Trainer) -> bool:
    """No broadcast of Lightning's SIGTERM flag before each training micro-batch; whether there was one.

    Lightning (2.5.2 on) broadcasts rank 0's ``received_sigterm`` to every rank before each training
    micro-batch of a multi-process run, and reads the result on the host (``.item()``): on GPUs a
    wait for the device at every micro-batch (issue 48: the host must run ahead). Only Lightning's
    own SIGTERM handler sets the flag, and the checkpoint saver's stop handler replaces it at
    ``on_train_start`` (runs/checkpoint_saver.py), where a signal that handler noted earlier is
    taken over (``take_over_a_noted_sigterm``): from the first micro-batch on, ranks agree on a stop
    through the stop vote (distributed/stop_vote.py), an asynchronous all-reduce a micro-batch read
    at the next, and the broadcast carried a 0 every time. A Lightning without the method has no
    such broadcast to skip.
    """
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(loop, SIGTERM_BROADCAST, None)):
        return False
    setattr(loop, SIGTERM_BROADCAST, _no_broadcast)
    return True


# The callback hooks Lightning calls at every training or validation micro-batch, all through
# ``_call_callback_hooks`` (never directly, as it calls ``on_save_checkpoint``).
PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_zero_grad",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
)


def skip_empty_batch_hooks(callbacks: Iterable[pl.Callback]) -> int:
    """Hide the per-batch hooks each callback leaves as pl.Callback's empty methods; how many were hidden.

    Lightning's dispatcher calls every hook on every callback, each inside a profiler context
    with its name formatted, and skips an attribute that is not callable (``_call_callback_hooks``:
    ``if callable(fn)``). A torchrun run's 9 callbacks took 54 training-hook calls a micro-batch,
    43 of them empty; Lightning's dispatching alone (the callbacks' own work apart) was 0.64-0.89%
    of the tiny model's step in three profiles, 0.52% after (py-spy, bench/results/launch.md).
    A hook set to None on the instance is skipped; a callback that overrides it keeps it.
    Guarded: where the installed dispatcher would call a hidden hook, nothing is hidden
    (``_dispatcher_skips_uncallable``); that every per-batch hook goes through that dispatcher
    is checked by a real fit in tests/unit/test_internals.py.
    """
    if not _dispatcher_skips_uncallable():
        return 0
    hidden = 0
    for callback in callbacks:
        for hook in PER_BATCH_HOOKS:
            if hook not in vars(callback) and getattr(type(callback), hook) is getattr(pl.Callback, hook):
                setattr(callback, hook, None)
                hidden += 1
    return hidden


@functools.cache
def _dispatcher_skips_uncallable() -> bool:
    """Whether Lightning's callback dispatcher passes over a hook set to None (asked once, of a
    stand-in trainer holding one such callback: the dispatcher reads only these attributes of it)."""
    from pytorch_lightning.profilers import PassThroughProfiler
    from pytorch_lightning.trainer import call

    probe = pl.Callback()
    trainer = SimpleNamespace(callbacks=[probe], lightning_module=None, profiler=PassThroughProfiler())
    try:
        for hook in PER_BATCH_HOOKS:
            setattr(probe, hook, None)
            call._call_callback_hooks(trainer, hook)  # type: ignore[arg-type]
    except Exception:  # any failure: the dispatcher does not skip it
        return False
    return True


def _no_broadcast() -> None:
    """In place of the epoch loop's SIGTERM broadcast: a stop travels by the stop vote."""


def take_over_a_noted_sigterm(trainer: pl.Trainer) -> bool:
    """Whether Lightning's SIGTERM handler noted a signal before the stop vote's replaced it (between
    Lightning's registration and ``on_train_start``: its barriers, the loaders' first workers); the
    note is cleared, for the caller to request the stop the stop vote agrees on. Left, it would end
    this rank alone after its first micro-batch, without a checkpoint, and the others at their next
    collective (the broadcast that carried it to every rank is skipped)."""
    connector = getattr(trainer, SIGNAL_CONNECTOR, None)
    if not getattr(connector, "received_sigterm", False):
        return False
    connector.received_sigterm = False  # type: ignore[union-attr]  # a bool attribute on Lightning's connector
    return True


def end_validation_now() -> None:
    """End the validation pass in progress after the current batch (called from a batch-end hook).

    Lightning's evaluation loop ends its pass on StopIteration from anywhere in a batch's step,
    hooks included (``_EvaluationLoop.run``: ``except StopIteration: break``), then runs its
    epoch-end and end hooks as after the last batch. tests/unit/test_internals.py checks it on the
    installed version.
    """
    raise StopIteration


def log_step_then(trainer: pl.Trainer, action: Callable[[], Any]) -> None:
    """Hand this optimizer step's metrics to the loggers now, then run ``action`` (a checkpoint's write).

    Lightning logs a step's metrics after every ``on_train_batch_end`` hook, and checkpoints are
    written in one: a process killed between the two (SIGKILL, the OOM killer, a node's death) left
    a checkpoint of a step that neither the loggers nor the tracker queue on disk had, and the
    resume, which starts after that step, never logged it. Called from the last callback's hook
    (runs/checkpoint_saver.py: SaveAtStepEnd), so every callback's metrics are in. Lightning's own
    call for this batch is then skipped (the method shadowed once on the instance), so no logger
    gets the step twice; if ``action`` raises, nothing is shadowed and the fit ends with its error.
    """
    connector = trainer._logger_connector
    getattr(connector, LOGGER_CONNECTOR_STEP)()
    action()

    def skip_this_batch() -> None:
        delattr(connector, LOGGER_CONNECTOR_STEP)  # the class's method again from the next batch on

    setattr(connector, LOGGER_CONNECTOR_STEP, skip_this_batch)


def set_logged_step(trainer: pl.Trainer) -> None:
    """Make the loggers' step the optimizer step count (Lightning's restore can leave it one behind)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step


def saved_epoch_ended(checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint was saved at its epoch's last batch (Lightning then starts the next)."""
    progress = checkpoint.get("loops", {}).get(FIT_LOOP, {}).get(BATCH_PROGRESS, {})
    return bool(progress.get("is_last_batch", False))


def epoch_batches_of(checkpoint: dict[str, Any]) -> int:
    """The saved epoch's batches Lightning counts as taken, in the saving run's micro-batches."""
    return int(epoch_batches(checkpoint)["ready"])


def epoch_batches(checkpoint: dict[str, Any]) -> dict[str, int]:
    """The counters of the saved epoch's batches inside a loaded checkpoint."""
    try:
        current = checkpoint["loops"][FIT_LOOP][BATCH_PROGRESS]["current"]
    except (KeyError, TypeError):
        raise _layout_error(f"checkpoint['loops'][{FIT_LOOP!r}][{BATCH_PROGRESS!r}]") from None
    if not all(counter in current for counter in COUNTERS):
        raise _layout_error(f"checkpoint['loops'][{FIT_LOOP!r}][{BATCH_PROGRESS!r}]['current']")
    return current  # type: ignore[no-any-return]  # the checkpoint's own dict, changed in place by the caller


def set_batches_done(checkpoint: dict[str, Any], done: int, epoch_ended: bool = False) -> None:
    """Make Lightning count ``done`` of the epoch's batches as taken when it restores this checkpoint.

    Every counter moves by the same amount: their offsets to each other say at which point of
    a batch the checkpoint was saved, and Lightning's restore reads them. ``epoch_ended``: the
    count is the whole epoch, and Lightning's restore must move on to the next one, which it does
    only for a checkpoint saved at its epoch's last batch (``is_last_batch``).
    """
    current = epoch_batches(checkpoint)
    shift = done - current["ready"]
    for counter in COUNTERS:
        current[counter] += shift
    if epoch_ended:
        checkpoint["loops"][FIT_LOOP][BATCH_PROGRESS]["is_last_batch"] = True


def reopen_closed_epoch(checkpoint: dict[str, Any]) -> bool:
    """Make a checkpoint saved after Lightning closed its epoch look saved at that epoch's last batch end.

    Before feeade4 (2026-11-23) the last step was saved in ``on_train_end``: Lightning had counted
    the epoch as processed and completed (``epoch`` one on) while the batch counters
    still held the closed epoch's micro-batches, so a resume with a larger ``trainer.max_steps``
    started the next epoch and left the rest of this one out. A batch-end save is taken with the
    epoch started but not processed, and the batch not yet completed: the counters are set so.
    Returns whether the checkpoint was such a save.
    """
    fit_loop = checkpoint.get("loops", {}).get(FIT_LOOP, {})
    epochs = fit_loop.get(EPOCH_PROGRESS, {})
    current, total = epochs.get("current", {}), epochs.get("total", {})
    batches = fit_loop.get(BATCH_PROGRESS, {}).get("current", {})
    # The epoch counted processed and completed says it, but not alone: after a resume from an
    # epoch's last step Lightning keeps all four equal for the rest of the run, and then counts a
    # closed epoch's processed and completed one past its ready and started. A batch-end save is
    # taken before its batch is counted completed; on_train_end's, after.
    if not all(counter in current for counter in COUNTERS) or not all(counter in batches for counter in COUNTERS):
        return False
    closed = current["processed"] == current["completed"] and current["ready"] == current["started"]
    closed &= current["ready"] in (current["processed"], current["processed"] - 1)
    batch_completed = batches["completed"] == batches["processed"]
    if not closed or not batch_completed or current["completed"] < 1 or int(batches["ready"]) < 1:
        return False
    for counters in (current, total):
        for counter in ("processed", "completed"):
            if counter in counters:
                counters[counter] -= 1
    for counters in (batches, fit_loop[BATCH_PROGRESS].get("total", {})):
        if "completed" in counters:
            counters["completed"] -= 1
    checkpoint["epoch"] = int(checkpoint.get("epoch", 1)) - 1
    return True


def drop_loader_states(checkpoint: dict[str, Any]) -> None:
    """Remove loader states an earlier version saved: today's loaders keep none, and Lightning
    refuses to restore states for loaders that take none."""
    fit_loop = checkpoint.get("loops", {}).get(FIT_LOOP, {})
    fit_loop.get("state_dict", {}).pop(LOADER_STATES, None)
