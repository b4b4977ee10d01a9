"""Padding and samples/s with and without ``data.group_by_length``, on LLaVA-Instruct-shaped lengths.

Lengths (text tokens a sample): a mixture like LLaVA-Instruct-665K's, generated here: 40% short
VQA-style answers (log-normal, median 60 tokens, sigma 0.5) and 60% conversations (log-normal,
median 320, sigma 0.7), clipped to 16..2048 (data.max_length). The epoch's order is our sampler's,
plain and grouped (data/sampler.py), consumed as the trainer consumes it:
every rank's micro-batch is ``batch`` samples at stride ``world``.

Measured, per shape:
- padding: padded positions / all positions of every rank's micro-batches over one epoch (exact);
- samples/s: one transformer layer (d_model 128, 4 heads, key-padding mask), forward and backward
  on the CPU over ``--timed`` micro-batches of rank 0 spread across the epoch, plain and grouped in
  turn. Its cost grows with the padded batch as a real LLM's does (linear layers in L, attention
  in L^2); the ratio is what transfers, not the number.

    .venv/bin/python -m bench.data.length_groups                 # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench.common import machine
from purrsight.data.sampler import GlobalPositionSampler


def llava_like_lengths(size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = rng.random(size) < 0.4
    lengths = np.where(short, rng.lognormal(np.log(60), 0.5, size), rng.lognormal(np.log(320), 0.7, size))
    return np.clip(np.round(lengths), 16, 2048).astype(np.int64)


def rank_batches(order: list[int], size: int, world: int, batch: int, rank: int) -> list[list[int]]:
    """Rank ``rank``'s micro-batches of one epoch from position 0 (the sampler's slicing)."""
    mine = order[rank : (size // world) * world : world]
    return [mine[i : i + batch] for i in range(0, len(mine) - batch + 1, batch)]


def padding_share(order: list[int], lengths: np.ndarray, world: int, batch: int) -> float:
    padded = total = 0
    for rank in range(world):
        for members in rank_batches(order, len(order), world, batch, rank):
            longest = int(lengths[members].max())
            total += longest * len(members)
            padded += longest * len(members) - int(lengths[members].sum())
    return padded / total


def samples_per_s(batches: list[list[int]], lengths: np.ndarray, layer: torch.nn.Module) -> float:
    start = time.perf_counter()
    count = 0
    for members in batches:
        rows = lengths[members]
        longest = int(rows.max())
        x = torch.randn(len(members), longest, 128)
        mask = torch.arange(longest)[None, :] >= torch.as_tensor(rows)[:, None]  # True: padding
        layer(x, src_key_padding_mask=mask).float().pow(2).mean().backward()
        count += len(members)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000, help="Samples in the set (one epoch measured).")
    parser.add_argument("--shapes", default="8x16,16x8,64x4", help="world x batch per rank, comma-separated.")
    parser.add_argument("--group-size", type=int, default=256, help="data.length_group_size")
    parser.add_argument("--window", type=int, default=64, help="data.length_group_window")
    parser.add_argument("--timed", type=int, default=24, help="Micro-batches of rank 0 timed per order.")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    lengths = llava_like_lengths(args.samples, seed=0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
    layer.train()
    results = []
    for shape in args.shapes.split(","):
        world, batch = (int(part) for part in shape.split("x"))
        orders = {}
        for name, grouped in (("plain", None), ("grouped", lengths)):
            sampler = GlobalPositionSampler(args.samples, world, 0, 1234, grouped, args.group_size, args.window)
            orders[name] = sampler.epoch_order()
        row: dict[str, object] = {"world": world, "batch": batch}
        for name, order in orders.items():
            row[f"{name}_padding"] = round(padding_share(order, lengths, world, batch), 4)
        for name, order in orders.items():
            batches = rank_batches(order, args.samples, world, batch, 0)
            picked = [batches[i] for i in np.linspace(0, len(batches) - 1, args.timed).astype(int)]
            samples_per_s(picked[:2], lengths, layer)  # warm-up
            row[f"{name}_samples_per_s"] = round(samples_per_s(picked, lengths, layer), 1)
        results.append(row)
        print(json.dumps(row), flush=True)
    spread = np.percentile(lengths, [5, 50, 95]).tolist()
    print(json.dumps({"lengths_p5_p50_p95": spread, "mean": float(lengths.mean()), "machine": machine()}))


if __name__ == "__main__":
    main()
