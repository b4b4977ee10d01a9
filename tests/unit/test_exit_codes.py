"""The exit codes are defined once (purrsight/errors.py) and every --help lists the same ones."""

from __future__ import annotations

import re
import subprocess

from purrsight.errors import EXIT_CODE_LINES, ExitCode
from tests.helpers import REPO, run_python


def test_every_exit_code_has_one_help_line() -> None:
    listed = [int(line.split()[0]) for line in EXIT_CODE_LINES if line.split()[0].isdigit()]
    assert listed == sorted(code.value for code in ExitCode)
    assert EXIT_CODE_LINES[-1].startswith("128+N")


def test_launcher_and_trainer_help_list_the_same_exit_codes() -> None:
    launcher = subprocess.run([str(REPO / "cluster_train.sh"), "--help"], capture_output=True, text=True, check=True).stdout
    trainer = run_python([str(REPO / "train_phase2.py"), "--help"]).stdout
    for line in EXIT_CODE_LINES:
        assert line in launcher, f"cluster_train.sh --help lacks: {line}"
        assert line in trainer, f"train_phase2.py --help lacks: {line}"
    # A runbook command split over lines keeps its backslash: pasted, it still runs as one.
    assert "-- \\\n        --config" in trainer


def test_launcher_constants_match() -> None:
    script = (REPO / "cluster_train.sh").read_text()
    constants = dict(re.findall(r"^readonly (EXIT_\w+)=(\d+)$", script, flags=re.MULTILINE))
    assert constants == {
        "EXIT_USAGE": str(ExitCode.USAGE.value),
        "EXIT_HEALTH": str(ExitCode.CLUSTER.value),
    }


def test_config_error_is_reported_before_lightning_loads() -> None:
    """A config mistake costs a fraction of a second, not the seconds Lightning's import takes."""
    probe = (
        "import sys; sys.argv[0] = 'train_phase2.py'; sys.path.insert(0, '.'); import train_phase2; "
        "code = train_phase2.main(['--config', 'config/train_config.yaml', 'data.batch_size=0']); "
        "print(code, 'pytorch_lightning' in sys.modules, 'torch' in sys.modules)"
    )
    result = run_python(["-c", probe])
    assert result.stdout.split() == ["2", "False", "False"], result.stderr
    assert (
        result.stderr.strip() == "error: override data.batch_size=0: data.batch_size: "
        "Input should be greater than 0 (a whole number of samples), or auto (got 0)"
    )
