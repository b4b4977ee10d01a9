"""The bad-input corpus: every user mistake gets one clear line and a non-zero exit.

Each case runs the real command (train_phase2.py, cluster_train.sh or the config check)
against a folder that already holds an earlier run's checkpoint and node log, and asserts:
the exit code, exactly one `error:` line naming the culprit, no traceback (LOG_LEVEL=INFO),
and the earlier run's files untouched. (How fast a mistake is reported is not timed here:
timings belong in bench/, and a loaded CI machine made a 30 s bound fail a correct case.)
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from tests.helpers import DEFAULT_CONFIG, REPO, free_port, launcher_env, python_env, tiny_overrides
from tests.preloaded import PreloadedTrainer

TRAIN = str(REPO / "train_phase2.py")


@dataclass
class Case:
    id: str
    command: str  # "train", "launcher" or "check"
    culprit: str
    # Trainer and check cases run in a forked child of the preloaded trainer (tests/preloaded.py):
    # the same main(), its own process, without 10 s of imports each. A few start a fresh
    # interpreter, as the user's command does, and so does every launcher case.
    fresh_interpreter: bool = False
    exit_code: int = 2
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[Path, Path], list[str]] | None = None  # (tmp, synthetic) -> extra args


# ----------------------------------------------------------------------- data helpers


def index_with(
    tmp: Path, synthetic: Path, line: str | None = None, extra_files: dict[str, bytes] | None = None, keep: int = 3
) -> Path:
    """A small index copied from the synthetic set, plus one crafted line."""
    folder = tmp / "data"
    folder.mkdir(exist_ok=True)
    for name in ("images", "audio"):
        if not (folder / name).exists():
            (folder / name).symlink_to(synthetic / name)
    lines = (synthetic / "train.jsonl").read_text().splitlines()[:keep]
    if line is not None:
        lines.append(line)
    for name, payload in (extra_files or {}).items():
        (folder / name).write_bytes(payload)
    (folder / "train.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))
    return folder / "train.jsonl"


def data_case(
    line: str | None = None, extra_files: dict[str, bytes] | None = None, keep: int = 3, more: list[str] | None = None
) -> Callable[[Path, Path], list[str]]:
    def prepare(tmp: Path, synthetic: Path) -> list[str]:
        index = index_with(tmp, synthetic, line, extra_files, keep)
        return [
            f"data.train_index={index}",
            "data.val_index=null",
            "data.synthetic_dir=null",
            f"model.llm.tokenizer={synthetic / 'tokenizer'}",
            *(more or []),
        ]

    return prepare


def png_bytes(truncate: bool, size: tuple[int, int] = (64, 64)) -> bytes:
    from io import BytesIO

    buffer = BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format="PNG")
    data = buffer.getvalue()
    return data[: len(data) // 3] if truncate else data


def wav_bytes(rate: int) -> bytes:
    from io import BytesIO

    buffer = BytesIO()
    soundfile.write(buffer, np.zeros(rate // 4, dtype=np.float32), rate, format="WAV")
    return buffer.getvalue()


def sample(**fields: object) -> str:
    return json.dumps({"id": "bad-1", "prompt": "What colour is the cat?", "response": "The cat is red.", **fields})


def config_file(text: str) -> Callable[[Path, Path], list[str]]:
    def prepare(tmp: Path, synthetic: Path) -> list[str]:
        (tmp / "bad.yaml").write_text(text)
        return ["--config", str(tmp / "bad.yaml")]

    return prepare


def malicious_checkpoint(tmp: Path, synthetic: Path) -> list[str]:
    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {tmp}/pwned",))

    with (tmp / "evil.ckpt").open("wb") as handle:
        pickle.dump({"state_dict": Exploit()}, handle)
    return ["--resume", str(tmp / "evil.ckpt")]


ONE_PER_STEP = ["data.batch_size=1"]  # every sample is decoded within the first steps

CASES = [
    # --- config
    Case("yaml-syntax", "train", "YAML syntax error", prepare=config_file("trainer:\n  max_steps: [1,\n"), fresh_interpreter=True),
    Case("unknown-key", "train", "unknown key trainer.max_stepz; did you mean trainer.max_steps?", args=["trainer.max_stepz=3"]),
    Case("wrong-type", "train", "trainer.max_steps: Input should be a valid integer", args=["trainer.max_steps=ten"]),
    Case("out-of-range", "train", "data.batch_size: Input should be greater than 0", args=["data.batch_size=0"]),
    Case("negative-lr", "train", "optim.lr: Input should be greater than 0", args=["optim.lr=-0.001"]),
    Case("bad-enum", "train", "trainer.precision: Input should be", args=["trainer.precision=fp8"]),
    Case(
        "missing-model-path",
        "train",
        "model.llm.path: path models/Qwen2.5-missing does not exist",
        args=["model.llm.path=models/Qwen2.5-missing", "model.llm.config=null"],
    ),
    Case("lora-target-absent", "train", "qkv_proj not found in the LLM", args=["model.llm.lora.target_modules=[qkv_proj]"]),
    Case("override-syntax", "train", "expected section.key=value", args=["trainer.max_steps"]),
    Case(
        "fsdp-one-process",
        "train",
        "distributed.strategy=fsdp shards the frozen weights over several processes and this run has one",
        args=["distributed.strategy=fsdp"],
    ),
    Case(
        "fsdp-compile",
        "train",
        "trainer.compile is not supported with distributed.strategy=fsdp",
        args=["distributed.strategy=fsdp", "trainer.compile=true"],
    ),
    Case(
        "fsdp-fp16-mixed",
        "check",
        "trainer.precision=16-mixed is not supported with distributed.strategy=fsdp",
        args=["distributed.strategy=fsdp", "trainer.precision=16-mixed"],
    ),
    Case(
        "cuda-graphs-at-dynamic-shapes",  # compiled but unpadded: every length would be a new recording
        "check",
        "trainer.cuda_graphs replays compiled layers at static shapes: set trainer.compile=true and data.pad_to_multiple_of",
        args=["trainer.cuda_graphs=true", "trainer.compile=true"],
    ),
    Case(
        "cuda-graphs-with-accumulation",  # known at the start: 8 samples a step = 1 process x 2 x 4 micro-batches
        "train",
        "trainer.cuda_graphs needs one micro-batch per optimizer step and this start has 4 (1 x 2 x 4 = 8)",
        args=[
            *("trainer.compile=true", "data.pad_to_multiple_of=16", "trainer.cuda_graphs=true"),
            *("trainer.global_batch_size=8", "data.batch_size=2"),
        ],
    ),
    Case("config-missing", "train", "config file not found", prepare=lambda tmp, syn: ["--config", str(tmp / "nope.yaml")]),
    Case("check-command", "check", "unknown key data.batchsize", args=["data.batchsize=4"]),
    # --- data
    Case("malformed-json", "train", "malformed JSON", prepare=data_case('{"id": "x", "prompt": ')),
    Case("missing-field", "train", "missing field 'response'", prepare=data_case(json.dumps({"id": "bad-1", "prompt": "p"}))),
    Case("missing-image", "train", "image file", prepare=data_case(sample(image="images/absent.png"))),
    Case(
        "truncated-png",
        "train",
        "bad.png: cannot decode image",
        prepare=data_case(sample(image="bad.png"), {"bad.png": png_bytes(truncate=True)}, keep=1, more=ONE_PER_STEP),
    ),
    Case(
        "truncated-png-in-loader-worker",  # the first line names the index line and file, as with no workers
        "train",
        "train.jsonl:2 (id 'bad-1'): ",
        prepare=data_case(
            sample(image="bad.png"), {"bad.png": png_bytes(truncate=True)}, keep=1, more=[*ONE_PER_STEP, "data.num_workers=2"]
        ),
        fresh_interpreter=True,
    ),
    Case(
        "image-above-the-pixel-limit",
        "train",
        "big.png: 1500x1000 image (2 megapixels) is above data.max_image_pixels=1000000",
        prepare=data_case(
            sample(image="big.png"),
            {"big.png": png_bytes(False, size=(1500, 1000))},
            keep=1,
            more=[*ONE_PER_STEP, "data.max_image_pixels=1000000"],
        ),
    ),
    Case(
        "more-bad-samples-than-allowed",  # skip mode's cap: was a traceback and exit 1
        "train",
        "1 bad samples skipped on rank 0, above data.max_bad_samples=0",
        prepare=data_case(
            sample(image="bad.png"),
            {"bad.png": png_bytes(truncate=True)},
            keep=1,
            more=["data.on_bad_sample=skip", "data.max_bad_samples=0", *ONE_PER_STEP],
        ),
    ),
    Case(
        "wav-not-audio",
        "train",
        "bad.wav: cannot decode audio",
        prepare=data_case(sample(audio="bad.wav"), {"bad.wav": b"RIFF not really a wave"}, keep=1, more=ONE_PER_STEP),
    ),
    Case(
        "wrong-sample-rate",
        "train",
        "sample rate 8000 Hz, the encoder expects 16000 Hz",
        prepare=data_case(
            sample(audio="slow.wav"), {"slow.wav": wav_bytes(8000)}, keep=1, more=["data.resample=false", *ONE_PER_STEP]
        ),
    ),
    Case("fewer-samples-than-a-batch", "train", "fewer than one global batch", prepare=data_case(keep=3)),
    Case("empty-index", "train", "index holds no samples", prepare=data_case(keep=0)),
    Case("prompt-too-long", "train", "data.max_length is 6", prepare=data_case(more=["data.max_length=6", *ONE_PER_STEP])),
    Case(
        "duplicate-id",
        "train",
        "duplicate id",
        prepare=data_case(json.dumps({"id": "train-00000", "prompt": "p", "response": "r"})),
    ),
    Case("data-via-launcher", "launcher", "health check data", exit_code=3, prepare=data_case('{"id": broken')),
    Case(  # found by a worker after torchrun started: torchrun says 1, the launcher the worker's 2
        "bad-sample-via-launcher",
        "launcher",
        "bad.wav: cannot decode audio",
        env={"HEALTH_CHECKS": "0", "MAX_RESTARTS": "0"},
        prepare=data_case(sample(audio="bad.wav"), {"bad.wav": b"RIFF not really a wave"}, keep=1, more=ONE_PER_STEP),
    ),
    # --- checkpoints
    # A second start into the earlier run's folder: refused, and the harness checks that run is untouched.
    Case(
        "run-folder-in-use",
        "train",
        "runs/phase2-tiny already holds a run",
        prepare=lambda tmp, syn: ["run.name=phase2-tiny"],
        fresh_interpreter=True,
    ),
    Case(
        "run-folder-in-use-via-launcher",
        "launcher",
        "runs/phase2-tiny already holds a run",
        prepare=lambda tmp, syn: ["run.name=phase2-tiny"],
    ),
    Case("resume-missing", "train", "checkpoint /nonexistent.ckpt does not exist", args=["--resume", "/nonexistent.ckpt"]),
    Case(
        "resume-malicious-pickle",
        "train",
        "is not a readable PurrSight checkpoint",
        prepare=malicious_checkpoint,
        fresh_interpreter=True,
    ),
    # --- launcher arguments: the ones bash checks alone are in tests/shell/cluster_train.bats (one place each)
    Case("port-in-use", "launcher", "is already in use", args=["1", "0", "127.0.0.1", "@BUSY_PORT@"]),
]


def split_flags(extra: list[str]) -> tuple[list[str], list[str]]:
    """(["--flag", value, ...], [override, ...]) from what a case's prepare() returned."""
    flags, overrides, items = [], [], iter(extra)
    for item in items:
        if item.startswith("--"):
            flags += [item, next(items)]
        else:
            overrides.append(item)
    return flags, overrides


def fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() + str(p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def earlier_run(tmp_path: Path) -> Path:
    """An earlier run's checkpoint, metrics and node log, which no failing command may touch."""
    (tmp_path / "runs" / "phase2-tiny" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / "step-00000050.ckpt").write_bytes(b"earlier weights")
    (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / "last.ckpt").write_bytes(b"earlier weights")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "cluster_train_20260101_000000_node0.log").write_text("earlier log\n")
    return tmp_path


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 30
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input(case: Case, earlier_run: Path, synthetic_dir: Path, preloaded_trainer: PreloadedTrainer) -> None:
    tmp = earlier_run
    before = {name: fingerprint(tmp / name) for name in ("runs", "logs")}
    extra = case.prepare(tmp, synthetic_dir) if case.prepare else []
    overrides = tiny_overrides(synthetic_dir, tmp / "runs", run__name=f"case-{case.id}")
    env = launcher_env(tmp / "logs", LOG_LEVEL="INFO", RDZV_TIMEOUT="5", **case.env)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    args = [a.replace("@BUSY_PORT@", str(busy.getsockname()[1])) for a in case.args]
    flags, extra_overrides = split_flags(extra)
    if case.command == "train":
        config = [] if "--config" in flags else ["--config", str(DEFAULT_CONFIG)]
        entry, argv = "train_phase2", [*config, *flags, *overrides, *extra_overrides, *args]  # the case wins
        command = [sys.executable, TRAIN, *argv]
    elif case.command == "check":
        entry, argv = "purrsight.config", ["check", str(DEFAULT_CONFIG), *args]
        command = [sys.executable, "-m", entry, *argv]
    else:  # a case without its own arguments gets a free port, not the default 29500: other tests run beside it
        placement = args or ["1", "0", "127.0.0.1", str(free_port())]
        command = ["./cluster_train.sh", str(DEFAULT_CONFIG), *placement, "--", *overrides, *extra_overrides]
    if case.command == "launcher" or case.fresh_interpreter:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    else:
        done = preloaded_trainer.run(entry, argv, env, timeout=120)
    returncode, output = done.returncode, done.stdout + done.stderr
    busy.close()
    assert returncode == case.exit_code, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith(("error:", "config error:")) or "] error:" in line]
    assert len(errors) == 1, output[-3000:]
    assert case.culprit in errors[0], errors
    assert "Traceback" not in output
    for name in ("runs", "logs"):
        now = fingerprint(tmp / name)
        assert {k: v for k, v in now.items() if k in before[name]} == before[name], f"{name} of the earlier run changed"
    assert not (tmp / "pwned").exists()


def test_debug_shows_the_traceback(synthetic_dir: Path, tmp_path: Path) -> None:
    env = dict(python_env(), LOG_LEVEL="DEBUG")
    done = subprocess.run(
        [
            sys.executable,
            TRAIN,
            "--config",
            str(DEFAULT_CONFIG),
            "--resume",
            "/nonexistent.ckpt",
            *tiny_overrides(synthetic_dir, tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        # A guard against a hang, not a speed check: it fails fast alone (8 s), and passed 60 s in
        # a fresh-clone run on a slow 2-core host beside the Ray cluster tests (2026-11-29).
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" in done.stderr and "error: --resume" in done.stderr
