"""What the benchmarks share, in one place: every bench/<concern>/ script imports from here.

- **Timed runs** (the CPU benchmarks): the machine, the environment, a run's launch -> first
  optimizer step and samples/s. A *timed run* starts a command and notes the wall clock just
  before; the trainer (its telemetry CSV) or the plain loop (its JSON) notes the wall clock after
  given optimizer steps. From those: launch -> first optimizer step, and samples/s over a window
  of steps that holds no validation and no checkpoint (both happen only at the last step).
- **A device's queued work waited for** (``synchronize``), around every GPU bench's timed call.
- **CPU seconds by part of the stack** (``ProcessTreeCPU``) and **a process's memory**
  (``/proc/PID/status``).
- **The real-size model** (config/qwen2.5-0.5b.yaml as config dicts), its training FLOPs per
  sample, and what one H100 consumes.
- **Generated data**: 32-px JPEGs and 12-MP phone photos cut from one photograph, their indexes,
  and ``train_phase2.py prepare`` run with its memory watched.

Imports beyond the standard library and psutil are made inside the functions that need them, so
that importing this module stays cheap: some scripts time a fresh interpreter's imports.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from purrsight.config import Config

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TINY_CONFIG = REPO / "config" / "train_config.yaml"
WINDOW_START = 20  # steps before this are warm-up (allocator, first-touch, loader start)
ROW_EVERY = 10  # telemetry.every_n_steps in every timed run


@dataclass(frozen=True)
class Timing:
    first_step_s: float  # launch -> end of the first optimizer step
    samples_per_s: float  # global, over steps WINDOW_START .. last - ROW_EVERY


def synchronize(device: torch.device) -> None:
    """Waits for the work queued on ``device`` (a CPU's is done when its call returns): every GPU
    bench times its calls with it."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def machine() -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line),
        platform.processor() or "unknown CPU",
    )
    import torch

    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {memory_gib:.0f} GiB; Python {platform.python_version()}, torch {torch.__version__}"


def steps_overrides(steps: int, run_dir: Path, per_process_batch: int) -> list[str]:
    """The tiny default with validation and checkpoints only at the last step, telemetry every ROW_EVERY."""
    return [
        f"run.output_dir={run_dir}",
        f"trainer.max_steps={steps}",
        f"trainer.val_every_n_steps={steps}",
        f"checkpoint.every_n_steps={steps}",
        f"telemetry.every_n_steps={ROW_EVERY}",
        f"data.batch_size={per_process_batch}",
    ]


def bench_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # one core per process in every run: the runs differ only in what they measure
    env["PATH"] = f"{Path(PYTHON).parent}:{env['PATH']}"
    env.update(extra)
    return env


def timed(command: list[str], env: dict[str, str], log: Path, cpu: ProcessTreeCPU | None = None) -> float:
    """Run ``command`` to completion (output to ``log``); return its launch time (Unix seconds).

    With ``cpu``, the CPU time of the command's process tree is sampled into it.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        launched = time.time()
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        if cpu is not None:
            cpu.watch(proc.pid)
        try:
            returncode = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SystemExit(f"bench: {command[0]} ... still running after 600 s; see {log}") from None
    if returncode != 0:
        raise SystemExit(f"bench: {command[0]} ... failed with exit code {returncode}; see {log}")
    return launched


def timing_from_step_times(launched: float, step_times: dict[int, float], steps: int, global_batch: int) -> Timing:
    end = steps - ROW_EVERY
    window = step_times[end] - step_times[WINDOW_START]
    return Timing(step_times[1] - launched, (end - WINDOW_START) * global_batch / window)


def telemetry_step_times(run_dir: Path) -> dict[int, float]:
    """Step -> wall time of the rows node 0's telemetry wrote (step 1, then every ROW_EVERY).

    A row still being written (read while the run goes on) has no time yet and is left out.
    """
    with (run_dir / "telemetry" / "node0.csv").open() as file:
        return {int(float(row["step"])): float(row["time"]) for row in csv.DictReader(file) if row.get("time")}


def plain_step_times(path: Path) -> dict[int, float]:
    return {int(step): t for step, t in json.loads(path.read_text()).items()}


def median_timing(timings: list[Timing]) -> Timing:
    return Timing(
        statistics.median(t.first_step_s for t in timings),
        statistics.median(t.samples_per_s for t in timings),
    )


def median_interval(values: list[float], confidence: float = 0.9, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of ``values``: an approximate ``confidence``
    interval for the median such repeats measure. A target within it is not resolved by the set,
    however near the median is; more repeats narrow it (as one over their square root). Over a
    handful of repeats it is the values' own range or close to it, which says little: read it from
    some ten repeats on."""
    if not values:
        raise ValueError("no values")
    if not 0 < confidence < 1 or resamples < 1:
        raise ValueError(f"confidence {confidence} must be in (0, 1) and resamples {resamples} at least 1")
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    outside = round((1 - confidence) / 2 * resamples)  # resamples left out at each end, the same count at both
    return medians[outside], medians[resamples - 1 - outside]


