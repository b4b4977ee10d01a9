"""The data pipeline alone: samples/s per loader worker against what one GPU consumes.

Generates 224-px JPEGs and 1 s 16 kHz WAV clips, then reads them through the real-size
path: config/qwen2.5-0.5b.yaml's data settings, a SigLIP image processor and a wav2vec2
feature extractor loaded from local directories (saved here from their defaults: nothing
is downloaded), our dataset and collator in a torch DataLoader. The tokenizer is the
synthetic set's (Qwen's is not available offline; tokenizing is a small share of a sample).

What one GPU consumes: samples/s = MFU x peak / training FLOPs per sample, for an H100
(989 bf16 TFLOP/s) at the 40% MFU target, FLOPs from bench/real_size.py.

    .venv/bin/python -m bench.data_pipeline --repeats 3   # from the repository root

Target: samples/s per worker >= 5 x one GPU's consumption.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image
from torch.utils.data import DataLoader

from bench.common import machine
from bench.real_size import REAL_CONFIG, synthetic_tokenizer, training_flops_per_sample
from purrsight.config import load_config
from purrsight.data.dataset import Collator, MultiModalDataset
from purrsight.training.datasets import build_datasets
from purrsight.training.telemetry import PEAK_TFLOPS

TARGET_MFU = 0.40
SAMPLE_RATE = 16000


def write_samples(folder: Path, count: int, seed: int = 0) -> Path:
    """Photo-like JPEGs (smooth shapes plus sensor noise, ~20 KB) and noisy tones; the index."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True)
    (folder / "audio").mkdir()
    lines = []
    for i in range(count):
        coarse = rng.integers(0, 256, size=(7, 7, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((224, 224), Image.Resampling.BICUBIC), dtype=np.int16)
        noisy = np.clip(smooth + rng.normal(0, 6, smooth.shape), 0, 255).astype(np.uint8)
        Image.fromarray(noisy).save(folder / "images" / f"{i}.jpg", quality=90)
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
                    "audio": f"audio/{i}.wav",
                }
            )
        )
    index = folder / "train.jsonl"
    index.write_text("\n".join(lines) + "\n")
    return index


def save_processors(folder: Path) -> tuple[Path, Path]:
    """SigLIP-base's image processor and wav2vec2-base's feature extractor, from their defaults."""
    from transformers import SiglipImageProcessor, Wav2Vec2FeatureExtractor

    image_dir, audio_dir = folder / "siglip", folder / "wav2vec2"
    SiglipImageProcessor(size={"height": 224, "width": 224}).save_pretrained(image_dir)
    Wav2Vec2FeatureExtractor(return_attention_mask=False, do_normalize=True).save_pretrained(audio_dir)
    return image_dir, audio_dir


def loader_rate(dataset: MultiModalDataset, collator: Collator, workers: int, batch_size: int, batches: int) -> float:
    """Samples/s once the workers have started (the first batch is not timed)."""
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collator, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, default=40, help="timed batches per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        index = write_samples(work / "data", args.samples)
        image_dir, audio_dir = save_processors(work)
        config = load_config(
            REAL_CONFIG,
            [
                f"data.train_index={index}",
                "data.val_index=null",
                "data.audio_seconds=1.0",
                f"model.llm.tokenizer={synthetic_tokenizer(work / 'synthetic')}",
                f"model.image_encoder.path={image_dir}",
                f"model.audio_encoder.path={audio_dir}",
            ],
            check_paths=False,
        )
        data = build_datasets(config, world_size=1)
        batch = config.data.batch_size
        rates = {
            w: [loader_rate(data.train, data.collator, w, batch, args.batches) for _ in range(args.repeats)] for w in args.workers
        }

    flops = training_flops_per_sample(
        config.data.max_length,
        2 * config.model.prefix_tokens,
        config.model.llm.lora.r,
        list(config.model.llm.lora.target_modules),
        audio_s=1.0,
    )
    gpu_rate = TARGET_MFU * PEAK_TFLOPS["H100"] * 1e12 / flops
    print(f"machine: {machine()}")
    print(f"{args.samples} samples (224-px JPEG + 1 s WAV), batch {batch}, {args.batches} timed batches, {args.repeats} repeats")
    print(f"one H100 at {TARGET_MFU:.0%} MFU consumes {gpu_rate:.1f} samples/s ({flops / 1e12:.2f} TFLOP per sample)\n")
    print("| loader workers | samples/s (median) | per worker | per worker / GPU consumption |")
    print("|---|---|---|---|")
    for workers, values in rates.items():
        rate = statistics.median(values)
        per_worker = rate / workers
        print(f"| {workers} | {rate:.1f} | {per_worker:.1f} | {per_worker / gpu_rate:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
