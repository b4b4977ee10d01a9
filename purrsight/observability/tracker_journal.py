"""What a run folder keeps of a tracker: its run, what its server holds, and what is queued for it.

``trackers.json`` (the ledger), per tracker: the tracker run's id and where it lives, the last
point *resolved* (taken by the server, or given up when the sender's queue overflowed, counted in
``lost``) and what was left queued when the last attempt ended (``kept``). Points are sent in
order, so everything up to the last resolved point is resolved. Two threads change the ledger
(the sender records what the server took, the training thread what an overflow gave up or a
run's end left), so every change and every write happens under one lock: a write built before
another thread's change must never land after it (a stop's ``lost`` went missing that way).

``tracker_queue/<tracker>/`` (the journal): every point queued for the server, one JSON line
each, written by the training thread before the point enters the sender's queue. A process
that dies by any path (an error in training, the watchdog's exit, kill -9, a stop during an
outage) leaves its queue there; the next attempt asks the server which of the unresolved points
it holds and sends the rest. Lines are written, not fsynced: the page cache outlives a killed
process, and a power cut costs the last seconds, as it costs ``metrics/metrics.csv``. The
journal is cut in segments of ``SEGMENT_POINTS`` lines; a segment whose points are all resolved
is removed, so a run whose server keeps up holds one or two small files.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from purrsight.atomic_file import write_json_atomically
from purrsight.observability.tracker_sender import Tally

log = logging.getLogger(__name__)

LEDGER_NAME = "trackers.json"
QUEUE_DIR = "tracker_queue"
SEGMENT_POINTS = 1000  # lines per journal file: ~100 KB, and a removal every 1,000 points sent


@dataclass(frozen=True)
class QueuedPoint:
    """One logged step's metrics, stamped when it was logged (not when the queue reaches it)."""

    step: int
    stamp_ms: int
    metrics: dict[str, float]

    def line(self) -> str:
        return json.dumps({"step": self.step, "time": self.stamp_ms, "metrics": self.metrics}) + "\n"


def tally(points: Iterable[QueuedPoint]) -> Tally:
    counted = Tally()
    for point in points:
        counted.add(point.step)
    return counted


class TrackerLedger:
    """One tracker's entry in ``trackers.json``: its run id, the last point resolved, what was lost or kept."""

    def __init__(self, run_dir: Path, tracker: str, target: str) -> None:
        self.path = run_dir / LEDGER_NAME
        self.tracker = tracker
        self.target = target  # where the run lives (URI, project): another target is another run
        self._lock = threading.Lock()
        entry = self._read().get(tracker, {})
        if entry.get("target") != target:
            if entry:
                log.warning(
                    "%s: the run folder's tracker run lives at %s, not %s: starting a new one", tracker, entry["target"], target
                )
            entry = {}
        self.run_id: str | None = entry.get("run_id")
        self.through_step: int = entry.get("through_step", -1)
        self.keys_at_step: set[str] = set(entry.get("keys_at_step", []))
        self.lost = Tally(**entry.get("lost", {}))
        self.kept = Tally(**entry.get("kept", {}))
        # Queued in this process (or kept by the last attempt and queued again) but not yet resolved:
        # never queued twice, never recorded early.
        self._claimed_step, self._claimed_keys = self.through_step, set(self.keys_at_step)

    def _read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {}
        return dict(json.loads(self.path.read_text()))

    def _write(self) -> None:
        """Lock held: the entry is built from the state as it is now, and written before anyone changes it."""
        ledger = self._read()  # the other tracker's entry is kept as it is
        ledger[self.tracker] = {
            "target": self.target,
            "run_id": self.run_id,
            "through_step": self.through_step,
            "keys_at_step": sorted(self.keys_at_step),
            **({"lost": self.lost.as_dict()} if self.lost.count else {}),
            **({"kept": self.kept.as_dict()} if self.kept.count else {}),
        }
        write_json_atomically(self.path, ledger)

    def remember_run(self, run_id: str) -> None:
        with self._lock:
            self.run_id = run_id
            self._write()

    def unsent(self, metrics: Mapping[str, Any], step: int) -> dict[str, Any]:
        """The points of ``metrics`` at ``step`` neither resolved nor queued yet; now counted as queued."""
        with self._lock:
            if step < self._claimed_step:
                return {}
            if step > self._claimed_step:
                self._claimed_step, self._claimed_keys = step, set()
            fresh = {key: value for key, value in metrics.items() if key not in self._claimed_keys}
            self._claimed_keys.update(fresh)
            return fresh

    def resolved(self, step: int, key: str) -> bool:
        with self._lock:
            return step < self.through_step or (step == self.through_step and key in self.keys_at_step)

    def claim(self, points: Iterable[QueuedPoint]) -> None:
        """Points the last attempt left, queued again: the steps a restart trains again skip them."""
        for point in points:
            self.unsent(point.metrics, point.step)

    def _resolve(self, metrics: Iterable[str], step: int) -> None:
        if step < self.through_step:
            return
        if step > self.through_step:
            self.through_step, self.keys_at_step = step, set()
        self.keys_at_step.update(metrics)

    def acknowledge(self, metrics: Mapping[str, Any], step: int) -> None:
        """The server took these points: a restart will not send them again."""
        with self._lock:
            self._resolve(metrics, step)
            self._write()

    def acknowledge_all(self, points: Iterable[QueuedPoint]) -> None:
        """The server took these points (one request's): one write for all of them."""
        with self._lock:
            for point in points:
                self._resolve(point.metrics, point.step)
            self._write()

    def give_up(self, point: QueuedPoint) -> None:
        """An overflow dropped this point: resolved as lost. Written with the next write (this runs on
        the training thread, which must not wait for a disk)."""
        with self._lock:
            self._resolve(point.metrics, point.step)
            self.lost.add(point.step)

    def record_kept(self, kept: Tally) -> None:
        """What this attempt left queued at its end (on disk, for the next attempt); the run report shows it."""
        with self._lock:
            self.kept = kept
            self._write()


