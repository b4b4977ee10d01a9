"""The tracker ledger and journal (purrsight/observability/tracker_journal.py): what a restart sends
again, what it skips, and the queue a dead process leaves on disk."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from purrsight.atomic_file import stale_temp_files
from purrsight.config import ConfigError
from purrsight.observability import tracker_journal
from purrsight.observability.tracker_journal import PointJournal, QueuedPoint, TrackerLedger
from purrsight.observability.tracker_sender import Tally
from purrsight.observability.trackers import close_trackers, flat_params, require


def test_a_restart_skips_the_points_the_server_acknowledged_and_sends_the_rest(tmp_path: Path) -> None:
    first = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")
    first.remember_run("run-1")
    for step in (1, 2, 3):
        fresh = first.unsent({"train/loss": 1.0, "epoch": 0}, step)
        assert fresh == {"train/loss": 1.0, "epoch": 0}
        assert first.unsent({"train/loss": 1.0}, step) == {}  # queued once in this process
        first.acknowledge(fresh, step)
    assert first.unsent({"val/loss": 2.0, "epoch": 0}, 3) == {"val/loss": 2.0}  # same step, a metric not yet there
    first.acknowledge({"val/loss": 2.0}, 3)
    assert first.unsent({"train/loss": 1.0}, 4) == {"train/loss": 1.0}  # queued, never acknowledged: the server never took it

    again = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")  # the restarted process, resumed at step 1
    assert again.run_id == "run-1"
    assert again.unsent({"train/loss": 9.0}, 2) == {}
    assert again.unsent({"train/loss": 9.0, "val/loss": 9.0, "val/accuracy": 0.5}, 3) == {"val/accuracy": 0.5}
    assert again.unsent({"train/loss": 9.0}, 4) == {"train/loss": 9.0}  # step 4 was queued, not acknowledged: sent again


def test_another_target_is_another_run_and_the_other_tracker_is_kept(tmp_path: Path) -> None:
    TrackerLedger(tmp_path, "wandb", "project p").remember_run("w1")
    TrackerLedger(tmp_path, "mlflow", "http://a experiment x").remember_run("m1")
    moved = TrackerLedger(tmp_path, "mlflow", "http://b experiment x")
    assert moved.run_id is None and moved.through_step == -1
    moved.remember_run("m2")
    ledger = json.loads((tmp_path / "trackers.json").read_text())
    assert ledger["wandb"]["run_id"] == "w1" and ledger["mlflow"]["run_id"] == "m2"


def test_the_config_becomes_flat_parameters() -> None:
    assert flat_params({"trainer": {"max_steps": 5, "precision": "auto"}, "seed": 0}) == {
        "trainer.max_steps": "5",
        "trainer.precision": "auto",
        "seed": "0",
    }


def test_a_tracker_package_that_is_absent_is_named_with_the_fix() -> None:
    with pytest.raises(ConfigError) as raised:
        require("no_such_tracker_package", "logging.mlflow_tracking_uri", "mlflow")
    assert raised.value.problems == [
        "logging.mlflow_tracking_uri is set but the no_such_tracker_package package is not installed: "
        "pip install -e '.[mlflow]', or unset logging.mlflow_tracking_uri"
    ]


def test_a_late_write_of_the_sender_keeps_what_the_training_thread_recorded_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender's thread records an acknowledgement while the training thread records the run's end.
    A slow disk (the sender's write held until the other thread is done) must not let the sender's
    entry, built before, land over the other's: a fresh-clone CI run lost ``lost`` that way."""
    ledger = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")
    ledger.remember_run("run-1")
    writing, done = threading.Event(), threading.Event()
    write = tracker_journal.write_json_atomically

    def slow_for_the_sender(path: Path, value: object) -> None:
        if threading.current_thread().name == "mlflow-sender":
            writing.set()
            done.wait(timeout=5)
        write(path, value)

    monkeypatch.setattr(tracker_journal, "write_json_atomically", slow_for_the_sender)
    sender = threading.Thread(target=lambda: ledger.acknowledge({"train/loss": 1.0}, 5), name="mlflow-sender")
    sender.start()
    assert writing.wait(timeout=5)
    end = threading.Thread(target=lambda: ledger.record_kept(Tally(3, 6, 8)))
    end.start()
    end.join(timeout=1)  # done at once without a lock; with one it waits for the sender's write
    done.set()
    sender.join(timeout=5)
    end.join(timeout=5)
    entry = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    assert entry["kept"] == {"count": 3, "first_step": 6, "last_step": 8} and entry["through_step"] == 5


