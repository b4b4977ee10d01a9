"""One log file per node: the launcher's lines and every local rank's, each prefixed.

cluster_train.sh pipes all its output (and torchrun's ``--tee`` of every worker) through
this process. Each line goes to ``LOG_DIR/cluster_train_<TS>_node<R>.log`` (rotated by size
with Python's RotatingFileHandler) and, when its local rank is in ``--console-ranks``, to the
console. ``latest_node<R>.log`` links to the newest run; runs beyond ``--keep-runs`` per node
are deleted (their rotated backups and torchrun folders too).
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import re
import shutil
import signal
import sys
from pathlib import Path

TORCHRUN_PREFIX = re.compile(r"^\[default(\d+)\]:")
RUN_NAME = re.compile(r"^cluster_train_(\d{8}_\d{6})_node(\d+)")


def run_name(timestamp: str, node_rank: int) -> str:
    return f"cluster_train_{timestamp}_node{node_rank}"


def prune_runs(log_dir: Path, node_rank: int, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` runs of this node; returns what was removed."""
    runs: dict[str, list[Path]] = {}
    for path in log_dir.iterdir():
        match = RUN_NAME.match(path.name)
        if match and int(match.group(2)) == node_rank:
            runs.setdefault(match.group(1), []).append(path)
    removed = []
    for timestamp in sorted(runs)[:-keep] if keep > 0 else []:
        for path in runs[timestamp]:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def parse_ranks(spec: str) -> set[int] | None:
    """'0' / '0,1' / 'all' -> the local ranks that reach the console (None: all)."""
    if spec.strip().lower() == "all":
        return None
    return {int(part) for part in spec.split(",") if part.strip()}


class NodeLog:
    def __init__(
        self,
        log_dir: Path,
        node_rank: int,
        nproc: int,
        timestamp: str,
        max_bytes: int,
        backups: int,
        console_ranks: set[int] | None,
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / f"{run_name(timestamp, node_rank)}.log"
        self.node_rank = node_rank
        self.nproc = nproc
        self.console_ranks = console_ranks
        self.handler = logging.handlers.RotatingFileHandler(self.path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        latest = log_dir / f"latest_node{node_rank}.log"
        tmp = latest.with_name(f".{latest.name}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.path.name)  # relative: the folder can move
        os.replace(tmp, latest)

    def write(self, line: str, shown: bool = False) -> None:
        """One line into the log file, and onto the console unless it was ``shown`` there already."""
        match = TORCHRUN_PREFIX.match(line)
        if match:
            local = int(match.group(1))
            rank = self.node_rank * self.nproc + local
            text = f"[node{self.node_rank} rank{rank}] {line[match.end() :]}"
            to_console = self.console_ranks is None or local in self.console_ranks
        else:
            text = f"[node{self.node_rank} launcher] {line}"
            to_console = True
        self.handler.emit(logging.LogRecord("node", logging.INFO, "", 0, text, None, None))
        if to_console and not shown:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--timestamp", required=True, help="YYYYmmdd_HHMMSS of this run")
    parser.add_argument("--max-bytes", type=int, default=100 * 2**20)
    parser.add_argument("--backups", type=int, default=5)
    parser.add_argument("--keep-runs", type=int, default=10)
    parser.add_argument("--console-ranks", default="0")
    parser.add_argument("--shown", type=Path, help="lines the launcher already showed (the node plan's): into the file only")
    args = parser.parse_args(argv)
    # The launcher forwards signals to torchrun; this process must outlive them to record
    # the last lines (the final checkpoint, the exit code), and ends at end of input.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log = NodeLog(
        args.log_dir, args.node_rank, args.nproc, args.timestamp, args.max_bytes, args.backups, parse_ranks(args.console_ranks)
    )
    prune_runs(args.log_dir, args.node_rank, args.keep_runs)
    if args.shown is not None and args.shown.is_file():
        for line in args.shown.read_text(encoding="utf-8", errors="replace").splitlines():
            log.write(line, shown=True)
    for raw in sys.stdin.buffer:
        log.write(raw.decode("utf-8", errors="replace").rstrip("\n"))
    log.handler.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
