"""Run by test_resume_memory.py: a resume through the trainer's own path (training/run.py's
``train``: the start plan, Lightning's checkpoint connector, the strategy's checkpoint IO, the
module's and the optimizer's loads), then, once everything is restored, this process's peak RSS
and whether it still maps the checkpoint file."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import pytorch_lightning as pl

from purrsight.cli import setup_logging
from purrsight.config import load_config
from purrsight.training.run import train


class AfterRestore(pl.Callback):
    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint.resolve()  # as /proc/self/maps names a mapped file

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        maps = Path("/proc/self/maps").read_text()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        print("PROBE " + json.dumps({"peak_rss": peak, "checkpoint_mapped": str(self.checkpoint) in maps}), flush=True)


if __name__ == "__main__":
    checkpoint, config_path, *overrides = sys.argv[1:]
    setup_logging()  # as train_phase2.py does
    train(load_config(config_path, overrides), resume=checkpoint, callbacks=[AfterRestore(Path(checkpoint))])