class PointJournal:
    """The queued points of one tracker on disk (see the module's docstring). Thread-safe."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._done: list[tuple[Path, int]] = []  # segments no longer written, with their last step, oldest first
        self._current: IO[str] | None = None
        self._current_path: Path | None = None
        self._current_lines, self._current_last = 0, -1
        self._next_number = 1
        self.failed = False  # the disk refused a line: from then on this attempt keeps nothing more

    def _segments(self) -> list[Path]:
        return sorted(self.folder.glob("*.jsonl")) if self.folder.is_dir() else []

    def read(self) -> list[QueuedPoint]:
        """Every point on disk, oldest first (at start, before any append)."""
        points: list[QueuedPoint] = []
        with self._lock:
            for segment in self._segments():
                found = list(_parse(segment))
                points += found
                self._done.append((segment, max((p.step for p in found), default=-1)))
                self._next_number = max(self._next_number, int(segment.stem) + 1)
        return points

    def append(self, point: QueuedPoint) -> bool:
        """Keep ``point`` on disk; False when the disk refused it (warned once)."""
        with self._lock:
            if self.failed:
                return False
            try:
                if self._current is None or self._current_lines >= SEGMENT_POINTS:
                    self._rotate()
                assert self._current is not None
                self._current.write(point.line())
                self._current.flush()  # in the page cache: a killed process loses nothing
            except OSError as error:
                self.failed = True
                log.warning(
                    "tracker queue: cannot keep points in %s (%s): points still queued when this process ends are lost",
                    self.folder,
                    error,
                )
                return False
            self._current_lines += 1
            self._current_last = max(self._current_last, point.step)
            return True

    def _rotate(self) -> None:
        """Lock held: the current segment is done; the next one opens."""
        if self._current is not None and self._current_path is not None:
            self._current.close()
            self._done.append((self._current_path, self._current_last))
        self.folder.mkdir(parents=True, exist_ok=True)
        self._current_path = self.folder / f"{self._next_number:08d}.jsonl"
        self._next_number += 1
        self._current = self._current_path.open("a", encoding="utf-8")
        self._current_lines, self._current_last = 0, -1

    def forget_before(self, step: int) -> None:
        """Remove the segments whose points are all resolved (their last step below ``step``)."""
        with self._lock:
            while self._done and self._done[0][1] < step:
                self._done.pop(0)[0].unlink(missing_ok=True)

    def clear(self) -> None:
        """Everything was resolved: nothing is left for a next attempt."""
        with self._lock:
            if self._current is not None:
                self._current.close()
                self._current = None
            for segment in self._segments():
                segment.unlink(missing_ok=True)
            self._done.clear()


def _parse(segment: Path) -> Iterable[QueuedPoint]:
    for number, line in enumerate(segment.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            entry = json.loads(line)
            yield QueuedPoint(int(entry["step"]), int(entry["time"]), {k: float(v) for k, v in entry["metrics"].items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            # The last line of a process killed while writing it: that point was never queued.
            log.warning("tracker queue: %s line %d is not a whole point: skipped", segment, number)
