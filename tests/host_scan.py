"""What another local user could see, and what a job left running: read from /proc and the file system.

Used during the real runs (tests/cluster, tests/launcher, tests/ray) as a site's admin would
check them: no secret on any command line (``/proc/PID/cmdline`` is readable by every local
user) or in a file others may read, and no process of a job left after it. The leftover check
does not go by command line, which Ray rewrites (``ray::RayTrainWorker...``), nor by the process
tree the teardown itself walks: it finds the processes that hold a file or their working folder
under the job's temp dir (every Ray process keeps its logs open there, and a child inherits them).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def shown(line: bytes) -> str:
    return line.replace(b"\0", b" ").decode(errors="replace").strip()


def pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def cmdlines_holding(secrets: Iterable[str]) -> list[str]:
    """'pid: command line' of every process whose command line holds one of ``secrets``."""
    wanted = [secret.encode() for secret in secrets if secret]
    found = []
    for pid in pids():
        line = cmdline(pid)
        if any(secret in line for secret in wanted):
            found.append(f"{pid}: {shown(line)[:300]}")
    return found


def readable_by_others_holding(secrets: Iterable[str], roots: Iterable[Path]) -> list[str]:
    """Files under ``roots`` that any user may read (mode o+r) and that hold one of ``secrets``."""
    wanted = [secret.encode() for secret in secrets if secret]
    found = []
    for root in roots:
        for folder, _, files in os.walk(root):
            for name in files:
                path = Path(folder, name)
                try:
                    info = path.lstat()
                    if not stat.S_ISREG(info.st_mode) or not info.st_mode & stat.S_IROTH or info.st_size > 64 * 2**20:
                        continue
                    data = path.read_bytes()
                except OSError:
                    continue
                if any(secret in data for secret in wanted):
                    found.append(f"{path} (mode {stat.S_IMODE(info.st_mode):o})")
    return found


def processes_with_env(name: str, value: str) -> dict[int, str]:
    """pid -> command line of each process whose environment holds ``name=value``: what every
    process a job starts inherits (SLURM's SLURM_JOB_ID, a pbsdsh task's tag), whatever it does
    later (a daemon that changes to / and closes every file is still found)."""
    wanted = f"{name}={value}\0".encode()
    found = {}
    for pid in pids():
        if pid == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes() + b"\0"
        except OSError:
            continue
        if environ.startswith(wanted) or b"\0" + wanted in environ:
            found[pid] = shown(cmdline(pid))
    return found


def processes_using(prefix: str) -> dict[int, str]:
    """pid -> command line of each process with its working folder or an open file under ``prefix``
    (a folder's path and what follows it: '/tmp/prs-12-' finds /tmp/prs-12-0 and /tmp/prs-12-1-x7/...),
    also once the folder is deleted."""
    held = {}
    for pid in pids():
        if pid == os.getpid():
            continue  # the tests' own secret scan opens the files under it, from this process
        try:
            links = [os.readlink(f"/proc/{pid}/cwd")]
            links += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(link.startswith(prefix) for link in links):
            held[pid] = shown(cmdline(pid))
    return held


# The kernel's process events connector (linux/cn_proc.h): a message for each exec, to root.
NETLINK_CONNECTOR, CN_IDX_PROC, CN_VAL_PROC, NLMSG_DONE = 11, 1, 1, 3
PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE, PROC_EVENT_EXEC = 1, 2, 2
EVENT_AT = 16 + 20  # the event after the netlink header (16 bytes) and the connector's (20)


def exec_events() -> socket.socket | None:
    """A socket that receives a message for every exec on the machine, or None where the kernel
    refuses it (not root, no connector): then the twice-a-second scan is all there is."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
    except OSError:
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 2**20)  # a busy machine's bursts of execs
        sock.bind((0, CN_IDX_PROC))
        subscribe(sock, PROC_CN_MCAST_LISTEN)
    except OSError:
        sock.close()
        return None
    return sock


def subscribe(sock: socket.socket, operation: int) -> None:
    """PROC_CN_MCAST_LISTEN or _IGNORE: the kernel sends process events while any socket listens."""
    body = struct.pack("=I", operation)
    message = struct.pack("=IIIIHH", CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(body), 0) + body
    sock.send(struct.pack("=IHHII", 16 + len(message), NLMSG_DONE, 0, 0, 0) + message)


def exec_pid(message: bytes) -> int | None:
    """The process an exec event names (its ``process_pid``), None for any other event."""
    if len(message) < EVENT_AT + 24:
        return None
    what, _cpu, _when, pid, _tgid = struct.unpack_from("=IIQII", message, EVENT_AT)
    return int(pid) if what == PROC_EVENT_EXEC else None


class SecretWatch:
    """Scans every process's command line for the secrets twice a second while a run goes on, and
    the files under ``roots`` every few seconds (temp files live only while the run does). As root,
    every exec on the machine is also read the moment the kernel reports it (the process events
    connector): a command that lives less than the scan's half second is read too, unless it ends
    before its line is read.

    ``secrets`` and ``roots`` are called at each scan: a token the job makes for itself, and the
    temp dirs it makes, join once they exist.
    """

    def __init__(
        self, secrets: Callable[[], list[str]], roots: Callable[[], list[Path]] = list, files_every_s: float = 5.0
    ) -> None:
        self.secrets = secrets
        self.roots = roots
        self.files_every_s = files_every_s
        self.hits: list[str] = []
        self.scans = 0
        self.seen: set[str] = set()
        self.execs_read = 0  # exec events whose command line was read (0: no connector here)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._events = exec_events()
        self._exec_thread = threading.Thread(target=self._read_execs, daemon=True)

    def _read_execs(self) -> None:
        assert self._events is not None
        self._events.settimeout(0.2)
        while not self._stop.is_set():
            try:
                pid = exec_pid(self._events.recv(4096))
            except TimeoutError:
                continue
            except OSError:  # ENOBUFS: events dropped while the machine was busy; the scan goes on
                continue
            if pid is None:
                continue
            line = cmdline(pid)
            if line:
                self.execs_read += 1
                # The secrets the scan has seen so far: asking for them here would walk the job's
                # folders at every exec on the machine.
                wanted = [secret.encode() for secret in list(self.seen) if secret]
                if any(secret in line for secret in wanted):
                    self.hits.append(f"{pid}: {shown(line)[:300]}")

    def _run(self) -> None:
        files_due = 0.0
        while not self._stop.wait(0.5):
            current = self.secrets()
            self.seen.update(current)
            self.hits += cmdlines_holding(current)
            if time.monotonic() >= files_due:
                self.hits += readable_by_others_holding(current, self.roots())
                files_due = time.monotonic() + self.files_every_s
            self.scans += 1

    def __enter__(self) -> SecretWatch:
        self._thread.start()
        if self._events is not None:
            self._exec_thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._events is not None:
            self._exec_thread.join()
            with contextlib.suppress(OSError):
                subscribe(self._events, PROC_CN_MCAST_IGNORE)
            self._events.close()
        self.hits += readable_by_others_holding(sorted(self.seen), self.roots())

    def assert_clean(self, expected: set[str]) -> None:
        """No hit, after scans that were looking for every one of ``expected`` (else they proved nothing)."""
        assert self.scans > 2 and expected <= self.seen, (self.scans, expected - self.seen)
        assert not self.hits, "secrets visible to every local user:\n" + "\n".join(sorted(set(self.hits)))
