"""The Ray engine's glue, without a cluster: paths, cluster fit, the coordinator, checkpoint reports.

``ray.train.report`` and ``ray.train.get_checkpoint`` are replaced where a test needs them:
outside a Ray Train worker they refuse to run. They stand in for Ray Train's session; the
real one is exercised by tests/ray (a two-node cluster).
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from purrsight.config import ConfigError, load_config, with_paths_under
from purrsight.distributed.stop_vote import StopRequest
from purrsight.runs.checkpoint_saver import CheckpointSaver
from tests.helpers import DEFAULT_CONFIG

pytest.importorskip("ray", reason="the Ray engine needs the ray extra (scripts/test.sh installs it)")

from purrsight.data.index import IndexFileError
from purrsight.data.prepared_manifest import PreparedSetError
from purrsight.ray_engine import callbacks, driver, worker
from purrsight.ray_engine.coordinator import RunCoordinator
from purrsight.ray_engine.pointer import POINTER_FILE, prune_stale, write_pointer
from purrsight.ray_engine.ray_noise import quiet_checkpoint_reports, without_noise


def test_relative_paths_are_taken_from_the_base_and_absolute_ones_kept(tmp_path: Path) -> None:
    config = load_config(DEFAULT_CONFIG, ["model.aligner_checkpoint=/abs/aligner.pt"], check_paths=False)
    moved = with_paths_under(config, tmp_path)
    assert moved.run.output_dir == str(tmp_path / "runs")
    assert moved.data.train_index == str(tmp_path / "data/synthetic/train.jsonl")
    assert moved.data.synthetic_dir == str(tmp_path / "data/synthetic")
    assert moved.model.aligner_checkpoint == "/abs/aligner.pt"
    assert with_paths_under(
        config.model_copy(update={"data": config.data.model_copy(update={"prepared": "sets/v1"})}), tmp_path
    ).data.prepared == str(tmp_path / "sets/v1")  # a prepared set lives under ray.shared_dir like the indexes
    assert moved.model.llm.path is None  # unset stays unset
    assert moved.trainer == config.trainer  # nothing else changes


def test_the_base_is_the_shared_dir_else_the_driver_folder(tmp_path: Path) -> None:
    shared = load_config(DEFAULT_CONFIG, [f"ray.shared_dir={tmp_path}"], check_paths=False)
    copy = Path("/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_abc")
    assert driver.base_folder(shared, copy) == tmp_path
    plain = load_config(DEFAULT_CONFIG, [], check_paths=False)
    assert driver.base_folder(plain, tmp_path) == tmp_path


def test_a_driver_in_rays_working_dir_copy_needs_a_shared_dir() -> None:
    plain = load_config(DEFAULT_CONFIG, [], check_paths=False)
    copy = Path("/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_abc")
    with pytest.raises(ConfigError) as caught:
        driver.base_folder(plain, copy)
    assert "ray.shared_dir" in caught.value.problems[0] and str(copy) in caught.value.problems[0]


def test_prepared_config_reports_a_missing_index_under_the_shared_dir(tmp_path: Path) -> None:
    config = load_config(
        DEFAULT_CONFIG, [f"ray.shared_dir={tmp_path}", "data.synthetic_dir=null", "data.train_index=nope.jsonl"], check_paths=False
    )
    with pytest.raises(ConfigError) as caught:
        driver.prepared_config(config, "cfg.yaml")
    assert str(tmp_path / "nope.jsonl") in " ".join(caught.value.problems)


def test_a_config_larger_than_the_cluster_is_refused_with_the_numbers() -> None:
    config = load_config(DEFAULT_CONFIG, ["ray.num_workers=16", "ray.resources_per_worker={GPU: 1, CPU: 8}"], check_paths=False)
    with pytest.raises(driver.RayClusterError) as caught:
        driver.check_cluster_fits(config, {"GPU": 8.0, "CPU": 256.0})
    assert "GPU 16 (the cluster has 8)" in str(caught.value) and "CPU" not in str(caught.value).split("needs")[1]
    driver.check_cluster_fits(config, {"GPU": 16.0, "CPU": 128.0})  # exactly enough


def test_an_elastic_group_needs_room_for_its_min_and_a_bad_range_is_refused_by_name() -> None:
    config = load_config(DEFAULT_CONFIG, ["ray.num_workers=[4, 16]", "ray.resources_per_worker={GPU: 1}"], check_paths=False)
    assert config.ray.worker_range == (4, 16)
    driver.check_cluster_fits(config, {"GPU": 4.0})  # Ray Train starts it with what fits, 4 to 16
    too_small = r"ray.num_workers=\[3, 8\] \(at least 3\) .* needs CPU 3 \(the cluster has 2\)"
    with pytest.raises(driver.RayClusterError, match=too_small):
        driver.check_cluster_fits(load_config(DEFAULT_CONFIG, ["ray.num_workers=[3, 8]"], check_paths=False), {"CPU": 2.0})
    assert load_config(DEFAULT_CONFIG, ["ray.num_workers=3"], check_paths=False).ray.worker_range == (3, 3)
    for bad in ("[2, 1]", "[0, 2]", "[1, 2, 3]", "[2]", "0", "two"):
        with pytest.raises(ConfigError) as caught:
            load_config(DEFAULT_CONFIG, [f"ray.num_workers={bad}"], check_paths=False)
        assert any("ray.num_workers" in problem for problem in caught.value.problems), (bad, caught.value.problems)


def test_the_launch_id_is_the_submission_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_X"}}))
    assert driver.submission_id() == "raysubmit_X"
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    assert driver.submission_id().startswith("ray-driver-")


def test_the_coordinator_counts_starts_per_rank_and_keeps_the_first_error_and_stop() -> None:
    coordinator = RunCoordinator()
    assert [coordinator.worker_started(0), coordinator.worker_started(1), coordinator.worker_started(0)] == [0, 0, 1]
    assert coordinator.user_error() is None and coordinator.stop_signal() is None
    coordinator.record_user_error(["bad sample a.png"])
    coordinator.record_user_error(["echo from another rank"])
    assert coordinator.user_error() == ["bad sample a.png"]
    coordinator.request_stop(signal.SIGTERM)
    coordinator.request_stop(signal.SIGINT)
    assert coordinator.stop_signal() == signal.SIGTERM


def test_stop_requests_work_in_a_thread_where_no_signal_handler_can_be_installed() -> None:
    stop = StopRequest()
    failures: list[BaseException] = []

    def in_thread() -> None:
        try:
            stop.install()  # signal.signal would raise ValueError here
            stop.request(signal.SIGTERM)
            stop.restore()
        except BaseException as err:
            failures.append(err)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert not failures
    assert stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the main thread's handlers untouched


def fake_trainer(saver: CheckpointSaver, rank: int) -> Any:
    return SimpleNamespace(callbacks=[saver], is_global_zero=rank == 0, global_step=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_saved_checkpoint_is_reported_once_by_every_rank(rank: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reports: list[tuple[dict[str, Any], Any, str]] = []

    def report(metrics: dict[str, Any], checkpoint: Any = None, checkpoint_dir_name: str = "") -> None:
        pointer = None
        if checkpoint is not None:  # Ray copies the folder during report; read it now
            pointer = json.loads((Path(checkpoint.path) / POINTER_FILE).read_text())
        reports.append((metrics, pointer, checkpoint_dir_name))

    monkeypatch.setattr(callbacks.ray.train, "report", report)
    saver = CheckpointSaver(tmp_path, every_n_steps=10, keep_last=3)
    trainer = fake_trainer(saver, rank)
    reporter = callbacks.ReportCheckpointsToRay(tmp_path / "ray", "job-2")
    reporter.on_train_start(trainer, None)  # type: ignore[arg-type]
    reporter.on_train_start(trainer, None)  # type: ignore[arg-type]  # a second fit listens once
    reporter.on_train_end(trainer, None)  # type: ignore[arg-type]
    assert reports == []  # nothing saved yet
    saver.last_saved_step, saver.last_saved_path = 10, tmp_path / "step-00000010.ckpt"
    for listener in saver.after_save:  # what CheckpointSaver.save calls after each write
        listener(trainer)
    reporter.on_train_end(trainer, None)  # type: ignore[arg-type]  # the same save: not reported twice
    expected_pointer = {"path": str(tmp_path / "step-00000010.ckpt"), "step": 10} if rank == 0 else None
    assert reports == [({"step": 10}, expected_pointer, "step-00000010")]


def test_a_restored_ray_checkpoint_points_at_our_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.train

    ours = tmp_path / "step-00000020.ckpt"
    ours.write_bytes(b"x")
    reported = tmp_path / "reported"
    reported.mkdir()
    (reported / POINTER_FILE).write_text(json.dumps({"path": str(ours), "step": 20}))
    monkeypatch.setattr(worker.ray.train, "get_checkpoint", lambda: ray.train.Checkpoint.from_directory(str(reported)))
    assert worker.restored_checkpoint() == str(ours)
    ours.unlink()  # rotated away or deleted by hand: fall back to the newest in the folder
    assert worker.restored_checkpoint() is None
    monkeypatch.setattr(worker.ray.train, "get_checkpoint", lambda: None)
    assert worker.restored_checkpoint() is None


def test_the_working_dir_upload_leaves_out_runs_data_logs_and_models(tmp_path: Path) -> None:
    """Ray's own packaging code (what `ray job submit --working-dir .` uploads) on a repo-like tree."""
    import shutil
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    from tests.helpers import REPO

    tree = tmp_path / "repo"
    for name in (
        "train_phase2.py",
        "purrsight/config.py",
        "runs/r/checkpoints/step-00000010.ckpt",
        "data/my.jsonl",
        "data/synthetic/train.jsonl",
        "logs/node0.log",
        "models/Qwen2.5/model.safetensors",
    ):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("x")
    shutil.copy(REPO / ".rayignore", tree / ".rayignore")
    shutil.copy(REPO / ".gitignore", tree / ".gitignore")
    package = tmp_path / "package.zip"
    create_package(str(tree), package, include_gitignore=True)
    uploaded = {name for name in zipfile.ZipFile(package).namelist() if not name.endswith("/")}
    assert {"train_phase2.py", "purrsight/config.py"} <= uploaded
    assert not [name for name in uploaded if name.split("/")[0] in {"runs", "data", "logs", "models"}], uploaded


