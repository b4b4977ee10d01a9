"""Host memory of one node while 8 ranks resume a checkpoint of the 7B preset's trainable state.

The 7B preset (``config/qwen2.5-7b.yaml``, ``distributed.strategy: fsdp``) trains LoRA r=16 on the
seven projections of Qwen2.5-7B's 28 layers and two projectors from 768-wide towers into its width
(3584): about 76M parameters, a 0.9 GB checkpoint with AdamW's moments. The frozen base is no part
of a checkpoint, so it is left out here: a module holding exactly those trainable shapes (the real
projector classes) trains one step in one process, is saved by the trainer's checkpoint IO, and
8 ranks (torchrun, gloo, CPU) resume it through Lightning and our fsdp strategy
(``ShardedFrozenBase``: the checkpoint connector, ``AtomicCheckpointIO.load_checkpoint``,
``set_model_state_dict`` and ``set_optimizer_state_dict``).

While they run, every rank's ``/proc/PID/smaps_rollup`` is read every 20 ms; the figures are sums
over the 8 ranks: PSS (a page mapped by several ranks counted once in all), its anonymous part (what
no file backs: copies a process made), and RSS. Reported: the sums just before the first rank starts
loading, their peak until the last rank has restored, and the growth between. ``--load eager`` is
the load before this change (``torch.load`` without ``mmap``, patched in); ``mmap`` is the trainer's.

    .venv/bin/python -m bench.model.resume_memory                           # tokens projector, eager and mmap (~5 min)
    .venv/bin/python -m bench.model.resume_memory --projector pooled --prefix-tokens 4 --loads mmap

``--projector pooled --prefix-tokens 32`` is the earlier projector at the preset's size (a 12 GB
checkpoint): more than this 24 GiB machine holds 8 eager copies of, so it is measured scaled down
(its output layer grows with the prefix tokens) and the growth per GB read off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]  # not bench.common's: the workers run this file as a script
RANKS = 8
HIDDEN, INTERMEDIATE, KV, LAYERS = 3584, 18944, 512, 28  # Qwen2.5-7B (4 KV heads of 128)
TOWER_WIDTH, PROJECTOR_HIDDEN = 768, 4096  # SigLIP-base and wav2vec2-base; config/qwen2.5-7b.yaml
LORA_RANK = 16
PROJECTIONS = {  # (in, out) of each projection LoRA wraps
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV),
    "v_proj": (HIDDEN, KV),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTERMEDIATE),
    "up_proj": (HIDDEN, INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
}


class LoraLayer(nn.Module):
    """One decoder layer's LoRA pairs (A: in -> rank, B: rank -> out), an FSDP unit as the layer is."""

    def __init__(self) -> None:
        super().__init__()
        for name, (inputs, outputs) in PROJECTIONS.items():
            pair = nn.Sequential(nn.Linear(inputs, LORA_RANK, bias=False), nn.Linear(LORA_RANK, outputs, bias=False))
            self.add_module(name, pair)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs  # never run: fully_shard wants a module with a forward


class PresetTrainables(nn.Module):
    """The 7B preset's trainable parameters and nothing else."""

    def __init__(self, projector: str, prefix_tokens: int) -> None:
        super().__init__()
        sys.path.insert(0, str(REPO))
        from purrsight.model.projector import build_projector

        self.layers = nn.ModuleList(LoraLayer() for _ in range(LAYERS))
        self.projectors = nn.ModuleDict(
            {
                name: build_projector(projector, TOWER_WIDTH, PROJECTOR_HIDDEN, HIDDEN, prefix_tokens, "sequence")  # type: ignore[arg-type]
                for name in ("image", "audio")
            }
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs  # never run: fully_shard wants a module with a forward

    def loss(self) -> torch.Tensor:
        """A loss every parameter takes part in (its gradient zero): AdamW then holds both moments of each."""
        return sum((param.sum() * 0.0 for param in self.parameters()), torch.zeros(()))


def lightning_module(projector: str, prefix_tokens: int, shard: bool) -> Any:
    import pytorch_lightning as pl

    from purrsight.config import OptimConfig
    from purrsight.training.optim import build_optimizer

    class Trainables(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body: PresetTrainables | None = None

        def configure_model(self) -> None:
            if self.body is not None:
                return
            self.body = PresetTrainables(projector, prefix_tokens)
            if shard:  # as training/fsdp.py shards: a unit per layer and per projector, the root last
                from torch.distributed.fsdp import fully_shard

                assert self.device_mesh is not None
                mesh = self.device_mesh["data_parallel"]
                for unit in [*self.body.layers, *self.body.projectors.values()]:
                    fully_shard(unit, mesh=mesh)
                fully_shard(self.body, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            assert self.body is not None
            return self.body.loss()

        def configure_optimizers(self) -> Any:
            assert self.body is not None
            optimizer, scheduler = build_optimizer(list(self.body.parameters()), OptimConfig(), 10)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return Trainables()


def one_batch() -> Any:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1)), batch_size=1)


def trainer(strategy: Any, max_steps: int, callbacks: list[Any]) -> Any:
    import pytorch_lightning as pl

    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def save_checkpoint(path: Path, projector: str, prefix_tokens: int) -> int:
    """One optimizer step in this process, saved by the trainer's checkpoint IO; the parameter count."""
    from pytorch_lightning.strategies import SingleDeviceStrategy

    from purrsight.runs.checkpoint_saver import AtomicCheckpointIO

    module = lightning_module(projector, prefix_tokens, shard=False)
    fit = trainer(SingleDeviceStrategy(torch.device("cpu"), checkpoint_io=AtomicCheckpointIO()), 1, [])
    fit.fit(module, train_dataloaders=one_batch())
    fit.save_checkpoint(path)
    return sum(param.numel() for param in module.parameters())


