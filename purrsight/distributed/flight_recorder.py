"""PyTorch's flight recorder on: the last collectives of every rank, dumped into the run folder.

The recorder keeps a ring of each process group's recent collectives (op, sizes, sequence
number, state: scheduled, started, completed; with the Python stack that issued it). It
works for gloo and NCCL. It is switched on before the process group starts, and dumped:

- by our watchdog when it fires (any backend): ``runs/<name>/flight_recorder/rank_<R>.pkl``;
- by NCCL's own watchdog on a collective timeout (TORCH_NCCL_DUMP_ON_TIMEOUT), to the same folder.

Read a folder of dumps with PyTorch's analyser: ``python -m torch.distributed.flight_recorder.fr_trace
runs/<name>/flight_recorder --prefix rank_`` (it names the ranks whose collective never started).
A user's own TORCH_FR_* / TORCH_NCCL_* settings win.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

from purrsight.atomic_file import write_atomically
from purrsight.internals.torch_c10d import flight_recorder_trace

log = logging.getLogger(__name__)

FOLDER = "flight_recorder"
BUFFER_ENTRIES = 2000  # a few hundred steps of DDP buckets; each entry is a few hundred bytes


def enable(run_dir: Path, environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the recorder's variables (read when a process group starts), unless the user set them."""
    folder = run_dir / FOLDER
    environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER_ENTRIES))
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", f"{folder}/rank_")  # NCCL's dumps: rank_<R>


def dump(run_dir: Path, rank: int) -> Path | None:
    """This rank's recorder written to the run folder; None when there is nothing to dump."""
    trace = flight_recorder_trace()
    if trace is None:
        return None
    folder = run_dir / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank_{rank}.pkl"
    # Whole or absent: torchrun ends the other ranks once one exits, perhaps mid-dump, and PyTorch's
    # analyser reads every rank_* file (a temp's hidden name is not one).
    write_atomically(path, trace)
    return path
