"""Ray's lines a user cannot act on, each dropped exactly (the rest of its source still speaks).

Two places, because the lines come from two places:

* In each worker: Ray Train logs three INFO lines per checkpoint we report ("Reporting
  training result N" from every rank, "Checkpoint successfully created at" from rank 0).
  Ray meant them for its own log files, but the worker's root logger is ours (rank-prefixed
  lines at INFO, like under torchrun), so they reached the job log in our format.
* In the driver: Ray's core logs an error line when Train's controller creates its
  PreemptionWatcher actor (its constructor arguments sit in the object store and it may be
  restarted, ray-project/ray#53727). Ray's own concern: nothing fails and nothing can be
  done about it. It reaches the job log through the driver, which prints every Ray
  process's output (log_to_driver), so the driver filters that stream.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from purrsight.internals.ray_logging import PRINT_HANDLER, stdstream_dispatcher, train_report_loggers

# Substrings of a Ray process's output line the driver does not forward.
FORWARDED_NOISE = ("Actor with class name: 'PreemptionWatcher'",)


class _DropMessages(logging.Filter):
    def __init__(self, starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_checkpoint_reports() -> None:
    """In a Ray Train worker: drop Ray Train's per-checkpoint INFO lines (kept where Ray moved them)."""
    loggers = train_report_loggers()
    if loggers is None:
        return
    context, storage = loggers
    reports = {context: "Reporting training result", storage: "Checkpoint successfully created at"}
    for logger, starts in reports.items():
        if not any(isinstance(f, _DropMessages) and f.starts == starts for f in logger.filters):
            logger.addFilter(_DropMessages(starts))


def without_noise(data: dict[str, Any]) -> dict[str, Any]:
    """One batch of a Ray process's output, as the driver receives it, less the known noise lines."""
    lines = data.get("lines", [])
    kept = [line for line in lines if not any(noise in line for noise in FORWARDED_NOISE)]
    return data if len(kept) == len(lines) else {**data, "lines": kept}


def filter_forwarded_output() -> bool:
    """In the driver, after ray.init: filter what log_to_driver prints. False when Ray's printer is not found."""
    dispatcher = stdstream_dispatcher()
    if dispatcher is None:
        return False
    printer: Callable[[dict[str, Any]], None] | None = next(
        (handler for name, handler in dispatcher.handlers if name == PRINT_HANDLER), None
    )
    if printer is None:
        return False
    dispatcher.remove_handler(PRINT_HANDLER)
    dispatcher.add_handler(PRINT_HANDLER, functools.partial(_print_filtered, printer))
    return True


def _print_filtered(printer: Callable[[dict[str, Any]], None], data: dict[str, Any]) -> None:
    filtered = without_noise(data)
    if filtered.get("lines"):
        printer(filtered)
