"""The data pipeline alone: samples/s per loader worker against what one GPU consumes.

Generates 224-px JPEGs and 1 s 16 kHz WAV clips, then reads them through the real-size
path: config/qwen2.5-0.5b.yaml's data settings, a SigLIP image processor and a wav2vec2
feature extractor loaded from local directories (saved here from their defaults: nothing
is downloaded), our dataset and collator in a torch DataLoader. The tokenizer is the
synthetic set's (Qwen's is not available offline; tokenizing is a small share of a sample).

What one GPU consumes: samples/s = MFU x peak / training FLOPs per sample, for an H100
(989 bf16 TFLOP/s) at the 40% MFU target, FLOPs from bench/common.py.

    .venv/bin/python -m bench.data.data_pipeline --repeats 3   # from the repository root

Target: samples/s per worker >= 5 x one GPU's consumption, and a 4000 x 3000 phone JPEG no
slower than 3 x a 224-px one. Side by side in one run, order rotated per repeat, one worker:

- ``processor``: the image processor called on each picture, JPEGs decoded whole, as before;
- ``ours``: the processor's own Pillow steps replayed (purrsight/data/pil_processing.py) and
  large JPEGs decoded at reduced scale (draft), as the trainer now does;

each on 224-px JPEGs and on 4000 x 3000 ones, plus ``ours`` with every clip cut from one
five-minute 44.1 kHz stereo recording (only the window used is read).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from bench.common import MEASURED_SETTINGS, REAL_CONFIG, TARGET_MFU, h100_consumption, machine, save_processors, synthetic_tokenizer
from purrsight.config import Config, load_config
from purrsight.data.dataset import Collator, MultiModalDataset, Sample
from purrsight.datasets.builder import Datasets, build_datasets

SAMPLE_RATE = 16000


def write_samples(folder: Path, count: int, seed: int = 0, size: tuple[int, int] = (224, 224), long_audio: bool = False) -> Path:
    """Photo-like JPEGs (smooth shapes plus sensor noise) and noisy tones, or clips of one long recording; the index."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True)
    (folder / "audio").mkdir()
    if long_audio:  # five minutes of 44.1 kHz stereo that every sample points at
        t = np.arange(44100 * 300) / 44100
        tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
        soundfile.write(folder / "audio" / "podcast.wav", np.stack([tone, tone], axis=1), 44100, subtype="PCM_16")
    lines = []
    for i in range(count):
        coarse = rng.integers(0, 256, size=(7, 7, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize(size, Image.Resampling.BICUBIC), dtype=np.int16)
        noisy = np.clip(smooth + rng.normal(0, 6, smooth.shape), 0, 255).astype(np.uint8)
        Image.fromarray(noisy).save(folder / "images" / f"{i}.jpg", quality=90)
        if not long_audio:
            t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
            wave = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 1000) * t) + 0.05 * rng.normal(size=t.shape)
            soundfile.write(folder / "audio" / f"{i}.wav", wave.astype(np.float32), SAMPLE_RATE, subtype="PCM_16")
        lines.append(
            json.dumps(
                {
                    "id": f"s{i}",
                    "prompt": f"Describe what you see and hear in clip {i}.",
                    "response": "A blurred coloured picture and a steady tone over soft noise. " * 4,
                    "image": f"images/{i}.jpg",
                    "audio": "audio/podcast.wav" if long_audio else f"audio/{i}.wav",
                }
            )
        )
    index = folder / "train.jsonl"
    index.write_text("\n".join(lines) + "\n")
    return index


def loader_rate(dataset: Dataset[Sample], collator: Collator, workers: int, batch_size: int, batches: int) -> float:
    """Samples/s once the workers have started (the first batch is not timed)."""
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collator, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size / (time.perf_counter() - start)


def corpus_config(work: Path, name: str, image_dir: Path, audio_dir: Path, batch_size: int | None, **kwargs: object) -> Config:
    index = write_samples(work / name, **kwargs)  # type: ignore[arg-type]
    batch = [*MEASURED_SETTINGS, *([f"data.batch_size={batch_size}"] if batch_size else [])]
    return load_config(
        REAL_CONFIG,
        [
            f"data.train_index={index}",
            "data.val_index=null",
            "data.audio_seconds=1.0",
            f"model.llm.tokenizer={synthetic_tokenizer(work / 'synthetic')}",
            f"model.image_encoder.path={image_dir}",
            f"model.audio_encoder.path={audio_dir}",
            *batch,
        ],
        check_paths=False,
    )


