from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from tests.preloaded import PreloadedTrainer

# Users run this suite on GPU nodes too, and its CPU expectations (gloo, one process, "no GPU"
# lines) must hold there: every test sees no GPU, in this process and in what it starts,
# unless it is marked `gpu`. Set before anything initialises CUDA.
HOST_CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Two pytest workers share this machine's cores (scripts/test.sh), and each test's trainer
# would start one OpenMP thread per core: threads that spin-wait on cores another process holds
# made a 100-step run take 150 s instead of 20 beside a second one. One thread per process,
# here and in everything the tests start (the launcher keeps a value it is given, as a user's).
os.environ["OMP_NUM_THREADS"] = "1"

from purrsight.data.synthetic import generate  # noqa: E402 (after hiding the GPUs)
from tests import run_order, suite_budget  # noqa: E402


class RunOrder:
    """Each xdist worker's share led by its longest files (tests/run_order.py), ordered once `-m`
    has deselected (trylast: the hook above adds the markers it deselects by); a file's tests stay
    together, in order, for its module fixtures."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        root = Path(__file__).parent.parent
        counts = Counter(item.path.relative_to(root).as_posix() for item in items)
        workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
        order = [path for share in run_order.shares(list(counts.items()), workers, run_order.known_seconds()) for path in share]
        place = {path: index for index, path in enumerate(order)}
        items.sort(key=lambda item: place[item.path.relative_to(root).as_posix()])


def pytest_configure(config: pytest.Config) -> None:
    suite_budget.register(config)  # each tier's durations, for the budget check (tests/suite_budget.py)
    config.pluginmanager.register(RunOrder(), "purrsight-run-order")


def has_gpu_driver() -> bool:
    return any(Path(path).exists() for path in GPU_DRIVER_FILES)


def gpu_env() -> dict[str, str]:
    """The environment with this node's GPUs visible again, for the `gpu` tests' subprocesses."""
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    if HOST_CUDA_VISIBLE_DEVICES is not None:
        env["CUDA_VISIBLE_DEVICES"] = HOST_CUDA_VISIBLE_DEVICES
    return env


@cache
def host_gpu_count() -> int:
    """CUDA devices the node offers (asked in a subprocess: this one hides them); 0 without a driver."""
    if not has_gpu_driver():
        return 0
    code = "import torch; print(torch.cuda.device_count())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=gpu_env(), timeout=120)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


# Outside tests/unit every test starts the real stack (a trainer, torchrun, launchers, a SLURM
# or Ray cluster): the quick tier (`bash scripts/test.sh --quick`, `-m "not slow"`) leaves them out.
QUICK_FOLDERS = ("unit",)
# Folders whose tests run a real cluster (SLURM's daemons and a PBS job's fixed master port in
# tests/cluster, the session's Ray cluster in tests/ray): marked `serial`, they run one at a time
# (scripts/test.sh runs them in a pytest of their own, beside the two workers of the others).
SERIAL_FOLDERS = ("cluster", "ray")


# Property tests (hypothesis) in CI draw the same examples on every run, from the test's own
# name (derandomize): a failure there reproduces on any machine with the same command, and a
# change that breaks a drawn case fails every time, not by chance. Elsewhere they draw afresh,
# which keeps looking into new corners; `--hypothesis-profile=ci` reproduces CI's draw.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        folder = item.path.relative_to(tests).parts[0]
        if folder not in QUICK_FOLDERS:
            item.add_marker(pytest.mark.slow)
        if folder in SERIAL_FOLDERS:
            item.add_marker(pytest.mark.serial)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None and os.geteuid() != 0:
        pytest.skip("needs root (network namespaces or SLURM's daemons); CI runs as root")
    gpu = item.get_closest_marker("gpu")
    if gpu is not None and host_gpu_count() < gpu.kwargs.get("count", 1):
        pytest.skip(f"needs {gpu.kwargs.get('count', 1)} CUDA GPU(s); this node has {host_gpu_count()} (it runs on GPU nodes)")
    if item.get_closest_marker("no_gpu_driver") is not None and has_gpu_driver():
        pytest.skip("checks a node without a GPU driver; on this GPU node the tests marked gpu cover the GPU path")


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small synthetic set for the whole session (generation is deterministic)."""
    return generate(tmp_path_factory.mktemp("data") / "synthetic", num_train=128, num_val=32, seed=0)


@pytest.fixture(scope="session")
def finished_run(synthetic_dir: Path, tmp_path_factory: pytest.TempPathFactory, preloaded_trainer: PreloadedTrainer) -> Path:
    """One default tiny run (20 steps), trained once for the tests that only start from a finished run."""
    from tests.helpers import train_tiny

    out = tmp_path_factory.mktemp("finished")
    done = train_tiny(synthetic_dir, out, preloaded=preloaded_trainer)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "phase2-tiny"


@pytest.fixture
def tmp_path_with_a_finished_run(finished_run: Path, tmp_path: Path) -> Path:
    """``tmp_path`` holding a copy of the finished run in ``phase2-tiny``, as ``train_tiny(synthetic_dir, tmp_path)`` leaves it."""
    shutil.copytree(finished_run, tmp_path / "phase2-tiny", symlinks=True)
    return tmp_path


@pytest.fixture(scope="session")
def preloaded_trainer() -> Iterator[PreloadedTrainer]:
    """The trainer's command line in forked children of one pre-imported interpreter (tests/preloaded.py)."""
    from tests.preloaded import PreloadedTrainer

    server = PreloadedTrainer()
    yield server
    server.close()
