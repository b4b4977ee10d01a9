"""Telemetry and throughput: what each node spends (power, energy, host) and what it gets done.

After the first optimizer step and every ``telemetry.every_n_steps`` steps, each node's
local rank 0 samples the GPUs its node trains on through NVML (power, the energy counter,
utilisation, memory, temperature; skipped without NVML, on CPU) and the host through psutil
(CPU %, RSS of the trainer, load average), appends a row to ``<run>/telemetry/node<N>.csv``
and logs the numbers through the trainer's logger.
Energy per step and per sample is the increase of those GPUs' energy counters between two
samples divided by the steps, and by the samples those GPUs ran, in between.

Throughput: samples/s and tokens/s on this rank and for the job (x world size); the step
time is split between waiting for data (batch end -> next batch start) and computing
(batch start -> batch end). MFU on GPUs = achieved FLOP/s / (peak FLOP/s x GPUs), from
purrsight/observability/flops.py (bf16 dense; override with telemetry.peak_tflops).
"""

from __future__ import annotations

import csv
import os
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import pytorch_lightning as pl
import torch

from purrsight.observability.flops import gpu_peak_tflops, model_flops_per_token
from purrsight.run_folder import truncate_history


def cuda_uuids_of_this_node(local_ranks: int) -> list[str]:
    """CUDA UUIDs of the GPUs this node's ranks train on (local rank i drives cuda:i); none on CPU."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(local_ranks)]


class _NVML:
    """NVML handles for the GPUs this node's ranks train on, or none (no package, no driver, CPU).

    NVML numbers every GPU in the machine and ignores CUDA_VISIBLE_DEVICES, so GPUs are
    matched by UUID (NVML's carries a "GPU-" prefix, CUDA's does not): a job given four GPUs
    of a shared eight-GPU node measures its own four, not its neighbours'.
    """

    def __init__(self, cuda_uuids: list[str]) -> None:
        self.handles: list[Any] = []
        if not cuda_uuids:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            by_uuid = {}
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                by_uuid[(uuid.decode() if isinstance(uuid, bytes) else uuid).removeprefix("GPU-")] = handle
            self.handles = [by_uuid[uuid] for uuid in cuda_uuids if uuid in by_uuid]
        except Exception:  # any NVML failure (no package, no driver) means host metrics only
            self.handles = []

    def sample(self) -> dict[str, float]:
        if not self.handles:
            return {}
        nv = self.nvml
        power = sum(nv.nvmlDeviceGetPowerUsage(h) for h in self.handles) / 1e3  # mW -> W
        energy = sum(nv.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles) / 1e3  # mJ -> J
        util = sum(nv.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles) / len(self.handles)
        memory = sum(nv.nvmlDeviceGetMemoryInfo(h).used for h in self.handles) / 2**30
        temp = max(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) for h in self.handles)
        return {
            "gpu_power_w": power,
            "gpu_energy_j": energy,
            "gpu_util_pct": util,
            "gpu_mem_gib": memory,
            "gpu_temp_c": float(temp),
        }


def runs_on_gpu(module: pl.LightningModule) -> bool:
    return module.device.type == "cuda"


# The row's values the loggers (and a tracker) get, as perf/<name>; the CSV has every column.
LOGGED = (
    "samples_per_s",
    "tokens_per_s",
    "global_tokens_per_s",
    "data_wait_frac",
    "cpu_pct",
    "mfu",
    "gpu_power_w",
    "energy_per_sample_j",
)


class Telemetry(pl.Callback):
    def __init__(
        self, run_dir: Path, every_n_steps: int, barrier_every: int | None, peak_tflops: float | None, seq_len: int
    ) -> None:
        self.folder = run_dir / "telemetry"
        self.every_n_steps = every_n_steps
        self.barrier_every = barrier_every
        self.peak_tflops = peak_tflops
        self.seq_len = seq_len
        self.flops_per_token: float | None = None
        self._process = psutil.Process()
        self._nvml: _NVML | None = None
        self._writer: Any = None
        self._file: Any = None
        self._batch_start = self._batch_end = 0.0
        self._data_wait = self._compute = 0.0
        self._samples = self._tokens = 0
        self._window_start = 0.0
        self._last_energy: float | None = None
        self._last_step = 0
        self._header: list[str] = []  # the columns of rows written before (a resume): kept as they are
        # Which machine wrote each row: node ranks are not machines (Ray's change across
        # restarts, and a requeue may land elsewhere), so one file can hold several.
        self._where = {"host": socket.gethostname(), "node_addr": os.environ.get("PURRSIGHT_NODE_ADDR", "")}
        self._on_gpu = False

    def _is_node_leader(self, trainer: pl.Trainer) -> bool:
        return trainer.local_rank == 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flops_per_token = model_flops_per_token(getattr(pl_module, "model", None), self.seq_len)
        # The placement, not what the node has: a CPU run on a GPU node (BACKEND=gloo) gets no
        # MFU against a GPU's peak and no power of GPUs it does not use.
        self._on_gpu = runs_on_gpu(pl_module)
        self.peak_tflops = self.peak_tflops or (gpu_peak_tflops() if self._on_gpu else None)
        # The node's leader alone reads NVML: it writes the node's CSV, and the logged
        # numbers come from global rank 0, a leader too.
        leader = self._is_node_leader(trainer)
        self._nvml = _NVML(cuda_uuids_of_this_node(trainer.num_devices) if leader and self._on_gpu else [])
        self._process.cpu_percent()  # the first call only starts psutil's measuring interval
        self._window_start = self._batch_end = time.perf_counter()
        if leader:
            self.folder.mkdir(parents=True, exist_ok=True)
            node = int(os.environ.get("GROUP_RANK", "0"))
            path = self.folder / f"node{node}.csv"
            # Rows after the step this run starts from are redone now (a resume) or belong to
            # nothing (a new run): they go, the rows before stay.
            self._header = truncate_history(path, trainer.global_step)
            self._file = path.open("a", newline="")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()
        self._data_wait += self._batch_start - self._batch_end

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_end = time.perf_counter()
        self._compute += self._batch_end - self._batch_start
        self._samples += batch["num_samples"]  # counted by the collator: no read of a device tensor
        self._tokens += batch["num_tokens"]
        step = trainer.global_step
        if self.barrier_every and step and step % self.barrier_every == 0 and trainer.world_size > 1:
            trainer.strategy.barrier("telemetry")  # aligned steps on every GPU: clean power traces
        # Step 1 too: its row measures start-up (compilation, allocator and loader warm-up)
        # and its wall time marks the first optimizer step (bench/ reads it).
        if (step == 1 or (step and step % self.every_n_steps == 0)) and self._samples:
            self._sample(trainer, pl_module)

    def after_save(self, trainer: pl.Trainer) -> None:
        """A checkpoint written after this callback's step end (CheckpointSaver.after_save) is the
        step's time, not the next batch's wait for data."""
        now = time.perf_counter()
        self._compute += now - self._batch_end
        self._batch_end = now

    def _sample(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = time.perf_counter()
        window = max(now - self._window_start, 1e-9)
        world = trainer.world_size
        row: dict[str, float] = {
            "step": float(trainer.global_step),
            "time": time.time(),  # wall clock (Unix seconds): lines rows up with scheduler and nvidia-smi logs
            "samples_per_s": self._samples / window,
            "tokens_per_s": self._tokens / window,
            "global_samples_per_s": self._samples / window * world,
            "global_tokens_per_s": self._tokens / window * world,
            "data_wait_frac": self._data_wait / max(self._data_wait + self._compute, 1e-9),
            "cpu_pct": self._process.cpu_percent(),
            "rss_gib": self._process.memory_info().rss / 2**30,
            "load_1m": os.getloadavg()[0],
        }
        gpus = self._nvml.handles if self._nvml else []
        row.update(self._nvml.sample() if self._nvml else {})
        if gpus:
            if self._last_energy is not None:
                spent = row["gpu_energy_j"] - self._last_energy
                row["energy_per_step_j"] = spent / max(1, trainer.global_step - self._last_step)
                # The energy is that of every GPU measured on this node; each ran as many
                # samples as this rank did (DDP: one rank per GPU, the same batch size).
                row["energy_per_sample_j"] = spent / (self._samples * len(gpus))
            self._last_energy = row["gpu_energy_j"]
        if self.flops_per_token and self.peak_tflops and self._on_gpu:
            row["mfu"] = self.flops_per_token * row["tokens_per_s"] / (self.peak_tflops * 1e12)
        # The loggers write on global rank 0 only: Lightning's bookkeeping of a logged value (about
        # a millisecond each) is not spent on the other ranks (rank_zero_only: no reduction either).
        if trainer.is_global_zero:
            for key in LOGGED:
                if key in row:
                    pl_module.log(f"perf/{key}", row[key], on_step=True, batch_size=1, rank_zero_only=True)
        if self._file is not None:
            if self._writer is None:
                # The first row has no energy deltas yet (nothing to subtract): name those
                # columns now, or every later row's would be dropped.
                energy = ["energy_per_step_j", "energy_per_sample_j"] if gpus else []
                fields = ["step", "time", *self._where, *list(row)[2:]] + [key for key in energy if key not in row]
                if self._file.tell() > 0 and self._header:
                    fields = self._header  # appending: the file's own columns, or its rows would shift
                self._writer = csv.DictWriter(self._file, fieldnames=fields, restval="", extrasaction="ignore")
                if self._file.tell() == 0:
                    self._writer.writeheader()
            self._writer.writerow({**row, **self._where})
            self._file.flush()
        self._samples = self._tokens = 0
        self._data_wait = self._compute = 0.0
        self._window_start = now
        self._last_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
