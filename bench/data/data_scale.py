"""Data at the size of a real job: a raw 1M-line index against the same set prepared.

Side by side in one run, on this machine:

1. **Start and memory, 2 ranks** (torchrun, the tiny default's model, 32-px JPEGs cut from
   matplotlib's photograph, 1,000 distinct files behind 1,000,000 index lines): the embedded
   default (512 generated samples), the 1M index read raw, and the 1M set prepared. For each:
   launch -> end of the first optimizer step, and the peak memory of each rank (anonymous:
   the process's own; RSS, which also counts the page-cache pages of files it maps).
2. **Metadata calls per rank** (strace: stat, open and access calls of each worker, imports
   included), raw and prepared, at two index sizes: which ones grow with the data set.
3. **Prepare throughput per core** on 4000x3000 phone-size JPEGs (the photograph upscaled,
   with sensor noise so entropy decoding costs what a photo's does), through SigLIP's
   224-px processor: samples/s with one process.
4. **Loader samples/s per worker** reading that prepared set, against what one H100
   consumes (bench/data/data_pipeline.py's model: 40% MFU, FLOPs from bench/common.py).

    .venv/bin/python -m bench.data.data_scale                 # ~25 min on 2 cores (needs strace)
    .venv/bin/python -m bench.data.data_scale --lines 20000 --photos 16   # a quick look
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
from torch.utils.data import DataLoader, Dataset, RandomSampler

from bench.common import (
    MEASURED_SETTINGS,
    PYTHON,
    REAL_CONFIG,
    REPO,
    TINY_CONFIG,
    anonymous_mib,
    bench_env,
    data_overrides,
    free_port,
    h100_consumption,
    machine,
    phone_photos,
    save_processors,
    synthetic_tokenizer,
    telemetry_step_times,
    write_index,
)
from purrsight.config import load_config
from purrsight.data.dataset import Collator, Sample
from purrsight.data.synthetic import generate
from purrsight.datasets.builder import build_datasets
from purrsight.datasets.prepare_job import prepare_set

METADATA_CALLS = "stat,lstat,newfstatat,statx,access,faccessat,faccessat2,open,openat,readlink"


class WorkerMemory:
    """Peak memory of each training process under a root pid, by its RANK, sampled every 0.2 s.

    ``anon``: anonymous memory, what a rank costs the node (a prepared set's memory-mapped
    shards are page cache, shared by the node's ranks and given back under pressure);
    ``rss``: everything resident, mapped file pages included.
    """

    def __init__(self) -> None:
        self.peaks: dict[int, dict[str, float]] = defaultdict(lambda: {"anon": 0.0, "rss": 0.0})
        self.pids: dict[int, int] = {}
        self._stop = threading.Event()

    def watch(self, root: int) -> None:
        threading.Thread(target=self._run, args=(root,), daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self, root: int) -> None:
        while not self._stop.is_set():
            try:
                children = psutil.Process(root).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for child in children:
                try:
                    if "train_phase2.py" not in " ".join(child.cmdline()):
                        continue
                    rank = int(child.environ().get("RANK", "-1"))
                    rss, anon = child.memory_info().rss / 2**20, anonymous_mib(child.pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, OSError):
                    continue
                self.pids[child.pid] = rank
                peak = self.peaks[rank]
                peak["anon"], peak["rss"] = max(peak["anon"], anon), max(peak["rss"], rss)
            time.sleep(0.2)


def train_two_ranks(work: Path, name: str, overrides: list[str], strace: Path | None = None) -> dict[str, Any]:
    """train_phase2.py on 2 ranks for 3 steps; launch -> first step, and peak memory per rank."""
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
    ]
    command += [str(REPO / "train_phase2.py"), "--config", str(TINY_CONFIG), *overrides]
    command += [f"run.output_dir={work / 'runs'}", f"run.name={name}", "trainer.max_steps=3", "telemetry.every_n_steps=1"]
    command += ["checkpoint.every_n_steps=1000", "trainer.val_every_n_steps=1000", "logging.progress=lines"]
    if strace is not None:
        command = ["strace", "-f", "-ff", "-qq", "-e", f"trace={METADATA_CALLS}", "-o", str(strace), *command]
    memory = WorkerMemory()
    log = work / f"{name}.log"
    with log.open("w") as out:
        launched = time.time()
        proc = subprocess.Popen(command, cwd=REPO, env=bench_env(), stdout=out, stderr=subprocess.STDOUT)
        memory.watch(proc.pid)
        code = proc.wait(timeout=3600)
        memory.stop()
    if code != 0:
        raise SystemExit(f"bench: {name} failed with exit code {code}; see {log}")
    first = telemetry_step_times(run_dir)[1] - launched
    return {
        "first_step_s": first,
        "memory_mib": {rank: dict(peak) for rank, peak in sorted(memory.peaks.items())},
        "pids": memory.pids,
    }


def metadata_calls(work: Path, name: str, overrides: list[str]) -> dict[int, int]:
    """Metadata system calls made by each rank's process (its own file of strace -ff), by rank."""
    folder = work / f"strace-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    result = train_two_ranks(work, f"strace-{name}", overrides, strace=folder / "trace")
    counts = {}
    for pid, rank in result["pids"].items():
        path = folder / f"trace.{pid}"
        counts[rank] = sum(1 for _ in path.open()) if path.is_file() else -1
    shutil.rmtree(folder, ignore_errors=True)
    return dict(sorted(counts.items()))


def prepared_set(index: Path, tokenizer: Path, out: Path, processes: int) -> float:
    """Prepare ``index`` (tiny default's model and processors) into ``out``; seconds taken."""
    config = load_config(TINY_CONFIG, data_overrides(index, None, tokenizer), check_paths=False)
    started = time.monotonic()
    prepare_set(config, out, processes, (0, 1), shard_size=4096)
    return time.monotonic() - started


def one_worker_rate(dataset: Dataset[Sample], collator: Collator, batch: int, batches: int) -> float:
    """Samples/s of one loader worker drawing at random (with replacement: a small set serves any count)."""
    sampler = RandomSampler(dataset, replacement=True, num_samples=batch * (batches + 1))  # type: ignore[arg-type]
    iterator = iter(DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=1, collate_fn=collator))
    next(iterator)  # the worker's start is not timed
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch / (time.perf_counter() - started)


