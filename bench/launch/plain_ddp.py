"""A plain PyTorch DDP training loop: the baseline our whole stack is measured against.

Same model (build_model), same samples and collator (build_datasets), same batch, AdamW
and schedule (build_optimizer), same DDP settings and gradient clipping as the tiny
default; no Lightning, no launcher, no callbacks. Run it under torchrun:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m bench.launch.plain_ddp --steps 110 --out plain.json

Rank 0 writes {step: wall time} after step 1 and every 10 optimizer steps (the rows our
telemetry writes), which bench/common.py turns into launch -> first step and samples/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from bench.common import ROW_EVERY
from purrsight.config import load_config
from purrsight.datasets.builder import build_datasets
from purrsight.datasets.synthetic_set import ensure_synthetic_set
from purrsight.training.model_builder import build_model
from purrsight.training.optim import build_optimizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="config/train_config.yaml")
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--out", type=Path, required=True, help="JSON of {step: wall time} (rank 0)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = load_config(args.config, [f"data.batch_size={args.batch_size}"])
    torch.manual_seed(config.run.seed)
    if rank == 0:  # as the DataModule's prepare_data: a no-op once made
        ensure_synthetic_set(config)
    dist.barrier()
    data = build_datasets(config, world)
    model = build_model(config).model
    ddp = DistributedDataParallel(
        model,
        bucket_cap_mb=config.distributed.bucket_cap_mb,
        gradient_as_bucket_view=config.distributed.gradient_as_bucket_view,
        find_unused_parameters=config.distributed.find_unused_parameters,
        broadcast_buffers=config.distributed.broadcast_buffers,
    )
    trainable = model.trainable_parameters()
    optimizer, scheduler = build_optimizer(trainable, config.optim, args.steps)
    sampler: DistributedSampler[Any] = DistributedSampler(
        data.train, num_replicas=world, rank=rank, shuffle=True, seed=config.run.seed, drop_last=True
    )
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler, collate_fn=data.collator, drop_last=True)
    clip = config.trainer.gradient_clip_val

    step, epoch, step_times = 0, 0, {}
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = ddp(batch).loss
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(trainable, clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and (step == 1 or step % ROW_EVERY == 0):
                step_times[step] = time.time()
            if step == args.steps:
                break
        epoch += 1
    if rank == 0:
        args.out.write_text(json.dumps(step_times))
        print(f"plain DDP: {step} steps on {world} processes, last loss {loss.item():.3f}", flush=True)
    dist.barrier()  # no rank tears the group down while another still writes or reads it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Past the barrier and the group's teardown the figures are written. The interpreter's own
    # shutdown once hung there for 10 minutes (rank 0 in a futex wait beside gloo's run-loop thread,
    # torch 2.13, a full test run on 2 busy cores, 2026-11-27): it measures nothing, so it is skipped.
    os._exit(code)
