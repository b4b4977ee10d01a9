"""This node's Ray temp dir: short (Ray's socket paths must fit 107 bytes) and the job's own.

``/tmp/prs-<job>-<slot>`` (RAY_TMP_ROOT moves it), never ``/tmp/ray``: another user's Ray
there stops ours. A folder of ours at that path is a run of this job before a requeue that
ended without its teardown, and is cleared. Anything else there (another user's folder, a
link, a file) is left as it is, and a fresh folder beside it is used instead: on a shared
/tmp that is nobody's node fault.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

MAX_TEMP_DIR = 40  # Ray's socket paths add ~60 bytes below the temp dir; a Unix socket path holds 107


def wanted(job: str, slot: int, root: str = "/tmp") -> Path:
    return Path(root) / f"prs-{job}-{slot}"


def make_temp_dir(job: str, slot: int, root: str, say: Callable[[str], None]) -> Path:
    """The job's temp dir for this node, made empty and 0700; another user's folder at its path is left alone."""
    path = wanted(job, slot, root)
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        path.mkdir(mode=0o700, parents=True)
        return path
    if stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid():
        shutil.rmtree(path)  # ours: left by a run of this job before a requeue
        path.mkdir(mode=0o700)
        return path
    fresh = Path(tempfile.mkdtemp(prefix=f"{path.name}-", dir=root))  # 0700, a name nobody holds
    what = "a folder of uid" if stat.S_ISDIR(found.st_mode) else "a non-folder of uid"
    say(f"{path} is {what} {found.st_uid}, not this job's: leaving it, using {fresh}")
    return fresh
