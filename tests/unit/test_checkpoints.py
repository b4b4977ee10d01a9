from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from purrsight.atomic_file import stale_temp_files
from purrsight.config import Config, load_config
from purrsight.run_folder import RunFolderError, link_or_copy, step_checkpoints
from purrsight.runs import checkpoint_saver
from purrsight.runs.checkpoint_files import CheckpointReadError, newest_checkpoint, saved_step
from purrsight.runs.checkpoint_saver import AtomicCheckpointIO
from purrsight.runs.start import ResumeError, StartPlan, choose_start, plan_start, prepare_run_folder
from purrsight.training.fingerprint import FINGERPRINT_VERSION
from purrsight.training.module import CheckpointMismatchError, verify_checkpoint
from purrsight.training.optim import warmup_cosine
from tests.helpers import DEFAULT_CONFIG, REPO, python_env
from tests.unit.test_atomic_file import DiskOrder


def test_killed_mid_write_leaves_the_previous_checkpoint_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1)}, target)

    def dies_half_way(obj: object, stream) -> None:  # type: ignore[no-untyped-def]
        stream.write(b"partial bytes of a checkpoint")
        raise KeyboardInterrupt  # what a kill during the write looks like to this process

    monkeypatch.setattr(checkpoint_saver.torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": torch.tensor(2)}, target)
    assert io.load_checkpoint(target)["step"].item() == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the temp file is gone


# A filesystem without hard links (some FUSE and SMB mounts) cannot be mounted on this machine
# (no vfat tools, no FUSE filesystem): os.link refusing is the one fake, as such a mount refuses.
LINKLESS_COPY_KILLED_AT = """
import os, resource, signal, sys
from pathlib import Path
from purrsight.run_folder import link_or_copy

def no_hard_links(*args, **kwargs):
    raise PermissionError(1, "Operation not permitted")

os.link = no_hard_links
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's default ends the writer
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
link_or_copy(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def test_a_last_ckpt_copy_killed_mid_write_leaves_the_old_one_and_a_temp_the_next_start_removes(tmp_path: Path) -> None:
    """last.ckpt copied (no hard links) by a real process the kernel kills half way through the
    write (SIGXFSZ at a file-size limit of half the checkpoint): the old last.ckpt is whole, and
    what the copy left is a temp file that the saver's start removes (stale_temp_files)."""
    newest = tmp_path / "step-00000020.ckpt"
    newest.write_bytes(os.urandom(4 * 2**20))
    last = write_checkpoint(tmp_path / "last.ckpt", 10)
    before = last.read_bytes()
    limit = 2 * 2**20
    args = [sys.executable, "-c", LINKLESS_COPY_KILLED_AT, str(newest), str(last), str(limit)]
    killed = subprocess.run(args, cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr[-2000:]
    assert last.read_bytes() == before and saved_step(last) == 10
    (torn,) = stale_temp_files(tmp_path)  # before the fix: a fixed '.last.ckpt.link' that no start removed
    assert torn.name.startswith(".last.ckpt.") and torn.stat().st_size == limit


def test_a_last_ckpt_copy_is_synced_before_it_replaces_the_old_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fsync a power cut after the rename could leave an empty last.ckpt (ext4's delayed allocation)."""
    newest = write_checkpoint(tmp_path / "step-00000020.ckpt", 20)
    write_checkpoint(tmp_path / "last.ckpt", 10)

    def no_hard_links(*args: object) -> None:  # as above: no such filesystem can be mounted here
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)
    order = DiskOrder(monkeypatch)
    link_or_copy(newest, tmp_path / "last.ckpt")
    (synced, tmp), renamed, synced_folder = order.events
    assert synced == "fsync" and Path(tmp).name.startswith(".last.ckpt.") and tmp.endswith(".tmp")
    assert renamed == ("rename", str(tmp_path / "last.ckpt")) and synced_folder == ("fsync", str(tmp_path))
    assert saved_step(tmp_path / "last.ckpt") == 20 and not stale_temp_files(tmp_path)


def test_last_ckpt_is_a_hard_link_to_the_newest_and_leaves_no_temp(tmp_path: Path) -> None:
    newest = write_checkpoint(tmp_path / "step-00000020.ckpt", 20)
    write_checkpoint(tmp_path / "last.ckpt", 10)
    for _ in range(2):  # the second time last.ckpt already is the newest: rename(2) then keeps both names
        link_or_copy(newest, tmp_path / "last.ckpt")
        assert (tmp_path / "last.ckpt").samefile(newest)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step-00000020.ckpt"]  # was: '.last.ckpt.link' left


def test_checkpoint_loading_refuses_pickled_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("owned",))

    path = tmp_path / "evil.ckpt"
    torch.save({"x": Evil()}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        AtomicCheckpointIO().load_checkpoint(path)


def write_checkpoint(path: Path, step: int = 0) -> Path:
    """The smallest file that reads as a PurrSight checkpoint saved at ``step``."""
    torch.save({"purrsight": {}, "state_dict": {"model.w": torch.zeros(64)}, "global_step": step}, path)
    return path


def test_newest_checkpoint_prefers_the_highest_step(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path) is None
    write_checkpoint(tmp_path / "last.ckpt", 7)
    assert newest_checkpoint(tmp_path) == (tmp_path / "last.ckpt", 7)
    for step in (5, 100, 20):
        write_checkpoint(tmp_path / f"step-{step:08d}.ckpt", step)
    (tmp_path / "step-junk.ckpt").write_bytes(b"x")
    assert [s for s, _ in step_checkpoints(tmp_path)] == [5, 20, 100]
    assert newest_checkpoint(tmp_path) == (tmp_path / "step-00000100.ckpt", 100)


def test_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for step in (10, 20, 30):
        write_checkpoint(tmp_path / f"step-{step:08d}.ckpt", step)
    newest = tmp_path / "step-00000030.ckpt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    (tmp_path / "step-00000020.ckpt").write_bytes(b"\x00garbage" * 100)  # corrupted
    assert newest_checkpoint(tmp_path) == (tmp_path / "step-00000010.ckpt", 10)
    assert "step-00000030.ckpt is unreadable" in caplog.text and "step-00000020.ckpt is unreadable" in caplog.text
    (tmp_path / "step-00000010.ckpt").write_bytes(b"")
    assert newest_checkpoint(tmp_path) is None  # nothing usable: the caller says so (never a silent pick)


def test_a_checkpoint_that_cannot_be_read_stops_instead_of_being_skipped(tmp_path: Path) -> None:
    """An OSError says nothing about the file: skipping it would resume an older one, or step 0."""
    write_checkpoint(tmp_path / "step-00000010.ckpt", 10)
    (tmp_path / "step-00000020.ckpt").mkdir()  # open() fails with EISDIR, a real OSError
    with pytest.raises(CheckpointReadError, match=r"cannot read checkpoint .*step-00000020\.ckpt: Is a directory"):
        newest_checkpoint(tmp_path)
    assert saved_step(write_checkpoint(tmp_path / "other.ckpt", 3)) == 3


def start(config: Config, resume: str | None = None, generation: int = 0) -> tuple[str | None, int]:
    plan = choose_start(config, resume, generation)
    return (plan.checkpoint.name if plan.checkpoint else None), plan.step


def test_choose_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PURRSIGHT_LAUNCH_ID", "launch-1")
    config = load_config(DEFAULT_CONFIG, [f"run.output_dir={tmp_path}"], check_paths=False)
    folder = tmp_path / "phase2-tiny" / "checkpoints"
    assert start(config) == (None, 0)
    assert start(config, "auto") == (None, 0)  # nothing to continue: a fresh start, no error
    with pytest.raises(ResumeError, match="no checkpoint in"):
        start(config, "newest")
    with pytest.raises(ResumeError, match=r"checkpoint /nope\.ckpt does not exist"):
        start(config, "/nope.ckpt")
    assert start(config, None, generation=1) == (None, 0)  # restarted before any checkpoint: from scratch
    folder.mkdir(parents=True, exist_ok=True)
    write_checkpoint(folder / "step-00000010.ckpt", 10)
    assert start(config, None, generation=1) == ("step-00000010.ckpt", 10)  # restarted: resumes by itself
    assert start(config, "auto") == ("step-00000010.ckpt", 10)  # PURRSIGHT_RESUME=auto (SLURM requeue)
    with pytest.raises(RunFolderError, match="already holds a run"):
        start(config, None, generation=0)  # a first start never resumes silently, nor mixes runs


def test_restarts_of_a_refused_start_are_refused_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun restarts workers that exited 2; they must not resume the run that was refused."""
    config = load_config(DEFAULT_CONFIG, [f"run.output_dir={tmp_path}"], check_paths=False)
    folder = tmp_path / "phase2-tiny" / "checkpoints"
    monkeypatch.setenv("PURRSIGHT_LAUNCH_ID", "the-earlier-run")
    assert start(config) == (None, 0)
    folder.mkdir(parents=True, exist_ok=True)
    write_checkpoint(folder / "step-00000150.ckpt", 150)
    monkeypatch.setenv("PURRSIGHT_LAUNCH_ID", "a-new-launch")
    for generation in (0, 1, 2):
        with pytest.raises(RunFolderError, match="already holds a run"):
            start(config, None, generation)
    monkeypatch.setenv("PURRSIGHT_LAUNCH_ID", "the-earlier-run")
    assert start(config, None, generation=1) == ("step-00000150.ckpt", 150)


def test_resuming_an_older_checkpoint_sets_the_later_ones_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PURRSIGHT_LAUNCH_ID", "launch-1")
    config = load_config(DEFAULT_CONFIG, [f"run.output_dir={tmp_path}"], check_paths=False)
    folder = tmp_path / "phase2-tiny" / "checkpoints"
    folder.mkdir(parents=True)
    for step in (50, 100, 150):
        write_checkpoint(folder / f"step-{step:08d}.ckpt", step)
    os.link(folder / "step-00000150.ckpt", folder / "last.ckpt")
    assert start(config, str(folder / "step-00000050.ckpt")) == ("step-00000050.ckpt", 50)
    assert [s for s, _ in step_checkpoints(folder)] == [50]
    (aside,) = folder.glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["last.ckpt", "step-00000100.ckpt", "step-00000150.ckpt"]
    assert (folder / "last.ckpt").samefile(folder / "step-00000050.ckpt")
    assert start(config, "newest") == ("step-00000050.ckpt", 50)  # the abandoned future is not resumed


def test_resuming_another_runs_checkpoint_into_a_folder_holding_a_run_is_refused(tmp_path: Path) -> None:
    elsewhere = write_checkpoint(tmp_path / "other.ckpt", 20)
    config = load_config(DEFAULT_CONFIG, [f"run.output_dir={tmp_path}"], check_paths=False)
    assert start(config, str(elsewhere)) == ("other.ckpt", 20)  # an empty folder: a new lineage from step 20
    (tmp_path / "phase2-tiny" / "metrics").mkdir(parents=True)
    (tmp_path / "phase2-tiny" / "metrics" / "metrics.csv").write_text("step,train/loss\n10,1.0\n")
    with pytest.raises(RunFolderError, match=r"phase2-tiny already holds a run \(a metrics history"):
        start(config, str(elsewhere))


def test_verify_checkpoint_names_the_difference() -> None:
    shapes = {"model.a": [2, 3]}
    meta: dict[str, object] = {"fingerprint": "f", "fingerprint_version": FINGERPRINT_VERSION}
    good = {"purrsight": meta, "state_dict": {"model.a": torch.zeros(2, 3)}}
    verify_checkpoint(good, "f", shapes, "pooled")  # no projector key: saved before there was a choice
    with pytest.raises(CheckpointMismatchError, match="fingerprint differs"):
        verify_checkpoint(good, "g", shapes, "pooled")
    with pytest.raises(CheckpointMismatchError, match=r"model\.b is missing"):
        verify_checkpoint(good, "f", {**shapes, "model.b": [1]}, "pooled")
    with pytest.raises(CheckpointMismatchError, match="not a PurrSight"):
        verify_checkpoint({"state_dict": {}}, "f", shapes, "pooled")
    with pytest.raises(CheckpointMismatchError, match=r"holds the pooled projector .* set model\.projector=pooled to resume it"):
        verify_checkpoint(good, "f", shapes, "tokens")
    tokens = {**good, "purrsight": {**meta, "projector": "tokens"}}
    verify_checkpoint(tokens, "f", shapes, "tokens")
    with pytest.raises(CheckpointMismatchError, match=r"holds the tokens projector .* set model\.projector=tokens"):
        verify_checkpoint(tokens, "f", shapes, "pooled")


def test_checkpoints_from_before_path_free_fingerprints_still_resume(caplog: pytest.LogCaptureFixture) -> None:
    """Their fingerprint hashed absolute model paths: it cannot be recomputed, so it is not held against them."""
    old = {"purrsight": {"fingerprint": "path-bound"}, "state_dict": {"model.a": torch.zeros(2, 3)}}
    verify_checkpoint(old, "f", {"model.a": [2, 3]}, "pooled")
    assert "earlier PurrSight" in caplog.text
    with pytest.raises(CheckpointMismatchError, match=r"model\.a: checkpoint shape \[2, 3\]"):
        verify_checkpoint(old, "f", {"model.a": [3, 2]}, "pooled")  # the shapes are still checked


def test_warmup_then_cosine_to_the_floor() -> None:
    values = [warmup_cosine(s, 10, 110, 0.1) for s in range(111)]
    assert values[0] < values[5] < values[9] < 1.0
    assert values[10] == pytest.approx(1.0)
    assert values[60] == pytest.approx(0.55)
    assert values[110] == pytest.approx(0.1)


def test_plan_start_decides_and_refuses_without_touching_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ray driver plans, then checks the cluster, then prepares: a refused submit changes nothing."""
    monkeypatch.setenv("PURRSIGHT_LAUNCH_ID", "launch-1")
    config = load_config(DEFAULT_CONFIG, [f"run.output_dir={tmp_path}", "run.if_exists=archive"], check_paths=False)
    run_dir = tmp_path / "phase2-tiny"
    assert plan_start(config, None) == StartPlan(None, 0, new_lineage=True)
    assert not run_dir.exists()  # absent stays absent
    (run_dir / "checkpoints").mkdir(parents=True)
    write_checkpoint(run_dir / "checkpoints" / "step-00000010.ckpt", 10)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert plan_start(config, None).new_lineage  # would archive the earlier run: not yet
    assert plan_start(config, "newest") == StartPlan(run_dir / "checkpoints" / "step-00000010.ckpt", 10)
    refusing = config.model_copy(update={"run": config.run.model_copy(update={"if_exists": "refuse"})})
    with pytest.raises(RunFolderError, match="already holds a run"):
        plan_start(refusing, None)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    prepare_run_folder(config, plan_start(config, None))  # now it happens: archived, and this launch recorded
    assert not (run_dir / "checkpoints").exists() and (run_dir / ".launch").read_text().strip() == "launch-1"
    assert len(list(tmp_path.glob("phase2-tiny.archived-*"))) == 1
