"""Shared command-line plumbing: logging format and the user-error -> exit code mapping."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import TypeVar

from purrsight.errors import ExitCode, UserError

T = TypeVar("T")


def setup_logging(force: bool = False) -> None:
    """Our line format, with the rank when there is one; ``force`` replaces handlers set before (Ray's)."""
    rank = os.environ.get("RANK")
    where = f" [rank {rank}]" if rank is not None else ""
    level = logging.DEBUG if os.environ.get("LOG_LEVEL", "INFO").upper() == "DEBUG" else logging.INFO
    logging.basicConfig(
        level=level,
        # Milliseconds: lines of several nodes interleave in one job log, and start-up phases are short.
        format=f"%(asctime)s.%(msecs)03d{where} %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stderr,
        force=force,
    )
    for noisy in ("httpx", "urllib3", "filelock", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_known_noise()


# Messages a user cannot act on, each silenced exactly (the rest of its source still speaks).
EXPECTED_WARNINGS = (
    # The tiny default decodes inline (data.num_workers 0), on purpose.
    r".*does not have many workers.*",
    # Frozen encoders sit in eval mode on purpose.
    r".*module\(s\) in eval mode.*",
    # torchrun, not srun, starts our ranks inside a SLURM allocation.
    r".*`srun` command is available.*",
    # Lightning counts this interval per epoch; ours (logging.every_n_steps) runs across epochs,
    # so a data set with fewer batches than the interval still logs on schedule.
    r".*is smaller than the logging interval.*",
    # A mid-epoch resume: Lightning cannot see that our DataModule restores the data position
    # itself, exactly (runs/data_position.py), and warns that results may be unreliable.
    r".*your dataloader is not resumable.*",
    # distributed.strategy=fsdp: a projector is a unit of its own and its output a view (a
    # Linear over tokens, or the pooled projector's reshape); the model only reads it out of
    # place (`prefix * present`), which keeps FSDP's backward hook (training/fsdp.py).
    r".*FSDP2-wrapped module \(FSDP(Token)?Projector\) returned a view tensor.*",
    # Deprecations inside our dependencies, not in our calls.
    r".*is_gradient_checkpointing.*",
    r".*set_vital.*",
    r".*LeafSpec.*",
)


class _DropAdverts(logging.Filter):
    """Lightning logs a litlogger advertisement ("💡 Tip: ...") at every start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_known_noise() -> None:
    for pattern in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    rank_zero = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    if not any(isinstance(f, _DropAdverts) for f in rank_zero.filters):
        rank_zero.addFilter(_DropAdverts())


def user_error_lines(err: BaseException) -> list[str]:
    """The lines a user reads for ``err``: its problems, or its message.

    A loader worker's exception comes back re-raised by torch as the same type, but with
    "Caught SampleError in DataLoader worker process 0." and the worker's traceback as its
    message; the original message is the traceback's last line, after the class name.
    """
    if isinstance(err, UserError) and err.problems:
        return err.lines()
    text = str(err)
    if text.startswith("Caught ") and " in DataLoader worker process " in text.partition("\n")[0]:
        last = text.rstrip().rpartition("\n")[2]
        return [last.partition(": ")[2] or last]
    return [text]


def run_guarded(command: Callable[[T], int], args: T) -> int:
    """Run ``command``; a user error becomes one line on stderr and exit 2.

    With LOG_LEVEL=DEBUG the traceback is printed too, for bug reports.
    """
    try:
        return command(args)
    except UserError as err:
        if os.environ.get("LOG_LEVEL", "").upper() == "DEBUG":
            logging.getLogger("purrsight").exception("user error")
        for line in user_error_lines(err):
            print(f"error: {line}", file=sys.stderr)
        return ExitCode.USAGE
