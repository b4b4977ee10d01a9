"""The real-size model on one GPU: tokens/s, MFU and peak memory at sequence lengths 512 and 1024.

Builds config/qwen2.5-0.5b.yaml's model, randomly initialised from bench/common.py's
config dicts, through build_model as training does (frozen SigLIP and wav2vec2 towers,
projectors, LoRA r=16 on every linear layer, gradient checkpointing as configured), and
trains it on random batches already on the GPU as the trainer's bf16-mixed does: frozen
weights held in bf16, LoRA and projectors in fp32 under bf16 autocast; the trainer's AdamW
(fused on GPUs) and gradient clipping, batch 8 per GPU, 5 s of audio and a 224-px image per
sample. Loading data is left out (bench/data/data_pipeline.py). --compile compiles the decoder layers,
projectors and loss as trainer.compile=true does; the first step's time (compilation included) is reported.

MFU = text tokens/s x FLOPs per token / peak, with telemetry's FLOPs count (LLM only; the
frozen towers' forward adds about 2% at 1024 tokens) and its peak table.

    .venv/bin/python -m bench.gpu.gpu_throughput            # on a GPU machine, from the repository root
    .venv/bin/python -m bench.gpu.gpu_throughput model.llm.gradient_checkpointing=false data.batch_size=16
    .venv/bin/python -m bench.gpu.gpu_throughput --compile  # trainer.compile=true
    .venv/bin/python -m bench.gpu.gpu_throughput --preset 7b --seq-lens 1024  # config/qwen2.5-7b.yaml's model
    .venv/bin/python -m bench.gpu.gpu_throughput --smoke    # the tiny default on CPU: checks the script runs
    .venv/bin/python -m bench.gpu.gpu_throughput --cpu --seq-lens 64 [--compile]  # the tiny default on CPU, timed

Target: MFU >= 40% on an H100.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    QWEN2_5_0_5B,
    QWEN2_5_7B,
    REAL_CONFIG,
    REPO,
    SIGLIP_BASE_224,
    TINY_CONFIG,
    random_init_overrides,
    synchronize,
    synthetic_tokenizer,
)
from purrsight.config import Config, load_config
from purrsight.estimate.auto_fit import auto_choice, with_choices
from purrsight.estimate.memory import estimate
from purrsight.model.llm import leave_lora_casts_to_autocast
from purrsight.model.lora_compute_copies import installed_compute_copies, use_adapter_compute_copies
from purrsight.model.multimodal import PurrSightModel
from purrsight.observability.flops import gpu_peak_tflops, model_flops_per_token
from purrsight.training.auto_settings import device_memory
from purrsight.training.model_builder import build_model, compile_trainable_path, frozen_dtype, padded_shapes
from purrsight.training.optim import build_optimizer


def random_batch(config: Config, model: PurrSightModel, batch: int, seq_len: int, device: torch.device) -> dict[str, Any]:
    vocab = model.llm.get_input_embeddings().num_embeddings
    image_size = SIGLIP_BASE_224["image_size"] if config.model.image_encoder.model_type == "siglip" else config.data.image_size
    input_ids = torch.randint(0, vocab, (batch, seq_len), device=device)
    return {
        "input_ids": input_ids,
        "labels": input_ids.clone(),  # every token scored: the loss covers the whole sequence
        "attention_mask": torch.ones_like(input_ids),
        "image": torch.randn(batch, 3, image_size, image_size, device=device),
        "has_image": torch.ones(batch, dtype=torch.bool, device=device),
        "image_rows": torch.arange(batch, device=device),
        "audio": torch.randn(batch, round(config.data.audio_sample_rate * config.data.audio_seconds), device=device),
        "has_audio": torch.ones(batch, dtype=torch.bool, device=device),
        "audio_rows": torch.arange(batch, device=device),
        "padded": False,  # full-length rows, every modality: SDPA runs causal without a mask
        "num_skipped": 0,
        "num_samples": batch,
        "num_tokens": batch * seq_len,
        "ids": [str(i) for i in range(batch)],
    }


PRESETS = {"0.5b": (REAL_CONFIG, QWEN2_5_0_5B), "7b": (REPO / "config" / "qwen2.5-7b.yaml", QWEN2_5_7B)}


def settle_auto(config: Config, seq_len: int, device: torch.device) -> Config:
    """``auto`` settings chosen as training chooses them on this device (one process), for ``seq_len``."""
    if not config.left_auto:
        return config
    memory, name = device_memory("gpu" if device.type == "cuda" else "cpu")
    priced = config.model_copy(update={"data": config.data.model_copy(update={"max_length": seq_len})})
    choice = auto_choice(priced, 1, memory, name, "bf16-mixed" if device.type == "cuda" else "32-true")
    print("\n".join(choice.lines()), flush=True)
    return with_choices(config, choice.batch_size, choice.gradient_checkpointing)


def build(
    preset: str | None, overrides: list[str], device: torch.device, seq_len: int, compiled: bool = False
) -> tuple[Config, PurrSightModel]:
    """A preset's model (``None``: the tiny default's), random-initialised from its config dicts,
    on ``device``, its frozen weights in the dtype training holds them in there, its LoRA adapters
    set up as the trainer sets them up for ``compiled`` or eager; settings left auto chosen for
    ``seq_len`` tokens."""
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        tokenizer = synthetic_tokenizer(Path(tmp) / "synthetic")
        if preset is None:
            path, options = TINY_CONFIG, [f"model.llm.tokenizer={tokenizer}"]
        else:
            path, llm = PRESETS[preset]
            options = random_init_overrides(tokenizer, llm)
        config = settle_auto(load_config(path, [*options, *overrides], check_paths=False), seq_len, device)
        precision = "bf16-mixed" if device.type == "cuda" else "32-true"  # make_step's autocast
        model = build_model(config, frozen_dtype(precision)).model
        leave_lora_casts_to_autocast(model, precision)  # as the trainer builds it (training/module.py)
        if not compiled:
            use_adapter_compute_copies(model, precision)
        return config, model.to(device)


def estimate_bytes(preset: str, overrides: list[str], seq_len: int) -> int:
    """The estimate's ddp figure for one GPU at exactly what ``measure`` trains (bench/model/estimate_vs_gpu.py)."""
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        path, llm = PRESETS[preset]
        options = [*random_init_overrides(synthetic_tokenizer(Path(tmp) / "synthetic"), llm), *overrides]
        config = load_config(path, [*options, f"data.max_length={seq_len}", "trainer.precision=bf16-mixed"], check_paths=False)
        return estimate(config, 1).per_gpu["ddp"].total


