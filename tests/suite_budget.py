"""The suite's time against its budget: each tier's wall time, written down by pytest, checked
against the table in tests/README.md ("Budget"), so a tier that grows past its budget fails the
run that grew it instead of being found days later.

Two halves:

- a pytest plugin (``tests/conftest.py`` loads it): when ``PURRSIGHT_DURATIONS`` names a file,
  the controlling pytest process writes there its tier's wall time and every test's seconds
  (setup, call and teardown summed) and start, ``{"tier", "wall_s", "tests": {nodeid: s},
  "began": {nodeid: epoch s}}``;
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
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent / "README.md"
DURATIONS_ENV = "PURRSIGHT_DURATIONS"
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

    @classmethod
    def read(cls, path: Path) -> TierTime:
        data = json.loads(path.read_text())
        return cls(str(data["tier"]), float(data["wall_s"]), {str(k): float(v) for k, v in data["tests"].items()})


def verdicts(times: list[TierTime], limits: dict[str, float], whole_s: float | None = None) -> tuple[list[str], bool]:
    """One line per tier (and the whole run), the slowest tests under each; and whether all fit."""
    lines, fits = [], True
    measured = [(t.tier, t.wall_s, t.tests) for t in times]
    if whole_s is not None:
        measured.append(("whole", whole_s, {}))
    for tier, wall_s, tests in measured:
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
    return lines, fits


class DurationsWriter:
    """The plugin: every test's seconds and the session's wall time, written at the session's end."""

    def __init__(self, path: Path, tier: str) -> None:
        self.path, self.tier = path, tier
        self.started = time.monotonic()
        self.tests: dict[str, float] = {}
        self.began: dict[str, float] = {}  # when each test's setup began (epoch s): the run's timeline

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests[report.nodeid] = self.tests.get(report.nodeid, 0.0) + report.duration
        self.began.setdefault(report.nodeid, report.start)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        record = {"tier": self.tier, "wall_s": time.monotonic() - self.started, "tests": self.tests, "began": self.began}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=1) + "\n")


def register(config: pytest.Config) -> None:
    """Called by tests/conftest.py: the writer in the controlling process only (not in xdist's workers,
    whose reports reach the controller anyway)."""
    path = os.environ.get(DURATIONS_ENV)
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationsWriter(Path(path), os.environ.get(TIER_ENV, "pytest")), "purrsight-durations")


def pytest_configure(config: pytest.Config) -> None:
    """The hook when this module is loaded as a plugin itself (``-p tests.suite_budget``)."""
    register(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Each tier's time (the plugin's files) against tests/README.md's budget.")
    parser.add_argument("files", nargs="+", type=Path, help="durations files (PURRSIGHT_DURATIONS)")
    parser.add_argument("--whole-s", type=float, help="the whole command's seconds, checked against the `whole` row")
    args = parser.parse_args(argv)
    times = [TierTime.read(path) for path in args.files if path.exists()]
    missing = [str(path) for path in args.files if not path.exists()]
    lines, fits = verdicts(times, budgets(), args.whole_s)
    for line in lines:
        print(line)
    for path in missing:
        print(f"no durations in {path}: that pytest run did not finish")
    return 0 if fits and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