def run_stack(
    nproc: int,
    steps: int,
    per_process_batch: int,
    work: Path,
    name: str,
    launcher: bool = True,
    extra: tuple[str, ...] = (),
    launcher_env: dict[str, str] | None = None,
    cpu: ProcessTreeCPU | None = None,
) -> Timing:
    """The tiny default through cluster_train.sh (or torchrun + train_phase2.py when ``launcher`` is off).

    ``launcher_env``: further launcher variables (MONITOR_INTERVAL=...); ``cpu``: sample the run's CPU time into it.
    """
    run_name = f"{name}-{time.time_ns()}"
    overrides = [*steps_overrides(steps, work / "runs", per_process_batch), f"run.name={run_name}", *extra]
    port = free_port()
    if launcher:
        command = ["bash", str(REPO / "cluster_train.sh"), str(TINY_CONFIG), "1", "0", "127.0.0.1", str(port), "--", *overrides]
        env = bench_env(NPROC_PER_NODE=str(nproc), BACKEND="gloo", LOG_DIR=str(work / "logs"), **(launcher_env or {}))
    else:
        command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command += [str(REPO / "train_phase2.py"), "--config", str(TINY_CONFIG), *overrides]
        env = bench_env()
    launched = timed(command, env, work / "logs" / f"{run_name}.out", cpu)
    return timing_from_step_times(launched, telemetry_step_times(work / "runs" / run_name), steps, nproc * per_process_batch)


def run_plain(nproc: int, steps: int, per_process_batch: int, work: Path, cpu: ProcessTreeCPU | None = None) -> Timing:
    """bench/launch/plain_ddp.py under plain torchrun: the same model, data, batch and optimizer, no Lightning."""
    out = work / f"plain-{time.time_ns()}.json"
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", "bench.launch.plain_ddp", "--steps", str(steps), "--batch-size", str(per_process_batch)]
    command += ["--out", str(out)]
    launched = timed(command, bench_env(), work / "logs" / f"{out.stem}.out", cpu)
    return timing_from_step_times(launched, plain_step_times(out), steps, nproc * per_process_batch)


def ensure_synthetic_set() -> None:
    """Generate the tiny default's data once, outside every timed run."""
    from purrsight.config import load_config
    from purrsight.datasets.synthetic_set import ensure_synthetic_set

    ensure_synthetic_set(load_config(TINY_CONFIG, check_paths=False))


# ---------------------------------------------------------------- CPU seconds by part of the stack
# A sampler thread walks the process trees under the given root pids every ``interval`` s and keeps
# each process's latest user + system time. A process that exits between two samples loses at most
# one interval of its time; the long-lived ones (workers, torchrun's agent, the log writer) are
# sampled until their last interval. The part a process plays is read from its command line
# (``role_of``).

ROLES = ("worker", "worker fork server", "loader workers", "torchrun agent", "log writer", "prepare", "launcher other")


