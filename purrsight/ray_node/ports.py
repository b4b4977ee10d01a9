"""A job's Ray ports: a block of 100 in 10000-19999 chosen from the job id, each port probed before use.

The block follows from the job id so that two jobs sharing a node usually never meet, but ids
that differ by a multiple of 100 land on the same block, and a site's own service may hold a
port in the range: a port in use is nobody's node fault. So the head's host probes its block
before any Ray starts (``ports``) and takes the next free one when a port of it is taken; each
node probes its own six ports at its start and takes the nearest free port for a taken one.
Below Linux's ephemeral range, where an outgoing connection could take a port between the
probe and Ray's bind, and below the launcher's MASTER_PORT (20000 + job id % 20000).
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable
from dataclasses import dataclass

PORT_BASE = 10000
BLOCK = 100  # ports per job: the head's 3, then 6 per node slot
JOB_SLOTS = 100  # blocks in the range: 10000-19999
HEAD_PORTS = ("--port", "--dashboard-port", "--ray-client-server-port")
NODE_PORTS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-grpc-port",
    "--dashboard-agent-listen-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
)
NODE_SLOTS = (BLOCK - 4) // len(NODE_PORTS)  # 16: nodes further apart share ports, on different hosts


def job_number(job: str) -> int:
    return int("".join(ch for ch in job.split(".", 1)[0] if ch.isdigit()) or 0)  # "4242.server" -> 4242


@dataclass(frozen=True)
class JobPorts:
    """The ports of one job's Ray: the head's three and those of the node in ``slot``."""

    base: int

    @classmethod
    def of(cls, job: str, range_base: int = PORT_BASE) -> JobPorts:
        return cls(range_base + (job_number(job) % JOB_SLOTS) * BLOCK)

    @property
    def gcs(self) -> int:
        return self.base

    @property
    def dashboard(self) -> int:
        return self.base + 1

    def head(self) -> dict[str, int]:
        return {flag: self.base + offset for offset, flag in enumerate(HEAD_PORTS)}

    def node(self, slot: int) -> dict[str, int]:
        first = self.base + 4 + (slot % NODE_SLOTS) * len(NODE_PORTS)
        return {flag: first + offset for offset, flag in enumerate(NODE_PORTS)}


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound on every address of this host, as Ray binds most of its ports."""
    for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                # As Ray's servers do: a port whose last connection lingers in TIME_WAIT is free to them.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((wildcard, port))
        except OverflowError:  # not a port number at all (a range moved past 65535)
            return False
        except OSError as err:
            if family == socket.AF_INET6 and err.errno in (97, 99):  # no IPv6 on this host: nothing to collide with
                continue
            return False
    return True


def free_block(job: str, range_base: int = PORT_BASE, is_free: Callable[[int], bool] = port_free) -> JobPorts | None:
    """The job's own block when the head's ports and node slot 0's are free here, else the next such block."""
    first = JobPorts.of(job, range_base)
    for step in range(JOB_SLOTS):
        ports = JobPorts(range_base + ((first.base - range_base) // BLOCK + step) % JOB_SLOTS * BLOCK)
        if all(is_free(port) for port in (*ports.head().values(), *ports.node(0).values())):
            return ports
    return None


def node_flags(
    ports: JobPorts,
    slot: int,
    range_base: int = PORT_BASE,
    is_free: Callable[[int], bool] = port_free,
    moved: Callable[[str, int, int], None] | None = None,
) -> list[str]:
    """``ray start`` flags for this node's ports: its slot's, a taken one replaced by the next free port
    after the job's block (inside it, it would take a port another node of this job wants).

    Worker processes take ports the kernel picks (0): free by construction, no block needed.
    """
    end = range_base + JOB_SLOTS * BLOCK
    spares = itertools.chain(range(ports.base + BLOCK, end), range(range_base, ports.base))
    flags = ["--min-worker-port", "0", "--max-worker-port", "0"]
    for flag, wanted in ports.node(slot).items():
        port = wanted if is_free(wanted) else next((p for p in spares if is_free(p)), None)
        if port is None:
            raise OSError(f"no free port in {range_base}-{end - 1} for {flag}")
        if port != wanted and moved is not None:
            moved(flag, wanted, port)
        flags += [flag, str(port)]
    return flags
