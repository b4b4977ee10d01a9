"""The job's effective training time: every attempt of a run recorded, and the wall time split.

An attempt is one start of training on a run folder (a first start, a torchrun restart, a
requeue, a resume, a Ray restart). Rank 0 rewrites one small file per attempt in
``runs/<name>/attempts/`` at the first step, every ``HEARTBEAT_S``, after each checkpoint and
at the end, so a kill -9 leaves the attempt's last step and time. ``summarize`` turns the
records into start-up, checkpoint writing, training, work lost, wind-down and time between
attempts, which add up to the wall time by construction (docs/OBSERVABILITY.md, "Effective
training time", defines each part).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytorch_lightning as pl

from purrsight.atomic_file import publish, write_json_atomically

log = logging.getLogger(__name__)

ATTEMPTS_DIR = "attempts"
HEARTBEAT_S = 2.0
LAUNCH_TIME_ENV = "PURRSIGHT_LAUNCH_TIME"  # exported by cluster_train.sh when it starts


@dataclass
class Attempt:
    number: int
    how: str
    launched_at: float
    resumed_step: int
    world_size: int
    global_batch: str | None = None  # "processes x batch x accumulation = samples" (records before 2026-11-28: none)
    first_step_at: float | None = None
    last_step: int = 0
    last_step_at: float | None = None
    checkpoint_s: float = 0.0
    updated_at: float = 0.0
    training_ended_at: float | None = None  # end() called: training over, wind-down begins
    ended_at: float | None = None  # the process's exit (rewritten at exit)
    end: str | None = None  # finished / stopped by SIGTERM / watchdog: ... / error: ...; None: killed

    @property
    def until(self) -> float:
        """The attempt's last known moment: its end, or its last heartbeat when it was killed."""
        return self.ended_at if self.ended_at is not None else self.updated_at


def read_attempts(run_dir: Path) -> list[Attempt]:
    folder = run_dir / ATTEMPTS_DIR
    if not folder.is_dir():
        return []
    attempts = [Attempt(**json.loads(path.read_text())) for path in folder.glob("attempt-*.json")]
    return sorted(attempts, key=lambda attempt: attempt.number)


@dataclass
class Split:
    """One attempt's share of the wall time, in seconds."""

    number: int
    how: str
    end: str
    waiting_before: float
    startup: float
    checkpoint: float
    training: float
    lost: float
    wind_down: float
    steps: tuple[int, int]  # (resumed step, last step)
    global_batch: str | None = None

    @property
    def total(self) -> float:
        return self.waiting_before + self.startup + self.checkpoint + self.training + self.lost + self.wind_down


@dataclass
class Summary:
    splits: list[Split] = field(default_factory=list)
    wall: float = 0.0

    def part(self, name: str) -> float:
        return sum(getattr(split, name) for split in self.splits)

    @property
    def effective(self) -> float:
        return self.part("training") / self.wall if self.wall > 0 else 0.0


def summarize(attempts: list[Attempt]) -> Summary:
    summary = Summary()
    if not attempts:
        return summary
    summary.wall = attempts[-1].until - attempts[0].launched_at
    for index, attempt in enumerate(attempts):
        training_until = attempt.training_ended_at if attempt.training_ended_at is not None else attempt.until
        first_step = attempt.first_step_at if attempt.first_step_at is not None else training_until
        startup = max(0.0, first_step - attempt.launched_at)
        checkpoint = attempt.checkpoint_s if attempt.first_step_at is not None else 0.0
        stepping = max(0.0, training_until - first_step - checkpoint)
        done = attempt.last_step - attempt.resumed_step
        lost = 0.0
        if index + 1 < len(attempts) and done > 0:
            redone = attempt.last_step - max(attempts[index + 1].resumed_step, attempt.resumed_step)
            lost = stepping * max(0, redone) / done
        waiting = attempt.launched_at - attempts[index - 1].until if index else 0.0
        summary.splits.append(
            Split(
                number=attempt.number,
                how=attempt.how,
                end=attempt.end or "killed (no end recorded)",
                waiting_before=waiting,
                startup=startup,
                checkpoint=checkpoint,
                training=stepping - lost,
                lost=lost,
                wind_down=max(0.0, attempt.until - training_until),
                steps=(attempt.resumed_step, attempt.last_step),
                global_batch=attempt.global_batch,
            )
        )
    return summary


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


