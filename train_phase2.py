#!/usr/bin/env python3
r"""Train the PurrSight Phase 2 multi-modal LLM (frozen encoders, projectors, LoRA).

Runbook
-------
One CPU (the embedded default: tiny model, generated data, about a minute)::

    python train_phase2.py --config config/train_config.yaml

One GPU node, all its GPUs (or through the launcher, which adds health checks and logs)::

    torchrun --nproc-per-node 8 train_phase2.py --config config/qwen2.5-0.5b.yaml
    ./cluster_train.sh config/qwen2.5-0.5b.yaml

Two nodes (run on each; node 0's address is the master)::

    ./cluster_train.sh config/qwen2.5-0.5b.yaml 2 0 10.0.0.1 29500   # on node 0
    ./cluster_train.sh config/qwen2.5-0.5b.yaml 2 1 10.0.0.1 29500   # on node 1

Overrides (``section.key=value``) win over the file::

    python train_phase2.py --config config/train_config.yaml trainer.max_steps=20 data.batch_size=4

Resume from the newest checkpoint of the run, or from a given one::

    python train_phase2.py --config config/train_config.yaml --resume
    python train_phase2.py --config config/train_config.yaml --resume runs/phase2-tiny/checkpoints/step-00000050.ckpt

On a Ray cluster (docs/RAY.md; workers and resources in the config's ray: section); the wrapper
exits with the driver's code, ``ray job submit`` with 1 for any failure::

    python -m purrsight.ray_engine.submit --address http://HEAD:8265 -- \
        --config config/train_config.yaml ray.shared_dir=/shared/purrsight
    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python train_phase2.py --engine ray --config config/train_config.yaml ray.shared_dir=/shared/purrsight

Prepare a large dataset once (decoded, tokenised, memory-mapped shards; docs/DATA.md), then train from it::

    python train_phase2.py prepare --config config/qwen2.5-0.5b.yaml --out /shared/prepared/v1
    python train_phase2.py --config config/qwen2.5-0.5b.yaml data.prepared=/shared/prepared/v1

Before queueing: does it fit? Per-GPU memory under ddp and fsdp, from config files only (docs/SCALING.md)::

    python train_phase2.py estimate --config config/qwen2.5-7b.yaml --gpus 8 --gpu-memory 80GB

Export (LoRA merged, Hugging Face directory, projectors beside it)::

    python train_phase2.py export --checkpoint runs/phase2-tiny/checkpoints/last.ckpt --out exported/phase2-tiny

"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from pathlib import Path

from purrsight.cli import run_guarded, setup_logging
from purrsight.distributed.process_group import order_ranks_by_node
from purrsight.errors import EXIT_CODE_LINES, SIGNAL_BASE, ClusterError, ExitCode, PeerHungError, PeerLostError

DEFAULT_CONFIG = "config/train_config.yaml"
EXIT_CODES_HELP = "Exit codes:\n" + "\n".join(f"  {line}" for line in EXIT_CODE_LINES)
NEWEST = "newest"  # the value purrsight.training.run understands as "the newest checkpoint of the run"
OVERRIDE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+=")


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_phase2.py",
        description=__doc__,
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (default: %(default)s)")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="newest",
        default=None,
        metavar="PATH",
        help="resume from PATH, or from the newest checkpoint of the run when PATH is omitted",
    )
    parser.add_argument(
        "--engine",
        choices=["torchrun", "ray"],
        default="torchrun",
        help="torchrun: train in this process (one rank of torchrun, or alone); "
        "ray: be the driver of a Ray Train job on the Ray cluster (the ray: section of the config)",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)  # overrides may stand before and after --resume PATH
    # `--resume trainer.max_steps=9` means "resume the newest" followed by an override,
    # not a checkpoint file with that odd name.
    if args.resume not in (None, NEWEST) and OVERRIDE.match(args.resume) and not Path(args.resume).exists():
        before = argv.index("--resume") if "--resume" in argv else 0  # keep the command line's order: later wins
        args.overrides.insert(sum(1 for arg in argv[:before] if OVERRIDE.match(arg)), args.resume)
        args.resume = NEWEST
    return args


def parse_export_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_phase2.py export", description="Merge LoRA and write a Hugging Face directory plus the projectors."
    )
    parser.add_argument("--checkpoint", required=True, help="a .ckpt written by training")
    parser.add_argument("--out", required=True, help="output directory")
    return parser.parse_args(argv)


def train_command(args: argparse.Namespace) -> int:
    from purrsight.config import load_config

    # The config is judged before Lightning and the engines load: a mistake is reported in
    # a fraction of a second instead of after seconds of imports.
    try:
        if args.engine == "ray":
            # Paths are checked by the driver, under ray.shared_dir where the workers see them.
            config = load_config(args.config, args.overrides, check_paths=False)
            from purrsight.ray_engine.driver import run_on_ray

            return run_on_ray(config, args.resume, args.config)
        config = load_config(args.config, args.overrides)
        from purrsight.training.run import train

        outcome = train(config, args.resume)
    except ClusterError as err:  # the fabric, not the input: the launcher's health-check code
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.CLUSTER
    except PeerHungError as err:  # another rank's watchdog fired: the job hung, whichever rank says it
        print(f"error: the job hung: {err}", file=sys.stderr)
        return ExitCode.WATCHDOG
    except PeerLostError as err:  # a node died: one line, the traceback only with LOG_LEVEL=DEBUG
        if os.environ.get("LOG_LEVEL", "").upper() == "DEBUG":
            logging.getLogger("purrsight").exception("a peer process is gone")
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.FAILED
    if outcome.stopped_by_signal is not None:
        name = signal.Signals(outcome.stopped_by_signal).name
        logging.getLogger("purrsight").warning(
            "stopped by %s at step %d; checkpoint: %s (resume with --resume; RESUME=auto with the launcher)",
            name,
            outcome.final_step,
            outcome.checkpoint,
        )
        return SIGNAL_BASE + outcome.stopped_by_signal
    if int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("purrsight").info(
            "done: step %d; checkpoint %s; run folder %s", outcome.final_step, outcome.checkpoint, outcome.run_dir
        )
    return 0


def export_command(args: argparse.Namespace) -> int:
    from purrsight.training.export import export

    out = export(args.checkpoint, args.out)
    print(f"exported to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ranks_note = order_ranks_by_node(os.environ)  # before logging: its prefix shows the rank
    setup_logging()
    if ranks_note:
        logging.getLogger("purrsight.distributed").info(ranks_note)
    if argv[:1] == ["export"]:
        return run_guarded(export_command, parse_export_args(argv[1:]))
    if argv[:1] == ["estimate"]:
        from purrsight.estimate.command import estimate_command, parse_estimate_args

        try:
            estimate_args = parse_estimate_args(argv[1:])
        except SystemExit as exit_:
            return ExitCode.USAGE if exit_.code else ExitCode.OK
        return run_guarded(estimate_command, estimate_args)
    if argv[:1] == ["prepare"]:
        from purrsight.datasets.prepare_job import parse_prepare_args, prepare_command

        try:
            prepare_args = parse_prepare_args(argv[1:])
        except SystemExit as exit_:
            return ExitCode.USAGE if exit_.code else ExitCode.OK
        return run_guarded(prepare_command, prepare_args)
    try:
        args = parse_train_args(argv)
    except SystemExit as exit_:
        return ExitCode.USAGE if exit_.code else ExitCode.OK
    return run_guarded(train_command, args)


if __name__ == "__main__":
    raise SystemExit(main())