def test_the_driver_refuses_an_incomplete_prepared_set_before_any_worker(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "plan.json").write_text("{}")  # a prepare that never finished
    config = load_config(DEFAULT_CONFIG, [f"ray.shared_dir={tmp_path}", "data.prepared=v1"], check_paths=False)
    with pytest.raises(PreparedSetError, match=r"v1 is not complete \(no manifest.json: a prepare was interrupted"):
        driver.prepared_config(config, "cfg.yaml")


def test_earlier_jobs_reports_go_with_the_checkpoints_they_name(tmp_path: Path) -> None:
    """A stopped job, then its resume: rotation deletes job-1's files; job-1's reports follow them."""
    checkpoints, ray_root = tmp_path / "checkpoints", tmp_path / "ray"
    checkpoints.mkdir()
    for job, steps in (("job-1", (10, 20)), ("job-2", (20, 30))):
        for step in steps:
            report = ray_root / job / f"step-{step:08d}"
            report.mkdir(parents=True)
            write_pointer(report, checkpoints / f"step-{step:08d}.ckpt", step)
        (ray_root / job / "checkpoint_manager_snapshot.json").write_text("{}")  # Ray's bookkeeping
    (checkpoints / "step-00000020.ckpt").write_bytes(b"x")  # step 10 and 30 rotated away (30: by job-2 itself)
    assert prune_stale(ray_root, "job-2") == [ray_root / "job-1" / "step-00000010"]
    assert (ray_root / "job-1" / "step-00000020").is_dir()  # still names a file
    assert (ray_root / "job-2" / "step-00000030").is_dir()  # the running job's reports are Ray's to prune
    (checkpoints / "step-00000020.ckpt").unlink()
    assert prune_stale(ray_root, "job-2") == [ray_root / "job-1" / "step-00000020", ray_root / "job-1"]
    assert sorted(p.name for p in ray_root.iterdir()) == ["job-2"]


