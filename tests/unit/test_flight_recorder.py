"""The flight recorder's dump (purrsight/distributed/flight_recorder.py): whole or absent."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from purrsight.atomic_file import stale_temp_files
from tests.helpers import REPO, python_env

# This process's real recorder dumped with a file-size limit of half the dump: the kernel kills it
# half way (SIGXFSZ; Python ignores the signal, so its default is set back first), as torchrun's
# end of the other ranks can while their watchdogs dump.
DUMP_KILLED_MID_WRITE = """
import resource, signal, sys
from pathlib import Path
from purrsight.distributed import flight_recorder
from purrsight.internals.torch_c10d import flight_recorder_trace

size = len(flight_recorder_trace() or b"")
assert size > 2, size
(Path(sys.argv[1]) / flight_recorder.FOLDER).mkdir()
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))
flight_recorder.dump(Path(sys.argv[1]), rank=3)
"""


def test_a_dump_killed_half_way_leaves_no_rank_file_for_the_analyser(tmp_path: Path) -> None:
    """The dump was written in place: a kill left half a pickle named ``rank_3.pkl``, which PyTorch's
    analyser (``fr_trace --prefix rank_``) reads with the others."""
    killed = subprocess.run(
        [sys.executable, "-c", DUMP_KILLED_MID_WRITE, str(tmp_path)],
        cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr[-2000:]
    folder = tmp_path / "flight_recorder"
    assert not list(folder.glob("rank_*")), "a torn dump is where the analyser reads"
    assert len(stale_temp_files(folder)) == 1  # hidden: the analyser never reads it
