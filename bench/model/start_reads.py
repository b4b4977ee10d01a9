"""What a rank reads from the base's weight files while its model is built under fsdp.

Two ranks (torchrun, gloo, CPU) build the model of the tiny default with its LLM from a directory
saved by ``save_pretrained`` in bf16, split over several files, through the trainer's own sharded
build (``training/fsdp.py``: ``build_sharded``). Each rank reads its own copy of the directory, as
a rank on another node reads through a page cache of its own: on one machine two ranks reading one
copy share the cache, and whichever faults a page first is charged for it. Each copy's pages are
dropped from the cache first (``POSIX_FADV_DONTNEED``). Per rank: the bytes it caused to be read
from storage during the build (``read_bytes`` of ``/proc/self/io``), against its shard of the base
(its rows of each tensor, as FSDP2 splits dim 0) and the base's size, and its wall and CPU seconds.

    .venv/bin/python -m bench.model.start_reads                          # the 0.5B shape, this tree (~4 min)
    .venv/bin/python -m bench.model.start_reads --old-tree /tmp/before   # also a tree of an earlier commit
    .venv/bin/python -m bench.model.start_reads --shape small            # a 55 MB base: what the test runs

An earlier commit's tree: ``git archive <commit> | tar -x -C /tmp/before``; its package shadows
this one's for the workers (PYTHONPATH), the worker itself is this file's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[2]  # not bench.common's: the workers run this file as a script
SMALL: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
SHARD_SIZE = {"small": "20MB", "0.5b": "300MB"}  # several files either way, as real bases come


def shape_of(name: str) -> dict[str, Any]:
    if name == "small":
        return SMALL
    sys.path.insert(0, str(REPO))
    from bench.common import QWEN2_5_0_5B  # Qwen2.5-0.5B's config.json

    return QWEN2_5_0_5B


def save_base(shape: dict[str, Any], folder: Path, tokenizer_dir: Path, shard_size: str) -> Path:
    """A Qwen2 base of ``shape``, random weights in bf16 (as Qwen ships it), saved in several files."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from purrsight.model.llm import load_tokenizer

    model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=shard_size)
    load_tokenizer(tokenizer_dir).save_pretrained(folder)
    return folder


def on_tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs (or ramfs), where reads reach no storage and count nothing."""
    best, kind = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount, fstype = fields[4], fields[fields.index("-") + 1]
        if str(path.resolve()).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fstype
    return kind in ("tmpfs", "ramfs")


def per_rank_copies(base: Path, ranks: int) -> None:
    """``base`` as ``base/../rank-N`` for every rank (a copy of its own each: a page cache of its own)."""
    for rank in range(ranks):
        shutil.copytree(base, base.parent / f"rank-{rank}", dirs_exist_ok=True)


# ---------------------------------------------------------------- inside each rank (torchrun)


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes (a kernel without task I/O accounting)")


def headers(folder: Path) -> dict[str, dict[str, Any]]:
    """Every tensor of the folder's safetensors files: dtype, shape, data_offsets (read here, not
    through the code measured)."""
    tensors: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            tensors.update({k: v for k, v in json.loads(stream.read(length)).items() if k != "__metadata__"})
    return tensors


def shard_bytes(tensors: dict[str, dict[str, Any]], rank: int, world: int) -> int:
    """The bytes of the rows FSDP2 gives ``rank`` of each tensor (dim 0 split as torch.chunk)."""
    total = 0
    for entry in tensors.values():
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        shape = entry["shape"]
        if not shape:
            total += size
            continue
        chunk = math.ceil(shape[0] / world)
        start = min(rank * chunk, shape[0])
        total += (min(start + chunk, shape[0]) - start) * size // shape[0]
    return total


def drop_from_cache(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # a dirty page stays cached whatever DONTNEED says: the copy was just written
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def count_sample_digests() -> list[int]:
    """How often this rank computes the weight files' fingerprint sample: [count], or [] in a tree without one."""
    from purrsight.model import weight_files

    files = getattr(weight_files, "WeightFiles", None)
    digest = getattr(files, "sample_digest", None)
    if files is None or digest is None:
        return []
    calls = [0]

    def counted(self: Any) -> str:
        calls[0] += 1
        return cast(str, digest(self))

    files.sample_digest = counted
    return calls


