"""The run report: report.md and PNG plots in the run folder, written by rank 0 at the end.

Sources: Lightning's metrics CSV (loss, learning rate, validation), the per-node telemetry
CSVs (throughput, host, power and energy), the preflight table when there was one, every
attempt's record (effective training time, attempts.py) and the hangs the watchdog named.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes
import matplotlib.pyplot as plt  # imported after the backend is chosen

from purrsight.atomic_file import publish, remove_stale_temp_files, write_text_atomically
from purrsight.observability.tracker_journal import LEDGER_NAME, QUEUE_DIR
from purrsight.observability.tracker_sender import Tally
from purrsight.run_folder import HANGS_LOG
from purrsight.runs.attempts import plot_timeline, read_attempts, summarize, summary_lines

log = logging.getLogger(__name__)


def _read(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _series(rows: list[dict[str, str]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    points = [(float(r[x]), float(r[key])) for r in rows if r.get(key) not in (None, "") and r.get(x) not in (None, "")]
    return [p[0] for p in points], [p[1] for p in points]


def _plot(path: Path, title: str, ylabel: str, curves: dict[str, tuple[list[float], list[float]]]) -> Path | None:
    curves = {label: xy for label, xy in curves.items() if xy[0]}
    if not curves:
        return None
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in curves.items():
        axes.plot(xs, ys, label=label)
    axes.set(title=title, xlabel="optimizer step", ylabel=ylabel)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    publish(path, lambda stream: figure.savefig(stream, format="png", dpi=100))
    plt.close(figure)
    return path


def _undelivered_tracker_points(run_dir: Path) -> list[str]:
    """Sections naming what a tracker server does not hold (trackers.json): points given up in an
    outage longer than the queue, and points still waiting on disk for the next attempt."""
    ledger = run_dir / LEDGER_NAME
    if not ledger.is_file():
        return []
    entries = json.loads(ledger.read_text()).items()
    lost = [(name, Tally(**entry["lost"])) for name, entry in entries if entry.get("lost")]
    kept = [(name, Tally(**entry["kept"])) for name, entry in entries if entry.get("kept")]
    lines = []
    if lost:
        lines += ["", "## Tracker points never delivered", ""]
        lines += [f"- {name}: {item} never reached the server; metrics/metrics.csv holds every point" for name, item in lost]
    if kept:
        lines += ["", "## Tracker points waiting to be sent", ""]
        lines += [
            f"- {name}: {item} not on the server when the run ended, kept in {QUEUE_DIR}/{name}/: "
            "the next attempt (a resume) sends them"
            for name, item in kept
        ]
    return lines


PUBLISHED = ("report.md", "loss.png", "throughput.png", "power.png", "attempts.png")


def write_report(run_dir: Path, preflight_table: str | None = None) -> Path:
    # Rank 0 alone writes these: the temp files of a report killed half way are its to remove.
    for stale in remove_stale_temp_files(run_dir, *PUBLISHED):
        log.warning("removed %s, left by a run killed while it wrote its report", stale)
    metrics = _read(run_dir / "metrics" / "metrics.csv")
    nodes = {p.stem: _read(p) for p in sorted((run_dir / "telemetry").glob("node*.csv"))}
    plots = [
        _plot(
            run_dir / "loss.png",
            "Loss",
            "cross-entropy",
            {"train": _series(metrics, "train/loss"), "validation": _series(metrics, "val/loss")},
        ),
        _plot(
            run_dir / "throughput.png",
            "Throughput",
            "tokens/s (job)",
            {node: _series(rows, "global_tokens_per_s") for node, rows in nodes.items()},
        ),
        _plot(run_dir / "power.png", "GPU power", "W", {node: _series(rows, "gpu_power_w") for node, rows in nodes.items()}),
    ]
    final = {key: values[-1] for key in ("train/loss", "val/loss", "val/accuracy") if (values := _series(metrics, key)[1])}
    lines = [f"# Run report: {run_dir.name}", "", "## Final metrics", ""]
    lines += [f"- {key}: {value:.4f}" for key, value in final.items()] or ["- (no metrics logged)"]
    lines += ["", "## Throughput and energy", ""]
    for node, rows in nodes.items():
        if rows:
            last = rows[-1]
            joules = last.get("energy_per_sample_j")
            energy = f"{float(joules):.3g} J (this node's GPUs)" if joules else "not measured (no NVML)"
            lines.append(
                f"- {node}: {float(last['global_tokens_per_s']):.1f} tokens/s (job), "
                f"{float(last['data_wait_frac']) * 100:.1f}% of step time waiting for data, "
                f"energy per sample: {energy}"
            )
    if not nodes:
        lines.append("- (no telemetry)")
    attempts = summarize(read_attempts(run_dir))
    plots.append(plot_timeline(attempts, run_dir / "attempts.png"))
    lines += ["", "## Effective training time", "", *summary_lines(attempts)]
    hangs = run_dir / HANGS_LOG
    if hangs.is_file():
        lines += ["", "## Hangs the watchdog named", "", "```", hangs.read_text().rstrip(), "```"]
    lines += _undelivered_tracker_points(run_dir)
    if preflight_table:
        lines += ["", "## Preflight all-reduce", "", "```", preflight_table, "```"]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots if p is not None]
    report = run_dir / "report.md"
    write_text_atomically(report, "\n".join(lines) + "\n")
    return report
