"""What a checkpoint reported to Ray holds: the path and step of our checkpoint file, not a copy.

Our file in the run folder stays the one source; Ray keeps and restores the names.
"""

from __future__ import annotations

import json
from pathlib import Path

POINTER_FILE = "purrsight_checkpoint.json"


def write_pointer(folder: Path, checkpoint: Path, step: int) -> None:
    (folder / POINTER_FILE).write_text(json.dumps({"path": str(checkpoint.resolve()), "step": step}))


def read_pointer(folder: Path) -> tuple[Path, int]:
    pointer = json.loads((folder / POINTER_FILE).read_text())
    return Path(pointer["path"]), int(pointer["step"])
