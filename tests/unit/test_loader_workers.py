"""Loader workers (training/datamodule.py): started from a fork server, and deaf to stop signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
from torch.utils.data import SequentialSampler

from purrsight.config import load_config
from purrsight.training.datamodule import Phase2DataModule
from tests.helpers import DEFAULT_CONFIG, REPO


def test_sigterm_to_the_workers_and_their_fork_server_leaves_the_loader_running() -> None:
    """What a preemption's SIGTERM to the whole process group does to them: nothing; the trainer
    saves its checkpoint first, and its exit ends them."""
    config = load_config(DEFAULT_CONFIG, ["data.num_workers=2", "data.batch_size=4"], check_paths=False)
    data = list(range(64))
    loader = Phase2DataModule(config)._loader(data, SequentialSampler(data), shuffle=True)  # type: ignore[arg-type]
    batches = iter(loader)
    first = next(batches)
    workers = [psutil.Process(worker.pid) for worker in batches._workers]  # type: ignore[attr-defined]
    fork_server = workers[0].parent()
    assert fork_server is not None and fork_server.pid != os.getpid()  # forked by the server, not by this process
    for process in (*workers, fork_server):
        process.send_signal(signal.SIGTERM)
    rest = list(batches)
    assert [int(x) for batch in (first, *rest) for x in batch] == data


def test_importing_the_signal_module_elsewhere_changes_nothing() -> None:
    """Only the fork server ignores stop signals: a trainer that did would never checkpoint on a stop."""
    check = "import signal, purrsight.data.fork_server_signals; print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stderr
