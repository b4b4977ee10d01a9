"""A resume reads what it uses of its checkpoint, not the whole file (issue 44, part 4).

Every rank loads the checkpoint, and loaded eagerly it lay whole in each rank's memory: 8 x 12 GB
a node for the pooled projector's state at the 7B preset. The trainer maps it instead
(runs/checkpoint_saver.py, runs/checkpoint_files.py) and the optimizer copies its moments out of
the mapping (training/optim.py). Here one real resume of the tiny default (training/run.py, in a
process of its own) from its own checkpoint, and one from the same checkpoint carrying 256 MiB it
never uses: the second's peak RSS must not grow by that much, and after the restore neither
process may still map its checkpoint. The 8-rank figures at the 7B preset's sizes are
bench/model/resume_memory.py's (bench/results/model.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.helpers import DEFAULT_CONFIG, REPO, run_python, tiny_overrides, train_tiny

BALLAST = 256 * 2**20  # bytes a resume never reads


def resume_probe(synthetic_dir: Path, out: Path, checkpoint: Path) -> dict[str, object]:
    args = [str(REPO / "tests" / "integration" / "resume_probe.py"), str(checkpoint), str(DEFAULT_CONFIG)]
    done = run_python([*args, *tiny_overrides(synthetic_dir, out, trainer__max_steps=3)])
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    return json.loads(line.split(" ", 1)[1])


def placed(checkpoint: Path, out: Path) -> Path:
    """``out``'s run folder holding only a file named as ``checkpoint``: where the resume starts."""
    folder = out / "phase2-tiny" / "checkpoints"
    folder.mkdir(parents=True)
    return folder / checkpoint.name


def test_a_resume_reads_what_it_uses_of_the_checkpoint_not_the_whole_file(synthetic_dir: Path, tmp_path: Path) -> None:
    first = train_tiny(synthetic_dir, tmp_path / "first", trainer__max_steps=2, checkpoint__every_n_steps=2)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = tmp_path / "first" / "phase2-tiny" / "checkpoints" / "step-00000002.ckpt"
    plain = placed(saved, tmp_path / "plain")
    shutil.copy(saved, plain)
    heavy = placed(saved, tmp_path / "heavy")
    state = torch.load(saved, map_location="cpu", weights_only=True)
    state["ballast"] = torch.ones(BALLAST // 4)  # saved as real bytes, never read by a resume
    torch.save(state, heavy)
    assert heavy.stat().st_size > plain.stat().st_size + BALLAST

    light, loaded = resume_probe(synthetic_dir, tmp_path / "plain", plain), resume_probe(synthetic_dir, tmp_path / "heavy", heavy)
    grown = int(loaded["peak_rss"]) - int(light["peak_rss"])  # type: ignore[call-overload]
    assert grown < BALLAST // 4, f"the resume's peak RSS grew {grown / 2**20:.0f} MiB with {BALLAST / 2**20:.0f} MiB it never uses"
    assert light["checkpoint_mapped"] is False and loaded["checkpoint_mapped"] is False  # the optimizer owns its moments
