"""The node's log lines: a time stamp and the node's name, on stderr (the step's log file).

A line that cannot be written is dropped, never raised: under ``PBS_LAUNCHER=ssh`` the node's
stderr is the ssh connection, which the batch script's teardown may close first, and a node
process that died of the broken pipe would leave its Ray running with SIGTERM blocked.
"""

from __future__ import annotations

import sys
import time


class Say:
    def __init__(self, name: str) -> None:
        self.name = name
        self.lost = 0  # lines that could not be written

    def __call__(self, line: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            print(f"{stamp} [ray_node {self.name}] {line}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # a closed pipe or file: the teardown matters more than the line
            self.lost += 1
