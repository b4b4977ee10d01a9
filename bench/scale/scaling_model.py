"""The numbers of docs/SCALING.md for 128 nodes x 8 GPUs, from counts, measurements and published models.

Counted: the real-size model's trainable parameters (config/qwen2.5-0.5b.yaml built from
the published architecture configs, random weights; bench/common.py). Measured: the
time our checkpoint writer (purrsight.runs.checkpoint_saver.AtomicCheckpointIO) takes for a
checkpoint of that size on ``--checkpoint-dir``. Modelled:

- gradient all-reduce: NCCL's own cost model, time = latency + bytes / algorithm bandwidth
  (src/graph/tuning.cc: the Simple protocol's base and per-hop latencies, ring
  2(p-1) steps of which 2(n-1) cross the network, tree 2((p/n - 1) intra + log2 n inter)
  hops; ring algorithm bandwidth = bus bandwidth x p / 2(p-1), tree = bus bandwidth / 2),
  at the NIC line rate per node (one NIC per node; rail-optimised nodes with one NIC per
  GPU divide the bandwidth term by 8);
- failures: 419 unexpected interruptions in 54 days on 16,384 H100 GPUs (Llama 3 paper,
  Dubey et al. 2024, section 3.3.4), as a rate per GPU-day;
- checkpoint interval: Young (1974) tau = sqrt(2 C M), with Daly's (2006) correction
  tau = sqrt(2 C M) - C, C the checkpoint cost and M the mean time between failures.

    .venv/bin/python -m bench.scale.scaling_model            # repository root; ~1 min, 4 GB of memory
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

NODES, GPUS_PER_NODE = 128, 8
# NCCL src/graph/tuning.cc, Simple protocol, microseconds: base latency by algorithm, per-hop by link.
BASE_LAT_US = {"ring": 8.4, "tree": 0.0}
HOP_LAT_US = {("ring", "nvlink"): 3.4, ("ring", "net"): 9.6, ("tree", "nvlink"): 28.0, ("tree", "net"): 50.0}
RING_PLATEAU = 1.9  # the same file: large multi-node ring all-reduces take 1.9x the modelled latency
LLAMA3_UNEXPECTED, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
H100_BF16_TFLOPS, MFU = 989.0, 0.40
TFLOP_PER_SAMPLE = 2.56  # bench/results/data.md, "Data pipeline": LLM + frozen towers, 1024 + 64 tokens


@dataclass(frozen=True)
class AllReduce:
    algorithm: str
    latency_s: float
    bandwidth_s: float

    @property
    def total_s(self) -> float:
        return self.latency_s + self.bandwidth_s


def allreduce_time(algorithm: str, size_bytes: float, link_gbps: float, nodes: int, per_node: int) -> AllReduce:
    """One all-reduce of ``size_bytes`` over ``nodes`` x ``per_node`` GPUs, NCCL's model, one NIC per node."""
    ranks = nodes * per_node
    bus_bytes_per_s = link_gbps * 1e9 / 8
    if algorithm == "ring":
        steps, inter_steps = 2 * (ranks - 1), 2 * (nodes - 1)
        hops_us = (steps - inter_steps) * HOP_LAT_US[("ring", "nvlink")] + inter_steps * HOP_LAT_US[("ring", "net")]
        latency_us = (BASE_LAT_US["ring"] + hops_us) * RING_PLATEAU
        algorithm_bw = bus_bytes_per_s * ranks / steps
    else:
        hops_us = 2 * ((per_node - 1) * HOP_LAT_US[("tree", "nvlink")] + math.log2(nodes) * HOP_LAT_US[("tree", "net")])
        latency_us = BASE_LAT_US["tree"] + hops_us
        algorithm_bw = bus_bytes_per_s * 0.9 / 2  # NCCL's tree runs at 0.9 of the bus bandwidth
    return AllReduce(algorithm, latency_us * 1e-6, size_bytes / algorithm_bw)


def per_step_allreduce(grad_bytes: float, bucket_mb: float, link_gbps: float, algorithm: str) -> float:
    """Seconds of all-reduce per optimizer step: DDP sends the gradients in buckets of ``bucket_mb``."""
    buckets = math.ceil(grad_bytes / (bucket_mb * 2**20))
    return buckets * allreduce_time(algorithm, grad_bytes / buckets, link_gbps, NODES, GPUS_PER_NODE).total_s


def preflight_s(mode: str, link_gbps: float) -> float:
    """The preflight all-reduce's collectives at 128 x 8 (tree): each size once to warm up, then timed iterations.

    Each iteration also holds two barriers (small all-reduces: latency only). NCCL's
    communicator set-up, paid by the first collective whoever issues it, is not included.
    """
    from purrsight.distributed.preflight import ITERATIONS, SIZES

    total = 0.0
    for size in SIZES[(mode, "cuda")]:
        reduce = allreduce_time("tree", size, link_gbps, NODES, GPUS_PER_NODE).total_s
        barrier = allreduce_time("tree", 4, link_gbps, NODES, GPUS_PER_NODE).total_s
        total += reduce + ITERATIONS[mode] * (reduce + 2 * barrier)
    return total


