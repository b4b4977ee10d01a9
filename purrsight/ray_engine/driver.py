"""The Ray engine's driver: check everything a worker would trip on, then run Ray Train.

It runs where ``ray job submit`` starts the entry point (or wherever ``python
train_phase2.py --engine ray`` is typed on a machine of the cluster). Before any worker
starts it makes every path absolute (workers run in their own copy of the working dir),
generates the synthetic set when the config asks for it, reads the data indexes, and
decides how the run starts (a resume, or a new run into a free folder), so bad input ends
here with one line and exit 2. Then it hands the workers to TorchTrainer, relays a stop
(``ray job stop`` signals this process only), and turns the outcome into our exit codes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from purrsight.config import Config, ConfigError, path_problems, with_paths_under
from purrsight.data.formats.records import read_options
from purrsight.data.index import read_index
from purrsight.data.prepared_manifest import check_sources, read_manifest
from purrsight.datasets.synthetic_set import ensure_synthetic_set
from purrsight.errors import SIGNAL_BASE, ClusterError, ExitCode
from purrsight.placement import decide
from purrsight.ray_engine.ray_noise import filter_forwarded_output
from purrsight.run_folder import HANGS_LOG, utc_stamp
from purrsight.runs.start import plan_start, prepare_run_folder

log = logging.getLogger("purrsight.ray_engine")
WORKING_DIR_COPY = ("runtime_resources", "working_dir_files")  # where Ray unpacks --working-dir


class RayClusterError(ClusterError):
    """No Ray cluster to run on, or one too small for the config (exit 3, like a failed health check)."""


def base_folder(config: Config, cwd: Path) -> Path:
    """Where relative paths of the config point: ray.shared_dir, else the driver's folder.

    Under ``ray job submit --working-dir`` the driver's folder is Ray's temporary copy
    of it on the head node: a run written there is lost with the job and unseen by the
    other nodes, so that needs ray.shared_dir.
    """
    if config.ray.shared_dir is not None:
        return Path(config.ray.shared_dir)
    if all(part in cwd.parts for part in WORKING_DIR_COPY):
        raise ConfigError(
            [
                f"ray.shared_dir is unset and this driver runs in Ray's temporary copy of the working dir ({cwd}): "
                "runs and data would be lost with the job and unseen by other nodes; "
                "set ray.shared_dir to a folder every node mounts (e.g. ray.shared_dir=$PWD when submitting from it)"
            ]
        )
    return cwd


def prepared_config(config: Config, source: str) -> Config:
    """Absolute paths, the synthetic set generated, the indexes read: what every worker will find."""
    base = base_folder(config, Path.cwd())
    typed = config  # the indexes as the command named them (a prepared set's source is compared so)
    config = with_paths_under(config, base)
    problems = path_problems(config, f"{source} (paths under {base})")
    if problems:
        raise ConfigError(problems)
    config.tokenizer_dir()  # a config without any tokenizer fails here, not in every worker
    ensure_synthetic_set(config)  # what the DataModule would do on each node, once here
    if config.data.prepared is not None:
        manifest = read_manifest(Path(config.data.prepared))  # complete (rank 0 checks that it matches the config)
        # An index this command's overrides name must be the set's source (the workers' copy of the
        # config no longer knows what the command said).
        indexes = {"train": typed.data.train_index, "val": typed.data.val_index}
        check_sources(manifest, Path(config.data.prepared), indexes, typed.overridden)
        return config
    # A bad line stops the job before any worker starts (and restarts); read as the workers read it.
    data, options = config.data, read_options(config.data)
    for index in (data.train_index, data.val_index):
        if index is not None:
            read_index(index, fmt=data.format, options=options)
    return config


def submission_id() -> str:
    """``ray job submit``'s id for this job (the launch id of the run folder), or a fresh one."""
    job_config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    return str(job_config.get("metadata", {}).get("job_submission_id") or f"ray-driver-{utc_stamp()}-{os.getpid()}")


