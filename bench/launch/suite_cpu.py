"""Where a command's CPU goes, by kind of process: every process it starts, the killed and the
orphaned ones too (the launcher's fork servers, Ray's actors, SLURM's job steps).

    .venv/bin/python -m bench.launch.suite_cpu --top 40 -- env CI=true bash .ci/run

The kernel's process accounting (``acct(2)``: root with CAP_SYS_PACCT) writes a record when any
process on the machine ends: its pid, parent, start, CPU time and 16-letter name, whatever ended
it. A name says little of a Python process ("python"), so while the command runs, a ``.pth`` file
in this interpreter's site-packages has every Python process of this environment that inherits
the command's environment write its command line to a folder, under its pid and start time. A
process forked without an exec (a fork server's worker, a DataLoader worker) is named after its
nearest logged ancestor. Records of processes that are not the command's (a daemon of the
machine) are counted too: run it on a quiet machine. It does not nest: the command must not run
another measure (its test skips inside one), since the machine has one accounting file.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime,
# etime (a float, in ticks), then eight comp_t (utime, stime, mem, io, rw, minflt, majflt, swaps), comm[16].
ACCT_V3 = struct.Struct("=BBHIIIIIIf8H16s")
ACCT_VERSION_3 = 3
AFORK = 0x01  # ac_flag: forked, never exec'd
TICKS_PER_S = 100  # AHZ: the unit of comp_t times and of etime
CAP_SYS_PACCT = 20
LOG_VARIABLE = "PURRSIGHT_CMDLINE_LOG"  # the folder the command's Python processes log to
# The .pth line: the whole logger, no module of its own (a process that read the line as the file
# was removed would fail to import one, and say so on stderr), and nothing it can raise reaches
# site.py (which would print it on the process's stderr). Inert without the variable.
LOGGER = f"""
folder = os.environ.get({LOG_VARIABLE!r})
if folder:
    try:
        import time
        with open("/proc/self/cmdline", "rb") as cmdline:
            line = cmdline.read().replace(b"\\0", b" ").replace(b"\\n", b" ").decode(errors="replace").strip()
        with open(os.path.join(folder, str(os.getpid())), "a", encoding="utf-8", errors="replace") as log:
            log.write(f"{{time.time():.0f}} {{line[:500]}}\\n")
    except Exception:
        pass
"""
PTH_LINE = f"import os; exec({LOGGER!r})\n"
INTERPRETER_FLAGS_WITH_VALUE = ("-X", "-W", "-Q")


@dataclass(frozen=True)
class Ended:
    """One accounting record: a process that ended."""

    pid: int
    ppid: int
    started: int  # seconds since the epoch (the kernel's: its end, less its whole seconds alive)
    alive_s: float
    cpu_s: float
    comm: str
    forked: bool  # forked and never exec'd


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
        cpu_s = (comp_t(fields[10]) + comp_t(fields[11])) / TICKS_PER_S
        comm = fields[18].split(b"\0", 1)[0].decode(errors="replace")
        records.append(Ended(fields[6], fields[7], fields[8], fields[9] / TICKS_PER_S, cpu_s, comm, bool(fields[0] & AFORK)))
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
    """A command line shortened to what it runs: the module, the code's start or the script, not its arguments."""
    words = command.replace(prefix, "").split()
    if not words:
        return "?"
    at = 1
    while at < len(words) and words[at].startswith("-") and words[at] not in ("-m", "-c"):
        at += 2 if words[at] in INTERPRETER_FLAGS_WITH_VALUE else 1  # -u, -B, -X importtime, ...
    if at + 1 < len(words) and words[at] == "-m":
        return f"{words[0]} -m {words[at + 1]}"
    if at + 1 < len(words) and words[at] == "-c":
        return f"{words[0]} -c {' '.join(words[at + 1 :])[:40]}"
    return " ".join(words[: at + 1])[:90]


def command_of(record: Ended, lines: dict[int, list[tuple[int, str]]]) -> str | None:
    """The logged command line of the process a record names: of those its pid had (pids are
    reused), the one logged nearest its start, within 3 s (an interpreter's start on a loaded
    machine, and the kernel's start rounded to whole seconds)."""
    near = [(abs(started - record.started), command) for started, command in lines.get(record.pid, [])]
    near = [item for item in near if item[0] <= 3]
    return min(near)[1] if near else None


