"""MLflow and Weights & Biases loggers that keep one tracker run per run folder, through every restart.

Lightning's loggers open a new tracker run in every process unless handed the old run's id
(Lightning #13524, #4935), and every restart is a new process; so the id lives in the run
folder (``trackers.json``, written by rank 0 before any step is sent). After a restart the
redone steps are **not sent again**: MLflow's are skipped by our ledger of what the server
acknowledged, W&B drops a step lower than one it has. MLflow's points travel on a thread of
their own (tracker_sender.py) so a dead server never holds training. docs/OBSERVABILITY.md,
"Experiment trackers", gives the choices and their reasons.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pytorch_lightning.loggers import Logger, MLFlowLogger, WandbLogger
from pytorch_lightning.utilities import rank_zero_only

from purrsight.atomic_file import write_json_atomically
from purrsight.config import Config, ConfigError
from purrsight.observability.step_numbering import RunStepNumbering
from purrsight.observability.tracker_sender import WARN_EVERY_N_FAILURES, BackgroundSender, Call, Lost

log = logging.getLogger(__name__)

LEDGER_NAME = "trackers.json"
# The MLflow client's own retries (exponential, minutes) and timeout, for the sender's calls:
# retrying is the sender's job, and a call must give up soon enough for a stop to be prompt.
SENDER_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


class TrackerLedger:
    """One tracker's entry in ``trackers.json``: its run id and the steps it has been sent."""

    def __init__(self, run_dir: Path, tracker: str, target: str) -> None:
        self.path = run_dir / LEDGER_NAME
        self.tracker = tracker
        self.target = target  # where the run lives (URI, project): another target is another run
        entry = self._read().get(tracker, {})
        if entry.get("target") != target:
            if entry:
                log.warning(
                    "%s: the run folder's tracker run lives at %s, not %s: starting a new one", tracker, entry["target"], target
                )
            entry = {}
        self.run_id: str | None = entry.get("run_id")
        self.through_step: int = entry.get("through_step", -1)
        self.keys_at_step: set[str] = set(entry.get("keys_at_step", []))
        self.lost = Lost(**entry.get("lost", {}))
        # [first, last] step of points sent and not yet acknowledged: a kill there leaves it unknown
        # whether the server has them, and the next attempt asks the server (settle).
        self.in_flight: list[int] | None = entry.get("in_flight")
        # Queued in this process but not yet acknowledged: never queued twice, never recorded early.
        self._claimed_step, self._claimed_keys = self.through_step, set(self.keys_at_step)

    def _read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {}
        return dict(json.loads(self.path.read_text()))

    def _write(self) -> None:
        ledger = self._read()  # the other tracker's entry is kept as it is
        ledger[self.tracker] = {
            "target": self.target,
            "run_id": self.run_id,
            "through_step": self.through_step,
            "keys_at_step": sorted(self.keys_at_step),
            **({"lost": self.lost.as_dict()} if self.lost.count else {}),
            **({"in_flight": self.in_flight} if self.in_flight else {}),
        }
        write_json_atomically(self.path, ledger)

    def remember_run(self, run_id: str) -> None:
        self.run_id = run_id
        self._write()

    def unsent(self, metrics: Mapping[str, Any], step: int) -> dict[str, Any]:
        """The points of ``metrics`` at ``step`` neither acknowledged nor queued yet; now counted as queued."""
        if step < self._claimed_step:
            return {}
        if step > self._claimed_step:
            self._claimed_step, self._claimed_keys = step, set()
        fresh = {key: value for key, value in metrics.items() if key not in self._claimed_keys}
        self._claimed_keys.update(fresh)
        return fresh

    def sending(self, first_step: int, last_step: int) -> None:
        """Points of these steps go to the server now (recorded first: see in_flight)."""
        self.in_flight = [first_step, last_step]
        self._write()

    def acknowledge(self, metrics: Mapping[str, Any], step: int, write: bool = True) -> None:
        """The server took these points: a restart will not send them again."""
        if step < self.through_step:
            return
        if step > self.through_step:
            self.through_step, self.keys_at_step = step, set()
        self.keys_at_step.update(metrics)
        if self.in_flight and step >= self.in_flight[1]:
            self.in_flight = None
        if write:
            self._write()

    def settle(self, on_server: dict[int, set[str]]) -> None:
        """Resolve the last attempt's points in flight by what the server holds (step -> metric names)."""
        for step in sorted(on_server):
            self.acknowledge(dict.fromkeys(on_server[step]), step, write=False)
        self.in_flight = None
        self._claimed_step, self._claimed_keys = self.through_step, set(self.keys_at_step)
        self._write()

    def record_lost(self, lost: Lost) -> None:
        """Points this attempt could not deliver, added to the run's count (the run report shows it)."""
        self.lost.add_all(lost)
        self._write()


