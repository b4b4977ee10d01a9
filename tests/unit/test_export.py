"""The export's folder (purrsight/training/export.py): what a killed export leaves, and whose it is.

The writer here is the one the export uses (atomic_file.publishing_folder) in a process killed
half way; the whole export killed mid-write runs in
tests/integration/test_train_single.py::test_an_export_killed_mid_write_publishes_nothing_and_the_next_one_does.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from purrsight.training.export import remove_interrupted_exports
from tests.helpers import REPO, python_env

# An export's write into its temporary folder, the process SIGKILLed half way through it.
KILLED_MID_EXPORT = """
import os, signal, sys
from pathlib import Path
from purrsight.atomic_file import publishing_folder

with publishing_folder(Path(sys.argv[1])) as folder:
    (folder / "model.safetensors").write_bytes(b"half")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_export(out: Path) -> Path:
    """The temporary folder an export to ``out`` killed half way leaves."""
    before = set(out.parent.iterdir())
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_EXPORT, str(out)], cwd=REPO, env=python_env(), timeout=120)
    assert killed.returncode == -signal.SIGKILL
    (left,) = set(out.parent.iterdir()) - before
    return left


def test_an_export_removes_the_temp_folder_of_its_own_out_only_not_of_one_its_name_prefixes(tmp_path: Path) -> None:
    """Exports to ``model`` and ``model.v2`` side by side: ``.model.*.tmp`` matched the other's
    ``.model.v2.<host>.<pid>.<random>.tmp`` too, and the export to ``model`` deleted it (perhaps
    while it was being written)."""
    theirs = killed_export(tmp_path / "model.v2")
    mine = killed_export(tmp_path / "model")
    assert mine.name.startswith(".model.") and theirs.name.startswith(".model.v2.")
    remove_interrupted_exports(tmp_path / "model")
    assert not mine.exists()
    assert (theirs / "model.safetensors").read_bytes() == b"half", "the export to model removed model.v2's temp folder"
    remove_interrupted_exports(tmp_path / "model.v2")
    assert list(tmp_path.iterdir()) == []
