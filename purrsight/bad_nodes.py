"""The job's list of nodes to avoid: written by the node that fails (a health check, the preflight), read by slurm/train.sbatch.

Shared by the launcher's health checks and the workers' preflight, so it lives in neither.
"""

from __future__ import annotations

import os
import socket

BAD_NODES_ENV = "PURRSIGHT_BAD_NODES_FILE"  # set by slurm/train.sbatch: the nodes it should exclude on requeue
NOT_THE_NODES_FAULT = ("config", "master reachable")  # failures that say nothing against this node


def name_bad_node(failed: list[str], environ: dict[str, str] | None = None, node: str | None = None) -> str | None:
    """Append a node (by default this one) to the job's bad-node file when a check of its own failed; its line, or None.

    The config is the same on every node, and an unreachable master is the master's fault (or
    the network's): neither makes this node one to avoid. The rest (packages, data mounts,
    GPUs, disk, a writable output) are this node's.
    """
    environ = dict(os.environ) if environ is None else environ
    path = environ.get(BAD_NODES_ENV)
    own = [name for name in failed if name not in NOT_THE_NODES_FAULT]
    if not path or not own:
        return None
    line = f"{node or environ.get('SLURMD_NODENAME') or socket.gethostname()}\t{', '.join(own)}"
    with open(path, "a") as bad_nodes:
        bad_nodes.write(line + "\n")  # one short append per failing node: whole lines on a shared filesystem
    return line