def role_of(cmdline: list[str]) -> str:
    command = " ".join(cmdline)
    if "purrsight.launcher.torchrun" in command or "torch.distributed.run" in command:
        return "torchrun agent"  # its command line names the training script too
    if "multiprocessing.forkserver import main" in command:
        # the launcher's worker server, or a rank's loader server and its forks (which keep its command line);
        # a forked worker has it too until it sets its own, so a process's role is read at every sample
        return "worker fork server" if "purrsight.launcher.forked_workers" in command else "loader workers"
    if "train_phase2.py" in command or "bench.launch.plain_ddp" in command:
        return "worker"
    if "purrsight.launcher.logwriter" in command:
        return "log writer"
    if "purrsight.launcher.node_plan" in command:
        return "prepare"  # probe, config check, placement, run folder, environment, health checks
    return "launcher other"  # bash and its tools


class ProcessTreeCPU:
    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.roots: list[int] = []
        self.seen: dict[tuple[int, float], tuple[str, float]] = {}  # (pid, create time) -> (role, cpu s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProcessTreeCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, pid: int) -> None:
        self.roots.append(pid)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        for root in list(self.roots):
            try:
                tree = [psutil.Process(root)]
                tree += tree[0].children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for process in tree:
                try:
                    with process.oneshot():
                        key = (process.pid, process.create_time())
                        times = process.cpu_times()
                        role = role_of(process.cmdline())
                except psutil.NoSuchProcess:
                    continue
                self.seen[key] = (role, times.user + times.system)

    def by_role(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for role, seconds in self.seen.values():
            totals[role] += seconds
        return {role: totals.get(role, 0.0) for role in ROLES}


# ---------------------------------------------------------------- a process's memory


def status_mib(field: str, pid: int | str = "self") -> float:
    """A memory field of /proc/PID/status in MiB (RssAnon, VmRSS: resident now; VmHWM: its peak); 0 if absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def anonymous_mib(pid: int | str = "self") -> float:
    """The process's anonymous resident memory (its own heap and stacks; not the page cache of files it maps)."""
    return status_mib("RssAnon", pid)


# ---------------------------------------------------------------- the real-size model
# config/qwen2.5-0.5b.yaml points at local model directories; the benchmarks cannot fetch them, so
# they build the same architectures randomly initialised from these dicts (the published configs of
# Qwen2.5-0.5B-Instruct, siglip-base-patch16-224's vision tower and wav2vec2-base). Compute and
# memory do not depend on the weights' values.

REAL_CONFIG = REPO / "config" / "qwen2.5-0.5b.yaml"
# The presets' micro-batch and checkpointing as they shipped until 2026-11-29 (auto since: chosen
# by the device's memory). The benchmarks measure at these, so their figures stay comparable.
MEASURED_SETTINGS = ["data.batch_size=8", "model.llm.gradient_checkpointing=true"]
TARGET_MFU = 0.40  # what one GPU consumes is counted at the MFU target

QWEN2_5_0_5B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
QWEN2_5_7B: dict[str, Any] = {  # Qwen2.5-7B's config.json values
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
SIGLIP_BASE_224: dict[str, Any] = {
    "image_size": 224,
    "patch_size": 16,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
}
WAV2VEC2_BASE: dict[str, Any] = {}  # transformers' Wav2Vec2Config defaults are wav2vec2-base


def synthetic_tokenizer(folder: Path) -> Path:
    """A tokenizer directory made offline (the synthetic set's); Qwen's own cannot be fetched here."""
    from purrsight.data.synthetic import generate

    generate(folder, 8, 2, 0, 32)  # a tiny set: only its tokenizer is used
    return folder / "tokenizer"


def random_init_overrides(tokenizer_dir: Path, llm: dict[str, Any] | None = None) -> list[str]:
    """Overrides turning a preset's model directories into config dicts (``llm``: the LLM's,
    Qwen2.5-0.5B's by default; the towers are SigLIP-base and wav2vec2-base in both presets)."""

    def flow(mapping: dict[str, Any]) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}"

    return [
        *MEASURED_SETTINGS,
        "model.llm.path=null",
        f"model.llm.config={flow(llm or QWEN2_5_0_5B)}",
        f"model.llm.tokenizer={tokenizer_dir}",
        "model.image_encoder.path=null",
        "model.image_encoder.model_type=siglip",
        f"model.image_encoder.config={flow(SIGLIP_BASE_224)}",
        "model.audio_encoder.path=null",
        "model.audio_encoder.model_type=wav2vec2",
        f"model.audio_encoder.config={flow(WAV2VEC2_BASE)}",
    ]


def save_processors(folder: Path) -> tuple[Path, Path]:
    """SigLIP-base's image processor and wav2vec2-base's feature extractor, from their defaults."""
    from transformers import SiglipImageProcessor, Wav2Vec2FeatureExtractor

    image_dir, audio_dir = folder / "siglip", folder / "wav2vec2"
    SiglipImageProcessor(size={"height": 224, "width": 224}).save_pretrained(image_dir)
    Wav2Vec2FeatureExtractor(return_attention_mask=False, do_normalize=True).save_pretrained(audio_dir)
    return image_dir, audio_dir


def encoder_forward_flops(image_size: int = 224, audio_samples: int = 16000) -> dict[str, float]:
    """Forward FLOPs of the frozen towers for one sample, counted on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import SiglipVisionConfig, SiglipVisionModel, Wav2Vec2Config, Wav2Vec2Model

    with torch.device("meta"):
        image_tower = SiglipVisionModel(SiglipVisionConfig(**SIGLIP_BASE_224))
        audio_tower = Wav2Vec2Model(Wav2Vec2Config(**WAV2VEC2_BASE))
        pixels = torch.empty(1, 3, image_size, image_size)
        wave = torch.empty(1, audio_samples)
    flops = {}
    for name, tower, inputs in (("image", image_tower, {"pixel_values": pixels}), ("audio", audio_tower, {"input_values": wave})):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            tower(**inputs)
        flops[name] = float(counter.get_total_flops())
    return flops


def llm_counts(lora_r: int, target_modules: list[str]) -> tuple[int, int]:
    """(LLM parameters, LoRA parameters) of Qwen2.5-0.5B, counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_5_0_5B))
    base = sum(p.numel() for p in model.parameters())
    lora = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in target_modules:
            lora += lora_r * (module.in_features + module.out_features)
    return base + lora, lora


