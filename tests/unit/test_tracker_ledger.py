"""The tracker ledger (purrsight/observability/trackers.py): what a restart sends again, and what it skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from purrsight.config import ConfigError
from purrsight.observability.trackers import TrackerLedger, flat_params, require


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


def test_points_in_flight_at_a_kill_are_settled_by_what_the_server_holds(tmp_path: Path) -> None:
    """Sent, then the process killed before the server's answer was recorded: the next attempt asks
    the server (MLflow's metric history) and sends again only what it lacks, so no point twice."""
    first = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")
    first.remember_run("run-1")
    first.acknowledge({"train/loss": 1.0}, 25)
    first.sending(26, 27)  # killed here: 26 reached the server, 27 did not
    again = TrackerLedger(tmp_path, "mlflow", "http://a experiment x")
    assert again.in_flight == [26, 27]
    again.settle({26: {"train/loss"}})
    assert again.in_flight is None and again.unsent({"train/loss": 9.0}, 26) == {}
    assert again.unsent({"train/loss": 9.0}, 27) == {"train/loss": 9.0}
    assert "in_flight" not in json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