def check_cluster_fits(config: Config, available: dict[str, float]) -> None:
    """A config that asks for more than the cluster has would wait for resources forever (an
    elastic group, ``[MIN, MAX]``, needs room for MIN: Ray Train starts it with what fits)."""
    wanted, most = config.ray.worker_range
    missing = [
        f"{name} {amount * wanted:g} (the cluster has {available.get(name, 0):g})"
        for name, amount in config.ray.resources_per_worker.items()
        if amount * wanted > available.get(name, 0)
    ]
    if missing:
        raise RayClusterError(
            f"ray.num_workers={config.ray.num_workers}{'' if wanted == most else f' (at least {wanted})'}"
            f" x ray.resources_per_worker={config.ray.resources_per_worker} needs "
            + ", ".join(missing)
            + "; lower ray.num_workers or the resources per worker, or add nodes (see `ray status`)"
        )


def connect() -> None:
    import ray

    address = os.environ.get("RAY_ADDRESS", "auto")
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    except ConnectionError as err:
        raise RayClusterError(
            f"no Ray cluster at {address} ({err}); start one with `ray start --head` (docs/RAY.md) or set RAY_ADDRESS"
        ) from None
    filter_forwarded_output()


class StopRelay:
    """SIGTERM/SIGINT of the driver (``ray job stop``, Ctrl-C) reach the workers via the coordinator.

    The handler only sets an event: the remote call is made by a thread, not inside a
    signal handler that interrupted Ray's own client code.
    """

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.signum: int | None = None
        self._arrived = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        # Inside a batch job's Ray (purrsight.ray_node) every Ray process, this driver included, is
        # born with SIGTERM held, so that a job-wide SIGTERM (scancel, a preemption, qdel) leaves
        # Ray up; the driver is the one process that must hear it (and `ray job stop`): it stops
        # the run. Ray itself holds SIGINT in its processes. One held before now arrives here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        threading.Thread(target=self._relay, name="purrsight-stop-relay", daemon=True).start()

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting for the checkpoint
        self.signum = signum
        self._arrived.set()

    def _relay(self) -> None:
        import ray

        self._arrived.wait()
        assert self.signum is not None
        log.warning(
            "received %s: asking every worker to finish its step, save a checkpoint and stop",
            signal.Signals(self.signum).name,
        )
        ray.get(self.coordinator.request_stop.remote(self.signum))


