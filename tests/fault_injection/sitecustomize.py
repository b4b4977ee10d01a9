"""Faults on demand for the fault tests, planted from outside the code they test.

A test that wants a fault runs the real stack (launcher, SLURM, torchrun, trainer) with
``fault_env(...)`` from tests/helpers.py: this folder first on PYTHONPATH, so every Python
process of the job imports this file at start-up (``site`` imports ``sitecustomize``), and
``PURRSIGHT_TEST_FAULT`` naming the fault. Nothing happens at start-up but registering an
import hook: when the worker imports the module the fault lives in, the hook wraps one of
its functions. Production code has no fault switch.

Faults (``PURRSIGHT_TEST_FAULT``):

- ``kill_during_checkpoint_write:N``: SIGKILL the process during its N-th checkpoint write,
  the temp file half written and flushed, as when a node dies or the OOM killer strikes
  mid-save. First worker generation only (restarted workers must be able to finish).
- ``kill_during_armed_checkpoint_write:FILE``: the same kill, in the first checkpoint write any
  process of the job makes while FILE exists (the test creates it when the write it wants killed
  is next: an elastic join's planned checkpoint, say). The process that takes it removes FILE
  first, so the fault fires once across every node and worker generation.

Every hook reads what differs between processes (rank, restart count, pid) when it acts, not
when it patches: the launcher's workers are forks of one server that imported (and so patched)
the trainer's modules before any worker existed.
- ``preflight_delay:RANK:SECONDS``: that rank's local work in the preflight takes SECONDS
  longer, a planted straggler.
- ``slow_prepare_shard:SECONDS``: every shard of ``train_phase2.py prepare`` takes SECONDS longer
  (as 4,096 12-MP photos would), spent inside its write with its temp file open, so a stop has
  queued shards to not wait for and shards half written.
- ``kill_during_shard_write:N``: SIGKILL the prepare process during its N-th shard write, half of
  the shard's rows handed to the writer and its temp file open, as a node that dies mid-prepare.
- ``kill_during_export_write``: SIGKILL ``train_phase2.py export`` once half of
  ``projectors.safetensors`` is written and flushed (the model and tokenizer files already are).

Not a fault but a gate, planted the same way: ``PURRSIGHT_TEST_HOLD=STEP:FILE[,STEP:FILE...]`` holds
every training process at the end of optimizer step STEP (one it trained, not one it resumed at)
until FILE exists, or until the process is asked to stop (a stop signal, or Ray's relay of one),
whichever comes first, and at most
``PURRSIGHT_TEST_HOLD_LIMIT_S`` seconds (600), so a test that failed before its release leaves no
job holding the test cluster's nodes. Each hold is logged with the process's rank (``rank R held
at step STEP until FILE exists``) and its end too, and marked by a file ``FILE.rankR.held`` made
as it starts (tests/helpers.held_marker): what a test waits for, since Ray folds lines that
differ only in their numbers into one ("repeated 2x across cluster"). A test that needs a job
still training when it acts holds it there, instead of racing the job's speed.

Not a fault but a witness, planted the same way: ``PURRSIGHT_TEST_RECORD_SAMPLES=DIR`` makes
every training process append what it trains to ``DIR/<start time ns>-<host>-<pid>-rank<R>.jsonl``
(names sort in the order the processes started): one
``{"epoch", "ids"}`` line per micro-batch as it starts and one ``{"step", "micro_batches", "world"}``
line per optimizer step (tests/helpers.py reads them back).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import io
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

FAULT = os.environ.get("PURRSIGHT_TEST_FAULT", "")
RECORD_SAMPLES = os.environ.get("PURRSIGHT_TEST_RECORD_SAMPLES", "")
HOLD = os.environ.get("PURRSIGHT_TEST_HOLD", "")
HOLD_LIMIT_S = float(os.environ.get("PURRSIGHT_TEST_HOLD_LIMIT_S", "600"))


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs each of a module's patches right after the module is imported, whoever imports it.

    Each patch takes the module as Any: it reaches the module's own functions, which ModuleType
    does not declare. Patches of one module run in the order they were added.
    """

    def __init__(self) -> None:
        self.patches: dict[str, list[Callable[[ModuleType], None]]] = {}

    def add(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.patches.setdefault(name, []).append(patch)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        load, patches = spec.loader.exec_module, self.patches[fullname]

        def load_then_patch(module: ModuleType) -> None:
            load(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = load_then_patch  # type: ignore[method-assign]
        return spec


class _SaveThenKill:
    """Stands in for the ``torch`` name inside purrsight.runs.checkpoint_saver: the ``kill_at``-th
    ``save`` writes half of the checkpoint's bytes into its stream (the temp file), flushes them to
    the disk, and SIGKILLs the process: a torn temp file, as a node that dies mid-write leaves."""

    def __init__(self, torch: Any, kill_at: int = 0, armed: str = "") -> None:
        self._torch, self._kill_at, self._armed, self._writes = torch, kill_at, armed, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def _fires(self) -> bool:
        if self._armed:
            try:
                os.unlink(self._armed)  # whoever removes it takes the fault: once across the job
            except FileNotFoundError:
                return False
            return True
        # Read at the write, not when the module was patched: a worker forked from the launcher's
        # preloaded server (purrsight/launcher/forked_workers.py) was patched there, before torchrun
        # told it its restart count.
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
        return not restarted and self._writes == self._kill_at

    def save(self, obj: Any, stream: Any, *args: Any, **kwargs: Any) -> None:
        self._writes += 1
        if not self._fires():
            self._torch.save(obj, stream, *args, **kwargs)
            return
        whole = io.BytesIO()
        self._torch.save(obj, whole, *args, **kwargs)
        stream.write(whole.getbuffer()[: whole.tell() // 2])
        stream.flush()
        os.fsync(stream.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


def _kill_during_checkpoint_write(count: str) -> Callable[[ModuleType], None]:
    def patch(module: Any) -> None:
        module.torch = _SaveThenKill(module.torch, kill_at=int(count))  # type: ignore[attr-defined]

    return patch


def _kill_during_armed_checkpoint_write(armed: str) -> Callable[[ModuleType], None]:
    def patch(module: Any) -> None:
        module.torch = _SaveThenKill(module.torch, armed=armed)  # type: ignore[attr-defined]

    return patch


def _preflight_delay(rank: str, seconds: str) -> Callable[[ModuleType], None]:
    def patch(module: Any) -> None:
        local_work = module._local_work

        def slow_local_work(device: Any) -> None:
            local_work(device)
            if module.dist.get_rank() == int(rank):
                time.sleep(float(seconds))

        module._local_work = slow_local_work

    return patch


def _record_samples(folder: str) -> Callable[[ModuleType], None]:
    def patch(module: Any) -> None:
        cls = module.Phase2Module
        batch_start = cls.on_train_batch_start
        state: dict[str, Any] = {"sink": None, "since_step": 0}

        def write(self: Any, record: dict[str, Any]) -> None:
            if state["sink"] is None:
                name = f"{time.time_ns()}-{os.uname().nodename}-{os.getpid()}-rank{self.global_rank}.jsonl"
                state["sink"] = open(os.path.join(folder, name), "a", buffering=1)  # noqa: SIM115  # open for the process's life
            state["sink"].write(json.dumps(record) + "\n")

        def recording_batch_start(self: Any, batch: Any, batch_idx: int) -> None:
            write(self, {"epoch": self.current_epoch, "ids": list(batch["ids"])})
            state["since_step"] += 1
            batch_start(self, batch, batch_idx)

        def recording_before_optimizer_step(self: Any, optimizer: Any) -> None:
            step = {"step": self.trainer.global_step + 1, "micro_batches": state["since_step"], "world": self.trainer.world_size}
            write(self, step)
            state["since_step"] = 0

        cls.on_train_batch_start = recording_batch_start
        cls.on_before_optimizer_step = recording_before_optimizer_step

    return patch


_stop_asked: list[int] = []  # set by the patched StopRequest.request: the hold lets a stop through


def _note_stops(module: Any) -> None:
    request = module.StopRequest.request

    def noted(self: Any, signum: int) -> None:
        _stop_asked.append(signum)
        request(self, signum)

    module.StopRequest.request = noted


def _hold(gates: str) -> Callable[[ModuleType], None]:
    holds = {int(step): path for step, _, path in (gate.partition(":") for gate in gates.split(","))}

    def patch(module: Any) -> None:
        cls = module.Phase2Module
        batch_end = cls.on_train_batch_end if "on_train_batch_end" in cls.__dict__ else None

        def held_batch_end(self: Any, *args: Any, **kwargs: Any) -> None:
            if batch_end is not None:
                batch_end(self, *args, **kwargs)
            # Only at the micro-batch that completed an optimizer step in this process: a run
            # resumed from step STEP's checkpoint starts at STEP, and must not hold there again.
            step, last = self.trainer.global_step, getattr(self, "_hold_last_step", None)
            self._hold_last_step = step
            path = holds.pop(step, None) if last is not None and last != step else None
            if path is None:
                return
            rank = self.trainer.global_rank
            print(f"rank {rank} held at step {step} until {path} exists", file=sys.stderr, flush=True)
            with open(f"{path}.rank{rank}.held", "w"):
                pass
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not os.path.exists(path) and not _stop_asked and time.monotonic() < deadline:
                time.sleep(0.1)
            if _stop_asked:
                why = "a stop was asked"
            elif os.path.exists(path):
                why = f"{path} exists"
            else:
                why = f"held {HOLD_LIMIT_S:.0f} s (PURRSIGHT_TEST_HOLD_LIMIT_S)"
            print(f"rank {rank} released at step {step}: {why}", file=sys.stderr, flush=True)

        cls.on_train_batch_end = held_batch_end

    return patch


def _slow_prepare_shard(seconds: str) -> Callable[[ModuleType], None]:
    def patch(module: Any) -> None:
        write_shard = module.write_shard

        def slow(path: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
            def slow_rows() -> Any:
                time.sleep(float(seconds))  # asked for the first row: the shard's temp file is open
                yield from rows

            return write_shard(path, slow_rows(), *args, **kwargs)

        module.write_shard = slow

    return patch


def _kill_during_shard_write(count: str) -> Callable[[ModuleType], None]:
    def patch(module: Any) -> None:
        write_shard = module.write_shard
        writes = [0]

        def killed(path: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
            writes[0] += 1
            if writes[0] != int(count):
                return write_shard(path, rows, *args, **kwargs)
            every = list(rows)

            def half_then_killed() -> Any:
                yield from every[: len(every) // 2]
                os.kill(os.getpid(), signal.SIGKILL)

            return write_shard(path, half_then_killed(), *args, **kwargs)

        module.write_shard = killed

    return patch


def _kill_during_export_write() -> Callable[[ModuleType], None]:
    def patch(module: Any) -> None:
        save_file = module.save_file

        def half_then_killed(tensors: Any, filename: str, *args: Any, **kwargs: Any) -> None:
            save_file(tensors, filename, *args, **kwargs)
            whole = open(filename, "rb").read()  # noqa: SIM115  # the process ends below
            with open(filename, "wb") as stream:
                stream.write(whole[: len(whole) // 2])
                stream.flush()
                os.fsync(stream.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        module.save_file = half_then_killed

    return patch


PATCHES = PatchOnImport()
if RECORD_SAMPLES:
    PATCHES.add("purrsight.training.module", _record_samples(RECORD_SAMPLES))
if HOLD:
    PATCHES.add("purrsight.distributed.stop_vote", _note_stops)
    PATCHES.add("purrsight.training.module", _hold(HOLD))
if FAULT:
    kind, _, arguments = FAULT.partition(":")
    if kind == "kill_during_checkpoint_write":
        PATCHES.add("purrsight.runs.checkpoint_saver", _kill_during_checkpoint_write(arguments))
    elif kind == "kill_during_armed_checkpoint_write":
        PATCHES.add("purrsight.runs.checkpoint_saver", _kill_during_armed_checkpoint_write(arguments))
    elif kind == "slow_prepare_shard":
        PATCHES.add("purrsight.datasets.prepare_job", _slow_prepare_shard(arguments))
    elif kind == "kill_during_shard_write":
        PATCHES.add("purrsight.datasets.prepare_job", _kill_during_shard_write(arguments))
    elif kind == "kill_during_export_write":
        PATCHES.add("purrsight.training.export", _kill_during_export_write())
    elif kind == "preflight_delay":
        PATCHES.add("purrsight.distributed.preflight", _preflight_delay(*arguments.split(":")))
    else:
        raise SystemExit(f"PURRSIGHT_TEST_FAULT={FAULT}: unknown fault (see {__file__})")
if PATCHES.patches:
    sys.meta_path.insert(0, PATCHES)
