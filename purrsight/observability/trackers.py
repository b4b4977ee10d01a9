"""MLflow and Weights & Biases loggers that keep one tracker run per run folder, through every restart.

Lightning's loggers open a new tracker run in every process unless handed the old run's id
(Lightning #13524, #4935), and every restart is a new process; so the id lives in the run
folder (``trackers.json``, written by rank 0 before any step is sent). After a restart the
redone steps are **not sent again**: MLflow's are skipped by our ledger of what was queued and
what the server took, W&B drops a step lower than one it has. MLflow's points travel on a
thread of their own (tracker_sender.py) so a dead server never holds training, and wait on disk
until the server has them (tracker_journal.py), so a run that dies leaves them for the next
attempt. Every call at a run's start and end is bounded. docs/OBSERVABILITY.md, "Experiment
trackers", gives the choices and their reasons.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pytorch_lightning.loggers import Logger, MLFlowLogger, WandbLogger
from pytorch_lightning.utilities import rank_zero_only

from purrsight.atomic_file import remove_stale_temp_files
from purrsight.config import Config, ConfigError
from purrsight.observability.step_numbering import RunStepNumbering
from purrsight.observability.tracker_journal import LEDGER_NAME, QUEUE_DIR, PointJournal, QueuedPoint, TrackerLedger, tally
from purrsight.observability.tracker_sender import CLOSE_TIMEOUT_S, WARN_EVERY_N_FAILURES, BackgroundSender, Call, Tally

log = logging.getLogger(__name__)

T = TypeVar("T")

# The MLflow client's own retries (exponential, minutes) and timeout, for every call from the
# first: retrying is the sender's job, and a call at start or end must give up within seconds.
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
# W&B's own init waits for its service process without a limit; offline it takes a second or
# two, online its own default allows 90 s. Every other rank waits for this one meanwhile.
WANDB_START_TIMEOUT_S = 60.0
# The question "which of these points do you hold": steps per request (a batch of 100 points spans
# about 100), and the rows MLflow's server answers at most (more are sampled, not listed).
HELD_WINDOW_STEPS = 1000
HELD_MAX_ROWS = 2500


def within(timeout_s: float, call: Callable[[], T], name: str) -> T:
    """``call()`` on a thread of its own, waited for at most ``timeout_s``; TimeoutError after that.

    The thread is left to finish or hang by itself: it is a daemon and never holds the exit.
    """
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as error:  # handed to the caller, not printed by the thread
            outcome.append((False, error))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"{name} did not return within {timeout_s:g} s")
    done, value = outcome[0]
    if not done:
        raise value
    return value  # type: ignore[no-any-return]  # call's own result


def tally_steps(points: set[tuple[int, str]]) -> Tally:
    """(step, metric) pairs counted as the log counts points: one per step."""
    counted = Tally()
    for step in sorted({step for step, _ in points}):
        counted.add(step)
    return counted


def flat_params(value: Any, prefix: str = "") -> dict[str, str]:
    """The resolved config as ``section.key -> text``, the form trackers list as parameters."""
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flat_params(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): str(value)}


class MLflowThroughSender(MLFlowLogger):
    """MLflow's points queued for the sender's thread and kept on disk until the server has them."""

    ledger: TrackerLedger
    journal: PointJournal
    sender: BackgroundSender | None = None
    _closed = False
    _ask_through = -1  # the last step of the points a last attempt left: the server is asked about those first
    _whole_histories = False  # the server has no question for a range of steps (an older MLflow)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        step = 0 if step is None else step  # MLflow's own default; Lightning always gives one here
        fresh = self.ledger.unsent(metrics, step)
        if not fresh or self.sender is None:
            return
        point = QueuedPoint(step, int(time.time() * 1000), {key: float(value) for key, value in fresh.items()})
        self.journal.append(point)  # before the queue: a death from here on leaves it on disk
        self.sender.put(self._call(point))  # after close() it stays on disk only, for the next attempt

    def _call(self, point: QueuedPoint) -> Call:
        return Call(lambda: self._send_points([point], after_failure=True), point.step, point=point)

    def _send_points(self, points: list[QueuedPoint], after_failure: bool) -> None:
        """One request for the points (the sender's thread). After a failed try the server may hold
        some already (it stored them and the answer was lost), and so may it hold the points a last
        attempt left: those are not sent again."""
        asked = after_failure or any(point.step <= self._ask_through for point in points)
        held = self._held_by_server(points) if asked else set()
        metrics = [
            self._metric(key, value, point)
            for point in points
            for key, value in point.metrics.items()
            if (point.step, key) not in held
        ]
        if metrics:
            self.experiment.log_batch(run_id=self.run_id, metrics=metrics, synchronous=True)
        if held:
            log.info("mlflow: the server held %s of these already: not sent again", tally_steps(held))
        self.ledger.acknowledge_all(points)
        self.journal.forget_before(self.ledger.through_step)

    @staticmethod
    def _metric(key: str, value: float, point: QueuedPoint) -> Any:
        from mlflow.entities import Metric

        return Metric(key=key, value=value, timestamp=point.stamp_ms, step=point.step)

    def _held_by_server(self, points: list[QueuedPoint]) -> set[tuple[int, str]]:
        """Which (step, metric) of ``points`` the server holds. We send each (step, metric) once, so
        one there is one of ours. Asked per metric for the steps in question only, a window of at
        most ``HELD_WINDOW_STEPS`` steps a request: the metric's whole history (paged by MLflow's
        client, megabytes after days) was read after every failed request."""
        wanted = {(point.step, key) for point in points for key in point.metrics}
        held: set[tuple[int, str]] = set()
        for key in sorted({key for _, key in wanted}):
            steps = sorted(step for step, wanted_key in wanted if wanted_key == key)
            while steps:
                window = [step for step in steps if step < steps[0] + HELD_WINDOW_STEPS]
                steps = steps[len(window) :]
                held |= {(step, key) for step in self._steps_held(key, window[0], window[-1])} & wanted
        return held

    def _steps_held(self, key: str, first: int, last: int) -> set[int]:
        """The steps from ``first`` to ``last`` at which the server holds ``key``. MLflow's client has no
        call for a range of steps; its server has one (get-history-bulk-interval),
        which answers every row of the range unless there are more than it returns (then sampled):
        the range is then halved, so no row is missed. A server without it: the whole history."""
        from mlflow.exceptions import MlflowException
        from mlflow.protos.service_pb2 import GetMetricHistoryBulkInterval
        from mlflow.store.tracking.rest_store import RestStore
        from mlflow.utils.proto_json_utils import message_to_json

        run_id = str(self.run_id)
        store = self.experiment._tracking_client.store  # MLflow's own store of this client: REST, SQL or files
        if not isinstance(store, RestStore):  # a store in this process (sqlite:///, a folder): its own call
            rows = [row.step for row in store.get_metric_history_bulk_interval([run_id], key, HELD_MAX_ROWS, first, last)]
        elif self._whole_histories:
            return {row.step for row in self.experiment.get_metric_history(run_id, key) if first <= row.step <= last}
        else:
            question = GetMetricHistoryBulkInterval(
                run_ids=[run_id], metric_key=key, start_step=first, end_step=last, max_results=HELD_MAX_ROWS
            )
            try:
                answer = store._call_endpoint(GetMetricHistoryBulkInterval, message_to_json(question))
            except MlflowException as error:
                if error.error_code != "ENDPOINT_NOT_FOUND":
                    raise
                log.warning(
                    "mlflow: the server at %s cannot answer for a range of steps (an older MLflow): after a failed "
                    "request it is asked for whole metric histories instead, longer as the run grows; upgrade the server",
                    self._tracking_uri,
                )
                self._whole_histories = True
                return self._steps_held(key, first, last)
            rows = [row.step for row in answer.metrics]
        if len(rows) < HELD_MAX_ROWS or first == last:
            return set(rows)
        middle = (first + last) // 2
        return self._steps_held(key, first, middle) | self._steps_held(key, middle + 1, last)

    def _left_by_last_attempt(self) -> list[QueuedPoint]:
        """The points an earlier attempt queued and never saw resolved. They are queued first and the
        sender asks the server which it holds before it sends them (``_ask_through``): the start
        waits for no question (every rank waits for rank 0's start), and a slow server holds only
        the sender's thread."""
        left: list[QueuedPoint] = []
        for point in self.journal.read():
            unresolved = {key: value for key, value in point.metrics.items() if not self.ledger.resolved(point.step, key)}
            if unresolved:
                left.append(QueuedPoint(point.step, point.stamp_ms, unresolved))
        if not left:
            self.journal.clear()
            return []
        self.ledger.claim(left)  # the steps a restart trains again are not queued again
        self._ask_through = max(point.step for point in left)
        log.info(
            "mlflow: the last attempt left %s queued: sent before this attempt's points, less what the server holds already",
            tally(left),
        )
        return left

    def _dropped(self, call: Call) -> None:
        if call.point is not None:
            self.ledger.give_up(call.point)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """Mark the run ended after the queued points, from the sender's thread (a dead server must not
        hold the end). An error in training ends the process next: the queue is closed now."""
        if self.sender is None:
            return
        self.sender.put(Call(lambda: MLFlowLogger.finalize(self, status), None))
        if status == "failed":
            self.close()

    def close(self) -> None:
        """Wait a bounded time for the queue; what the server never got stays on disk and is named."""
        if self.sender is None or self._closed:
            return
        self._closed = True
        left = self.sender.close()
        points = [call.point for call in left if call.point is not None]
        if len(points) < len(left):
            log.warning("mlflow: the run's end status never reached the server (it shows the run as running)")
        if self.sender.lost.count:
            log.warning(
                "mlflow: %s gave way in the queue during the outage and never reached the server; metrics/metrics.csv keeps them",
                self.sender.lost,
            )
        if points and self.journal.failed:  # not all of them on disk: named as lost instead
            log.warning("mlflow: %s never reached the server before the run ended; metrics/metrics.csv keeps them", tally(points))
            for point in points:
                self.ledger.give_up(point)
            points = []
        elif points:
            log.warning(
                "mlflow: %s not on the server when the run ended: kept in %s; the next attempt (a resume) sends them",
                tally(points),
                self.journal.folder,
            )
        self.ledger.record_kept(tally(points))  # also writes what the overflow gave up
        if not points:
            self.journal.clear()


class RunMLflowLogger(RunStepNumbering, MLflowThroughSender):
    def __init__(self, config: Config, run_dir: Path) -> None:
        for name, value in MLFLOW_HTTP.items():
            os.environ.setdefault(name, value)  # before the first call; a user's own setting wins
        uri = str(config.logging.mlflow_tracking_uri)
        self.ledger = TrackerLedger(run_dir, "mlflow", f"{uri} experiment {config.logging.mlflow_experiment}")
        self.journal = PointJournal(run_dir / QUEUE_DIR / "mlflow")
        super().__init__(
            experiment_name=config.logging.mlflow_experiment,
            run_name=run_dir.name,
            tracking_uri=uri,
            run_id=self.ledger.run_id,
            synchronous=True,  # a point is on the server when log_batch returns: the ledger stays true
        )
        self._params = flat_params(config.model_dump(mode="json"))

    def attach(self) -> str:
        """Create or reopen the tracker run now, at start, so a wrong URI fails before any step trains."""
        continuing = self.ledger.run_id is not None
        try:
            run_id = str(self.run_id)
            left: list[QueuedPoint] = []
            if continuing:
                self.experiment.update_run(run_id, status="RUNNING")  # the last attempt may have marked it ended
                left = self._left_by_last_attempt()
            else:
                self.journal.clear()  # points of another tracker run (the target changed): not this one's
                self.ledger.remember_run(run_id)
                MLFlowLogger.log_hyperparams(self, self._params)
        except Exception as error:
            raise ConfigError(
                [f"logging.mlflow_tracking_uri: cannot use {self._tracking_uri}: {type(error).__name__}: {error}"]
            ) from None
        self.sender = BackgroundSender("mlflow", send_points=self._send_points, on_dropped=self._dropped)
        for point in left:
            self.sender.put(self._call(point))
        state = "continued" if continuing else "new"
        return f"MLflow run {run_id} ({state}) in experiment {self._experiment_name} at {self._tracking_uri}"


def wandb_settings() -> Any:
    import wandb

    # W&B's file is written every 15 s by default: a killed node would lose that much history.
    return wandb.Settings(x_transaction_log_flush_interval=1.0)


def stop_wandb_service() -> None:
    """End a W&B service process that does not answer: W&B's own exit hook would wait for it forever.

    Its files keep what it wrote (``wandb sync`` uploads them); W&B's hook is then told it is gone.
    """
    import psutil
    import wandb

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name().startswith("wandb-core"):
                child.kill()
    # W&B's teardown unhooks its exit handler first; then its farewell to the ended service fails, or
    # it raises SystemExit with the service's exit code (-9): neither may end this process.
    with contextlib.suppress(Exception, SystemExit):
        within(5.0, wandb.teardown, "wandb-teardown")


class WandbBounded(WandbLogger):
    """W&B's calls: a failure while training is a warning; its start and end bounded, off the training thread."""

    _failures = 0
    _closed = False

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        try:
            if step is None:
                self.experiment.log(dict(metrics))
            else:
                # W&B's own step is the training step, so an offline attempt synced after an earlier one
                # continues its history instead of being dropped as "steps going back".
                self.experiment.log(dict(metrics, **{"trainer/global_step": step}), step=step)
        except Exception as error:  # an unavailable tracker must not end a week-long run
            if self._failures % WARN_EVERY_N_FAILURES == 0:
                log.warning(
                    "wandb: could not log step %s (%s: %s); training goes on, metrics/metrics.csv keeps it",
                    step,
                    type(error).__name__,
                    error,
                )
            self._failures += 1

    def start(self) -> None:
        try:
            within(WANDB_START_TIMEOUT_S, lambda: self.experiment, "wandb-init")
        except TimeoutError:
            stop_wandb_service()
            raise ConfigError(
                [
                    f"logging.wandb_project: W&B did not start within {WANDB_START_TIMEOUT_S:g} s (its service process "
                    "does not answer); check W&B on this node, or unset logging.wandb_project"
                ]
            ) from None
        except Exception as error:
            raise ConfigError([f"logging.wandb_project: W&B did not start: {type(error).__name__}: {error}"]) from None

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if status == "failed":  # an error ends the process next: W&B's file is closed now, bounded
            self.close()

    def close(self) -> None:
        """Finish the W&B run: its last points reach the file now, not at an interpreter exit that a
        Ray worker never gets (Ray ends its workers without running their exit handlers)."""
        if self._experiment is None or self._closed:
            return
        self._closed = True
        try:
            within(CLOSE_TIMEOUT_S, self._experiment.finish, "wandb-finish")
        except TimeoutError:
            log.warning(
                "wandb: the run's finish did not return within %g s (its service process does not answer): "
                "ended; %s/wandb keeps what it wrote (the last second may be missing)",
                CLOSE_TIMEOUT_S,
                self.save_dir,
            )
            stop_wandb_service()
        except Exception as error:
            log.warning("wandb: the run's finish failed (%s: %s)", type(error).__name__, error)


class RunWandbLogger(RunStepNumbering, WandbBounded):
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

    def attach(self) -> str:
        if not self._continuing:
            self.ledger.remember_run(self._run_id)  # before wandb.init: a kill during it keeps the id
        self.start()
        where = f"offline files in {self.save_dir}/wandb (upload: wandb sync)" if self._offline else "online"
        return f"W&B run {self._run_id} ({'continued' if self._continuing else 'new'}) in project {self._project}, {where}"


def close_trackers(loggers: list[Logger]) -> None:
    """At the end of a run (finished or stopped by a signal), on rank 0: flush and close the tracker runs."""
    for logger in loggers:
        if isinstance(logger, MLflowThroughSender | WandbBounded):
            logger.close()


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
    if int(os.environ.get("RANK", "0")) == 0:  # the one writer of trackers.json: what a killed write left is its to remove
        for stale in remove_stale_temp_files(run_dir, LEDGER_NAME):
            log.warning("removed %s, left by a process killed while it wrote %s", stale, LEDGER_NAME)
        for tracker in trackers:
            log.info("tracker: %s", tracker.attach())
    return trackers
