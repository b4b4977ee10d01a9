"""A run folder holds one run: never mixed with another, nothing deleted unless asked.

``<run.output_dir>/<run.name>/`` is one run's lineage: its checkpoints, its metrics
history, its telemetry and report. The rules (docs/RELIABILITY.md):

- A start without a resume into a folder that already holds a run (a checkpoint or a
  metrics history) is refused, unless ``run.if_exists`` says ``archive`` (the old run is
  renamed to ``<name>.archived-<UTC time>`` beside it) or ``overwrite`` (deleted).
- Resuming from an older checkpoint of the same folder sets the later checkpoints aside in
  ``checkpoints/superseded-<UTC time>/``: they belong to a future this run abandons.
- Resuming at step S keeps the history (metrics, telemetry) up to S; rows after S are
  redone by the resumed run and replaced.

No Lightning and no torch here: the node plan (purrsight/launcher/node_plan.py)
checks the folder on every node before torchrun, so a refused start costs a second, not a
rendezvous.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

from purrsight.atomic_file import copy_atomically, link_atomically, write_text_atomically
from purrsight.errors import UserError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
METRICS_CSV = Path("metrics") / "metrics.csv"
LAST_NAME = "last.ckpt"
STEP_PATTERN = re.compile(r"^step-(\d+)\.ckpt$")
HANGS_LOG = "hangs.log"  # one line per progress-watchdog firing (watchdog.py), read by the report and the Ray driver
LAUNCH_MARKER = ".launch"  # which launch last started training here (see launched_here)
IF_EXISTS = ("refuse", "archive", "overwrite")


class RunFolderError(UserError):
    """The run folder cannot be used as asked; the message names it and the choices."""


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def step_name(step: int) -> str:
    return f"step-{step:08d}.ckpt"


def step_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the step checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_PATTERN.match(p.name))]
    return sorted(found)


def existing_run(run_dir: Path) -> str | None:
    """What an earlier run left in ``run_dir`` that a new one would mix with; None when nothing."""
    found = []
    steps = step_checkpoints(checkpoint_dir(run_dir))
    if steps:
        found.append(f"checkpoints up to step {steps[-1][0]}")
    elif (checkpoint_dir(run_dir) / LAST_NAME).is_file():
        found.append(LAST_NAME)
    if (run_dir / METRICS_CSV).is_file():
        found.append(f"a metrics history in {METRICS_CSV}")
    return " and ".join(found) or None


def utc_stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def refusal(run_dir: Path, found: str) -> str:
    return (
        f"run folder {run_dir} already holds a run ({found}); "
        "continue it with --resume (RESUME=auto with the launcher), "
        "or start another with a new run.name=..., "
        "or start over here with run.if_exists=archive (keeps the old run beside it) "
        "or run.if_exists=overwrite (deletes it)"
    )


def refuse_mixing(run_dir: Path, if_exists: str) -> str | None:
    """Raise when ``run_dir`` holds a run that a new one would mix with and ``if_exists`` keeps it;
    else what it holds (None: nothing)."""
    found = existing_run(run_dir)
    if found is not None and if_exists not in ("archive", "overwrite"):
        raise RunFolderError(refusal(run_dir, found))
    return found


def clear_for_new_run(run_dir: Path, if_exists: str) -> None:
    """Make ``run_dir`` ready for a run that does not continue the one in it, as ``if_exists`` allows."""
    found = refuse_mixing(run_dir, if_exists)
    if found is None:
        return
    if if_exists == "archive":
        target = run_dir.with_name(f"{run_dir.name}.archived-{utc_stamp()}")
        os.rename(run_dir, target)
        log.warning("run.if_exists=archive: the earlier run in %s (%s) is now %s", run_dir, found, target)
    elif if_exists == "overwrite":
        shutil.rmtree(run_dir)
        log.warning("run.if_exists=overwrite: deleted the earlier run in %s (%s)", run_dir, found)


def link_or_copy(source: Path, target: Path) -> None:
    """Point ``target`` at ``source``: a hard link, or a copy where the filesystem has none.

    Either way through atomic_file.py (a unique temp name, fsync, rename): a writer killed
    mid-copy leaves the old ``target`` whole and a ``.*.tmp`` file that the next start removes.
    """
    try:
        link_atomically(source, target)
    except OSError:
        copy_atomically(source, target)


def set_aside_later_checkpoints(resumed: Path, step: int) -> Path | None:
    """Resuming from an older checkpoint of its own folder: move the later ones out of the way.

    Left in place, rotation (which keeps the highest steps) would delete the resumed run's
    new checkpoints as soon as they are written, and the next resume would jump back into
    the abandoned future. Returns the folder they went to, or None when there were none.
    """
    folder = resumed.parent
    later = [(saved, path) for saved, path in step_checkpoints(folder) if saved > step]
    if not later:
        return None
    aside = folder / f"superseded-{utc_stamp()}"
    aside.mkdir(exist_ok=True)
    for _, path in later:
        os.replace(path, aside / path.name)
    last = folder / LAST_NAME
    if last.exists() and not last.samefile(resumed):
        os.replace(last, aside / LAST_NAME)
        link_or_copy(resumed, last)
    log.warning(
        "resuming at step %d: set aside %d later checkpoint(s) (up to step %s) in %s",
        step,
        len(later),
        later[-1][0],
        aside,
    )
    return aside


def truncate_history(path: Path, through_step: int) -> list[str]:
    """Keep the rows of the CSV ``path`` up to ``through_step``; its header (empty if no file).

    Rows after the step a run resumes from are redone by it: kept, they would show twice.
    The file is published anew whole (atomic_file.py), so a crash leaves one version.
    """
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    kept = [row for row in rows if not row.get("step") or float(row["step"]) <= through_step]
    if len(kept) == len(rows):
        return header
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=header)
    writer.writeheader()
    writer.writerows(kept)
    write_text_atomically(path, text.getvalue())
    dropped = len(rows) - len(kept)
    log.info("%s: kept %d rows up to step %d, dropped %d after it (redone now)", path, len(kept), through_step, dropped)
    return header


def launch_id() -> str:
    """This launch, the same for every worker generation torchrun starts within it.

    The launcher names each launch (PURRSIGHT_LAUNCH_ID); under plain torchrun the agent
    (this process's parent, alive across worker restarts) does: host, pid and start time.
    """
    named = os.environ.get("PURRSIGHT_LAUNCH_ID")
    if named:
        return named
    import psutil

    parent = psutil.Process(os.getppid())
    return f"{socket.gethostname()}:{parent.pid}:{parent.create_time():.0f}"


def record_launch(run_dir: Path, launch: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(run_dir / LAUNCH_MARKER, launch + "\n")


def launched_here(run_dir: Path, launch: str) -> bool:
    """True when this launch already started training in ``run_dir``.

    A torchrun restart resumes on its own only then. When the first start was refused (the
    folder held another run), its restarts must be refused too, not resume that other run.
    """
    try:
        return (run_dir / LAUNCH_MARKER).read_text().strip() == launch
    except OSError:
        return False
