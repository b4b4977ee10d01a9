"""The suite's time against its budget: each tier's wall time, written down by pytest, checked
against the table in tests/README.md ("Budget"), so a tier that grows past its budget fails the
run that grew it instead of being found days later.

Two halves:

- a pytest plugin (``tests/conftest.py`` loads it): when ``PURRSIGHT_DURATIONS`` names a file,
  the controlling pytest process writes there its tier's wall time and every test's seconds
  (setup, call and teardown summed) and start, and the CPU seconds each test used, ``{"tier",
  "wall_s", "tests": {nodeid: s}, "began": {nodeid: epoch s}, "cpu": {nodeid: s}}``;
- ``python -m tests.suite_budget FILE...``: each file's tier against its budget, the whole run's
  time against the ``whole`` row when ``--whole-s`` gives it, the slowest tests of each tier
  named; exit 1 when anything is over budget.

scripts/test.sh does both (``PURRSIGHT_DURATIONS`` per pytest run, then the check).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.cpu_cgroup import move_into_own_cgroup

README = Path(__file__).resolve().parent / "README.md"
DURATIONS_ENV = "PURRSIGHT_DURATIONS"
CPU_PROPERTY = "purrsight_cpu_s"  # the user property a test's CPU seconds travel in
CPU_COUNTER_PROPERTY = "purrsight_cpu_counter"  # and how they were counted: "cgroup" or "waited"
CPU_COUNTED = {
    "cgroup": "in every process the tests started (a cgroup's count)",
    "waited": "in the tests' own processes and those they waited for (not fork servers' children)",
}
TIER_ENV = "PURRSIGHT_TIER"
SLOWEST_SHOWN = 5
# A budget row of tests/README.md: | `tier` | what runs | 17 min |
BUDGET_ROW = re.compile(r"^\|\s*`(?P<tier>[\w-]+)`\s*\|[^|]*\|\s*(?P<minutes>\d+(?:\.\d+)?) min\s*\|\s*$")


def budgets(readme: Path = README) -> dict[str, float]:
    """Seconds per tier, from the budget table of tests/README.md."""
    found = {m["tier"]: float(m["minutes"]) * 60 for line in readme.read_text().splitlines() if (m := BUDGET_ROW.match(line))}
    if not found:
        raise ValueError(f"{readme} has no budget table (rows like | `tier` | what | 17 min |)")
    return found


@dataclass(frozen=True)
class TierTime:
    tier: str
    wall_s: float
    tests: dict[str, float]
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per test (files before 2026-11-27: none)
    cpu_counted: str = "waited"  # "cgroup": every process the tests started; "waited": those they waited for

    @classmethod
    def read(cls, path: Path) -> TierTime:
        data = json.loads(path.read_text())
        cpu = {str(k): float(v) for k, v in data.get("cpu", {}).items()}
        tests = {str(k): float(v) for k, v in data["tests"].items()}
        return cls(str(data["tier"]), float(data["wall_s"]), tests, cpu, str(data.get("cpu_counted") or "waited"))


def verdicts(times: list[TierTime], limits: dict[str, float], whole_s: float | None = None) -> tuple[list[str], bool]:
    """One line per tier (and the whole run), the slowest tests under each; and whether all fit."""
    lines, fits = [], True
    measured = [(t.tier, t.wall_s, t.tests, t.cpu, t.cpu_counted) for t in times]
    if whole_s is not None:
        measured.append(("whole", whole_s, {}, {}, ""))
    for tier, wall_s, tests, cpu, counted in measured:
        if tier not in limits:
            lines.append(f"{tier}: {wall_s / 60:.1f} min, no budget in tests/README.md: add a row for it")
            fits = False
            continue
        over = wall_s > limits[tier]
        fits = fits and not over
        share = f"{wall_s / limits[tier]:.0%} of its budget"
        verdict = "OVER BUDGET" if over else "within budget"
        lines.append(f"{tier}: {wall_s / 60:.1f} min of {limits[tier] / 60:.0f} ({share}): {verdict}")
        for nodeid, seconds in sorted(tests.items(), key=lambda item: -item[1])[:SLOWEST_SHOWN]:
            lines.append(f"    {seconds:7.1f} s  {nodeid}")
        if cpu:  # what each test costs the suite, whatever ran beside it
            whose = CPU_COUNTED.get(counted, f"counted by {counted}")
            lines.append(f"  CPU: {sum(cpu.values()) / 60:.1f} min {whose}; the costliest:")
            for nodeid, seconds in sorted(cpu.items(), key=lambda item: -item[1])[:SLOWEST_SHOWN]:
                lines.append(f"    {seconds:7.1f} CPU-s  {nodeid}")
    return lines, fits


def cpu_seconds() -> float:
    """This process's CPU time and that of its children it has waited for (theirs, in turn, included)."""
    used = os.times()
    return used.user + used.system + used.children_user + used.children_system


def everything_started_reader() -> tuple[str, Callable[[], float]]:
    """CPU seconds of this process and all it starts, fork servers' children included, where a cgroup
    of its own can be made (tests/cpu_cgroup.py: as root, CI); else ``cpu_seconds``. With its name."""
    read = move_into_own_cgroup()
    return ("cgroup", read) if read is not None else ("waited", cpu_seconds)


