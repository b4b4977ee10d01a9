"""Which library stores a prepared set: ``datasets``' memory-mapped Arrow shards or LitData's chunks.

The same samples written by each (224-px uint8 pictures, as SigLIP's processor leaves them
before normalising, plus token ids), then read back in a shuffled order by one process that
normalises each picture as training does. Measured side by side: write samples/s, size on
disk, read samples/s, and the reader's anonymous memory after a full pass (mapped files' page
cache not counted: it is shared by a node's ranks).

LitData is not a dependency of the project. Install it without its dependencies (it pulls a
CUDA build of torch and torchvision, which would replace the CPU torch):

    .venv/bin/pip install --no-deps litdata lightning-utilities boto3 obstore
    .venv/bin/python -m bench.data.prepared_formats --samples 4096
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import SiglipImageProcessor

from bench.common import anonymous_mib, machine, photograph
from purrsight.data.media import ImageDecoder
from purrsight.data.prepared import PreparedSplit, sample_row, write_shard

SHARD = 1024


def samples(count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    photo = np.asarray(photograph().resize((224, 224)), np.int16)
    rng = np.random.default_rng(0)
    made = []
    for _ in range(count):
        pixels = np.clip(photo + rng.normal(0, 4, photo.shape), 0, 255).astype(np.uint8).transpose(2, 0, 1).copy()
        made.append((pixels, rng.integers(0, 50000, size=int(rng.integers(64, 257)), dtype=np.int32)))
    return made


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def write_ours(data: list[tuple[np.ndarray, np.ndarray]], out: Path) -> list[dict[str, Any]]:
    (out / "train").mkdir(parents=True)
    shards = []
    for number, start in enumerate(range(0, len(data), SHARD)):
        rows = (
            sample_row(f"s{start + i}", i, ids.tolist(), ids.tolist(), torch.from_numpy(pixels), None)
            for i, (pixels, ids) in enumerate(data[start : start + SHARD])
        )
        name = f"train/shard-{number:05d}"
        shards.append({"name": name, "rows": write_shard(out / f"{name}.arrow", rows)})
    return shards


def _litdata_item(item: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    pixels, ids = item
    return {"image": pixels, "input_ids": ids}


def write_litdata(data: list[tuple[np.ndarray, np.ndarray]], out: Path) -> None:
    import litdata

    litdata.optimize(fn=_litdata_item, inputs=data, output_dir=str(out), chunk_bytes="128MB", num_workers=1, verbose=False)


def reencoded(data: list[tuple[np.ndarray, np.ndarray]], count: int = 256) -> dict[str, dict[str, float]]:
    """The other storage choice: each picture re-encoded (PNG lossless, JPEG quality 95), by size and read cost."""
    import io

    found = {}
    for name, options in (("PNG", {"format": "PNG"}), ("JPEG q95", {"format": "JPEG", "quality": 95})):
        encoded = []
        for pixels, _ in data[:count]:
            buffer = io.BytesIO()
            Image.fromarray(pixels.transpose(1, 2, 0)).save(buffer, **options)  # type: ignore[arg-type]
            encoded.append(buffer.getvalue())
        started = time.perf_counter()
        for blob in encoded:
            np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
        decode = (time.perf_counter() - started) / len(encoded)
        started = time.perf_counter()
        for pixels, _ in data[:count]:
            torch.from_numpy(np.frombuffer(pixels.tobytes(), np.uint8).reshape(pixels.shape).copy())
        copy = (time.perf_counter() - started) / count
        found[name] = {
            "bytes per picture": sum(map(len, encoded)) / len(encoded),
            "read us": decode * 1e6,
            "uint8 read us": copy * 1e6,
        }
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prepared-formats-"))
    decoder = ImageDecoder(SiglipImageProcessor(size={"height": 224, "width": 224}), 224)
    data = samples(args.samples)
    results: dict[str, dict[str, float]] = {}
    encodings = reencoded(data)
    try:
        started = time.perf_counter()
        shards = write_ours(data, work / "ours")
        ours_write = time.perf_counter() - started
        started = time.perf_counter()
        write_litdata(data, work / "litdata")
        litdata_write = time.perf_counter() - started
        del data

        before = anonymous_mib()
        split = PreparedSplit(work / "ours", shards, decoder, None)
        order = torch.randperm(len(split)).tolist()
        started = time.perf_counter()
        for i in order:
            decoder.finish(split[i].image)  # type: ignore[arg-type]  # normalised, as for LitData below (training does it on the GPU)
        results["datasets (Arrow, memory-mapped)"] = {
            "write samples/s": args.samples / ours_write,
            "MiB on disk": folder_bytes(work / "ours") / 2**20,
            "read samples/s": args.samples / (time.perf_counter() - started),
            "reader memory growth MiB": anonymous_mib() - before,
        }

        import litdata

        before = anonymous_mib()
        streaming = litdata.StreamingDataset(str(work / "litdata"), shuffle=True)
        started = time.perf_counter()
        count = 0
        for item in streaming:
            decoder.finish(torch.as_tensor(item["image"]))
            count += 1
        results["LitData (optimize + StreamingDataset)"] = {
            "write samples/s": args.samples / litdata_write,
            "MiB on disk": folder_bytes(work / "litdata") / 2**20,
            "read samples/s": count / (time.perf_counter() - started),
            "reader memory growth MiB": anonymous_mib() - before,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"machine: {machine()}; {args.samples} samples of 224-px uint8 + 64-256 tokens, one process\n")
    columns = ["write samples/s", "MiB on disk", "read samples/s", "reader memory growth MiB"]
    print("| store | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.0f}" for c in columns) + " |")
    print("\n| re-encoded picture | bytes (uint8: 150,528) | decode per picture, us | uint8 copy, us |")
    print("|---|---|---|---|")
    for name, row in encodings.items():
        print(f"| {name} | {row['bytes per picture']:.0f} | {row['read us']:.0f} | {row['uint8 read us']:.0f} |")
    print(json.dumps({"stores": results, "reencoded": encodings}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
