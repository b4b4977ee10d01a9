"""What a run folder keeps of a tracker: its run, what its server holds, and what is queued for it.

``trackers.json`` (the ledger), per tracker: the tracker run's id and where it lives, the last
point *resolved* (taken by the server, or given up when the sender's queue overflowed, counted in
``lost``) and what was left queued when the last attempt ended (``kept``). Points are sent in
order, so everything up to the last resolved point is resolved. Several threads and both trackers
change the ledger (MLflow's sender records what the server took; the training thread what an
overflow gave up, a run's end left, or W&B's run id), so a process keeps one state per ledger file,
shared by every tracker's ledger. A change is made in memory under a state lock that no disk write
ever holds (the training thread takes it at every logged step); writes go one at a time under a
writer lock, each of the state as it is when its turn comes, so a write built before another
thread's change never lands after it (a stop's ``lost``, and W&B's run id, went missing that way).

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
import weakref
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


class _LedgerEntry:
    """One tracker's record in ``trackers.json``, as this process knows it (guarded by its file's state lock)."""

    def __init__(self, target: str, stored: Mapping[str, Any] | None = None) -> None:
        stored = stored or {}
        self.target = target  # where the run lives (URI, project): another target is another run
        self.run_id: str | None = stored.get("run_id")
        self.through_step: int = stored.get("through_step", -1)
        self.keys_at_step: set[str] = set(stored.get("keys_at_step", []))
        self.lost = Tally(**stored.get("lost", {}))
        self.kept = Tally(**stored.get("kept", {}))

    def as_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "run_id": self.run_id,
            "through_step": self.through_step,
            "keys_at_step": sorted(self.keys_at_step),
            **({"lost": self.lost.as_dict()} if self.lost.count else {}),
            **({"kept": self.kept.as_dict()} if self.kept.count else {}),
        }


class _LedgerFile:
    """``trackers.json`` of one run folder: one per path in a process, shared by every tracker's ledger.

    Two locks. The state lock guards the entries in memory and is held for microseconds, never
    across a disk write: the training thread takes it at every logged step. The write lock makes
    writes one at a time, each of the newest state (its snapshot is taken inside it), so a write
    never lands after a newer one; a change already written by a later write is not written again.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._stored: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        self._entries: dict[str, _LedgerEntry] = {}
        self._version = 0  # changes made in memory
        self._written = 0  # the last of them on disk

    def entry(self, tracker: str, target: str) -> _LedgerEntry:
        with self.state_lock:
            entry = self._entries.get(tracker)
            if entry is None and tracker in self._stored:
                entry = _LedgerEntry(self._stored[tracker]["target"], self._stored[tracker])
            if entry is not None and entry.target != target:
                where = entry.target
                log.warning("%s: the run folder's tracker run lives at %s, not %s: starting a new one", tracker, where, target)
                entry = None
            if entry is None:
                entry = _LedgerEntry(target)
            self._entries[tracker] = entry
            return entry

    def changed(self) -> int:
        """State lock held: the state's new version, for ``write``."""
        self._version += 1
        return self._version

    def write(self, version: int) -> None:
        """The state as it is now on disk, unless a write since change ``version`` put it there (state lock not held)."""
        with self._write_lock:
            if self._written >= version:
                return
            with self.state_lock:
                # An entry without a run yet (a new target, not attached) leaves the stored one as it was.
                ledger = {**self._stored, **{name: e.as_json() for name, e in self._entries.items() if e.run_id is not None}}
                version = self._version
            write_json_atomically(self.path, ledger)
            self._written = version


_ledger_files: weakref.WeakValueDictionary[Path, _LedgerFile] = weakref.WeakValueDictionary()
_ledger_files_lock = threading.Lock()


def _ledger_file(path: Path) -> _LedgerFile:
    """This process's one ``_LedgerFile`` for ``path``; read anew from disk once no ledger holds it."""
    with _ledger_files_lock:
        found = _ledger_files.get(path.resolve())
        if found is None:
            found = _ledger_files[path.resolve()] = _LedgerFile(path)
        return found


class TrackerLedger:
    """One tracker's entry in ``trackers.json``: its run id, the last point resolved, what was lost or kept.

    Every ledger of one run folder in a process shares one state and one writer (``_LedgerFile``):
    MLflow's sender records what its server took while W&B's start records its run, and neither
    may write over the other's record.
    """

    def __init__(self, run_dir: Path, tracker: str, target: str) -> None:
        self.path = run_dir / LEDGER_NAME
        self.tracker = tracker
        self.target = target
        self._file = _ledger_file(self.path)
        self._lock = self._file.state_lock
        self._entry = self._file.entry(tracker, target)
        with self._lock:
            # Queued in this process (or kept by the last attempt and queued again) but not yet resolved:
            # never queued twice, never recorded early.
            self._claimed_step, self._claimed_keys = self._entry.through_step, set(self._entry.keys_at_step)

    @property
    def run_id(self) -> str | None:
        return self._entry.run_id

    @property
    def through_step(self) -> int:
        return self._entry.through_step

    def remember_run(self, run_id: str) -> None:
        with self._lock:
            self._entry.run_id = run_id
            version = self._file.changed()
        self._file.write(version)

    def unsent(self, metrics: Mapping[str, Any], step: int) -> dict[str, Any]:
        """The points of ``metrics`` at ``step`` neither resolved nor queued yet; now counted as queued.
        On the training thread at every logged step: it never waits for a disk write."""
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
            return step < self._entry.through_step or (step == self._entry.through_step and key in self._entry.keys_at_step)

    def claim(self, points: Iterable[QueuedPoint]) -> None:
        """Points the last attempt left, queued again: the steps a restart trains again skip them."""
        for point in points:
            self.unsent(point.metrics, point.step)

    def _resolve(self, metrics: Iterable[str], step: int) -> None:
        """State lock held."""
        entry = self._entry
        if step < entry.through_step:
            return
        if step > entry.through_step:
            entry.through_step, entry.keys_at_step = step, set()
        entry.keys_at_step.update(metrics)

    def acknowledge(self, metrics: Mapping[str, Any], step: int) -> None:
        """The server took these points: on disk when this returns, so a restart will not send them again."""
        with self._lock:
            self._resolve(metrics, step)
            version = self._file.changed()
        self._file.write(version)

    def acknowledge_all(self, points: Iterable[QueuedPoint]) -> None:
        """The server took these points (one request's): one write for all of them."""
        with self._lock:
            for point in points:
                self._resolve(point.metrics, point.step)
            version = self._file.changed()
        self._file.write(version)

    def give_up(self, point: QueuedPoint) -> None:
        """An overflow dropped this point: resolved as lost. Written with the next write (this runs on
        the training thread, which must not wait for a disk)."""
        with self._lock:
            self._resolve(point.metrics, point.step)
            self._entry.lost.add(point.step)
            self._file.changed()

    def record_kept(self, kept: Tally) -> None:
        """What this attempt left queued at its end (on disk, for the next attempt); the run report shows it."""
        with self._lock:
            self._entry.kept = kept
            version = self._file.changed()
        self._file.write(version)


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
