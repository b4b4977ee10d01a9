"""Files that are whole or absent: written to a temporary name beside the target, then renamed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` at ``path``, or nothing there: a reader (or a second writer) never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json_atomically(path: Path, value: Any) -> None:
    write_atomically(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())
