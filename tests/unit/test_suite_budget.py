"""The suite's budget check (tests/suite_budget.py): the table it reads, the file pytest writes, the verdict."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.suite_budget import CPU_COUNTED, README, TierTime, budgets, verdicts


def own_cpuacct_writable() -> bool:
    """Whether cgroup v1's cpuacct is mounted on its own here and a group can be made in it, asked
    without tests/cpu_cgroup.py (as on this project's machines and CI's, as root)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    if not any(line.split(":")[1] == "cpuacct" for line in lines):
        return False
    probe = Path("/sys/fs/cgroup/cpuacct") / f"probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return True


def test_the_readme_gives_a_budget_to_every_tier_scripts_test_sh_runs() -> None:
    limits = budgets(README)
    assert set(limits) == {"quick", "not-serial", "serial", "whole"}
    script = (REPO / "scripts" / "test.sh").read_text()
    for tier in ("quick", "not-serial", "serial"):
        assert f"PURRSIGHT_TIER={tier} " in script, f"scripts/test.sh never runs the {tier} tier under its name"
    # the two halves run side by side: each within the whole, the whole within CI's 90 minutes
    assert limits["not-serial"] <= limits["whole"] and limits["serial"] <= limits["whole"] <= 90 * 60


def test_a_tier_over_its_budget_fails_and_names_its_slowest_tests() -> None:
    limits = {"serial": 600.0, "whole": 1200.0}
    within = TierTime("serial", 599.0, {"a": 1.0})
    over = TierTime("serial", 601.0, {f"t{n}": float(n) for n in range(9)})
    assert verdicts([within], limits, whole_s=1199.0)[1]
    lines, fits = verdicts([over], limits)
    assert not fits
    assert lines[0].startswith("serial: 10.0 min of 10 (100% of its budget): OVER BUDGET")
    assert [line.split()[-1] for line in lines[1:]] == ["t8", "t7", "t6", "t5", "t4"]  # the five slowest, slowest first
    assert not verdicts([within], limits, whole_s=1201.0)[1]  # the whole command over: fails too
    assert not verdicts([TierTime("new-tier", 1.0, {})], limits)[1]  # a tier without a row is named, not passed


def test_pytest_writes_each_tests_seconds_and_the_check_reads_them(tmp_path: Path) -> None:
    """A real pytest run with the plugin (through tests/conftest.py), then the check as scripts/test.sh runs it."""
    burn = "import sys, time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\nopen(sys.argv[1], 'w')"
    # An orphan, as a fork server's workers are: its parent exits without waiting for it.
    orphan = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', *sys.argv[1:]])"
    (tmp_path / "test_two.py").write_text(
        "import os, subprocess, sys, time\n\ndef test_slow():\n    time.sleep(0.3)\n\n"
        f"def test_busy_child():\n    subprocess.run([sys.executable, '-c', {burn!r}, 'busy.done'], check=True)\n\n"
        f"def test_orphan():\n    subprocess.run([sys.executable, '-c', {orphan!r}, {burn!r}, 'orphan.done'], check=True)\n"
        "    while not os.path.exists('orphan.done'):\n        time.sleep(0.05)\n"
    )
    durations = tmp_path / "quick.json"
    env = {"PURRSIGHT_DURATIONS": str(durations), "PURRSIGHT_TIER": "quick", "PYTHONPATH": str(REPO)}
    done = subprocess.run(  # two xdist workers, as scripts/test.sh runs the tiers: the CPU is counted in each
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.suite_budget", "-p", "no:cacheprovider",
         str(tmp_path / "test_two.py")],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    record = json.loads(durations.read_text())
    assert record["tier"] == "quick"
    slow = next(seconds for nodeid, seconds in record["tests"].items() if nodeid.endswith("test_slow"))
    assert slow >= 0.3 and len(record["tests"]) == 3
    assert record["wall_s"] >= slow
    cpu = {nodeid.rsplit("::", 1)[1]: seconds for nodeid, seconds in record["cpu"].items()}
    assert cpu["test_busy_child"] >= 0.5 and cpu["test_slow"] < 0.2, cpu  # a child's CPU counts, a sleep's wait does not
    # As root on these machines (CI's too) a cgroup counts the orphan too; elsewhere (no cgroup to
    # make, or only one that would change CPU shares) only what the test waited for, and the report
    # says which.
    counted = record["cpu_counted"]
    assert counted == "cgroup" or not own_cpuacct_writable(), counted
    assert (cpu["test_orphan"] >= 0.5) == (counted == "cgroup"), cpu
    check = subprocess.run([sys.executable, "-m", "tests.suite_budget", str(durations)], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    # Two xdist workers take seconds to start on a busy machine: the wall time is not 0.0 min there.
    assert re.match(r"quick: \d+\.\d min of 4 ", check.stdout), check.stdout
    assert "test_slow" in "".join(check.stdout.splitlines()[1:4]), check.stdout
    assert CPU_COUNTED[counted] in check.stdout
    costliest = "".join(check.stdout.split("CPU:", 1)[1].splitlines()[1:3])
    assert "CPU-s  " in check.stdout and "test_busy_child" in costliest, check.stdout