class Kinds:
    """Each record's kind: a logged Python process by its command; a process forked from one (no
    exec, no line of its own) after its nearest logged ancestor; any other by its name."""

    def __init__(self, records: list[Ended], lines: dict[int, list[tuple[int, str]]], prefix: str) -> None:
        self.lines, self.prefix = lines, prefix
        self.by_pid: dict[int, list[Ended]] = defaultdict(list)  # pids are reused: every record of each
        self.logged: dict[int, str] = {}  # id(record) -> its own kind, for a record with a logged line
        for record in records:
            self.by_pid[record.pid].append(record)
            command = command_of(record, lines)
            if command is not None:
                self.logged[id(record)] = kind(command, prefix)

    def parent_of(self, child: Ended) -> Ended | None:
        """The record of the process ``child.ppid`` that was alive when the child started (a second
        of slack either side: the kernel's start times are whole seconds)."""
        alive = [r for r in self.by_pid.get(child.ppid, []) if r.started - 1 <= child.started <= r.started + r.alive_s + 1]
        return max(alive, key=lambda r: r.started) if alive else None

    def of(self, record: Ended) -> str:
        if id(record) in self.logged:
            return self.logged[id(record)]
        process, hops = record, 0
        while process.forked and hops < 8:
            parent = self.parent_of(process)
            if parent is None:  # alive at the end: no record, but its line, if it logged one
                started = [(at, command) for at, command in self.lines.get(process.ppid, []) if at <= process.started + 1]
                if not started:
                    break
                return f"{record.comm} forked from: {kind(max(started)[1], self.prefix)}"
            if id(parent) in self.logged:
                return f"{record.comm} forked from: {self.logged[id(parent)]}"
            process, hops = parent, hops + 1
        return f"[{record.comm}]"


def by_kind(records: list[Ended], lines: dict[int, list[tuple[int, str]]], prefix: str) -> tuple[dict[str, float], Counter[str]]:
    """CPU seconds and counts by kind (``Kinds``)."""
    kinds = Kinds(records, lines, prefix)
    cpu: defaultdict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for record in records:
        key = kinds.of(record)
        cpu[key] += record.cpu_s
        count[key] += 1
    return cpu, count


def may_account() -> bool:
    """Whether this process may switch the kernel's accounting (CAP_SYS_PACCT, which root in a
    container may lack)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_PACCT & 1)
    return False


def account_to(path: Path | None) -> None:
    """acct(2): records to ``path`` from now on, or none (None)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(path).encode() if path else None) != 0:
        error = ctypes.get_errno()
        raise SystemExit(f"error: acct({path}): {os.strerror(error)}")


def stop_on_signals(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # the finally blocks below remove the logger and stop accounting


def measure(command: list[str], work: Path) -> tuple[list[Ended], dict[int, list[tuple[int, str]]], int]:
    """Run ``command`` with accounting on and the command-line logger installed; its records, lines and exit code."""
    accounting, folder = work / "pacct", work / "cmdlines"
    folder.mkdir()
    accounting.touch()
    site = Path(sysconfig.get_paths()["purelib"])
    pth = site / f"_purrsight_cmdline_log_{os.getpid()}.pth"  # its own: a run never removes another's
    staged = pth.with_suffix(".tmp")
    staged.write_text(PTH_LINE)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on_signals)
    try:
        os.replace(staged, pth)  # whole or absent: an interpreter starting now never reads half a line
        account_to(accounting)
        try:
            child = subprocess.Popen(command, env={**os.environ, LOG_VARIABLE: str(folder)})
            try:
                code = child.wait()
            except KeyboardInterrupt:  # the terminal's SIGINT reached the command too: let it end its way
                code = child.wait()
            time.sleep(0.5)  # its orphans' last exits
        finally:
            account_to(None)
    finally:
        staged.unlink(missing_ok=True)
        pth.unlink(missing_ok=True)
    return read_records(accounting), read_command_lines(folder), 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=30, help="kinds to list (default: %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...: what to measure")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: put it after --")
    if LOG_VARIABLE in os.environ:
        parser.error("already inside a measure: the kernel has one accounting file, and this one's would end the outer one's")
    if not may_account():
        parser.error("the kernel's process accounting needs CAP_SYS_PACCT: run as root (a container may not grant it)")
    with tempfile.TemporaryDirectory(prefix="suite-cpu-", ignore_cleanup_errors=True) as work:
        records, lines, code = measure(command, Path(work))
    cpu, count = by_kind(records, lines, prefix=re.sub(r"bin/python[\d.]*$", "", sys.executable))
    total = sum(cpu.values())
    print(f"{total / 60:.1f} CPU-min in {len(records)} processes; the command exited {code}")
    print(f"{'CPU-s':>8} {'share':>6} {'count':>6} {'each':>6}  kind")
    for key, seconds in sorted(cpu.items(), key=lambda item: -item[1])[: args.top]:
        share = seconds / total if total else 0.0
        print(f"{seconds:8.1f} {share:6.1%} {count[key]:6d} {seconds / count[key]:6.2f}  {key}")
    return code


if __name__ == "__main__":
    sys.exit(main())