def held_for_the_sender(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """trackers.json's writes on the sender's thread held until released (a slow shared filesystem):
    returns (a write is held, release it)."""
    writing, release = threading.Event(), threading.Event()
    write = tracker_journal.write_json_atomically

    def slow_for_the_sender(path: Path, value: object) -> None:
        if threading.current_thread().name == "mlflow-sender":
            writing.set()
            release.wait(timeout=10)
        write(path, value)

    monkeypatch.setattr(tracker_journal, "write_json_atomically", slow_for_the_sender)
    return writing, release


def test_the_training_thread_never_waits_for_the_senders_disk_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """log_metrics asks the ledger at every logged step, and an overflow gives a point up there: both
    return while the sender's write of trackers.json is held. They waited for it (the write held the
    ledger's one lock: a 0.2 s fsync made log_metrics wait 0.2 s, and every rank with it)."""
    ledger = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")
    ledger.remember_run("run-1")
    writing, release = held_for_the_sender(monkeypatch)
    sender = threading.Thread(target=lambda: ledger.acknowledge({"train/loss": 1.0}, 5), name="mlflow-sender")
    sender.start()
    assert writing.wait(timeout=5)
    fresh: list[dict[str, object]] = []

    def log_two_steps() -> None:
        fresh.append(ledger.unsent({"train/loss": 2.0}, 6))
        ledger.give_up(point(6, **{"train/loss": 2.0}))

    training = threading.Thread(target=log_two_steps, name="training")
    training.start()
    training.join(timeout=2)
    returned = not training.is_alive()
    release.set()
    sender.join(timeout=10)
    training.join(timeout=10)
    assert returned, "the training thread waited for the sender's write of trackers.json"
    assert fresh == [{"train/loss": 2.0}]
    ledger.record_kept(Tally())  # the next write carries the give-up
    entry = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    assert entry["through_step"] == 6 and entry["lost"] == {"count": 1, "first_step": 6, "last_step": 6}


def test_two_trackers_ledgers_share_one_state_so_neither_write_drops_the_others_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's sender settles the last attempt's points while W&B's start records its run id, each
    through its own TrackerLedger of one trackers.json. A sender's write built before W&B's record
    landed after it: W&B's entry vanished, and the next attempt started a second W&B run."""
    mlflow = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")
    mlflow.remember_run("mlflow-run")
    wandb = TrackerLedger(tmp_path, "wandb", "project p")
    writing, release = held_for_the_sender(monkeypatch)
    sender = threading.Thread(target=lambda: mlflow.acknowledge({"train/loss": 1.0}, 5), name="mlflow-sender")
    sender.start()
    assert writing.wait(timeout=5)
    start = threading.Thread(target=lambda: wandb.remember_run("wandb-run"), name="training")
    start.start()
    start.join(timeout=1)  # waits for the sender's write (its own comes after it), or not
    release.set()
    sender.join(timeout=10)
    start.join(timeout=10)
    ledger = json.loads((tmp_path / "trackers.json").read_text())  # what the next attempt reads
    assert ledger["wandb"]["run_id"] == "wandb-run", ledger
    assert ledger["mlflow"]["run_id"] == "mlflow-run" and ledger["mlflow"]["through_step"] == 5, ledger
    assert TrackerLedger(tmp_path, "wandb", "project p").run_id == "wandb-run"  # one state in this process too


def point(step: int, **metrics: float) -> QueuedPoint:
    return QueuedPoint(step, 1_700_000_000_000 + step, metrics)


def test_the_journal_keeps_every_queued_point_in_order_and_drops_the_segments_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracker_journal, "SEGMENT_POINTS", 3)
    journal = PointJournal(tmp_path / "queue")
    for step in range(1, 9):
        assert journal.append(point(step, loss=float(step)))
    assert len(list((tmp_path / "queue").glob("*.jsonl"))) == 3  # 3 + 3 + 2 lines
    journal.forget_before(5)  # steps 1-3 all resolved; the segment of 4-6 holds unresolved ones
    again = PointJournal(tmp_path / "queue")  # the next attempt
    assert again.read() == [point(step, loss=float(step)) for step in range(4, 9)]
    assert again.append(point(9, loss=9.0))
    assert sorted(p.name for p in (tmp_path / "queue").glob("*.jsonl")) == ["00000002.jsonl", "00000003.jsonl", "00000004.jsonl"]
    again.clear()
    assert not list((tmp_path / "queue").glob("*.jsonl"))