def test_rays_per_checkpoint_lines_are_dropped_exactly(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import ray.train.v2._internal.execution.context as context

    quiet_checkpoint_reports()
    quiet_checkpoint_reports()  # once per worker start; filters are not stacked
    reporting = logging.getLogger(context.__file__)
    storage = logging.getLogger("ray.train.v2._internal.execution.storage")
    assert len(reporting.filters) == 1
    with caplog.at_level(logging.INFO):
        reporting.info("Reporting training result 1: TrainingReport(checkpoint=None, metrics={'step': 10}) from rank 1")
        storage.info("Checkpoint successfully created at: Checkpoint(filesystem=local, path=/r/ray/j/step-00000010)")
        reporting.warning("a report that failed")  # everything else of theirs still speaks
    assert [r.getMessage() for r in caplog.records] == ["a report that failed"]


def test_the_driver_forwards_rays_output_less_the_preemption_watcher_line() -> None:
    watcher = (
        "[2026-11-24 06:13:01,078 E 6620 6656] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and ID: "
        "'2c40' has constructor arguments in the object store and max_restarts > 0."
    )
    data = {"pid": 6620, "lines": ["Started training worker group of size 2: ", watcher], "is_err": True}
    assert without_noise(data) == {**data, "lines": ["Started training worker group of size 2: "]}
    untouched = {"pid": 1, "lines": ["Actor with class name: 'RunCoordinator' died"]}
    assert without_noise(untouched) is untouched


def test_a_failure_after_the_watchdog_fired_exits_86(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog's os._exit(86) reaches Ray as a dead worker; the driver finds its line in hangs.log."""
    import ray

    hangs_log = tmp_path / "hangs.log"
    hangs_log.write_text("2026-11-20 10:00:00 seen by rank 1: hang: an earlier job's\n")
    hangs = driver.HangsSince(hangs_log)
    coordinator = SimpleNamespace(user_error=SimpleNamespace(remote=lambda: None))
    monkeypatch.setattr(ray, "get", lambda ref: ref)  # the coordinator here is a plain object, not an actor
    assert driver._failed(coordinator, RuntimeError("worker died"), hangs) == 1  # an earlier job's hang is not this one's
    with hangs_log.open("a") as log:
        log.write("2026-11-24 10:00:00 seen by rank 0: hang: rank 1 in all_reduce at step 12\n")
    assert driver._failed(coordinator, RuntimeError("worker died"), hangs) == 86
    assert "last: 2026-11-24 10:00:00 seen by rank 0: hang: rank 1 in all_reduce at step 12" in capsys.readouterr().err


def test_the_driver_reads_a_llava_file_with_its_media_root_under_the_shared_dir(synthetic_dir: Path, tmp_path: Path) -> None:
    """data.format and data.media_root reach the driver's check of the index, and a relative media
    root is made absolute under ray.shared_dir as the index is (workers run in other folders)."""
    from tests.unit.test_cluster_logs_ranks_health import llava_file_beside_its_media_root

    index, media = llava_file_beside_its_media_root(tmp_path)
    # The synthetic set's folder only for its tokenizer (already generated: nothing written).
    overrides = [f"ray.shared_dir={tmp_path}", f"data.synthetic_dir={synthetic_dir}", "data.val_index=null", "data.format=llava"]
    overrides.append(f"data.train_index={index.relative_to(tmp_path)}")
    config = load_config(DEFAULT_CONFIG, [*overrides, f"data.media_root={media.relative_to(tmp_path)}"], check_paths=False)
    prepared = driver.prepared_config(config, "cfg.yaml")
    assert prepared.data.media_root == str(media)
    with pytest.raises(IndexFileError, match=r"image file .*annotations/coco/a.png does not exist"):
        driver.prepared_config(load_config(DEFAULT_CONFIG, overrides, check_paths=False), "cfg.yaml")


def test_the_driver_refuses_an_index_the_command_names_that_is_not_the_prepared_sets_source(tmp_path: Path) -> None:
    """The workers' copy of the config no longer knows what the command said: the driver compares."""
    (tmp_path / "v1").mkdir()
    sources = {"train": {"index": "data/a.jsonl", "format": "purrsight", "sha256": "0" * 64, "records": 4}}
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps({"format": 1, "sources": sources, "splits": {}}))
    shared = [f"ray.shared_dir={tmp_path}", "data.prepared=v1", "data.val_index=null"]
    config = load_config(DEFAULT_CONFIG, [*shared, "data.train_index=data/b.jsonl"], check_paths=False)
    with pytest.raises(PreparedSetError, match=r"data.train_index=data/b.jsonl names other data than data.prepared="):
        driver.prepared_config(config, "cfg.yaml")
    same = load_config(DEFAULT_CONFIG, [*shared, "data.train_index=data/a.jsonl"], check_paths=False)
    assert driver.prepared_config(same, "cfg.yaml").data.prepared == str(tmp_path / "v1")
