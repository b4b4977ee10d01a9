"""Where a command's CPU goes, by kind of process: every process it starts, the killed and the
orphaned ones too (the launcher's fork servers, Ray's actors, SLURM's job steps).

    .venv/bin/python -m bench.launch.suite_cpu --top 40 -- bash scripts/test.sh tests/launcher

The kernel's process accounting (``accton``, Debian's ``acct``; root) writes a record when any
process on the machine ends: its pid, parent, CPU time and 16-letter name, whatever ended it. A
name says little of a Python process ("python"), so while the command runs, a ``.pth`` file in
this interpreter's site-packages has every Python process that starts from this environment
write its command line to a folder, under its pid and start time (only processes that inherit the
command's environment: the folder is named in it); a process forked without an exec (a fork
server's worker) is named after its parent's. The ``.pth`` file is removed when the command
ends, however it ends. Records of processes that are not the command's (a daemon of the
machine) are counted too: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime,
# etime (a float), then eight comp_t (utime, stime, mem, io, rw, minflt, majflt, swaps), comm[16].
ACCT_V3 = struct.Struct("=BBHIIIIIIf8H16s")
ACCT_VERSION_3 = 3
TICKS_PER_S = 100  # AHZ: the unit of comp_t times
LOG_VARIABLE = "PURRSIGHT_CMDLINE_LOG"  # the folder the command's Python processes log to
# The .pth line: the whole logger, no module of its own (a process that read the line as the file
# was removed would fail to import one, and say so on stderr). Inert without the variable: other
# processes of this environment (another terminal's) log nothing.
LOGGER = f"""
folder = os.environ.get({LOG_VARIABLE!r})
if folder:
    try:
        import time
        with open("/proc/self/cmdline", "rb") as cmdline:
            line = cmdline.read().replace(b"\\0", b" ").replace(b"\\n", b" ").decode(errors="replace").strip()
        with open(os.path.join(folder, str(os.getpid())), "a") as log:
            log.write(f"{{time.time():.0f}} {{line[:500]}}\\n")
    except OSError:
        pass
"""
PTH_LINE = f"import os; exec({LOGGER!r})\n"


@dataclass(frozen=True)
class Ended:
    """One accounting record: a process that ended."""

    pid: int
    ppid: int
    started: int  # seconds since the epoch
    cpu_s: float
    comm: str


def comp_t(value: int) -> int:
    """A comp_t: 13 bits of mantissa, 3 of base-8 exponent."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 0x7))


def read_records(path: Path) -> list[Ended]:
    data = path.read_bytes()
    records = []
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        fields = ACCT_V3.unpack_from(data, offset)
        if fields[1] & 0x0F != ACCT_VERSION_3:
            raise SystemExit(f"error: {path} is not in the acct_v3 format (version {fields[1]})")
        utime, stime = comp_t(fields[10]), comp_t(fields[11])
        comm = fields[18].split(b"\0", 1)[0].decode(errors="replace")
        records.append(Ended(fields[6], fields[7], fields[8], (utime + stime) / TICKS_PER_S, comm))
    return records


def read_command_lines(folder: Path) -> dict[int, list[tuple[int, str]]]:
    """pid -> [(start time, command line)] of every Python process that started meanwhile."""
    lines: dict[int, list[tuple[int, str]]] = {}
    for path in folder.iterdir():
        for line in path.read_text(errors="replace").splitlines():
            started, _, command = line.partition(" ")
            lines.setdefault(int(path.name), []).append((int(started), command))
    return lines


def kind(command: str, prefix: str) -> str:
    """A command line shortened to what it runs: the module, script or code, not its arguments."""
    words = command.replace(prefix, "").split()
    if len(words) > 2 and words[1] in ("-m", "-c"):
        return " ".join(words[:3])[:90]
    if len(words) > 2 and words[1] == "-u":
        return " ".join(words[:4] if words[2] == "-m" else words[:3])[:90]
    return " ".join(words[:2])[:90]


def command_of(record: Ended, lines: dict[int, list[tuple[int, str]]]) -> str | None:
    """The logged command line of the process a record names: of those its pid had (pids are
    reused), the one logged nearest its start (the fork), within 3 s (an interpreter's start on a
    loaded machine)."""
    near = [(abs(started - record.started), command) for started, command in lines.get(record.pid, [])]
    near = [item for item in near if item[0] <= 3]
    return min(near)[1] if near else None


def by_kind(records: list[Ended], lines: dict[int, list[tuple[int, str]]], prefix: str) -> tuple[dict[str, float], Counter[str]]:
    """CPU seconds and counts by kind: a logged Python process by its command, a process forked from
    one (no exec, no line of its own) after its parent, any other by its name."""
    logged = {id(record): command for record in records if (command := command_of(record, lines)) is not None}
    parents: dict[int, list[tuple[int, str]]] = defaultdict(list)  # pid -> [(start, kind)]: pids are reused
    for record in records:
        if id(record) in logged:
            parents[record.pid].append((record.started, kind(logged[id(record)], prefix)))
    cpu: defaultdict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for record in records:
        # A forked child's parent: the process of that pid that started last before it.
        parent = [name for started, name in sorted(parents.get(record.ppid, [])) if started <= record.started][-1:]
        if id(record) in logged:
            key = kind(logged[id(record)], prefix)
        elif parent and record.comm.startswith(("python", "pt_", "ray::")):
            key = f"{record.comm} forked from: {parent[0]}"
        else:
            key = f"[{record.comm}]"
        cpu[key] += record.cpu_s
        count[key] += 1
    return cpu, count


def measure(command: list[str], work: Path) -> tuple[list[Ended], dict[int, list[tuple[int, str]]], int]:
    """Run ``command`` with accounting on and the command-line logger installed; its records, lines and exit code."""
    accounting, folder = work / "pacct", work / "cmdlines"
    folder.mkdir()
    accounting.touch()
    pth = Path(sysconfig.get_paths()["purelib"]) / "_purrsight_cmdline_log.pth"
    pth.write_text(PTH_LINE)
    try:
        subprocess.run(["accton", str(accounting)], check=True, stdout=subprocess.DEVNULL)
        try:
            code = subprocess.run(command, env={**os.environ, LOG_VARIABLE: str(folder)}, check=False).returncode
        finally:
            subprocess.run(["accton", "off"], check=False, stdout=subprocess.DEVNULL)
    finally:
        pth.unlink(missing_ok=True)
    time.sleep(0.5)  # the last records of processes that ended with the command
    return read_records(accounting), read_command_lines(folder), code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=30, help="kinds to list (default: %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...: what to measure")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: put it after --")
    if os.geteuid() != 0 or shutil.which("accton") is None:
        parser.error("process accounting needs root and accton (apt-get install acct)")
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as work:
        records, lines, code = measure(command, Path(work))
    cpu, count = by_kind(records, lines, prefix=re.sub(r"bin/python[\d.]*$", "", sys.executable))
    total = sum(cpu.values())
    print(f"{total / 60:.1f} CPU-min in {len(records)} processes; the command exited {code}")
    print(f"{'CPU-s':>8} {'share':>6} {'count':>6} {'each':>6}  kind")
    for key, seconds in sorted(cpu.items(), key=lambda item: -item[1])[: args.top]:
        print(f"{seconds:8.1f} {seconds / total:6.1%} {count[key]:6d} {seconds / count[key]:6.2f}  {key}")
    return code


if __name__ == "__main__":
    sys.exit(main())
