"""Loader workers (training/datamodule.py, data/loader_worker.py): started from a fork server, deaf to stop
signals, with the trainer's process-wide settings."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import SequentialSampler

from purrsight.config import load_config
from purrsight.data.loader_worker import seed_like_lightning
from purrsight.data.media import ImageDecoder
from purrsight.training.datamodule import LOADER_PRELOAD, Phase2DataModule
from tests.helpers import DEFAULT_CONFIG, REPO
from tests.sample_ids import WorkerSettings, first_item

PILLOW_DEFAULT = Image.MAX_IMAGE_PIXELS  # before any decoder of ours set it in this process


def held_signals(pid: int) -> set[int]:
    """The signals a process blocks, from /proc (SigBlk: a mask, bit n-1 for signal n)."""
    mask = int(
        next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigBlk:")).split()[1], 16
    )
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


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
    # Workers are born with both signals held (a SIGTERM while one starts, before its init function,
    # killed it), and released once their init function ignores them.
    assert held_signals(fork_server.pid) >= {signal.SIGTERM, signal.SIGINT}
    assert not held_signals(workers[0].pid) & {signal.SIGTERM, signal.SIGINT}
    for process in (*workers, fork_server):
        process.send_signal(signal.SIGTERM)
    rest = list(batches)
    assert [int(x) for batch in (first, *rest) for x in batch] == data


LOADER_THEN_WAIT = """
import sys, time
from torch.utils.data import SequentialSampler
from purrsight.config import load_config
from purrsight.training.datamodule import Phase2DataModule
config = load_config(sys.argv[1], ["data.num_workers=2", "data.batch_size=4"], check_paths=False)
data = list(range(64))
batches = iter(Phase2DataModule(config)._loader(data, SequentialSampler(data), shuffle=True))
next(batches)
print(" ".join(str(worker.pid) for worker in batches._workers), flush=True)
time.sleep(600)
"""


def test_a_trainer_killed_with_sigkill_takes_its_loader_server_and_workers_with_it() -> None:
    """The OOM killer or a fault's SIGKILL gives the trainer no say: its loader's fork server dies with
    it (the parent-death signal), and torch's workers, their parent gone, end within seconds. They
    ran on for good before (each holding the server's alive pipe, the server waiting for them)."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", LOADER_THEN_WAIT, str(DEFAULT_CONFIG)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert trainer.stdout is not None
        workers = [psutil.Process(int(pid)) for pid in trainer.stdout.readline().split()]
        server = workers[0].parent()
        assert len(workers) == 2 and server is not None and server.pid != trainer.pid
        trainer.kill()
        trainer.wait(timeout=30)
        _gone, alive = psutil.wait_procs([server, *workers], timeout=20)
        assert not alive, [process.cmdline()[:3] for process in alive]
    finally:
        trainer.kill()


def test_importing_the_signal_module_elsewhere_changes_nothing() -> None:
    """Only the loader's fork server ignores stop signals: a trainer that did would never checkpoint
    on a stop. Neither a plain import nor the launcher's worker server, which preloads the whole
    trainer (loader_worker.py among it), holds or ignores them."""
    check = (
        "import signal, purrsight.data.loader_fork_server; "
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True False", done.stderr
    from purrsight.launcher.forked_workers import PRELOAD

    assert "purrsight.data.loader_fork_server" not in PRELOAD


def test_every_process_wide_setting_reaches_a_real_loader_worker(tmp_path: Path) -> None:
    """Inside real workers (2, from the fork server): Pillow's limit as data.max_image_pixels sets it
    (a 200-MP scan under the 250-MP default decodes; it was refused at Pillow's own 179 MP), one
    intra-op thread, stop signals ignored, our log line format. With 0 workers the same holds in
    this process."""
    scan = tmp_path / "scan.jpg"
    Image.new("L", (20000, 10000), 200).save(scan, quality=50)  # 200 MP: above Pillow's default, under ours
    config = load_config(DEFAULT_CONFIG, ["data.num_workers=2", "data.batch_size=1"], check_paths=False)
    decoder = ImageDecoder(None, 32, config.data.max_image_pixels)
    Image.MAX_IMAGE_PIXELS = PILLOW_DEFAULT  # as a fresh process has it: the decoder must carry ours
    dataset = WorkerSettings(decoder, str(scan), 4)
    module = Phase2DataModule(config)
    loader = module._loader(dataset, SequentialSampler(range(4)), shuffle=False)  # type: ignore[arg-type]
    loader.collate_fn = first_item
    seen = list(loader)
    assert {item["pid"] for item in seen} - {os.getpid()}, "the items came from loader workers"
    for item in seen:
        assert item["pid"] != os.getpid()
        assert item["max_image_pixels"] == config.data.max_image_pixels
        assert item["decode_error"] == ""
        assert item["torch_threads"] == 1
        assert item["sigterm_ignored"] and item["sigint_ignored"]
        assert "%(levelname)s %(name)s: %(message)s" in item["log_format"]
        assert item["lightning"] == []  # seeded as Lightning seeds, without importing it (1.9 CPU-s a server)


# A script that runs the trainer's loader, as train_phase2.py or a user's own script does: each run
# of its top level leaves a file named by the module name it ran under.
LOADER_FROM_A_SCRIPT = """
import json, os, sys
from pathlib import Path

Path(sys.argv[1], f"{__name__}-{os.getpid()}").touch()
if __name__ == "__main__":
    from torch.utils.data import SequentialSampler
    from purrsight.config import load_config
    from purrsight.training.datamodule import Phase2DataModule
    from tests.sample_ids import WorkerSettings, first_item

    config = load_config(sys.argv[2], ["data.num_workers=2", "data.batch_size=1"], check_paths=False)
    loader = Phase2DataModule(config)._loader(WorkerSettings(str, "-", 4), SequentialSampler(range(4)), shuffle=False)
    loader.collate_fn = first_item
    print(json.dumps([[item["pid"], item["main"]] for item in loader]), flush=True)
    # Not the interpreter's exit: multiprocessing's exit handler SIGTERMs its daemon children and
    # joins them, and loader workers ignore SIGTERM by design (loader_worker.py); in a trainer,
    # Lightning's teardown shuts them down first.
    os._exit(0)
"""


def test_loader_workers_do_not_run_the_trainers_script_again(tmp_path: Path) -> None:
    """multiprocessing runs the parent's ``__main__`` script in each child before its task, as
    ``__mp_main__``; the loader's workers skip it (internals/python_forkserver.py): a test's probe
    script, Lightning at its top, made each worker 2.4 CPU-s instead of 0.3, and under Ray each
    worker imported Ray again (``default_worker.py``)."""
    script, marks = tmp_path / "run_loader.py", tmp_path / "marks"
    script.write_text(LOADER_FROM_A_SCRIPT)
    marks.mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(marks), str(DEFAULT_CONFIG)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    items = json.loads(done.stdout.splitlines()[-1])
    assert len({pid for pid, _ in items}) == 2, items  # two workers served the four items
    assert [main for _, main in items] == [None] * 4, items  # the fork server's __main__, not the script
    assert sorted(mark.name.split("-")[0] for mark in marks.iterdir()) == ["__main__"], sorted(marks.iterdir())


@settings(max_examples=200)
@given(
    base_seed=st.integers(0, 2**63 - 1), worker_id=st.integers(0, 63), rank=st.integers(0, 1023)
)  # fmt: skip
@example(base_seed=0, worker_id=0, rank=0)
@example(base_seed=2**63 - 1, worker_id=63, rank=1023)  # the widest mix, before the 64-bit masks
def test_workers_are_seeded_as_lightnings_own_init_function_seeds_them(base_seed: int, worker_id: int, rank: int) -> None:
    """torch, Python and NumPy states after seed_like_lightning equal those after Lightning's
    pl_worker_init_function, from the seed torch gives worker ``worker_id``: a resumed run keeps
    the augmentations an earlier version drew."""
    from lightning_fabric.utilities.seed import pl_worker_init_function

    def states(seed_worker: Callable[[int, int], None]) -> tuple[object, ...]:
        torch.manual_seed(base_seed + worker_id)  # what torch's worker loop does before the init function
        seed_worker(worker_id, rank)
        return torch.initial_seed(), random.getstate(), np.random.get_state()[1].tolist()

    assert states(seed_like_lightning) == states(pl_worker_init_function)


def test_the_loader_servers_preload_imports_no_lightning() -> None:
    """The fork server's imports, in a fresh interpreter as the server starts: Lightning would cost
    every trainer with loader workers 1.9 CPU-s more at its start (loader_worker.py)."""
    probe = "import importlib, json, sys\nfor name in sys.argv[1:]: importlib.import_module(name)\n"
    probe += "print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe, *LOADER_PRELOAD], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(json.loads(done.stdout))
    assert "purrsight.data.dataset" in loaded and "transformers" in loaded  # the probe imported the list
    assert not loaded & {"lightning_fabric", "pytorch_lightning", "torchmetrics"}, sorted(
        loaded & {"lightning_fabric", "pytorch_lightning", "torchmetrics"}
    )