class _SendEachStepOnce:
    """Mixin for a tracker logger: skips what a restart logs again; a tracker error is a warning, not a crash.

    With a ``sender`` (set on rank 0 by ``attach``) the calls go through its thread; without
    one (W&B) they are made here.
    """

    ledger: TrackerLedger
    sender: BackgroundSender | None = None
    _failures = 0

    def _unsent(self, metrics: Mapping[str, float], step: int) -> dict[str, float]:
        return self.ledger.unsent(metrics, step)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        fresh = dict(metrics) if step is None else self._unsent(metrics, step)
        if not fresh:
            return
        if self.sender is not None:
            acknowledge = None if step is None else (lambda: self.ledger.acknowledge(fresh, step))
            self.sender.put(Call(lambda: self._send(fresh, step), step, acknowledge, point=self._point(fresh, step)))
            return
        try:
            self._send(fresh, step)
        except Exception as error:  # an unreachable tracker must not end a week-long run
            if self._failures % WARN_EVERY_N_FAILURES == 0:
                log.warning(
                    "%s: could not send step %s (%s: %s); training goes on, metrics/metrics.csv keeps it",
                    self.ledger.tracker,
                    step,
                    type(error).__name__,
                    error,
                )
            self._failures += 1

    def _send(self, metrics: Mapping[str, float], step: int | None) -> None:
        super().log_metrics(metrics, step)  # type: ignore[misc]  # the Lightning logger this is mixed into

    def _point(self, metrics: Mapping[str, float], step: int | None) -> Any:
        """A point's payload for a sender that sends several in one request (None: sent alone)."""
        return None

    def close_sender(self) -> None:
        """Wait a bounded time for the queued calls; name and record what never reached the server."""
        if self.sender is None:
            return
        lost = self.sender.close()
        self.sender = None
        if lost.count:
            log.warning(
                "%s: %s never reached the server before the run ended; metrics/metrics.csv keeps them",
                self.ledger.tracker,
                lost,
            )
            self.ledger.record_lost(lost)


def flat_params(value: Any, prefix: str = "") -> dict[str, str]:
    """The resolved config as ``section.key -> text``, the form trackers list as parameters."""
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flat_params(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): str(value)}


@contextmanager
def _fail_fast_http() -> Iterator[None]:
    """MLflow retries an unreachable server for minutes by default: at start a few seconds must do."""
    saved = {name: os.environ.get(name) for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="1", MLFLOW_HTTP_REQUEST_TIMEOUT="10")
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


class RunMLflowLogger(RunStepNumbering, _SendEachStepOnce, MLFlowLogger):
    def __init__(self, config: Config, run_dir: Path) -> None:
        uri = str(config.logging.mlflow_tracking_uri)
        self.ledger = TrackerLedger(run_dir, "mlflow", f"{uri} experiment {config.logging.mlflow_experiment}")
        super().__init__(
            experiment_name=config.logging.mlflow_experiment,
            run_name=run_dir.name,
            tracking_uri=uri,
            run_id=self.ledger.run_id,
            synchronous=True,  # a point is on the server when log_metrics returns: the ledger stays true
        )
        self._params = flat_params(config.model_dump(mode="json"))

    def attach(self) -> str:
        """Create or reopen the tracker run now, at start, so a wrong URI fails before any step trains."""
        continuing = self.ledger.run_id is not None
        try:
            with _fail_fast_http():
                run_id = str(self.run_id)
                if continuing:
                    self.experiment.update_run(run_id, status="RUNNING")  # the last attempt may have marked it ended
        except Exception as error:
            raise ConfigError(
                [f"logging.mlflow_tracking_uri: cannot use {self._tracking_uri}: {type(error).__name__}: {error}"]
            ) from None
        if not continuing:
            self.ledger.remember_run(run_id)
            self.log_hyperparams(self._params)
        elif self.ledger.in_flight:
            self._settle_in_flight(run_id)
        for name, value in SENDER_HTTP.items():
            os.environ.setdefault(name, value)  # a user's own setting wins: it only affects the sender's thread
        self.sender = BackgroundSender("mlflow", send_points=self._send_points)
        state = "continued" if continuing else "new"
        return f"MLflow run {run_id} ({state}) in experiment {self._experiment_name} at {self._tracking_uri}"

    def _point(self, metrics: Mapping[str, float], step: int | None) -> Any:
        """The point as MLflow entities, stamped when it was logged (not when the queue reaches it)."""
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        return [Metric(key=key, value=float(value), timestamp=stamp, step=step or 0) for key, value in metrics.items()]

    def _send_points(self, points: list[Any]) -> None:
        metrics = [metric for point in points for metric in point]
        if metrics:
            self.ledger.sending(min(m.step for m in metrics), max(m.step for m in metrics))
        self.experiment.log_batch(run_id=self.run_id, metrics=metrics, synchronous=True)

    def _settle_in_flight(self, run_id: str) -> None:
        """The last attempt ended while points were in flight: whether the server took them is asked of
        the server (their metrics' histories), so none is sent twice and none is skipped."""
        first, last = self.ledger.in_flight or [0, -1]
        on_server: dict[int, set[str]] = {}
        try:
            with _fail_fast_http():
                for key in self.experiment.get_run(run_id).data.metrics:
                    for point in self.experiment.get_metric_history(run_id, key):
                        if first <= point.step <= last:
                            on_server.setdefault(point.step, set()).add(key)
        except Exception as error:  # unknown: sending again risks a duplicate, not a loss
            log.warning("mlflow: could not ask the server about steps %d-%d (%s): they are sent again", first, last, error)
            on_server = {}
        self.ledger.settle(on_server)
        log.info(
            "mlflow: steps %d-%d were in flight when the last attempt ended; the server holds %s",
            first,
            last,
            ", ".join(str(step) for step in sorted(on_server)) or "none of them",
        )

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """Mark the run ended after the queued points, from the sender's thread (a dead server must not hold the end)."""
        if self.sender is None:
            super().finalize(status)
        else:
            self.sender.put(Call(lambda: MLFlowLogger.finalize(self, status), None))


