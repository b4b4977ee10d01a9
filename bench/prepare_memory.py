"""Peak memory of ``train_phase2.py prepare``'s processes on 12-MP photos, by shard size.

A shard's samples stream into its Arrow writer (64 rows at a time), so a decoding process's
memory should not grow with ``--shard-size``. Side by side in one run: this tree, and with
``--compare-with REV`` the same command from an earlier commit (a git worktree, the same
interpreter), which held a whole shard's rows in memory before writing it.

Data: ``--lines`` index lines over ``--photos`` distinct 4000x3000 JPEGs (bench/data_scale.py's
phone photos: the photograph upscaled, with sensor noise), the shipped real config's data
settings with SigLIP-base's 224-px processor (pictures stored as uint8, 150 KB a sample).
Memory: each process's anonymous resident memory (its own heap; not the page cache of the
photos it reads), peak over samples every 0.1 s; 2 decoding processes.

    .venv/bin/python -m bench.prepare_memory --compare-with e9ed23d      # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench.common import PYTHON, REPO, bench_env, machine
from bench.data_pipeline import save_processors
from bench.data_scale import anonymous_mib, phone_photos
from bench.real_size import REAL_CONFIG, random_init_overrides, synthetic_tokenizer


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=16, help="distinct 4000x3000 JPEGs (default: %(default)s)")
    parser.add_argument("--lines", type=int, default=512, help="index lines over them (default: %(default)s)")
    parser.add_argument("--shard-sizes", type=int, nargs="+", default=[64, 512], help="(default: %(default)s)")
    parser.add_argument("--compare-with", default=None, metavar="REV", help="also run prepare from this commit")
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        from transformers import SiglipVisionConfig, Wav2Vec2Config

        image_dir, audio_dir = save_processors(work / "processors")
        SiglipVisionConfig().save_pretrained(image_dir)
        Wav2Vec2Config().save_pretrained(audio_dir)
        photos = phone_photos(work / "photos", args.photos).parent
        lines = [
            json.dumps(
                {"id": f"s{i}", "prompt": "Describe the photo.", "response": "A portrait.", "image": f"{i % args.photos}.jpg"}
            )
            for i in range(args.lines)
        ]
        index = photos / "lines.jsonl"
        index.write_text("\n".join(lines) + "\n")
        llm = [o for o in random_init_overrides(synthetic_tokenizer(work / "tokenizer-set")) if o.startswith("model.llm.")]
        overrides = [
            *llm,  # the real config's LLM from its config dict: prepare needs only its tokenizer
            f"data.train_index={index}",
            "data.val_index=null",
            "data.audio_seconds=1.0",
            f"model.image_encoder.path={image_dir}",
            f"model.audio_encoder.path={audio_dir}",
        ]
        trees = {"this tree": REPO}
        if args.compare_with:
            old = work / "old-tree"
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(old), args.compare_with], cwd=REPO, check=True, capture_output=True
            )
            trees[args.compare_with] = old
        try:
            print(f"\n{args.lines} samples over {args.photos} photos, 2 processes")
            print("| code | --shard-size | seconds | main process peak MiB | largest worker peak MiB |")
            print("|---|---|---|---|---|")
            for shard_size in args.shard_sizes:
                for name, tree in trees.items():
                    run = run_prepare(tree, overrides, work / "out", shard_size)
                    figures = f"{run['seconds']:.0f} | {run['main_mib']:.0f} | {run['worker_mib']:.0f}"
                    print(f"| {name} | {shard_size} | {figures} |", flush=True)
        finally:
            if args.compare_with:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees[args.compare_with])], cwd=REPO, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
