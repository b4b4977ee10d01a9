"""The loss's chunk scorer, eager against compiled (``trainer.compile``), side by side in one process.

The head's matmul, the fp32 log-softmax, the loss and the gradient of the logits, chunk by chunk
(purrsight/model/linear_cross_entropy.py), forward and backward, at the 0.5B preset's head
(hidden 896, vocabulary 151,936) by default. Eager, each chunk is some fifteen kernels, most of
them passes over the chunk's fp32 logits (441 rows x 151,936: 268 MB); compiled, inductor fuses
the passes. The two alternate, each timed at its best of ``--repeats``, after two warm-up calls
(the compilation, and the recompilation a batch's shorter last chunk brings).

    .venv/bin/python -m bench.gpu.loss_scorer                   # CPU, the 0.5B head, 882 rows
    .venv/bin/python -m bench.gpu.loss_scorer --hidden 64       # narrow: the passes dominate
    python3 -m bench.gpu.loss_scorer --device cuda --rows 8192  # on a GPU (bench/gpu_session.sh)
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import synchronize
from purrsight.labels import IGNORE_INDEX
from purrsight.model.linear_cross_entropy import Scorer, chunk_rows, compiled_scorer, linear_cross_entropy, score_chunk


def seconds_per_call(score: Scorer, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> float:
    """One forward and backward of the chunked loss, in seconds (the device synchronised)."""
    start = time.perf_counter()
    hidden.grad = None
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=hidden.device.type == "cuda"):
        loss, _ = linear_cross_entropy(hidden, weight, targets, rows, False, score)
    loss.backward()
    synchronize(hidden.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda [cpu]")
    parser.add_argument("--hidden", type=int, default=896, help="the LLM's hidden size [896: Qwen2.5-0.5B]")
    parser.add_argument("--vocab", type=int, default=151_936, help="the vocabulary [151,936: Qwen2.5-0.5B]")
    parser.add_argument("--rows", type=int, default=882, help="positions scored (a third unlabelled) [882: two chunks]")
    parser.add_argument("--repeats", type=int, default=4, help="timed calls of each, alternating [4]")
    args = parser.parse_args()

    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.02).to(device)
    targets = torch.randint(0, args.vocab, (args.rows,), generator=generator)
    targets[::3] = IGNORE_INDEX
    targets = targets.to(device)
    rows = chunk_rows(args.vocab)
    scorers = {"eager": score_chunk, "compiled": compiled_scorer()}
    for score in scorers.values():
        for _ in range(2):
            seconds_per_call(score, hidden, weight, targets, rows)
    times: dict[str, list[float]] = {name: [] for name in scorers}
    for _ in range(args.repeats):
        for name, score in scorers.items():
            times[name].append(seconds_per_call(score, hidden, weight, targets, rows))
    best = {name: min(values) for name, values in times.items()}
    print(f"loss scorer on {device.type}, hidden {args.hidden}, vocabulary {args.vocab:,}, {args.rows} rows in chunks of {rows}:")
    eager, compiled = best["eager"], best["compiled"]
    print(f"  eager {eager * 1e3:.1f} ms, compiled {compiled * 1e3:.1f} ms: {eager / compiled:.2f}x")


if __name__ == "__main__":
    main()