def run_on_ray(config: Config, resume: str | None, source: str) -> int:
    """Train ``config`` on the Ray cluster; our exit code (0, 2, 3, 128+N after a stop, 1)."""
    launch = submission_id()
    log.info("Ray engine driver for job %s: checking the config, data and run folder", launch)
    config = prepared_config(config, source)
    os.environ["PURRSIGHT_LAUNCH_ID"] = launch  # the run folder's launch marker names this job
    # Decided (and refused) now; the folder is prepared only once the cluster can take the job,
    # so that a refused submit leaves it as it was.
    plan = plan_start(config, resume or os.environ.get("PURRSIGHT_RESUME") or None)
    log.info(
        "run folder %s: %s",
        config.run.run_dir,
        f"resuming from {plan.checkpoint} (step {plan.step})" if plan.checkpoint else "a new run",
    )
    # The launcher's decision, made by the same function over the GPUs each worker is given,
    # before any cluster is touched.
    gpus = int(config.ray.resources_per_worker.get("GPU", 0) > 0)
    placement = decide(config.trainer.accelerator, config.distributed.backend, gpus)
    backend = placement.backend

    connect()
    import ray

    # Train V2's classes by their own modules: what ray.train.* resolves to under V2 (the
    # default of the pinned Ray), and typed as V2 (ray.train's stubs name V1's).
    from ray.train.torch import TorchConfig
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.exceptions import TrainingFailedError
    from ray.train.v2.torch.torch_trainer import TorchTrainer
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from purrsight.ray_engine.coordinator import RunCoordinator
    from purrsight.ray_engine.worker import train_on_worker

    check_cluster_fits(config, ray.cluster_resources())
    prepare_run_folder(config, plan)
    low, high = config.ray.worker_range
    ray_root = config.run.run_dir.resolve() / "ray"  # Ray's storage: a folder per job, each report naming our file
    # No CPU: it only holds a few values. On the driver's node: placed on another, it died with that
    # node, and the workers Ray restarted could not reach it (a lost node ended the job).
    beside_the_driver = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    coordinator_actor: Any = ray.remote(RunCoordinator)
    coordinator = coordinator_actor.options(num_cpus=0, scheduling_strategy=beside_the_driver).remote()
    relay = StopRelay(coordinator)
    relay.install()
    trainer = TorchTrainer(
        train_on_worker,  # type: ignore[arg-type]  # Train V2 hands rank 0's return value to the driver
        train_loop_config={
            "config": config.model_dump(mode="json"),
            "resume": str(plan.checkpoint) if plan.checkpoint else None,
            "coordinator": coordinator,
            "launch": launch,
            "placement": placement.environment(),
            "ray_root": str(ray_root),
        },
        torch_config=TorchConfig(backend=backend, timeout_s=config.distributed.timeout_s),
        scaling_config=ScalingConfig(
            num_workers=low if low == high else (low, high),
            use_gpu=placement.accelerator == "gpu",
            resources_per_worker=dict(config.ray.resources_per_worker),
            placement_strategy=config.ray.placement_strategy,
        ),
        run_config=RunConfig(
            name=launch,
            storage_path=str(ray_root),
            failure_config=FailureConfig(max_failures=config.ray.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=config.checkpoint.keep_last),
            # Ray Train V2 turns every print() of a worker into a log record, also prints a
            # library captures (dill's disassembly, when datasets fingerprints a table).
            worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}},
        ),
    )
    workers = f"{low} Ray Train workers"
    if low < high:
        workers = f"{low} to {high} Ray Train workers (elastic: goes on while {low} remain)"
    log.info("starting %s, each %s, backend %s", workers, config.ray.resources_per_worker, backend)
    hangs = HangsSince(config.run.run_dir / HANGS_LOG)
    try:
        result = trainer.fit()
    except TrainingFailedError as err:
        return _failed(coordinator, err, hangs)
    user_error = ray.get(coordinator.user_error.remote())
    if user_error:
        return _user_error(user_error)
    outcome = getattr(result, "return_value", None) or {}  # Train V2's Result (typed as V1's)
    stopped = outcome.get("stopped_by_signal")
    if stopped is not None:
        log.warning(
            "stopped by %s at step %s; checkpoint: %s (resubmit with --resume)",
            signal.Signals(stopped).name,
            outcome.get("final_step"),
            outcome.get("checkpoint"),
        )
        return SIGNAL_BASE + int(stopped)
    step, checkpoint = outcome.get("final_step"), outcome.get("checkpoint")
    log.info("done: step %s; checkpoint %s; run folder %s", step, checkpoint, config.run.run_dir)
    return 0


def _user_error(lines: list[str]) -> int:
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    return ExitCode.USAGE


class HangsSince:
    """The progress watchdog's lines (hangs.log) written after this point: a watchdog exit
    kills its worker (exit 86 under torchrun), which Ray reports as just another failure."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.is_file() else 0

    def lines(self) -> list[str]:
        if not self.path.is_file():
            return []
        with self.path.open() as hangs:
            hangs.seek(self.offset)
            return [line.strip() for line in hangs if line.strip()]


def _failed(coordinator: Any, err: Exception, hangs: HangsSince) -> int:
    import ray

    user_error = ray.get(coordinator.user_error.remote())
    if user_error:
        return _user_error(user_error)
    fired = hangs.lines()
    if fired:
        print(
            f"error: the progress watchdog stopped the workers ({len(fired)} time(s), {hangs.path}); last: {fired[-1]}",
            file=sys.stderr,
        )
        return ExitCode.WATCHDOG
    print(f"error: training failed on the Ray cluster: {err}", file=sys.stderr)
    return ExitCode.FAILED
