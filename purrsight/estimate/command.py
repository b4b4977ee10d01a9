"""``train_phase2.py estimate``: whether a config's training fits its GPUs, before it is queued."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from purrsight.errors import UserError

if TYPE_CHECKING:
    from purrsight.config import Config

DESCRIPTION = """\
Per-GPU memory of training CONFIG on N GPUs, ddp and fsdp side by side, and the checkpoint's size.
Built from config files alone on the meta device: a model directory is read for its config.json,
never its weights; nothing is downloaded.

Counted per GPU: frozen weights (bf16 under bf16 precisions), trainable weights (LoRA and the
projectors, fp32), their gradients, AdamW's two moments, fsdp's all-gather buffers (the root unit
and two neighbouring units gathered, one twice while copied out), and the peak of one micro-batch's
activations and logits at data.batch_size and data.max_length (plus the prefix tokens), found by
running that step's forward and backward on meta with gradient checkpointing as configured (the
logits at their real bytes: the loss makes them a chunk of rows at a time, never whole, counted as
if every text token carried a label).
trainer.precision auto counts as bf16-mixed. data.batch_size auto and model.llm.gradient_checkpointing
auto are priced as training chooses them (docs/SCALING.md, "The micro-batch and checkpointing the GPU decides") for --gpu-memory, or
for an 80 GB GPU where it is not given: the lines above the table name the choice (where not one
sample fits, the refusal training would give, and the table at micro-batch 1).

Not counted: the CUDA context, NCCL buffers and allocator fragmentation (leave 1-5 GB of an 80 GB
GPU for them), pinned loader batches, kernel workspaces. docs/SCALING.md has the tables.

Host memory per node (--gpus-per-node ranks, default 8 or fewer GPUs in all): each rank's peak
while it builds the model on the CPU: ddp holds every frozen weight (bf16 under bf16 precisions),
fsdp its shard and one tensor's rows in flight; both the towers whole in fp32, the trainable
weights and 0.5 GB a process. An upper bound on GPUs, where transformers reads onto the device.

With --gpu-memory each strategy gets a verdict: "fits" when its total plus 2 GB (the least of what
is not counted) is within the memory, "tight" when the total alone is, else "DOES NOT FIT";
"refused" where training would not start it (fsdp with one GPU, or a model without decoder layers
to shard), the reason below the table. --json carries the verdict, and "fits" true for the
verdict "fits" alone.

  python train_phase2.py estimate --config config/qwen2.5-7b.yaml --gpus 8 --gpu-memory 80GB
  python train_phase2.py estimate --config config/qwen2.5-7b.yaml --gpus 8 --llm-config /path/Qwen2.5-72B/config.json --json