def worker(root: Path, synthetic: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from purrsight.config import load_config
    from purrsight.training.fsdp import build_sharded

    digests = count_sample_digests()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    llm = root / f"rank-{rank}"
    overrides = [f"data.synthetic_dir={synthetic}", f"data.train_index={synthetic}/train.jsonl"]
    overrides += [f"data.val_index={synthetic}/val.jsonl", f"model.llm.path={llm}", "model.llm.config=null"]
    # The default config of the tree whose package runs (an earlier tree knows fewer keys).
    import purrsight

    tree_config = Path(purrsight.__file__).resolve().parent.parent / "config" / "train_config.yaml"
    config = load_config(tree_config, [*overrides, f"run.output_dir={root / 'runs'}"])
    tensors = headers(llm)
    base = sum(path.stat().st_size for path in llm.glob("*.safetensors"))
    dist.barrier()
    drop_from_cache(llm)
    dist.barrier()
    before, started, cpu = read_bytes(), time.monotonic(), time.process_time()
    built, _ = build_sharded(config, torch.bfloat16, mesh, torch.device("cpu"))
    row = {
        "rank": rank,
        "read": read_bytes() - before,
        "shard": shard_bytes(tensors, rank, world),
        "base": base,
        "wall_s": round(time.monotonic() - started, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
        "fingerprint": built.fingerprint,
        "sample_digests": digests[0] if digests else None,  # None: a tree without them (before version 3)
    }
    # A file per rank, not a line on the shared stdout: two ranks' lines once arrived glued into one.
    (root / f"reads-rank{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


# ---------------------------------------------------------------- the driver


def measure(root: Path, synthetic: Path, ranks: int, tree: Path | None = None) -> list[dict[str, Any]]:
    """One torchrun job of ``ranks`` workers; each rank's row, by rank."""
    from bench.common import PYTHON, bench_env, free_port

    env = bench_env()
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{env['PYTHONPATH']}"
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(free_port()), __file__, "--worker", str(root), str(synthetic)]
    for stale in root.glob("reads-rank*.json"):
        stale.unlink()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"exit {done.returncode}\n{done.stderr[-3000:]}")
    rows = [json.loads(path.read_text()) for path in root.glob("reads-rank*.json")]
    return sorted(rows, key=lambda row: row["rank"])


def prepare(work: Path, shape: str, ranks: int) -> tuple[Path, Path]:
    """The synthetic set and a base of ``shape`` copied once per rank, under ``work``."""
    from purrsight.data.synthetic import generate

    synthetic = generate(work / "synthetic", 128, 32, 0, 32)
    base = save_base(shape_of(shape), work / "base", synthetic / "tokenizer", SHARD_SIZE[shape])
    per_rank_copies(base, ranks)
    return work, synthetic


def table(label: str, rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        extra = (row["read"] - row["shard"]) / row["base"]
        lines.append(
            f"| {label} | {row['rank']} | {row['base'] / 2**20:.1f} | {row['shard'] / 2**20:.1f} | {row['read'] / 2**20:.1f} "
            f"| {100 * row['read'] / row['base']:.1f}% | {100 * extra:+.1f}% | {row['wall_s']} | {row['cpu_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHARD_SIZE), default="0.5b")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--old-tree", type=Path, help="also measure the package in this folder (an earlier commit's tree)")
    parser.add_argument("--work-dir", type=Path, help="for the copies (default: the temp folder); not a tmpfs: it reads no storage")
    args = parser.parse_args()
    from bench.common import machine

    print(f"# {machine()}; {time.strftime('%Y-%m-%d')}; {args.ranks} ranks, gloo, bf16 base of shape {args.shape}")
    print("| tree | rank | base MiB | shard MiB | read MiB | read / base | read - shard, of base | wall s | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        if on_tmpfs(Path(tmp)):
            raise SystemExit(f"{tmp} is on a tmpfs, where reads count no storage: pass --work-dir on a disk")
        root, synthetic = prepare(Path(tmp), args.shape, args.ranks)
        trees: list[tuple[str, Path | None]] = [("this", None)]
        if args.old_tree is not None:
            trees.append(("old", args.old_tree))
        for label, tree in trees:
            print(table(label, measure(root, synthetic, args.ranks, tree)), flush=True)


if __name__ == "__main__":
    main()
