"""Shared test helpers: the tiny config with its paths pointed into a test's folders."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from purrsight.config import Config, load_config

if TYPE_CHECKING:
    from peft import PeftModel

    from tests.preloaded import PreloadedTrainer

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "config" / "train_config.yaml"
CHANCE_ACCURACY = (1 / 4 + 1 / 3 + 1 / 12) / 3  # image-only, audio-only, both: answer guessed uniformly
# How far the training loss must fall, in nats. The start is near ln(vocabulary size), so a
# fraction of it would depend on the tokenizer; 0.6 is what 20% meant at the word-level start (3.1).
LEARNED_NATS = 0.6


def tiny_overrides(synthetic_dir: Path, output_dir: Path, **extra: object) -> list[str]:
    """The default config shrunk for tests, its data and run folders moved under tmp."""
    values: dict[str, object] = {
        "run.output_dir": str(output_dir),
        "data.synthetic_dir": str(synthetic_dir),
        "data.train_index": str(synthetic_dir / "train.jsonl"),
        "data.val_index": str(synthetic_dir / "val.jsonl"),
        "data.synthetic.num_train": 128,
        "data.synthetic.num_val": 32,
        "data.batch_size": 8,
        "trainer.max_steps": 20,
        "trainer.val_every_n_steps": 10,
        "checkpoint.every_n_steps": 10,
        "logging.progress": "lines",
        "logging.every_n_steps": 5,
    }
    values.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in values.items()]


def tiny_config(synthetic_dir: Path, output_dir: Path, **extra: object) -> Config:
    return load_config(DEFAULT_CONFIG, tiny_overrides(synthetic_dir, output_dir, **extra))


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    return env


# A publish of ``path`` (purrsight/atomic_file.py) that the kernel kills half way: SIGXFSZ at a
# file-size limit (Python ignores the signal, so its default is set back first).
KILLED_MID_PUBLISH = """
import resource, signal, sys
from pathlib import Path
from purrsight.atomic_file import write_atomically

signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
write_atomically(Path(sys.argv[1]), b"x" * 8192)
"""


def killed_mid_publish(path: Path) -> Path:
    """The temp file that a writer of ``path`` killed half way leaves beside it."""
    from purrsight.atomic_file import stale_temp_files

    killed = subprocess.run([sys.executable, "-c", KILLED_MID_PUBLISH, str(path)], cwd=REPO, env=python_env(), timeout=120)
    assert killed.returncode == -signal.SIGXFSZ
    (torn,) = stale_temp_files(path.parent, path.name)
    assert torn.stat().st_size == 4096
    return torn


FAULT_INJECTION = REPO / "tests" / "fault_injection"


def fault_env(fault: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables that plant ``fault`` in every Python process of a job (tests/fault_injection/sitecustomize.py)."""
    path = (environ if environ is not None else os.environ).get("PYTHONPATH", "")
    return {"PURRSIGHT_TEST_FAULT": fault, "PYTHONPATH": os.pathsep.join(p for p in (str(FAULT_INJECTION), str(REPO), path) if p)}


