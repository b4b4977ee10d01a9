from __future__ import annotations

from pathlib import Path

import pytest
import torch

from purrsight.config import load_config
from purrsight.training import checkpoints
from purrsight.training.checkpoints import AtomicCheckpointIO, newest_checkpoint, step_checkpoints
from purrsight.training.module import CheckpointMismatchError, verify_checkpoint
from purrsight.training.optim import warmup_cosine
from purrsight.training.run import ResumeError, choose_resume
from tests.helpers import DEFAULT_CONFIG


def test_killed_mid_write_leaves_the_previous_checkpoint_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1)}, target)

    def dies_half_way(obj: object, stream) -> None:  # type: ignore[no-untyped-def]
        stream.write(b"partial bytes of a checkpoint")
        raise KeyboardInterrupt  # what a kill during the write looks like to this process

    monkeypatch.setattr(checkpoints.torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": torch.tensor(2)}, target)
    assert io.load_checkpoint(target)["step"].item() == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the temp file is gone


def test_checkpoint_loading_refuses_pickled_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("owned",))

    path = tmp_path / "evil.ckpt"
    torch.save({"x": Evil()}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        AtomicCheckpointIO().load_checkpoint(path)


def write_checkpoint(path: Path) -> Path:
    """The smallest file that reads as a PurrSight checkpoint."""
    torch.save({"purrsight": {}, "state_dict": {"model.w": torch.zeros(64)}}, path)
    return path


def test_newest_checkpoint_prefers_the_highest_step(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path) is None
    write_checkpoint(tmp_path / "last.ckpt")
    assert newest_checkpoint(tmp_path) == tmp_path / "last.ckpt"
    for step in (5, 100, 20):
        write_checkpoint(tmp_path / f"step-{step:08d}.ckpt")
    (tmp_path / "step-junk.ckpt").write_bytes(b"x")
    assert [s for s, _ in step_checkpoints(tmp_path)] == [5, 20, 100]
    assert newest_checkpoint(tmp_path) == tmp_path / "step-00000100.ckpt"


def test_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for step in (10, 20, 30):
        write_checkpoint(tmp_path / f"step-{step:08d}.ckpt")
    newest = tmp_path / "step-00000030.ckpt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    (tmp_path / "step-00000020.ckpt").write_bytes(b"\x00garbage" * 100)  # corrupted
    assert newest_checkpoint(tmp_path) == tmp_path / "step-00000010.ckpt"
    assert "step-00000030.ckpt is unreadable" in caplog.text and "step-00000020.ckpt is unreadable" in caplog.text
    (tmp_path / "step-00000010.ckpt").write_bytes(b"")
    assert newest_checkpoint(tmp_path) is None  # nothing usable: the caller says so (never a silent pick)


def test_choose_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(DEFAULT_CONFIG, [f"run.output_dir={tmp_path}"], check_paths=False)
    folder = tmp_path / "phase2-tiny" / "checkpoints"
    assert choose_resume(config, None) is None
    assert choose_resume(config, "auto") is None  # nothing to continue: a fresh start, no error
    with pytest.raises(ResumeError, match="no checkpoint in"):
        choose_resume(config, "newest")
    with pytest.raises(ResumeError, match=r"checkpoint /nope\.ckpt does not exist"):
        choose_resume(config, "/nope.ckpt")
    assert choose_resume(config, None, generation=1) is None  # restarted before any checkpoint: from scratch
    folder.mkdir(parents=True)
    write_checkpoint(folder / "step-00000010.ckpt")
    assert choose_resume(config, None, generation=1) == folder / "step-00000010.ckpt"  # restarted: resumes by itself
    assert choose_resume(config, None, generation=0) is None  # a first start never resumes silently
    assert choose_resume(config, "auto") == folder / "step-00000010.ckpt"  # PURRSIGHT_RESUME=auto (SLURM requeue)


def test_verify_checkpoint_names_the_difference() -> None:
    shapes = {"model.a": [2, 3]}
    good = {"purrsight": {"fingerprint": "f"}, "state_dict": {"model.a": torch.zeros(2, 3)}}
    verify_checkpoint(good, "f", shapes)
    with pytest.raises(CheckpointMismatchError, match="fingerprint differs"):
        verify_checkpoint(good, "g", shapes)
    with pytest.raises(CheckpointMismatchError, match=r"model\.b is missing"):
        verify_checkpoint(good, "f", {**shapes, "model.b": [1]})
    with pytest.raises(CheckpointMismatchError, match="not a PurrSight"):
        verify_checkpoint({"state_dict": {}}, "f", shapes)


def test_warmup_then_cosine_to_the_floor() -> None:
    values = [warmup_cosine(s, 10, 110, 0.1) for s in range(111)]
    assert values[0] < values[5] < values[9] < 1.0
    assert values[10] == pytest.approx(1.0)
    assert values[60] == pytest.approx(0.55)
    assert values[110] == pytest.approx(0.1)
