"""Node health checks before torchrun: each a line with PASS/FAIL/SKIP and its time.

All checks run, then a summary; the node plan (purrsight/launcher/node_plan.py)
runs them and exits 3 on any failure, so the node stops before it burns GPU hours or holds
the other nodes at the rendezvous.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from purrsight.bad_nodes import BAD_NODES_ENV, name_bad_node
from purrsight.launcher import network

if TYPE_CHECKING:  # the caller loaded the config; importing pydantic here would cost every import of this module
    from purrsight.config import Config

# import name -> distribution name (for its version)
REQUIRED_PACKAGES = {
    "torch": "torch",
    "pytorch_lightning": "pytorch-lightning",
    "transformers": "transformers",
    "peft": "peft",
    "datasets": "datasets",
    "tokenizers": "tokenizers",
    "soundfile": "soundfile",
    "PIL": "pillow",
    "pydantic": "pydantic",
    "yaml": "PyYAML",
}


class CheckFailedError(Exception):
    """A failed check; the message is the line the user reads."""


class DataContentError(CheckFailedError):
    """The data's content is wrong (a bad index line, a prepared set of other sources): the same on
    every node, so no node is named for it; a requeue excluding node 0 would only repeat it."""


class CheckSkippedError(Exception):
    """A check that does not apply on this node (GPUs on a CPU node); the message says why."""


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float
    nodes_fault: bool = True  # a failure that says something against this node (bad_nodes.py)


def check_data(config: Config, node_rank: int = 0) -> str:
    """The data before torchrun starts (and restarts): node 0 reads every index line, the others much less.

    Node 0 validates each line and that its media files exist, so a bad line stops the job
    before any worker starts. Every other node only checks that the indexes (or the prepared
    set's manifest) exist and can be read: a million-line index checked on 128 nodes is 128
    million metadata calls on the shared filesystem for nothing.
    """
    from purrsight.data.formats.records import read_options
    from purrsight.data.index import MAX_LISTED_PROBLEMS, IndexFileError, read_index
    from purrsight.data.prepared_manifest import PreparedSetError, check_sources, read_manifest

    data = config.data
    if data.prepared is not None:
        try:
            manifest = read_manifest(Path(data.prepared))
            if node_rank == 0:  # made from these indexes (a hash of each: no media file touched)
                try:
                    check_sources(
                        manifest, Path(data.prepared), {"train": data.train_index, "val": data.val_index}, config.overridden
                    )
                except PreparedSetError as err:
                    raise DataContentError(str(err)) from None
        except PreparedSetError as err:  # no manifest here: a mount this node lacks, or a prepare never run
            raise CheckFailedError(str(err)) from None
        counts = ", ".join(f"{split} {entry['samples']} samples" for split, entry in manifest["splits"].items())
        return f"prepared {data.prepared}: {counts} (rank 0 checks the settings match the config)"
    indexes = [i for i in (data.train_index, data.val_index) if i]
    if data.synthetic_dir and not all(Path(i).is_file() for i in indexes):
        raise CheckSkippedError(f"synthetic set generated on first use in {data.synthetic_dir}")
    if node_rank > 0:
        for index in indexes:
            try:
                with open(index, "rb") as handle:
                    handle.read(1)
            except OSError as err:
                raise CheckFailedError(f"{index}: cannot read the index ({err.strerror or err})") from None
        return f"{', '.join(indexes)} readable (node 0 checks every line)"
    try:
        # The trainer's reading of them: its format, field names and media root (a LLaVA file's
        # images are often relative to data.media_root, not to the file's folder).
        options = read_options(data)
        sizes = [
            f"{index}: {len(read_index(index, fmt=data.format, options=options, max_problems=MAX_LISTED_PROBLEMS))} samples"
            for index in indexes
        ]
    except IndexFileError as err:  # read on node 0 only: the index's content, not this node
        raise DataContentError("\n".join(err.lines())) from None  # every problem of the pass, one line each
    return "; ".join(sizes)


def check_packages(packages: dict[str, str] = REQUIRED_PACKAGES) -> str:
    """Every package the trainer imports is installed here; their versions.

    Found, not imported: importing Lightning, transformers and peft takes seconds that
    every start would pay twice (here, then in the workers). The launcher's probe has
    already imported torch; a package that is installed but broken fails in the workers,
    with its traceback in the node log.
    """
    versions, missing = [], []
    for module, distribution in packages.items():
        if importlib.util.find_spec(module) is None:
            missing.append(module)
            continue
        try:
            versions.append(f"{module} {importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:  # importable from a path without metadata
            versions.append(f"{module} ?")
    if missing:
        raise CheckFailedError(f"cannot import {', '.join(missing)} (activate the right environment: CONDA_ENV or VENV)")
    return ", ".join(versions)


def check_gpus(expect_gpus: bool, visible: int | None = None) -> str:
    """GPUs, their free memory, CUDA and NCCL; ``visible`` is the launcher probe's count.

    With the probe's count of 0 torch is not imported again: a CPU start pays for it once.
    """
    if visible == 0 or (visible is None and not _cuda_available()):
        if expect_gpus:
            raise CheckFailedError("BACKEND=nccl but no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES?)")
        raise CheckSkippedError("no GPU: training on CPU")
    import torch

    lines = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        lines.append(f"{i}: {torch.cuda.get_device_name(i)} {free / 2**30:.1f}/{total / 2**30:.1f} GiB free")
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return f"{len(lines)} GPU(s), CUDA {torch.version.cuda}, NCCL {nccl}; " + "; ".join(lines)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_disk(folders: list[Path], min_free_gb: float) -> str:
    parts = []
    for folder in folders:
        probe = folder
        while not probe.exists():
            probe = probe.parent
        free = shutil.disk_usage(probe).free / 2**30
        if free < min_free_gb:
            raise CheckFailedError(f"{folder}: {free:.1f} GiB free, need {min_free_gb:.1f} (HEALTH_MIN_FREE_GB)")
        parts.append(f"{folder} {free:.1f} GiB free")
    return "; ".join(parts)


def check_writable(folder: Path) -> str:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".health-"):
            pass
    except OSError as err:
        raise CheckFailedError(f"{folder}: not writable ({err.strerror})") from None
    return str(folder)


def check_master(addr: str, port: int, timeout_s: float, interval_s: float = 1.0) -> str:
    """The master's rendezvous port answers within the timeout (a worker node started before its
    master waits for it)."""
    try:
        attempts = network.await_port(addr, port, timeout_s, interval_s)
    except OSError as err:
        raise CheckFailedError(
            f"Cannot connect to master node at {addr}:{port} after {timeout_s:.0f} s ({err.strerror or err}). "
            "Check: the master node's launcher is running; the firewall allows TCP "
            f"{port} between nodes; {addr} is the master's address on a network this node reaches"
        ) from None
    return f"{addr}:{port} answered after {attempts} attempt(s)"


def run_check(name: str, check: Callable[[], str]) -> Result:
    start = time.monotonic()
    try:
        detail, status = check(), "PASS"
    except CheckSkippedError as skip:
        detail, status = str(skip), "SKIP"
    except CheckFailedError as failed:
        detail, status = str(failed), "FAIL"
        return Result(name, status, detail, time.monotonic() - start, nodes_fault=not isinstance(failed, DataContentError))
    return Result(name, status, detail, time.monotonic() - start)


def run_checks(
    config: Config,
    node_rank: int,
    master_addr: str,
    master_port: int,
    log_dir: Path,
    backend: str,
    gpus: int | None,
    min_free_gb: float,
    master_timeout_s: float,
    say: Callable[[str], None],
) -> list[str]:
    """Every check, a line each through ``say``, then a summary; the names of the failed ones."""
    output_dir = config.run.run_dir
    checks: list[tuple[str, Callable[[], str]]] = [
        ("packages", check_packages),
        ("data", lambda: check_data(config, node_rank)),
        ("gpus", lambda: check_gpus(backend == "nccl", gpus)),
        ("disk", lambda: check_disk([output_dir, log_dir], min_free_gb)),
        ("output writable", lambda: check_writable(output_dir)),
    ]
    if node_rank > 0:
        checks.append(("master reachable", lambda: check_master(master_addr, master_port, master_timeout_s)))
    results = []
    for name, check in checks:
        result = run_check(name, check)
        results.append(result)
        say(f"health: {result.status:4}  {name:16} {result.detail}  ({result.seconds:.2f} s)")
    failed = [r for r in results if r.status == "FAIL"]
    summary = f"{len(results) - len(failed)}/{len(results)} checks passed"
    say(f"health: {summary}" + (f"; failed: {', '.join(r.name for r in failed)}" if failed else ""))
    for result in failed:
        say(f"error: health check {result.name}: {result.detail}")
    if failed and name_bad_node([r.name for r in failed if r.nodes_fault]):
        say(f"health: this node is named in {os.environ[BAD_NODES_ENV]}: the job excludes it when it requeues")
    return [r.name for r in failed]
