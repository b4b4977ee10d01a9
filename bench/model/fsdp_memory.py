"""DDP against FSDP (``distributed.strategy``) at 2 ranks on this CPU: memory per rank and speed.

For each model, side by side in one run, the same command under either strategy:

- ``tiny``: the embedded default's model, its LLM saved as a local directory;
- ``0.5b``: Qwen2.5-0.5B's shape (its config, random weights, tied embeddings) saved the same way,
  with the tiny default's towers and data.

Per rank: the frozen weights it holds and its peak RSS when the model is built (the trainer's
own line), its peak RSS and peak anonymous RSS over the whole run (polled every 50 ms), and the
job's samples/s over the steps after the first (telemetry). The LLM is a directory so FSDP
takes the path a user's base takes: built on the meta device, each rank reading its own rows.

    .venv/bin/python -m bench.model.fsdp_memory            # ~6 min on 2 cores
    .venv/bin/python -m bench.model.fsdp_memory --precision bf16-mixed --models 0.5b --steps 2
                                                           # frozen weights in bf16: what a rank's build holds
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import (  # QWEN2_5_0_5B: Qwen2.5-0.5B's config.json
    PYTHON,
    QWEN2_5_0_5B,
    REPO,
    TINY_CONFIG,
    anonymous_mib,
    bench_env,
    free_port,
    machine,
    telemetry_step_times,
)

TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
BATCH = 2  # per rank
BUILT = re.compile(
    r"model built: frozen weights (whole|sharded)[^;]*; this rank holds ([\d.]+) MiB of them; peak RSS so far (\d+) MiB"
)


def save_llm(shape: dict[str, Any], folder: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from purrsight.model.llm import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    options = {**shape, "vocab_size": shape.get("vocab_size", len(tokenizer))}
    model = AutoModelForCausalLM.from_config(Qwen2Config(**options), dtype=torch.bfloat16)  # as Qwen ships it
    model.save_pretrained(folder, max_shard_size="500MB")
    tokenizer.save_pretrained(folder)
    return folder


class PeakRSS(threading.Thread):
    """The largest RSS each trainer process of a job reached, by pid."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peaks, self.anon, self.done = root, dict[int, int](), dict[int, int](), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            try:
                children = psutil.Process(self.root).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for child in children:
                try:
                    if "train_phase2.py" in " ".join(child.cmdline()):
                        self.peaks[child.pid] = max(self.peaks.get(child.pid, 0), child.memory_info().rss)
                        self.anon[child.pid] = max(self.anon.get(child.pid, 0), round(anonymous_mib(child.pid) * 2**20))
                except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                    continue


def run(llm: Path, strategy: str, steps: int, work: Path, precision: str) -> dict[str, object]:
    out = work / f"{llm.name}-{strategy}"
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(free_port()), str(REPO / "train_phase2.py"), "--config", str(TINY_CONFIG)]
    command += [f"run.output_dir={out}", "run.name=bench", f"model.llm.path={llm}", "model.llm.config=null"]
    command += [f"distributed.strategy={strategy}", f"trainer.max_steps={steps}", f"data.batch_size={BATCH}"]
    command += ["telemetry.every_n_steps=1", "checkpoint.every_n_steps=1000", "trainer.val_every_n_steps=1000"]
    command += ["data.val_index=null", "preflight.mode=off", "logging.progress=lines", f"trainer.precision={precision}"]
    job = subprocess.Popen(command, cwd=REPO, env=bench_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = PeakRSS(job.pid)
    peaks.start()
    output, _ = job.communicate(timeout=1800)
    peaks.done.set()
    if job.returncode != 0:
        raise SystemExit(f"{llm.name} {strategy}: exit {job.returncode}\n{output[-3000:]}")
    built = re.findall(
        r"model built: frozen weights (whole|sharded)[^;]*; this rank holds ([\d.]+) MiB of them; peak RSS so far (\d+) MiB", output
    )
    times = telemetry_step_times(out / "bench")
    first, last = min(t for s, t in times.items() if s >= 2), max(times.values())
    counted = max(times) - min(s for s in times if s >= 2)
    return {
        "frozen_held_mib": [float(held) for _, held, _ in built],
        "build_peak_rss_mib": [int(peak) for _, _, peak in built],
        "run_peak_rss_mib": sorted(round(p / 2**20) for p in peaks.peaks.values())[-2:],
        "run_peak_anon_mib": sorted(round(p / 2**20) for p in peaks.anon.values())[-2:],
        "samples_per_s": round(counted * 2 * BATCH / (last - first), 2) if last > first else None,  # too few steps
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=["tiny", "0.5b"])
    parser.add_argument("--precision", default="32-true", help="trainer.precision (bf16-mixed: frozen weights held in bf16)")
    args = parser.parse_args()
    print(f"# {machine()}; {time.strftime('%Y-%m-%d')}; 2 ranks, gloo, {args.precision}, batch {BATCH} per rank")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        from purrsight.data.synthetic import generate

        data = generate(REPO / "data" / "synthetic", 512, 64, 0, 32)  # the embedded default's set (a no-op when present)
        for name in args.models:
            llm = save_llm(TINY if name == "tiny" else QWEN2_5_0_5B, work / name, data / "tokenizer")
            for strategy in ("ddp", "fsdp"):
                print(f"{name:5} {strategy:4} {run(llm, strategy, args.steps, work, args.precision)}", flush=True)


if __name__ == "__main__":
    main()
