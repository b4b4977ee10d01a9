"""What a checkpoint reported to Ray holds: the path and step of our checkpoint file, not a copy.

Our file in the run folder stays the one source; Ray keeps and restores the names. Ray
prunes the reports of the job that made them (``keep_last``); those of earlier jobs into
the same run folder (a stopped job, then its resume) would outlive the checkpoints they
name once our rotation deletes them, so the running job prunes them (``prune_stale``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)
POINTER_FILE = "purrsight_checkpoint.json"


def write_pointer(folder: Path, checkpoint: Path, step: int) -> None:
    (folder / POINTER_FILE).write_text(json.dumps({"path": str(checkpoint.resolve()), "step": step}))


def read_pointer(folder: Path) -> tuple[Path, int]:
    pointer = json.loads((folder / POINTER_FILE).read_text())
    return Path(pointer["path"]), int(pointer["step"])


def prune_stale(ray_root: Path, current_job: str) -> list[Path]:
    """Delete earlier jobs' reports under ``ray_root`` whose checkpoint file is gone; what was deleted.

    A job folder left without reports goes too (its other files are Ray's bookkeeping for
    that finished job, read only by a job of the same name). The current job's reports
    are Ray's to prune: it would log an error for a folder deleted under it.
    """
    deleted: list[Path] = []
    for job in sorted(p for p in ray_root.glob("*") if p.is_dir() and p.name != current_job):
        reports = [p for p in job.glob("*") if (p / POINTER_FILE).is_file()]
        stale = [p for p in reports if not read_pointer(p)[0].exists()]
        for report in stale:
            shutil.rmtree(report, ignore_errors=True)
        deleted += stale
        if len(stale) == len(reports):
            shutil.rmtree(job, ignore_errors=True)
            deleted.append(job)
    if deleted:
        log.info("removed %d folder(s) of earlier Ray jobs under %s that named deleted checkpoints", len(deleted), ray_root)
    return deleted