def training_flops_per_sample(seq_len: int, prefix_tokens: int, lora_r: int, target_modules: list[str], audio_s: float) -> float:
    """Model FLOPs of one training sample: LLM (telemetry's count, per processed token) plus the towers' forward."""
    from purrsight.observability.flops import flops_per_token

    llm_params, lora = llm_counts(lora_r, target_modules)
    tokens = seq_len + prefix_tokens
    per_token = flops_per_token(llm_params, lora, QWEN2_5_0_5B["num_hidden_layers"], QWEN2_5_0_5B["hidden_size"], tokens)
    towers = encoder_forward_flops(audio_samples=round(16000 * audio_s))
    return per_token * tokens + towers["image"] + towers["audio"]


def h100_consumption(config: Config) -> tuple[float, float]:
    """(training FLOPs per sample of ``config``'s model with 1 s audio, samples/s one H100 consumes at TARGET_MFU)."""
    from purrsight.observability.flops import PEAK_TFLOPS

    flops = training_flops_per_sample(
        config.data.max_length,
        2 * config.model.prefix_tokens,
        config.model.llm.lora.r,
        list(config.model.llm.lora.target_modules),
        audio_s=1.0,
    )
    return flops, TARGET_MFU * PEAK_TFLOPS["H100"] * 1e12 / flops


# ---------------------------------------------------------------- generated data, and prepare run on it


def photograph() -> Image.Image:
    """matplotlib's sample photograph (a portrait), in RGB."""
    import matplotlib.cbook
    from PIL import Image

    with Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as image:
        return image.convert("RGB")


def write_index(folder: Path, lines: int, distinct: int = 1000) -> Path:
    """``lines`` samples over ``distinct`` 32-px JPEGs cut from the photograph; the synthetic set's words."""
    import numpy as np

    images = folder / "images"
    if not images.is_dir():
        images.mkdir(parents=True)
        photo, rng = photograph(), np.random.default_rng(0)
        for i in range(distinct):
            left, top = (int(v) for v in rng.integers(0, 200, size=2))
            photo.crop((left, top, left + 300, top + 300)).resize((32, 32)).save(images / f"{i}.jpg", quality=90)
    index = folder / f"train-{lines}.jsonl"
    colours = ("red", "green", "blue", "yellow")
    with index.open("w") as out:
        for i in range(lines):
            colour = colours[i % 4]
            record = {
                "id": f"s{i}",
                "prompt": "What colour is the cat?",
                "response": f"The cat is {colour}.",
                "image": f"images/{i % distinct}.jpg",
            }
            out.write(json.dumps(record) + "\n")
    return index