def test_a_line_torn_by_a_kill_is_skipped(tmp_path: Path) -> None:
    journal = PointJournal(tmp_path / "queue")
    journal.append(point(1, loss=1.0))
    with (tmp_path / "queue" / "00000001.jsonl").open("a") as segment:
        segment.write('{"step": 2, "time": 17')  # the process died in this write: the point was never queued
    assert PointJournal(tmp_path / "queue").read() == [point(1, loss=1.0)]


def test_points_the_last_attempt_left_are_claimed_so_the_redone_steps_are_not_queued_again(tmp_path: Path) -> None:
    first = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")
    first.remember_run("run-1")
    first.acknowledge({"train/loss": 1.0}, 25)
    again = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")  # resumed at step 20
    assert not again.resolved(26, "train/loss") and again.resolved(25, "train/loss")
    again.claim([point(26, **{"train/loss": 2.0}), point(27, **{"train/loss": 3.0})])  # left by the first attempt
    assert again.unsent({"train/loss": 9.0}, 26) == {} and again.unsent({"train/loss": 9.0}, 27) == {}
    assert again.unsent({"train/loss": 9.0}, 28) == {"train/loss": 9.0}


def test_a_point_the_overflow_gave_up_is_resolved_and_counted_lost(tmp_path: Path) -> None:
    ledger = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")
    ledger.remember_run("run-1")
    ledger.give_up(point(3, loss=1.0))  # on the training thread: no write of its own
    assert "lost" not in json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    ledger.acknowledge({"loss": 1.0}, 4)
    entry = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    assert entry["lost"] == {"count": 1, "first_step": 3, "last_step": 3} and entry["through_step"] == 4
    assert str(Tally(2, 5, 7)) == "2 points (steps 5-7)"


def test_points_left_for_one_tracker_run_never_go_to_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run folder moved to another MLflow experiment starts a new tracker run: the queue the old
    one left on disk is not sent to it. MLflow's own SQL store, in this process (no server)."""
    from mlflow.tracking import MlflowClient

    from purrsight.config import load_config
    from purrsight.observability.trackers import RunMLflowLogger
    from tests.helpers import DEFAULT_CONFIG

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as the logger sets them, undone after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    TrackerLedger(run_dir, "mlflow", f"{uri} experiment old").remember_run("an-old-run")
    PointJournal(run_dir / "tracker_queue" / "mlflow").append(point(7, **{"train/loss": 1.0}))  # left by the old run
    config = load_config(DEFAULT_CONFIG, [f"logging.mlflow_tracking_uri={uri}", "logging.mlflow_experiment=new"], check_paths=False)
    logger = RunMLflowLogger(config, run_dir)
    logger.attach()
    logger.log_metrics({"train/loss": 2.0}, 8)
    logger.close()
    history = MlflowClient(uri).get_metric_history(str(logger.run_id), "train/loss")
    assert [(metric.step, metric.value) for metric in history] == [(8, 2.0)]


def test_the_temp_file_of_a_ledger_write_killed_half_way_is_removed_by_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's start removes what a process killed while it wrote trackers.json left (it stayed for
    good). MLflow's SQL store in this process (no server)."""
    from purrsight.config import load_config
    from purrsight.observability.trackers import RunMLflowLogger, build_trackers
    from tests.helpers import DEFAULT_CONFIG, killed_mid_publish

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as the logger sets them, undone after the test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.delenv("RANK", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torn = killed_mid_publish(run_dir / "trackers.json")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_config(DEFAULT_CONFIG, [f"logging.mlflow_tracking_uri={uri}"], check_paths=False)
    (logger,) = build_trackers(config, run_dir)
    close_trackers([logger])
    assert not torn.exists() and stale_temp_files(run_dir) == []
    assert isinstance(logger, RunMLflowLogger)
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"] == logger.run_id


def test_the_report_names_what_a_tracker_server_lacks(tmp_path: Path) -> None:
    from purrsight.observability.report import write_report

    ledger = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")
    ledger.remember_run("run-1")
    ledger.give_up(point(3, loss=1.0))
    ledger.record_kept(Tally(40, 21, 60))
    report = write_report(tmp_path).read_text()
    assert "## Tracker points never delivered\n\n- mlflow: 1 point (steps 3-3) never reached the server" in report
    waiting = "- mlflow: 40 points (steps 21-60) not on the server when the run ended, kept in tracker_queue/mlflow/"
    assert "## Tracker points waiting to be sent\n\n" + waiting in report