def summary_lines(summary: Summary) -> list[str]:
    """The report's section: the ratio, the parts, and one row per attempt (Markdown)."""
    if not summary.splits:
        return ["- (no attempts recorded)"]
    wall = summary.wall or 1.0
    parts = [
        ("training", "training"),
        ("start-up (launch to first step)", "startup"),
        ("checkpoint writing", "checkpoint"),
        ("work lost (steps trained again after a restart)", "lost"),
        ("wind-down (trackers closing, report, exit)", "wind_down"),
        ("between attempts (restart, requeue, queue, preemption)", "waiting_before"),
    ]
    lines = [
        f"Effective training time: **{summary.effective * 100:.1f}%** of {_duration(summary.wall)} wall time, "
        f"over {len(summary.splits)} attempt(s).",
        "",
        "| part | time | share |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {_duration(summary.part(name))} | {summary.part(name) / wall * 100:.1f}% |" for label, name in parts]
    lines += [
        "",
        "| attempt | how | steps | global batch (processes x batch x accumulation) | waited before | start-up | training "
        "| checkpoints | lost | wind-down | end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for split in summary.splits:
        lines.append(
            f"| {split.number} | {split.how} | {split.steps[0]} -> {split.steps[1]} | {split.global_batch or '-'} | "
            f"{_duration(split.waiting_before)} | "
            f"{_duration(split.startup)} | {_duration(split.training)} | {_duration(split.checkpoint)} | "
            f"{_duration(split.lost)} | {_duration(split.wind_down)} | {split.end} |"
        )
    return lines


def plot_timeline(summary: Summary, path: Path) -> Path | None:
    """One bar per attempt along the wall clock: start-up, training, checkpoints, lost, wind-down; gaps are waiting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not summary.splits:
        return None
    colours = {"start-up": "#999999", "training": "#2e7d32", "checkpoints": "#1565c0", "lost": "#c62828", "wind-down": "#bdbdbd"}
    figure, axes = plt.subplots(figsize=(9, 1.4 + 0.4 * len(summary.splits)))
    clock = 0.0
    for row, split in enumerate(summary.splits):
        clock += split.waiting_before
        for label, width in (
            ("start-up", split.startup),
            ("training", split.training),
            ("checkpoints", split.checkpoint),
            ("lost", split.lost),
            ("wind-down", split.wind_down),
        ):
            axes.barh(row, width / 60, left=clock / 60, color=colours[label], label=label if row == 0 else None)
            clock += width
    axes.set(xlabel="minutes since the first launch", yticks=range(len(summary.splits)))
    axes.set_yticklabels([f"attempt {split.number}" for split in summary.splits])
    axes.invert_yaxis()
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the bars, never on them
    axes.set_title(f"Attempts: {summary.effective * 100:.1f}% effective training time")
    figure.tight_layout()
    publish(path, lambda stream: figure.savefig(stream, format="png", dpi=100))  # a kill mid-write keeps the last one
    plt.close(figure)
    return path


def launch_time(generation: int) -> float:
    """When this attempt was launched: the launcher's start for its first workers, else this process's start."""
    launched = os.environ.get(LAUNCH_TIME_ENV)
    if generation == 0 and launched:
        return float(launched.replace(",", "."))  # bash writes EPOCHREALTIME with the locale's decimal mark
    return float(psutil.Process().create_time())


def how_started(number: int, generation: int, resumed_step: int) -> str:
    if number == 1 and resumed_step == 0:
        return "first start"
    slurm = os.environ.get("SLURM_JOB_ID")
    requeues = os.environ.get("SLURM_RESTART_COUNT")
    where = f" (SLURM job {slurm}{f', requeue {requeues}' if requeues else ''})" if slurm else ""
    if generation > 0:
        return f"restart {generation} of the launch{where}"
    return f"new launch, resumed{where}"


class AttemptRecorder(pl.Callback):
    """Rank 0 writes this attempt's file: at the start, every HEARTBEAT_S during training, at the end."""

    def __init__(self, run_dir: Path, generation: int, seconds_saving: Any, global_batch: str | None = None) -> None:
        self.folder = run_dir / ATTEMPTS_DIR
        self.generation = generation
        self.seconds_saving = seconds_saving  # a callable: the checkpoint saver's running total
        self.global_batch = global_batch  # "processes x batch x accumulation = samples" (purrsight/global_batch.py)
        self.attempt: Attempt | None = None
        self._written = 0.0

    def _write(self, now: float) -> None:
        assert self.attempt is not None
        self.attempt.updated_at = now
        self.attempt.checkpoint_s = float(self.seconds_saving())
        write_json_atomically(self.folder / f"attempt-{self.attempt.number:04d}.json", asdict(self.attempt))
        self._written = now

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        number = len(list(self.folder.glob("attempt-*.json"))) + 1
        step = trainer.global_step
        how = how_started(number, self.generation, step)
        datamodule = getattr(trainer, "datamodule", None)
        note = getattr(datamodule, "resume_note", None)  # a resume onto changed data (training/datamodule.py)
        self.attempt = Attempt(
            number=number,
            how=f"{how}; {note}" if note else how,
            launched_at=launch_time(self.generation),
            resumed_step=step,
            world_size=trainer.world_size,
            global_batch=self.global_batch,
            last_step=step,
        )
        self._write(time.time())

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.attempt is None or trainer.global_step == self.attempt.last_step:
            return  # not rank 0, or a batch that only accumulated gradients
        now = time.time()
        first = self.attempt.first_step_at is None
        if first:
            self.attempt.first_step_at = now
        self.attempt.last_step, self.attempt.last_step_at = trainer.global_step, now
        if first or now - self._written >= HEARTBEAT_S:
            self._write(now)

    def after_save(self, trainer: pl.Trainer) -> None:
        """Written after every checkpoint (CheckpointSaver.after_save): a kill then loses no record of
        the steps that checkpoint keeps, however many fast steps fit into one heartbeat interval."""
        if self.attempt is not None:
            self.attempt.last_step, self.attempt.last_step_at = trainer.global_step, time.time()
            self._write(self.attempt.last_step_at)

    def end(self, how: str) -> None:
        """Record this attempt's end (finished, a stop signal, the watchdog, an error); rank 0 only."""
        if self.attempt is None or self.attempt.end is not None:
            return
        now = time.time()
        self.attempt.end, self.attempt.training_ended_at = how, now
        self._write_end(now)  # the report, written next, sees the attempt end here: no wind-down yet
        atexit.register(self._write_end)  # the report and the process's exit belong to the attempt too

    def _write_end(self, now: float | None = None) -> None:
        assert self.attempt is not None
        now = time.time() if now is None else now
        self.attempt.ended_at = now
        try:
            self._write(now)
        except OSError as error:  # the run is ending anyway: its own error matters more
            log.warning("could not record the attempt's end in %s: %s", self.folder, error)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.end(f"error: {type(exception).__name__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m purrsight.runs.attempts",
        description="Print a run folder's effective training time, over every attempt so far (also in report.md).",
    )
    parser.add_argument("run_dir", type=Path, help="the run folder, runs/<name>")
    args = parser.parse_args(argv)
    attempts = read_attempts(args.run_dir)
    if not attempts:
        print(f"error: no attempts recorded in {args.run_dir / ATTEMPTS_DIR}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(summarize(attempts))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
