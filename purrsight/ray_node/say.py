"""The node's log lines: a time stamp and the node's name, on stderr (the step's log file)."""

from __future__ import annotations

import sys
import time


class Say:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, line: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"{stamp} [ray_node {self.name}] {line}", file=sys.stderr, flush=True)