def young_daly(checkpoint_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * checkpoint_s * mtbf_s) - checkpoint_s


def trainable_parameters() -> tuple[int, int]:
    """(trainable, all) parameters of the real-size model, built on CPU with random weights."""
    from bench.common import REAL_CONFIG, random_init_overrides, synthetic_tokenizer
    from purrsight.config import load_config
    from purrsight.training.model_builder import build_model

    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        config = load_config(REAL_CONFIG, random_init_overrides(synthetic_tokenizer(Path(tmp))), check_paths=False)
        model = build_model(config).model
    trainable = sum(p.numel() for p in model.trainable_parameters())
    return trainable, sum(p.numel() for p in model.parameters())


def checkpoint_write_s(trainable: int, folder: Path) -> tuple[int, float]:
    """(bytes, seconds) of one checkpoint as ours holds it: fp32 weights + AdamW's two moments, atomic write."""
    from purrsight.runs.checkpoint_saver import AtomicCheckpointIO

    weights = torch.randn(trainable)
    moments = {"exp_avg": torch.randn(trainable), "exp_avg_sq": torch.rand(trainable)}
    state = {"state_dict": {"w": weights}, "optimizer_states": [moments]}
    target = folder / "scaling-model.ckpt"
    start = time.perf_counter()
    AtomicCheckpointIO().save_checkpoint(state, target)
    elapsed = time.perf_counter() - start
    size = target.stat().st_size
    target.unlink()
    return size, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path(tempfile.gettempdir()), help="where the write is timed")
    parser.add_argument("--trainable", type=int, help="skip building the model: this many trainable parameters")
    args = parser.parse_args()
    trainable, total = (args.trainable, 0) if args.trainable else trainable_parameters()
    grad_bytes = trainable * 4  # fp32 master weights under bf16-mixed: DDP reduces fp32 gradients
    print(f"trainable parameters: {trainable:,} of {total:,}; gradients per step {grad_bytes / 1e6:.0f} MB (fp32)")

    step_s = 8 * TFLOP_PER_SAMPLE / (H100_BF16_TFLOPS * MFU)  # batch 8 per GPU (config/qwen2.5-0.5b.yaml)
    print(f"compute per step at {MFU:.0%} MFU, batch 8: {step_s * 1e3:.0f} ms")
    print("\nall-reduce of one step's gradients, 128 nodes x 8 GPUs, one NIC per node (ms):")
    print("| link | ring, one call | tree, one call | 25 MB buckets, tree | 100 MB buckets, tree | accumulate 4, 25 MB, tree |")
    print("|---|---|---|---|---|---|")
    for gbps in (100, 200, 400):
        ring = allreduce_time("ring", grad_bytes, gbps, NODES, GPUS_PER_NODE)
        tree = allreduce_time("tree", grad_bytes, gbps, NODES, GPUS_PER_NODE)
        b25 = per_step_allreduce(grad_bytes, 25, gbps, "tree")
        b100 = per_step_allreduce(grad_bytes, 100, gbps, "tree")
        print(
            f"| {gbps} Gb/s | {ring.total_s * 1e3:.0f} ({ring.latency_s * 1e3:.1f} latency) | {tree.total_s * 1e3:.0f}"
            f" ({tree.latency_s * 1e3:.1f} latency) | {b25 * 1e3:.0f} | {b100 * 1e3:.0f} | {b25 / 4 * 1e3:.0f} |"
        )

    for mode in ("quick", "full"):
        costs = ", ".join(f"{gbps} Gb/s {preflight_s(mode, gbps):.2f} s" for gbps in (100, 200, 400))
        print(f"preflight all-reduce, mode {mode}: {costs}")

    size, write_s = checkpoint_write_s(trainable, args.checkpoint_dir)
    rate = size / write_s / 1e6
    print(f"\ncheckpoint: {size / 1e9:.2f} GB, written in {write_s:.1f} s on {args.checkpoint_dir} ({rate:.0f} MB/s)")

    gpus = NODES * GPUS_PER_NODE
    per_gpu_day = LLAMA3_UNEXPECTED / (LLAMA3_DAYS * LLAMA3_GPUS)
    failures_per_day = per_gpu_day * gpus
    mtbf_s = 86400 / failures_per_day
    print(f"\nfailures: {per_gpu_day:.2e} per GPU-day -> {failures_per_day:.2f} per day on {gpus} GPUs, MTBF {mtbf_s / 3600:.1f} h")
    for write in (write_s, 10.0, 60.0):
        tau = young_daly(write, mtbf_s)
        steps = tau / step_s
        print(f"  checkpoint cost {write:5.1f} s: interval {tau / 60:.1f} min = {steps:,.0f} steps at {step_s * 1e3:.0f} ms/step")
    print(f"\n(cpu count here: {os.cpu_count()}; all figures above but the write time are independent of this machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