def record_samples_env(folder: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables that make every training process of a job record the samples it trains and the
    micro-batches of each optimizer step into ``folder`` (tests/fault_injection/sitecustomize.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = (environ if environ is not None else os.environ).get("PYTHONPATH", "")
    paths = os.pathsep.join(p for p in (str(FAULT_INJECTION), str(REPO), path) if p)
    return {"PURRSIGHT_TEST_RECORD_SAMPLES": str(folder), "PYTHONPATH": paths}


def hold_env(holds: dict[int, Path], environ: dict[str, str] | None = None) -> dict[str, str]:
    """Variables that hold every training process of a job at the end of each optimizer step given
    until its file exists, or until the process is asked to stop (tests/fault_injection/sitecustomize.py)."""
    path = (environ if environ is not None else os.environ).get("PYTHONPATH", "")
    paths = os.pathsep.join(p for p in (str(FAULT_INJECTION), str(REPO), path) if p)
    return {"PURRSIGHT_TEST_HOLD": ",".join(f"{step}:{file}" for step, file in holds.items()), "PYTHONPATH": paths}


def held_marker(gate: Path, rank: int = 0) -> Path:
    """The file a process of rank ``rank`` makes when ``hold_env`` holds it at ``gate``'s step."""
    return gate.with_name(f"{gate.name}.rank{rank}.held")


def recorded_steps(path: Path) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each optimizer step of one process's record file (``record_samples_env``): its step line
    (``step``, ``micro_batches``, ``world``) and the micro-batches trained for it. Micro-batches
    after the last step never reached an optimizer step and are left out."""
    pending: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "ids" in record:
            pending.append(record)
            continue
        yield record, pending
        pending = []


def check_every_sample_once(folder: Path, every_id: set[str], whole_epochs: int, accumulation: int) -> None:
    """What a job's processes recorded into ``folder``: every optimizer step took ``accumulation``
    micro-batches, no epoch trained a sample twice, and the first ``whole_epochs`` epochs trained
    every id (for sets that divide into whole global batches: no tail left out by design).

    A step trained again after a restart (the steps after the checkpoint a killed attempt had
    passed) counts in the last attempt that trained it, as the checkpoints do; micro-batches
    after a process's last step never reached an optimizer step, and count nowhere.
    """
    steps: dict[tuple[str, int], list[dict[str, Any]]] = {}  # (rank, step) -> its micro-batches, last attempt's
    for path in sorted(folder.glob("*.jsonl")):  # in the order the processes started
        rank = path.stem.rsplit("-", 1)[1]
        for record, micro_batches in recorded_steps(path):
            assert record["micro_batches"] == accumulation, f"step {record['step']} in {path.name}: {record}"
            steps[rank, record["step"]] = micro_batches
    by_epoch: dict[int, list[str]] = {}
    for micro_batches in steps.values():
        for micro_batch in micro_batches:
            by_epoch.setdefault(micro_batch["epoch"], []).extend(micro_batch["ids"])
    assert by_epoch, f"nothing recorded in {folder}"
    for epoch, taken in sorted(by_epoch.items()):
        twice = sorted(sample for sample, count in Counter(taken).items() if count > 1)
        assert not twice, f"trained twice in epoch {epoch}: {twice}"
        if epoch < whole_epochs:
            assert set(taken) == every_id, f"left out of epoch {epoch}: {sorted(every_id - set(taken))}"


def launcher_env(log_dir: Path, **extra: str) -> dict[str, str]:
    """The environment a test gives cluster_train.sh: the project's venv first, logs under tmp."""
    env = python_env()
    env.update({"PATH": f"{REPO / '.venv' / 'bin'}:{env['PATH']}", "LOG_DIR": str(log_dir), **extra})
    return env


def run_trainer(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """train_phase2.py with the default config; ``args`` are options and overrides."""
    return run_python([str(REPO / "train_phase2.py"), "--config", str(DEFAULT_CONFIG), *args], timeout=timeout)


def torchrun_job(script: Path, *args: str, ranks: int = 2) -> list[str]:
    """A one-node torchrun on a free loopback port, as the launcher runs it: our wrapper, each worker
    forked from a server that imported the trainer once (WORKER_START=forkserver, docs/LAUNCHER.md)."""
    return [
        sys.executable, "-m", "purrsight.launcher.torchrun", "--run-path", "--start-method", "forkserver",
        "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(script), *args,
    ]  # fmt: skip


def run_python(
    args: list[str], timeout: float = 300, cwd: Path = REPO, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``prefix`` runs the interpreter under another command (setpriv, say); ``env`` adds variables."""
    return subprocess.run(
        [*prefix, sys.executable, *args],
        cwd=cwd,
        env={**python_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_tiny(
    synthetic_dir: Path,
    out: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    preloaded: PreloadedTrainer | None = None,
    **overrides: object,
) -> subprocess.CompletedProcess[str]:
    """train_phase2.py on the tiny config in one process; ``extra`` are options such as --resume.

    ``preloaded`` runs it in a forked child of that server instead of a fresh interpreter
    (tests/preloaded.py): the same main(), without the imports; not for output checked for noise.
    """
    args = ["--config", str(DEFAULT_CONFIG), *extra, *tiny_overrides(synthetic_dir, out, **overrides)]
    if preloaded is not None:
        return preloaded.run("train_phase2", args, {**python_env(), **(env or {})})
    return run_python([str(REPO / "train_phase2.py"), *args], env=env)


def trainable_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    import csv

    with (run_dir / "metrics" / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(row[name]) for row in rows if row.get(name)]


# Rank 0's step line (logging.progress=lines) wherever it stands in a line: a node's log, a batch
# script's output (srun's "[node0 rank0] " prefix) or Ray's ("(RayTrainWorker pid=…) " prefix).
# Rank 0's lines, or a one-process run's (which name no rank).
RANK0_STEP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})(?: \[rank 0\])? INFO purrsight\.progress: step (\d+)/")


def log_time(stamp: str) -> float:
    """The Unix time of a log line's 'YYYY-mm-dd HH:MM:SS.fff' (its first 23 characters)."""
    return datetime.strptime(stamp[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()


def rank0_steps(text: str) -> list[tuple[float, int]]:
    """(when, step) of each of rank 0's step lines in ``text``."""
    return [(log_time(match.group(1)), int(match.group(2))) for match in RANK0_STEP.finditer(text)]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Messages no run may print (issue 13): each was noise a user could not act on, fixed at its
# cause or silenced exactly (purrsight/cli.py EXPECTED_WARNINGS).
NOISE = (
    "`weights_only` was not set",
    "litlogger",
    "`broadcast_buffers` is deprecated",
    "sync_dist=True)` when logging",
    "Total length of `list` across ranks is zero",
    "smaller than the logging interval",
    "Writing model shards",
    "Pre-processing sequences",  # the tokenizer trainer's bar when the synthetic set is generated
    "Epoch ",
    "dataloader is not resumable",  # Lightning's warning on a mid-epoch resume: ours restores the position
    "You have overridden `",  # Lightning: a LightningModule's hook shadowing the DataModule's (the batch move)
)


def noise_in(text: str) -> list[str]:
    return [message for message in NOISE if message in text]


def small_lora_llm(frozen: torch.dtype, *, dropout: float, use_dora: bool = False) -> PeftModel:
    """Two Qwen2 layers (vocabulary 64), LoRA on the seven projections, checkpointed as the presets
    train, its frozen weights in ``frozen``; lora_B random (peft starts it at zero, where A would
    get no gradient). In training mode."""
    from peft import LoraConfig

    from purrsight.model.llm import load_llm
    from purrsight.training.model_builder import hold_frozen_in

    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=projections, bias="none", task_type="CAUSAL_LM", use_dora=use_dora
    )
    llm, _ = load_llm(64, 0, lora, config=small, gradient_checkpointing=True)
    hold_frozen_in(llm, frozen)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in llm.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return llm.train()