# ---------------------------------------------------------------- inside each rank (torchrun)


def worker(checkpoint: Path, projector: str, prefix_tokens: int, load: str) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.environments import TorchElasticEnvironment

    from purrsight.runs.checkpoint_saver import AtomicCheckpointIO
    from purrsight.training.fsdp import ShardedFrozenBase

    loading = AtomicCheckpointIO.load_checkpoint

    def timed_load(self: Any, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        print(f"PHASE load {time.time()}", flush=True)
        if load == "eager":  # the line before this change
            return torch.load(path, map_location=map_location or "cpu", weights_only=True)
        return loading(self, path, map_location, weights_only)

    AtomicCheckpointIO.load_checkpoint = timed_load  # type: ignore[method-assign]

    class Restored(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            print(f"PHASE restored {time.time()}", flush=True)
            trainer.should_stop = True

    strategy = ShardedFrozenBase(TorchElasticEnvironment(), "gloo", timedelta(minutes=30))
    fit = trainer(strategy, 2, [Restored()])
    fit.fit(lightning_module(projector, prefix_tokens, shard=True), train_dataloaders=one_batch(), ckpt_path=str(checkpoint))


# ---------------------------------------------------------------- the driver


def _rollup(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value) * 1024
    return fields


class NodeMemory(threading.Thread):
    """Every 20 ms: (time, PSS, anonymous PSS, RSS) summed over the worker processes under ``root``."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.samples, self.done = root, list[tuple[float, int, int, int]](), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            try:
                workers = [p for p in psutil.Process(self.root).children(recursive=True) if "--worker" in p.cmdline()]
            except psutil.NoSuchProcess:
                return
            totals = [0, 0, 0]
            for process in workers:
                try:
                    fields = _rollup(process.pid)
                except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess):
                    continue
                totals[0] += fields["Pss"]
                totals[1] += fields.get("Pss_Anon", 0)
                totals[2] += fields["Rss"]
            if len(workers) == RANKS:
                self.samples.append((time.time(), totals[0], totals[1], totals[2]))


def measure(checkpoint: Path, projector: str, prefix_tokens: int, load: str) -> dict[str, float]:
    from bench.common import PYTHON, bench_env, free_port

    command = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(free_port()), __file__, "--worker", str(checkpoint), projector, str(prefix_tokens), load]
    job = subprocess.Popen(command, cwd=REPO, env=bench_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    memory = NodeMemory(job.pid)
    memory.start()
    output, _ = job.communicate(timeout=1800)
    memory.done.set()
    memory.join()
    if job.returncode != 0:
        raise SystemExit(f"{load}: exit {job.returncode}\n{output[-4000:]}")
    phases: dict[str, list[float]] = {"load": [], "restored": []}
    for name, at in re.findall(r"PHASE (load|restored) (\d+\.\d+)", output):  # 8 ranks' lines may interleave
        phases[name].append(float(at))
    if len(phases["load"]) != RANKS or len(phases["restored"]) != RANKS:
        raise SystemExit(f"{load}: {phases} is not one load and one restore per rank\n{output[-3000:]}")
    start, end = min(phases["load"]), max(phases["restored"])
    before = [s for s in memory.samples if s[0] < start]
    during = [s for s in memory.samples if start <= s[0] <= end]
    if not before or not during:
        raise SystemExit(f"{load}: no memory sample before or during the load ({len(memory.samples)} in all)")
    base = before[-1]
    row: dict[str, float] = {"seconds": round(end - start, 1)}
    for index, name in ((1, "pss"), (2, "anon"), (3, "rss")):
        peak = max(s[index] for s in during)
        row[f"{name}_before"], row[f"{name}_peak"] = base[index] / 2**30, peak / 2**30
        row[f"{name}_growth"] = (peak - base[index]) / 2**30
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--projector", choices=["tokens", "pooled"], default="tokens")
    parser.add_argument("--prefix-tokens", type=int, default=32, help="the preset's 32; fewer shrink the pooled projector")
    parser.add_argument("--loads", nargs="+", choices=["eager", "mmap"], default=["eager", "mmap"])
    parser.add_argument("--work-dir", type=Path, help="where the checkpoint is written (default: the temp folder)")
    args = parser.parse_args()
    from bench.common import machine

    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        checkpoint = Path(tmp) / "step-00000001.ckpt"
        parameters = save_checkpoint(checkpoint, args.projector, args.prefix_tokens)
        size = checkpoint.stat().st_size
        print(f"# {machine()}; {time.strftime('%Y-%m-%d')}; {RANKS} ranks, gloo, fsdp (ShardedFrozenBase)")
        what = f"{args.projector} projector, {args.prefix_tokens} prefix tokens: {parameters / 1e6:.1f}M trainable"
        print(f"# {what}, checkpoint {size / 2**30:.2f} GiB")
        print("| load | PSS before GiB | PSS peak | PSS growth | anon PSS growth | RSS growth | PSS growth / file | load s |")
        print("|---|---|---|---|---|---|---|---|")
        for load in args.loads:
            row = measure(checkpoint, args.projector, args.prefix_tokens, load)
            print(
                f"| {load} | {row['pss_before']:.2f} | {row['pss_peak']:.2f} | {row['pss_growth']:.2f} | {row['anon_growth']:.2f} "
                f"| {row['rss_growth']:.2f} | {row['pss_growth'] * 2**30 / size:.2f} | {row['seconds']} |",
                flush=True,
            )
            print("JSON " + json.dumps({"load": load, "checkpoint_bytes": size, "parameters": parameters, **row}), flush=True)


if __name__ == "__main__":
    main()
