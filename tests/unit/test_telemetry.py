from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import socket
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from purrsight.config import ConfigError
from purrsight.observability import telemetry
from purrsight.observability.flops import flops_per_token
from purrsight.observability.loggers import build_loggers
from purrsight.observability.report import write_report
from tests.helpers import read_metrics, run_trainer, tiny_config, tiny_overrides


def test_flops_per_token_matches_a_hand_count() -> None:
    """1 layer, hidden 4, seq 8; N = 100 frozen+LoRA LLM params, T = 10 trainable."""
    # 4N = 400 (forward 2N + input gradients 2N), 2T = 20, attention 12*1*4*8 = 384
    assert flops_per_token(llm_params=100, trainable_params=10, layers=1, hidden=4, seq_len=8) == 804


def test_cpu_run_writes_telemetry_report_profile_and_tensorboard(synthetic_dir: Path, tmp_path: Path) -> None:
    done = run_trainer(
        *tiny_overrides(
            synthetic_dir,
            tmp_path,
            trainer__max_steps=20,
            logging__tensorboard="true",
            telemetry__every_n_steps=5,
            telemetry__barrier_every=5,
            profiler__enabled="true",
            profiler__start_step=2,
            profiler__end_step=4,
            checkpoint__every_n_steps=5,  # the steps telemetry logs are checkpoint steps too
        )
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "phase2-tiny" / "telemetry" / "node0.csv").open()))
    assert [int(float(r["step"])) for r in rows] == [1, 5, 10, 15, 20]  # step 1: start-up cost
    times = [float(r["time"]) for r in rows]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 600  # wall clock, in order
    for row in rows:
        assert float(row["samples_per_s"]) > 0 and float(row["tokens_per_s"]) > float(row["samples_per_s"])
        assert 0 <= float(row["data_wait_frac"]) < 1
        assert float(row["rss_gib"]) > 0.05 and float(row["cpu_pct"]) >= 0
        assert "gpu_power_w" not in row  # no NVML on CPU: host metrics only, no error
        assert row["host"] == socket.gethostname()  # which machine wrote it (node ranks are not machines)
    metrics = read_metrics(tmp_path / "phase2-tiny")
    assert "perf/tokens_per_s" in metrics[0] and "perf/data_wait_frac" in metrics[0]

    # the run report and its plots, from the same run
    report = (tmp_path / "phase2-tiny" / "report.md").read_text()
    assert "## Final metrics" in report and "train/loss:" in report and "val/accuracy:" in report
    assert "tokens/s (job)" in report and "energy per sample: not measured (no NVML)" in report
    for plot in ("loss.png", "throughput.png"):
        assert (tmp_path / "phase2-tiny" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({plot})" in report
    assert not (tmp_path / "phase2-tiny" / "power.png").exists()  # no power without NVML: no empty plot
    # the TensorBoard logger gets what the CSV logger gets
    events = EventAccumulator(str(tmp_path / "phase2-tiny" / "tensorboard"))
    events.Reload()
    assert {"train/loss", "val/loss", "perf/tokens_per_s"} <= set(events.Tags()["scalars"])
    csv_steps = [int(row["step"]) for row in metrics if row["perf/tokens_per_s"]]
    # At every checkpoint step too: the saver logs the step after every callback's hook (perf/* were
    # lost at checkpoint steps when it logged from its own, the first).
    assert csv_steps == [5, 10, 15, 20] and [event.step for event in events.Scalars("perf/tokens_per_s")] == csv_steps
    # the profiler window
    trace = json.loads((tmp_path / "phase2-tiny" / "profiler" / "rank0.json").read_text())
    assert any("aten::" in event.get("name", "") for event in trace["traceEvents"])


class FakeNVML(types.ModuleType):
    """Stands in for nvidia-ml-py on a three-GPU node: no GPU or NVML driver exists here.

    GPU k draws 100 x (k + 1) W, and its energy counter gains 1000 x (k + 1) mJ at each read,
    so every telemetry row's interval costs the measured GPUs a known number of joules.
    """

    NVML_TEMPERATURE_GPU = 0

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.energy_mj = [0, 0, 0]
        self.read: set[int] = set()

    def nvmlInit(self) -> None:  # noqa: N802 (NVML's names)
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 (NVML's names)
        return 3

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802 (NVML's names)
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802 (NVML's names)
        return f"GPU-0000000{handle}-aaaa-bbbb-cccc-dddddddddddd"

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:  # noqa: N802 (NVML's names)
        self.read.add(handle)
        return 100_000 * (handle + 1)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:  # noqa: N802 (NVML's names)
        self.energy_mj[handle] += 1000 * (handle + 1)
        return self.energy_mj[handle]

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> types.SimpleNamespace:  # noqa: N802 (NVML's names)
        return types.SimpleNamespace(gpu=50)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:  # noqa: N802 (NVML's names)
        return types.SimpleNamespace(used=2**30)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:  # noqa: N802 (NVML's names)
        return 60 + handle


class TokenBatches(pl.LightningModule):
    """A one-weight model fed batches shaped like the trainer's (tensors and the collator's counts)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.batch_size = batch_size

    def train_dataloader(self) -> torch.utils.data.DataLoader[dict[str, Any]]:
        items = [{"input_ids": torch.ones(6, dtype=torch.long), "attention_mask": torch.ones(6)} for _ in range(64)]

        def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
            batch: dict[str, Any] = torch.utils.data.default_collate(rows)
            return {**batch, "num_samples": len(rows), "num_tokens": 6 * len(rows)}

        return torch.utils.data.DataLoader(items, batch_size=self.batch_size, collate_fn=collate)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return (self.weight * batch["attention_mask"]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_energy_is_measured_on_the_jobs_gpus_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The job trains on GPUs 1 and 2 of three (CUDA_VISIBLE_DEVICES=1,2): NVML must not read GPU 0."""
    nvml = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    job_gpus = ["00000001-aaaa-bbbb-cccc-dddddddddddd", "00000002-aaaa-bbbb-cccc-dddddddddddd"]
    # stands in for torch.cuda's device properties (no CUDA here): the UUIDs of cuda:0 and cuda:1
    monkeypatch.setattr(telemetry, "cuda_uuids_of_this_node", lambda local_ranks: job_gpus)
    monkeypatch.setattr(telemetry, "runs_on_gpu", lambda module: True)  # a module on cuda, as far as telemetry asks
    batch = 4
    callback = telemetry.Telemetry(tmp_path, every_n_steps=2, barrier_every=None, peak_tflops=None, seq_len=6)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=6, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(TokenBatches(batch))

    assert nvml.read == {1, 2}
    rows = list(csv.DictReader((tmp_path / "telemetry" / "node0.csv").open()))
    assert [int(float(r["step"])) for r in rows] == [1, 2, 4, 6]
    spent_per_row = (1000 * 2 + 1000 * 3) / 1e3  # joules: GPU 1 and GPU 2 per read
    assert rows[0]["energy_per_sample_j"] == ""  # nothing to subtract yet
    for previous, row in itertools.pairwise(rows):
        steps = float(row["step"]) - float(previous["step"])
        assert float(row["gpu_power_w"]) == 200 + 300
        assert float(row["energy_per_step_j"]) == pytest.approx(spent_per_row / steps)
        # each of the two GPUs ran `batch` samples per step
        assert float(row["energy_per_sample_j"]) == pytest.approx(spent_per_row / (2 * batch * steps))

    report = write_report(tmp_path).read_text()
    assert f"energy per sample: {spent_per_row / (2 * batch * 2):.3g} J" in report
    assert (tmp_path / "power.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](power.png)" in report


def test_tensorboard_without_its_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """find_spec answering None stands in for a machine without tensorboard (CI installs it)."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    config = tiny_config(tmp_path / "data", tmp_path / "runs", logging__tensorboard="true")
    with pytest.raises(ConfigError, match=r"pip install -e \.\[tensorboard\], or set logging.tensorboard=false"):
        build_loggers(config, tmp_path / "run", resumed_step=0)


def test_rows_name_their_machine_and_keep_an_older_files_columns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A file begun before the host columns existed (or with other columns) is appended to in its own layout."""
    monkeypatch.setenv("PURRSIGHT_NODE_ADDR", "10.0.0.7")
    older = tmp_path / "old"
    (older / "telemetry").mkdir(parents=True)
    (older / "telemetry" / "node0.csv").write_text("step,time,samples_per_s\n0.0,1.0,2.0\n")
    for run_dir in (tmp_path / "new", older):
        callback = telemetry.Telemetry(run_dir, every_n_steps=2, barrier_every=None, peak_tflops=None, seq_len=6)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=2,
            callbacks=[callback],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
        trainer.fit(TokenBatches(4))
    new_rows = list(csv.DictReader((tmp_path / "new" / "telemetry" / "node0.csv").open()))
    assert [(r["host"], r["node_addr"]) for r in new_rows] == [(socket.gethostname(), "10.0.0.7")] * 2
    lines = (older / "telemetry" / "node0.csv").read_text().splitlines()
    assert lines[:2] == ["step,time,samples_per_s", "0.0,1.0,2.0"] and len(lines) == 4
    assert all(len(line.split(",")) == 3 for line in lines)  # no column shifted under another's name