def data_overrides(index: Path | None, prepared: Path | None, tokenizer: Path) -> list[str]:
    """The tiny default trained on ``index`` (raw, or the set ``prepared`` from it); None: the embedded default."""
    if index is None:
        return []  # the embedded default: its generated set
    return [
        f"data.train_index={index}",
        "data.val_index=null",
        "data.synthetic_dir=null",
        f"model.llm.tokenizer={tokenizer}",
        *([f"data.prepared={prepared}"] if prepared else []),
    ]


def phone_photos(folder: Path, count: int) -> Path:
    """``count`` 4000x3000 JPEGs from the photograph (upscaled, shifted, with sensor noise) and their index."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    photo, rng = photograph(), np.random.default_rng(1)
    lines = []
    for i in range(count):
        left = int(rng.integers(0, 60))
        big = np.asarray(photo.crop((left, 0, left + 450, 600)).resize((4000, 3000), Image.Resampling.BICUBIC), np.int16)
        noisy = np.clip(big + rng.normal(0, 4, big.shape), 0, 255).astype(np.uint8)
        Image.fromarray(noisy).save(folder / f"{i}.jpg", quality=90)
        lines.append(json.dumps({"id": f"p{i}", "prompt": "Describe the photo.", "response": "A portrait.", "image": f"{i}.jpg"}))
    (folder / "index.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "index.jsonl"


def prepare_overrides(work: Path, tokenizer: Path) -> list[str]:
    """prepare's settings: the real config's LLM as a config dict (only its tokenizer is used), SigLIP's 224-px processor."""
    from transformers import SiglipVisionConfig, Wav2Vec2Config

    image_dir, audio_dir = save_processors(work / "processors")
    SiglipVisionConfig().save_pretrained(image_dir)
    Wav2Vec2Config().save_pretrained(audio_dir)
    llm = [o for o in random_init_overrides(tokenizer) if o.startswith("model.llm.")]
    return [
        *llm,
        "data.val_index=null",
        "data.audio_seconds=1.0",
        f"model.image_encoder.path={image_dir}",
        f"model.audio_encoder.path={audio_dir}",
    ]


def peak_anonymous_mib(root: subprocess.Popen[bytes]) -> tuple[float, float]:
    """(the main process's, the largest worker's) peak anonymous memory until ``root`` exits."""
    main = worker = 0.0
    while root.poll() is None:
        try:
            main = max(main, anonymous_mib(root.pid))
            for child in psutil.Process(root.pid).children(recursive=True):
                worker = max(worker, anonymous_mib(child.pid))
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.1)
    return main, worker


def run_prepare(tree: Path, overrides: list[str], out: Path, shard_size: int) -> dict[str, float]:
    """``train_phase2.py prepare`` of ``tree`` (2 processes) into ``out``: seconds, and its processes' peak anonymous MiB."""
    shutil.rmtree(out, ignore_errors=True)
    command = [PYTHON, str(tree / "train_phase2.py"), "prepare", "--config", str(REAL_CONFIG), "--out", str(out)]
    command += ["--num-proc", "2", "--shard-size", str(shard_size), *overrides]
    started = time.monotonic()
    with subprocess.Popen(command, cwd=tree, env=bench_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as process:
        peaks: list[tuple[float, float]] = []
        watcher = threading.Thread(target=lambda: peaks.append(peak_anonymous_mib(process)))
        watcher.start()
        _, errors = process.communicate()
        watcher.join()
    if process.returncode != 0:
        raise SystemExit(f"prepare failed in {tree}:\n{errors.decode()[-3000:]}")
    main, worker = peaks[0]
    return {"seconds": time.monotonic() - started, "main_mib": main, "worker_mib": worker}