def write_rows(
    path: Path, preset: str, compiled: bool, graphs: bool, batch: int, results: list[dict[str, float]], estimates: list[int]
) -> None:
    """Adds this run's rows to ``path`` (bench/gpu_session.sh gathers every run's rows in one file)."""
    table: dict[str, Any] = (
        json.loads(path.read_text())
        if path.exists()
        else {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    )
    for result, estimated in zip(results, estimates, strict=True):
        row = {"preset": preset, "compile": compiled, "seq_len": result["seq_len"], "batch": batch, "mfu": result["mfu"]}
        row |= {"cuda_graphs": graphs}
        row |= {"step_s": result["step_s"], "first_step_s": result["first_step_s"], "tokens_per_s": result["tokens_per_s"]}
        row |= {"peak_bytes": int(result["peak_mem_gib"] * 2**30), "estimate_bytes": estimated}
        table["rows"].append(row)
    path.write_text(json.dumps(table, indent=2) + "\n")


def make_step(
    config: Config, model: PurrSightModel, data: dict[str, Any], optimizer: torch.optim.Optimizer, adapter_copies: bool = True
) -> Callable[[], None]:
    """One optimizer step as the trainer takes it: bf16 autocast on a GPU, clipping, AdamW.
    ``adapter_copies=False``: autocast casts each LoRA weight at each use, as before the copies
    (model/lora_compute_copies.py), for a side-by-side measure of what they give."""
    device = next(model.parameters()).device
    trainable = model.trainable_parameters()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    clip = config.trainer.gradient_clip_val
    graphs = config.trainer.cuda_graphs
    copies = installed_compute_copies(model) if adapter_copies else None

    def step() -> None:
        if graphs:  # a new iteration for the graph trees, as the trainer marks each micro-batch
            torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            if copies is not None:  # the adapters' bf16 copies, one cast a layer (training/module.py)
                copies.refresh(device.type)
            loss = model(data).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if copies is not None:
            copies.release()

    return step


def measure(
    config: Config, model: PurrSightModel, seq_len: int, batch: int, steps: int, warmup: int, device: torch.device
) -> dict[str, float]:
    optimizer, _ = build_optimizer(model.trainable_parameters(), config.optim, steps + warmup)
    data = random_batch(config, model, batch, seq_len, device)
    step = make_step(config, model, data, optimizer)
    first = time.perf_counter()
    step()
    synchronize(device)
    first_step_s = time.perf_counter() - first
    for _ in range(warmup - 1):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    elapsed = time.perf_counter() - start
    tokens_per_s = batch * seq_len * steps / elapsed
    prefix = config.model.prefix_tokens * 2
    per_token = model_flops_per_token(model, seq_len + prefix) or 0.0
    peak = config.telemetry.peak_tflops or gpu_peak_tflops()
    return {
        "seq_len": seq_len,
        "step_s": elapsed / steps,
        "first_step_s": first_step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": per_token * tokens_per_s / (peak * 1e12) if peak else float("nan"),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. data.batch_size=16")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="0.5b", help="the preset's model, random-initialised")
    parser.add_argument("--compile", action="store_true", help="compile as trainer.compile=true does")
    parser.add_argument("--smoke", action="store_true", help="tiny default on CPU, 2 steps: checks the script, measures nothing")
    parser.add_argument("--cpu", action="store_true", help="tiny default on CPU, timed (compile's gain where no GPU is)")
    parser.add_argument("--json", type=Path, help="add this run's rows, with the estimate's figure for each, to this file (a GPU)")
    args = parser.parse_args()
    if args.smoke:
        args.cpu, args.seq_lens, args.steps, args.warmup = True, [16, 32], 2, 1
    elif not args.cpu and not torch.cuda.is_available():
        raise SystemExit("bench.gpu.gpu_throughput: no CUDA device; run it on a GPU machine (or --cpu / --smoke on CPU)")
    device = torch.device("cpu" if args.cpu else "cuda")

    config, model = build(None if args.cpu else args.preset, args.overrides, device, max(args.seq_lens), args.compile)
    if args.compile:  # as the trainer does (training/module.py)
        compile_trainable_path(model, padded_shapes(config), cuda_graphs=config.trainer.cuda_graphs)
    model.train()
    results = []
    for seq in args.seq_lens:  # printed as measured: a length that runs out of memory leaves the others' figures
        results.append(measure(config, model, seq, config.data.micro_batch, args.steps, args.warmup, device))
        print(f"measured {seq} tokens: {results[-1]}", flush=True)

    name = (
        torch.cuda.get_device_name(0)
        if device.type == "cuda"
        else "CPU, tiny default" + (" (smoke run: figures mean nothing)" if args.smoke else "")
    )
    llm = sum(p.numel() for p in model.llm.parameters()) / 1e6
    print(f"device: {name}; torch {torch.__version__}; {datetime.date.today()}")
    print(
        f"LLM {llm:.0f}M parameters; batch {config.data.micro_batch}; compile {args.compile}; "
        f"{args.steps} timed steps after {args.warmup} warm-up\n"
    )
    print("| seq len | first step (s) | step (s) | tokens/s | MFU | peak memory (GiB) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['seq_len']} | {r['first_step_s']:.2f} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} "
            f"| {r['peak_mem_gib']:.1f} |"
        )
    if args.json and device.type == "cuda":
        chosen = [
            f"data.batch_size={config.data.micro_batch}",
            f"model.llm.gradient_checkpointing={config.model.llm.checkpointing}",
        ]
        estimates = [estimate_bytes(args.preset, [*args.overrides, *chosen], int(r["seq_len"])) for r in results]
        write_rows(args.json, args.preset, args.compile, config.trainer.cuda_graphs, config.data.micro_batch, results, estimates)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