def wandb_settings() -> Any:
    import wandb

    # W&B's file is written every 15 s by default: a killed node would lose that much history.
    return wandb.Settings(x_transaction_log_flush_interval=1.0)


class RunWandbLogger(RunStepNumbering, _SendEachStepOnce, WandbLogger):
    def __init__(self, config: Config, run_dir: Path) -> None:
        project = str(config.logging.wandb_project)
        self.ledger = TrackerLedger(run_dir, "wandb", f"project {project}")
        self._continuing = self.ledger.run_id is not None
        self._run_id = self.ledger.run_id or secrets.token_hex(4)  # W&B's own ids are 8 characters
        super().__init__(
            project=project,
            name=run_dir.name,
            id=self._run_id,
            save_dir=str(run_dir),
            offline=config.logging.wandb_mode == "offline",
            resume="allow",
            # The config goes with a new run only: W&B refuses a changed value on resume (max_steps raised, say).
            config=None if self._continuing else config.model_dump(mode="json"),
            settings=wandb_settings(),
        )

    def _unsent(self, metrics: Mapping[str, float], step: int) -> dict[str, float]:
        return dict(metrics)  # W&B drops the steps it has (see the module's docstring)

    def _send(self, metrics: Mapping[str, float], step: int | None) -> None:
        if step is None:
            self.experiment.log(dict(metrics))
        else:
            # W&B's own step is the training step, so an offline attempt synced after an earlier one
            # continues its history instead of being dropped as "steps going back".
            self.experiment.log(dict(metrics, **{"trainer/global_step": step}), step=step)

    def attach(self) -> str:
        if not self._continuing:
            self.ledger.remember_run(self._run_id)  # before wandb.init: a kill during it keeps the id
        _ = self.experiment
        where = f"offline files in {self.save_dir}/wandb (upload: wandb sync)" if self._offline else "online"
        return f"W&B run {self._run_id} ({'continued' if self._continuing else 'new'}) in project {self._project}, {where}"

    def close(self) -> None:
        """Finish the W&B run: its last points reach the file now, not at an interpreter exit that a
        Ray worker never gets (Ray ends its workers without running their exit handlers)."""
        if self._experiment is not None:
            self._experiment.finish()


def close_trackers(loggers: list[Logger]) -> None:
    """At the end of a run (finished or stopped by a signal), on rank 0: flush and close the tracker runs."""
    for logger in loggers:
        if isinstance(logger, RunWandbLogger):
            logger.close()
        if isinstance(logger, _SendEachStepOnce):
            logger.close_sender()


def require(package: str, setting: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            [f"{setting} is set but the {package} package is not installed: pip install -e '.[{extra}]', or unset {setting}"]
        )


def build_trackers(config: Config, run_dir: Path) -> list[Logger]:
    """The configured trackers, attached on rank 0 (other ranks never log, so they never connect)."""
    trackers: list[Any] = []
    if config.logging.mlflow_tracking_uri:
        require("mlflow", "logging.mlflow_tracking_uri", "mlflow")
        trackers.append(RunMLflowLogger(config, run_dir))
    if config.logging.wandb_project:
        require("wandb", "logging.wandb_project", "wandb")
        trackers.append(RunWandbLogger(config, run_dir))
    if int(os.environ.get("RANK", "0")) == 0:
        for tracker in trackers:
            log.info("tracker: %s", tracker.attach())
    return trackers
