"""Where one training step's time goes: the ops it issues, and, on a GPU, how long the GPU waits.

Two measures, one script:

- ``count`` (any machine): the aten ops the trainer dispatches per optimizer step, through the
  real trainer (training/run.py's ``train``: Lightning, our callbacks, the loss, AdamW, clipping),
  at the 0.5B preset's architecture made narrow so that compute is nothing: 24 decoder layers,
  14 heads and 2 KV heads (head width 2), LoRA r=16 with the preset's dropout on its seven
  projections, 32 prefix tokens a modality through per-token projectors, gradient checkpointing,
  bf16-mixed (on a CPU as on a GPU: autocast's casts are ops too), the tiny default's towers and
  data. Every op is one or more kernel launches on a GPU, and at this model's real size the host
  issuing them one by one is what bounds the step (bench/results/gpu.md). The count, the ops by
  name and the CPU time per step are printed; ``tests/unit/test_step_ops.py`` holds the count
  under a ceiling.
- ``profile`` (a GPU): one optimizer step of the 0.5B or the 7B preset (random init from their
  config dicts, batch and length as bench/gpu/gpu_throughput.py trains them) under
  ``torch.profiler``: the top ops by self CUDA time and by self CPU time, the kernels launched per
  step, and the share of the step's wall time in which no kernel ran on the GPU. Then the same
  step with the LoRA adapters' compute copies and with autocast's per-use casts instead
  (model/lora_compute_copies.py), alternating, so that lever is measured side by side.

    .venv/bin/python -m bench.gpu.step_profile count                  # CPU: ops per optimizer step
    .venv/bin/python -m bench.gpu.step_profile count model.llm.lora.dropout=0.0
    .venv/bin/python -m bench.gpu.step_profile profile --preset 0.5b  # on a GPU machine
    .venv/bin/python -m bench.gpu.step_profile profile --preset 7b --seq-len 1024
    .venv/bin/python -m bench.gpu.step_profile profile --device cpu --seq-len 16 --batch 1 --rounds 2  # checks the script (40 s)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import TINY_CONFIG, ensure_synthetic_set

# The 0.5B preset's decoder at a width where compute is nothing: what is left is the ops' count.
NARROW_05B = {
    "hidden_size": 28,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def narrow_overrides(run_dir: Path, steps: int) -> list[str]:
    """The tiny default's config turned into the 0.5B preset's architecture at narrow width."""
    flow = "{" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in NARROW_05B.items()) + "}"
    return [
        f"model.llm.config={flow}",
        "model.llm.lora.r=16",
        "model.llm.lora.alpha=32",
        "model.llm.lora.dropout=0.05",
        "model.llm.gradient_checkpointing=true",
        "model.prefix_tokens=32",
        "model.projector=tokens",
        "model.projector_hidden=32",
        "trainer.precision=bf16-mixed",
        "trainer.accumulate_grad_batches=1",
        f"trainer.max_steps={steps}",
        "data.val_index=null",
        "logging.every_n_steps=1000",
        "checkpoint.every_n_steps=100000",
        "telemetry.enabled=false",
        f"run.output_dir={run_dir}",
        "run.if_exists=overwrite",
    ]


class _CountOps(TorchDispatchMode):  # type: ignore[misc]  # torch ships the base untyped
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class OpsPerStep(pl.Callback):
    """The aten ops of one training batch (forward, backward, optimizer step), counted at batch
    ``counted`` (the first builds the optimizer's state), and the CPU time of every other batch
    (uncounted: the count's Python hook costs more than the ops)."""

    def __init__(self, counted: int = 2) -> None:
        self.counted = counted
        self.ops: Counter[str] = Counter()
        self.cpu_s: list[float] = []
        self._mode: _CountOps | None = None
        self._started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.counted:
            self._mode = _CountOps()
            self._mode.__enter__()
        self._started = time.process_time()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.ops, self._mode = self._mode.ops, None
        elif batch_idx > 0:
            self.cpu_s.append(time.process_time() - self._started)


def count_ops(overrides: list[str], run_dir: Path, steps: int = 6) -> tuple[Counter[str], float]:
    """(the ops of one optimizer step, the median CPU seconds of a step uncounted), from ``steps``
    steps trained in this process into ``run_dir`` (kept: the run records its end at exit)."""
    from purrsight.config import load_config
    from purrsight.training.run import train

    ensure_synthetic_set()
    config = load_config(TINY_CONFIG, [*narrow_overrides(run_dir, steps), *overrides])
    counter = OpsPerStep()
    train(config, None, callbacks=[counter])
    return counter.ops, statistics.median(counter.cpu_s)


def profile(
    preset: str, seq_len: int, batch: int, device_type: str = "cuda"
) -> tuple[dict[str, Any], Callable[[int], dict[str, list[float]]]]:
    """One optimizer step of a preset on the GPU under torch.profiler (after two warm-up steps),
    and a function that times, for a number of rounds, that step with the LoRA adapters' compute
    copies against the same step with autocast's per-use casts (``alternating_steps``): called
    after the profile is printed, so that a time limit cut there loses no profile. ``device_type``
    "cpu" checks the script where no GPU is (float32, so no autocast and no copies: the two steps
    are the same there, and no kernel is counted)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bench.common import synchronize
    from bench.gpu.gpu_throughput import build, make_step, random_batch
    from purrsight.training.optim import build_optimizer

    device = torch.device(device_type)
    config, model = build(preset, [], device, seq_len)
    model.train()
    optimizer, _ = build_optimizer(model.trainable_parameters(), config.optim, 10)
    step = make_step(config, model, random_batch(config, model, batch, seq_len, device), optimizer)
    for _ in range(2):
        step()
    synchronize(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        step()
        synchronize(device)
        wall_s = time.perf_counter() - started
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, reach = 0.0, float("-inf")
    for start, end in kernels:  # the union of the kernels' intervals, in microseconds
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    table = prof.key_averages()
    result = {
        "preset": preset,
        "seq_len": seq_len,
        "batch": batch,
        "step_s": wall_s,
        "kernel_launches": launches,
        "gpu_idle_share": 1 - busy / 1e6 / wall_s,
        "by_cuda": table.table(sort_by="self_cuda_time_total", row_limit=15),
        "by_cpu": table.table(sort_by="self_cpu_time_total", row_limit=15),
    }

    def by_casts(rounds: int) -> dict[str, list[float]]:
        other_batch = random_batch(config, model, batch, seq_len, device)
        autocast_casts = make_step(config, model, other_batch, optimizer, adapter_copies=False)
        return alternating_steps({COPIES: step, CASTS: autocast_casts}, rounds, device)

    return result, by_casts


COPIES, CASTS = "adapter copies", "autocast's casts"


def alternating_steps(steps: dict[str, Callable[[], None]], rounds: int, device: torch.device) -> dict[str, list[float]]:
    """Each of ``steps`` once a round, in turn, for ``rounds`` rounds after one warm-up each: the
    seconds of each call, ``device`` waited for around every one (side by side, so a GPU that warms
    or throttles touches all alike)."""
    from bench.common import synchronize

    times: dict[str, list[float]] = {name: [] for name in steps}
    for warm_up in steps.values():
        warm_up()
    for _ in range(rounds):
        for name, step in steps.items():
            synchronize(device)
            started = time.perf_counter()
            step()
            synchronize(device)
            times[name].append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    count = commands.add_parser("count", help="aten ops per optimizer step, the 0.5B architecture at narrow width (CPU)")
    count.add_argument("overrides", nargs="*", help="config overrides on top of the narrow 0.5B shape")
    count.add_argument("--json", type=Path, help="also write the counts here")
    prof = commands.add_parser("profile", help="torch.profiler over one step of a preset (GPU)")
    prof.add_argument("--preset", choices=("0.5b", "7b"), default="0.5b")
    prof.add_argument("--seq-len", type=int, default=1024)
    prof.add_argument("--batch", type=int, default=8)
    prof.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the script, measure nothing")
    prof.add_argument("--json", type=Path)
    prof.add_argument("--rounds", type=int, default=12, help="rounds of the side-by-side after the profile")
    args = parser.parse_args()
    if args.command == "count":
        ops, cpu_s = count_ops(args.overrides, Path(tempfile.mkdtemp(prefix="step-profile-")))
        print(f"aten ops per optimizer step: {sum(ops.values())}; CPU {cpu_s * 1000:.0f} ms a step (median, uncounted steps)")
        for name, n in ops.most_common(25):
            print(f"{n:8d}  {name}")
        if args.json:
            args.json.write_text(json.dumps({"total": sum(ops.values()), "cpu_s": cpu_s, "ops": dict(ops)}, indent=1))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: profile needs a CUDA GPU; on this machine run `count`", file=sys.stderr)
        return 2
    result, by_casts = profile(args.preset, args.seq_len, args.batch, args.device)
    print(f"{args.preset}, {args.batch} x {args.seq_len}: step {result['step_s']:.3f} s, "
          f"{result['kernel_launches']} kernel launches, GPU idle {result['gpu_idle_share']:.1%} of the step")  # fmt: skip
    print("top ops by self CUDA time\n" + result["by_cuda"])
    print("top ops by self CPU time\n" + result["by_cpu"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    times = by_casts(args.rounds)
    copies, casts = statistics.median(times[COPIES]), statistics.median(times[CASTS])
    print(f"the step, {args.rounds} rounds alternating: with the adapters' compute copies {copies:.4f} s, "
          f"with autocast's per-use casts {casts:.4f} s (median); casts / copies {casts / copies:.3f}")  # fmt: skip
    for name, seconds in times.items():
        print(f"  {name}: " + " ".join(f"{s:.4f}" for s in seconds))
    if args.json:
        args.json.write_text(json.dumps(result | {"step_s_by_casts": times}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