def photo_pipeline(work: Path, photos: int, tokenizer: Path) -> dict[str, float]:
    """Prepare throughput per core on 12-MP photos (SigLIP 224 px), then the loader's rate per worker from the set."""
    from transformers import SiglipVisionConfig, Wav2Vec2Config

    image_dir, audio_dir = save_processors(work / "processors")
    SiglipVisionConfig().save_pretrained(image_dir)  # the towers' config (what a prepared set is made for); no weights needed
    Wav2Vec2Config().save_pretrained(audio_dir)
    index = phone_photos(work / "photos", photos)
    overrides = [
        f"data.train_index={index}",
        "data.val_index=null",
        "data.audio_seconds=1.0",  # as bench/data/data_pipeline.py, whose GPU consumption model assumes 1 s clips
        f"model.llm.tokenizer={tokenizer}",
        f"model.image_encoder.path={image_dir}",
        f"model.audio_encoder.path={audio_dir}",
    ]
    config = load_config(REAL_CONFIG, [*MEASURED_SETTINGS, *overrides], check_paths=False)
    out = work / "photos-prepared"
    shutil.rmtree(out, ignore_errors=True)
    started = time.monotonic()
    prepare_set(config, out, 1, (0, 1), shard_size=64)
    per_core = photos / (time.monotonic() - started)
    prepared = config.model_copy(update={"data": config.data.model_copy(update={"prepared": str(out)})})
    data = build_datasets(prepared, world_size=1)
    rate = max(one_worker_rate(data.train, data.collator, batch=8, batches=50) for _ in range(3))
    _, gpu_rate = h100_consumption(config)
    return {"prepare_per_core": per_core, "loader_per_worker": rate, "h100_consumes": gpu_rate}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000, help="index lines for part 1 (default: %(default)s)")
    parser.add_argument("--strace-lines", type=int, nargs=2, default=[10_000, 100_000], help="two index sizes for part 2")
    parser.add_argument("--photos", type=int, default=64, help="4000x3000 photos for parts 3 and 4 (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one, removed after)")
    parser.add_argument(
        "--runs-only", action="store_true", help="part 1's training runs only, on --work's index and prepared set of an earlier run"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    generate(REPO / "data" / "synthetic", 512, 64, 0)  # the embedded default's set, as its first run makes it
    tokenizer = synthetic_tokenizer(work / "synthetic")
    results: dict[str, Any] = {"machine": machine(), "lines": args.lines}

    prepared = work / f"prepared-{args.lines}"
    if args.runs_only:
        index = work / "corpus" / f"train-{args.lines}.jsonl"
    else:
        index = write_index(work / "corpus", args.lines)
        shutil.rmtree(prepared, ignore_errors=True)
        results["prepare_s"] = prepared_set(index, tokenizer, prepared, processes=2)
        results["prepared_gib"] = sum(f.stat().st_size for f in prepared.rglob("*")) / 2**30
    for name, overrides in (
        ("default", data_overrides(None, None, tokenizer)),
        ("raw", data_overrides(index, None, tokenizer)),
        ("prepared", data_overrides(index, prepared, tokenizer)),
    ):
        results[name] = train_two_ranks(work, name, overrides)
        print(name, json.dumps(results[name]["first_step_s"]), json.dumps(results[name]["memory_mib"]), flush=True)

    if args.runs_only:
        print(json.dumps(results, indent=1, default=str))
        return 0
    results["metadata_calls"] = {}
    for lines in args.strace_lines:
        small = write_index(work / "corpus", lines)
        small_prepared = work / f"prepared-{lines}"
        shutil.rmtree(small_prepared, ignore_errors=True)
        prepared_set(small, tokenizer, small_prepared, processes=2)
        for name, overrides in (
            ("raw", data_overrides(small, None, tokenizer)),
            ("prepared", data_overrides(small, small_prepared, tokenizer)),
        ):
            results["metadata_calls"][f"{name} {lines}"] = metadata_calls(work, f"{name}-{lines}", overrides)
            print(name, lines, results["metadata_calls"][f"{name} {lines}"], flush=True)

    results["photos"] = photo_pipeline(work, args.photos, tokenizer)
    print(json.dumps(results, indent=1, default=str))
    (REPO / "bench" / "data" / "data_scale.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