class CpuPerTest:
    """In the process that runs the tests (an xdist worker, or pytest itself): each test's CPU seconds,
    its own and its waited-for subprocesses' (a torchrun job and its workers, a launcher, a trainer),
    carried to the controller in the teardown report's user properties.

    Wall time on two busy cores says how crowded the machine was; CPU says what a test costs the
    suite (one 6-CPU-second script took 67 s in a full run). As root the count is a cgroup's, made at
    the first test: everything the tests start, fork servers' workers and SLURM's and Ray's daemons
    included (a daemon's CPU lands on the test it ran beside). Elsewhere only the processes a test
    waited for count, about half a multi-rank test's CPU."""

    def __init__(self) -> None:
        self._started: dict[str, float] = {}
        self._counter: tuple[str, Callable[[], float]] | None = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self._counter is None:  # here, where tests run (not in xdist's controller)
            self._counter = everything_started_reader()
        self._started[item.nodeid] = self._counter[1]()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        if call.when == "teardown" and item.nodeid in self._started and self._counter is not None:
            kind, read = self._counter
            item.user_properties.append((CPU_PROPERTY, read() - self._started.pop(item.nodeid)))
            item.user_properties.append((CPU_COUNTER_PROPERTY, kind))
        yield


class DurationsWriter:
    """The plugin: every test's seconds and CPU seconds and the session's wall time, written at the session's end."""

    def __init__(self, path: Path, tier: str) -> None:
        self.path, self.tier = path, tier
        self.started = time.monotonic()
        self.tests: dict[str, float] = {}
        self.began: dict[str, float] = {}  # when each test's setup began (epoch s): the run's timeline
        self.cpu: dict[str, float] = {}
        self.cpu_counters: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests[report.nodeid] = self.tests.get(report.nodeid, 0.0) + report.duration
        self.began.setdefault(report.nodeid, report.start)
        for name, value in report.user_properties:
            if name == CPU_PROPERTY:
                self.cpu[report.nodeid] = round(float(value), 2)  # type: ignore[arg-type]  # user properties are objects
            elif name == CPU_COUNTER_PROPERTY:
                self.cpu_counters.add(str(value))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        record = {
            "tier": self.tier,
            "wall_s": time.monotonic() - self.started,
            "tests": self.tests,
            "began": self.began,
            "cpu": self.cpu,
            "cpu_counted": "+".join(sorted(self.cpu_counters)),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=1) + "\n")


def register(config: pytest.Config) -> None:
    """Called by tests/conftest.py: the CPU counter where tests run, the writer in the controlling
    process only (not in xdist's workers, whose reports reach the controller anyway)."""
    path = os.environ.get(DURATIONS_ENV)
    if not path:
        return
    config.pluginmanager.register(CpuPerTest(), "purrsight-cpu-per-test")  # where tests run: here, or in each worker
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationsWriter(Path(path), os.environ.get(TIER_ENV, "pytest")), "purrsight-durations")


def pytest_configure(config: pytest.Config) -> None:
    """The hook when this module is loaded as a plugin itself (``-p tests.suite_budget``)."""
    register(config)


def write_file_seconds(times: list[TierTime], out: Path, shortest_s: float = 5.0) -> None:
    """Each test file's seconds (its tests' summed) in ``times``, those of ``shortest_s`` and more,
    as tests/run_order.py reads them; the xdist tier's only (the cluster tier runs one at a time)."""
    seconds: dict[str, float] = {}
    for tier in times:
        if tier.tier == "serial":
            continue
        for nodeid, spent in tier.tests.items():
            path = nodeid.split("::", 1)[0]
            seconds[path] = seconds.get(path, 0.0) + spent
    kept = {path: round(spent, 1) for path, spent in sorted(seconds.items()) if spent >= shortest_s}
    measured = f"{time.strftime('%Y-%m-%d')}: each file's tests summed, files of {shortest_s:g} s and more"
    out.write_text(json.dumps({"measured": measured, "seconds": kept}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Each tier's time (the plugin's files) against tests/README.md's budget.")
    parser.add_argument("files", nargs="+", type=Path, help="durations files (PURRSIGHT_DURATIONS)")
    parser.add_argument("--whole-s", type=float, help="the whole command's seconds, checked against the `whole` row")
    parser.add_argument(
        "--file-seconds",
        type=Path,
        metavar="OUT",
        help="also write each file's seconds to OUT (tests/file_seconds.json: the run order's table)",
    )
    args = parser.parse_args(argv)
    times = [TierTime.read(path) for path in args.files if path.exists()]
    if args.file_seconds is not None:
        write_file_seconds(times, args.file_seconds)
    missing = [str(path) for path in args.files if not path.exists()]
    lines, fits = verdicts(times, budgets(), args.whole_s)
    for line in lines:
        print(line)
    for path in missing:
        print(f"no durations in {path}: that pytest run did not finish")
    return 0 if fits and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