def processor_path(data: Datasets) -> Datasets:
    """The same datasets with the image decoder as it was: processor called, JPEGs decoded whole."""
    assert isinstance(data.train, MultiModalDataset)
    image = copy.copy(data.train.image)
    assert image is not None
    image.plan, image.draft_box = None, None
    train = copy.copy(data.train)
    train.image = image
    return Datasets(train, None, data.collator)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--large-samples", type=int, default=48, help="4000 x 3000 JPEGs (generating them takes a while)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, default=40, help="timed batches per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batch-size", type=int, default=None, help="samples per batch (default: the real config's data.batch_size)"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        image_dir, audio_dir = save_processors(work)
        config = corpus_config(work, "small", image_dir, audio_dir, args.batch_size, count=args.samples)
        ours = {
            "224 px": build_datasets(config, world_size=1),
            "4000x3000": build_datasets(
                corpus_config(work, "large", image_dir, audio_dir, args.batch_size, count=args.large_samples, size=(4000, 3000)),
                world_size=1,
            ),
            "224 px + 5-min audio": build_datasets(
                corpus_config(work, "long", image_dir, audio_dir, args.batch_size, count=args.samples, long_audio=True),
                world_size=1,
            ),
        }
        batch = config.data.micro_batch
        variants = {
            ("processor", "224 px"): processor_path(ours["224 px"]),
            ("ours", "224 px"): ours["224 px"],
            ("processor", "4000x3000"): processor_path(ours["4000x3000"]),
            ("ours", "4000x3000"): ours["4000x3000"],
            ("ours", "224 px + 5-min audio"): ours["224 px + 5-min audio"],
        }
        large_batches = max(1, min(args.batches, args.large_samples // batch - 1))
        side_by_side: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
        keys = list(variants)
        for repeat in range(args.repeats):
            for key in keys[repeat % len(keys) :] + keys[: repeat % len(keys)]:  # rotate the order per repeat
                batches = large_batches if key[1] == "4000x3000" else args.batches
                side_by_side[key].append(loader_rate(variants[key].train, variants[key].collator, 1, batch, batches))
        rates = {
            w: [loader_rate(ours["224 px"].train, ours["224 px"].collator, w, batch, args.batches) for _ in range(args.repeats)]
            for w in args.workers
        }

    flops, gpu_rate = h100_consumption(config)
    median = {key: statistics.median(values) for key, values in side_by_side.items()}
    print(f"machine: {machine()}")
    print(f"{args.samples} samples (224-px JPEG + 1 s WAV), batch {batch}, {args.batches} timed batches, {args.repeats} repeats")
    print(f"one H100 at {TARGET_MFU:.0%} MFU consumes {gpu_rate:.1f} samples/s ({flops / 1e12:.2f} TFLOP per sample)\n")
    print("| loader workers | samples/s (median) | per worker | per worker / GPU consumption |")
    print("|---|---|---|---|")
    for workers, values in rates.items():
        rate = statistics.median(values)
        per_worker = rate / workers
        print(f"| {workers} | {rate:.1f} | {per_worker:.1f} | {per_worker / gpu_rate:.2f} |")
    print("\nSide by side, one worker (samples/s, median):\n")
    print("| pictures | processor path (before) | ours | ours / before | ours / GPU consumption |")
    print("|---|---|---|---|---|")
    for picture in ("224 px", "4000x3000"):
        before, after = median[("processor", picture)], median[("ours", picture)]
        print(f"| {picture} | {before:.1f} | {after:.1f} | {after / before:.2f} | {after / gpu_rate:.2f} |")
    long_audio = median[("ours", "224 px + 5-min audio")]
    print(f"| 224 px + 5-min 44.1 kHz stereo audio | | {long_audio:.1f} | | {long_audio / gpu_rate:.2f} |")
    slowdown = median[("ours", "224 px")] / median[("ours", "4000x3000")]
    print(
        f"\na 4000x3000 JPEG costs {slowdown:.2f}x a 224-px one (target <= 3; the processor path: "
        f"{median[('processor', '224 px')] / median[('processor', '4000x3000')]:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