"""
AUTO_GPU_MEMORY = 80 * 10**9  # what "auto" settings are priced for without --gpu-memory: an A100's or H100's
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_estimate_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_phase2.py estimate", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="config/train_config.yaml", help="YAML config (default: %(default)s)")
    parser.add_argument("--gpus", default="1", help="GPUs the job trains on, all nodes together (default: %(default)s)")
    parser.add_argument(
        "--gpus-per-node", default=None, metavar="N", help="ranks on one node, for its host memory (default: 8, or --gpus if fewer)"
    )
    parser.add_argument(
        "--gpu-memory", default=None, metavar="SIZE", help="one GPU's memory (80GB, 141GB, 80GiB): say whether each strategy fits"
    )
    parser.add_argument(
        "--llm-config",
        default=None,
        metavar="PATH",
        help="a config.json (or a directory holding one) whose shape replaces model.llm's: price a base you have not downloaded",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for training")
    return parser.parse_args(argv)


def parse_size(text: str) -> int:
    """``80GB`` -> 80e9 bytes; ``80GiB`` -> 80 * 2**30; a bare number is bytes."""
    match = SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in {*UNITS, ""}:
        raise UserError(f"--gpu-memory {text}: not a size; write it as 80GB or 80GiB (units: {', '.join(UNITS)})")
    return int(float(match.group(1)) * UNITS.get(unit, 1))


def parse_gpus(text: str, option: str = "--gpus") -> int:
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"{option} {text}: give a whole number of GPUs, at least 1")
    return int(text)


def parse_gpu_memory(text: str) -> int:
    size = parse_size(text)
    if size <= 0:
        raise UserError(f"--gpu-memory {text}: a GPU's memory is more than nothing; write it as 80GB or 80GiB")
    return size


def in_unit(count: int, unit: int) -> str:
    return f"{count / unit:.2f}"


def settle_auto(config: Config, gpus: int, memory: int | None, llm_config: Path | None) -> tuple[Config, list[str]]:
    """``config`` with its auto settings chosen as training would on GPUs of ``memory`` bytes
    (AUTO_GPU_MEMORY where not given), and the lines that say so; an unchanged config where none is
    auto. Where not one sample fits, the table prices micro-batch 1 under the refusal training would
    give: the figures are what a user needs to choose what to shard or shorten."""
    from purrsight.estimate.auto_fit import NothingFitsError, auto_choice, with_choices
    from purrsight.estimate.memory import precision_of

    if not config.left_auto:
        return config, []
    given = memory is not None
    memory = memory or AUTO_GPU_MEMORY
    device = f"a {memory / 1e9:.0f} GB GPU" + ("" if given else ", --gpu-memory names yours")
    try:
        choice = auto_choice(config, gpus, memory, device, precision_of(config), llm_config)
    except NothingFitsError as refusal:
        checkpointing = config.model.llm.gradient_checkpointing is not False
        return with_choices(config, 1, checkpointing), [f"{refusal} (training stops at start; priced below at micro-batch 1)"]
    return with_choices(config, choice.batch_size, choice.gradient_checkpointing), choice.lines()


def estimate_command(args: argparse.Namespace) -> int:
    gpus, memory = parse_gpus(args.gpus), parse_gpu_memory(args.gpu_memory) if args.gpu_memory is not None else None
    per_node = parse_gpus(args.gpus_per_node, "--gpus-per-node") if args.gpus_per_node is not None else None
    from purrsight.config import load_config
    from purrsight.estimate.memory import STRATEGIES, estimate

    config = load_config(args.config, args.overrides, check_paths=False)  # model paths: config.json only, checked as read
    llm_config = Path(args.llm_config) if args.llm_config else None
    config, chosen = settle_auto(config, gpus, memory, llm_config)
    result = estimate(config, gpus, llm_config, per_node)
    if args.json:
        per_gpu = {
            name: {
                **vars(part),
                "total": part.total,
                **({"refused": result.refused[name]} if name in result.refused else {}),
                **({"fits": result.fits(name, memory), "verdict": result.verdict(name, memory)} if memory else {}),
            }
            for name, part in result.per_gpu.items()
        }
        print(
            json.dumps(
                {
                    "config": args.config,
                    "gpus": gpus,
                    "precision": result.precision,
                    "frozen_parameters": result.frozen_parameters,
                    "trainable_parameters": result.trainable_parameters,
                    "checkpoint_bytes": result.checkpoint_bytes,
                    "gpu_memory_bytes": memory,
                    "per_gpu_bytes": per_gpu,
                    "gpus_per_node": result.gpus_per_node,
                    "host_bytes_per_node": result.host_per_node,
                    "data.batch_size": config.data.micro_batch,
                    "model.llm.gradient_checkpointing": config.model.llm.checkpointing,
                    "auto": chosen,
                },
                indent=2,
            )
        )
        return 0
    largest = max(part.total for part in result.per_gpu.values())
    unit, unit_name = (10**9, "GB") if largest >= 10**9 else (10**6, "MB")
    print(
        f"{args.config} on {gpus} GPU(s), {result.precision}: {result.frozen_parameters / 1e6:,.1f}M frozen, "
        f"{result.trainable_parameters / 1e6:,.2f}M trainable parameters; checkpoint {result.checkpoint_bytes / 1e9:.3f} GB"
    )
    for line in chosen:
        print(line)
    rows = ["frozen", "trainable", "gradients", "optimizer", "all_gather", "activations", "logits"]
    print(f"{'per GPU, ' + unit_name:<14}" + "".join(f"{name:>14}" for name in STRATEGIES))
    for row in rows:
        print(f"{row:<14}" + "".join(f"{in_unit(getattr(result.per_gpu[name], row), unit):>14}" for name in STRATEGIES))
    print(f"{'total':<14}" + "".join(f"{in_unit(result.per_gpu[name].total, unit):>14}" for name in STRATEGIES))
    if memory:
        verdicts = (result.verdict(name, memory).replace("does not fit", "DOES NOT FIT") for name in STRATEGIES)
        print(f"{'in ' + in_unit(memory, unit) + ' ' + unit_name:<14}" + "".join(f"{verdict:>14}" for verdict in verdicts))
    host = result.host_per_node
    print(
        f"host memory per node of {result.gpus_per_node} rank(s), while they build the model: "
        + ", ".join(f"{name} {'refused' if name in result.refused else f'{host[name] / 1e9:.2f} GB'}" for name in STRATEGIES)
    )
    for name, why in result.refused.items():
        print(f"{name}: {why}")
    return 0
