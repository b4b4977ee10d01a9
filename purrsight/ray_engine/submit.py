"""Submit a training job to a Ray cluster, follow its log, and exit with the driver's code.

``ray job submit`` exits 1 for every failed job: a typo in the config (our driver's exit 2)
and a cluster too small (exit 3) look the same to the shell that called it. This wraps
Ray's job SDK the same way (upload the working dir, run ``train_phase2.py --engine ray``,
print the log as it comes) and then exits with the driver's own code, so a CI pipeline or
a SLURM script that submits to Ray can tell them apart:

    python -m purrsight.ray_engine.submit --address http://10.0.0.1:8265 -- \\
        --config config/qwen2.5-0.5b.yaml ray.shared_dir=/shared/purrsight

Everything after ``--`` goes to ``train_phase2.py`` (``--config``, ``--resume``, overrides).
SIGTERM or Ctrl-C here stops the job as ``ray job stop`` does (each worker saves a
checkpoint) and still waits for its end. A second Ctrl-C at the keyboard leaves the job running
and returns (one within 2 s is the first one's echo). A SIGTERM never does: a batch job hears
several while its checkpoint is written (the time limit's after the script's own stop, a
scancel that signals this process and the script that relays it), and returning would let the
script tear Ray down under the checkpoint; the job's own end, or SIGKILL, ends the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from purrsight.errors import EXIT_CODE_LINES, SIGNAL_BASE, ExitCode
from purrsight.internals.ray_logging import RUNTIME_ENV_LOGGERS

ENTRYPOINT = ("python", "train_phase2.py", "--engine", "ray")
ADDRESS_VARIABLES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")  # the order `ray job` reads them in
FINAL_STATES = {"SUCCEEDED", "FAILED", "STOPPED"}
SAME_STOP_S = 2.0  # a second Ctrl-C sooner than this is the first one's echo, not a second press
# Ray's SDK narrates the upload file by file and each websocket it closes; what is uploaded
# is .rayignore's business (docs/RAY.md), and its warnings and errors still print.
CHATTY_LOGGERS = {
    RUNTIME_ENV_LOGGERS[0]: logging.WARNING,
    RUNTIME_ENV_LOGGERS[1]: logging.ERROR,  # ".git and .venv are now ignored": as we want
    "ray.dashboard.modules.dashboard_sdk": logging.WARNING,
    "ray.dashboard.modules.job.sdk": logging.WARNING,
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m purrsight.ray_engine.submit",
        description=__doc__.split("\n\n")[0],
        epilog="exit codes (the driver's, as under torchrun):\n  " + "\n  ".join(EXIT_CODE_LINES) + "\n\nSee docs/RAY.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--address",
        default=next((os.environ[name] for name in ADDRESS_VARIABLES if os.environ.get(name)), None),
        help="the job server, http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS)",
    )
    parser.add_argument("--working-dir", default=".", help="the code uploaded to every node (default: %(default)s)")
    parser.add_argument(
        "--runtime-env-json", default=None, help='more of the job\'s runtime env, e.g. \'{"env_vars": {"NCCL_DEBUG": "INFO"}}\''
    )
    parser.add_argument("--no-follow", action="store_true", help="return after submitting (exit 0); follow with `ray job logs -f`")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train_phase2.py's arguments")
    args = parser.parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    if not args.address:
        parser.error("no job server: pass --address http://HEAD:8265 or set RAY_ADDRESS")
    return args


def exit_code(status: str, driver_exit_code: int | None) -> int:
    """The shell's exit code for a finished job: the driver's own, else what its status implies."""
    if driver_exit_code is not None:
        return driver_exit_code
    if status == "SUCCEEDED":
        return ExitCode.OK
    if status == "STOPPED":  # the driver was killed before it could return (ray job stop's SIGKILL)
        return SIGNAL_BASE + signal.SIGTERM
    return ExitCode.FAILED


def fail(code: int, message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def runtime_env(working_dir: str, extra_json: str | None) -> dict[str, Any]:
    import json

    env: dict[str, Any] = {"working_dir": working_dir}
    if extra_json:
        try:
            extra = json.loads(extra_json)
        except json.JSONDecodeError as err:
            fail(ExitCode.USAGE, f"--runtime-env-json is not JSON ({err})")
        env.update(extra)
    return env


def status_name(info: Any) -> str:
    return str(getattr(info.status, "value", info.status))  # JobStatus is a str enum


class Submission:
    """One job: submitted, followed, stopped on a signal, and its end read back."""

    def __init__(self, client: Any, job_id: str) -> None:
        self.client = client
        self.job_id = job_id
        self.stop_asked_at: float | None = None  # when the first SIGINT/SIGTERM asked the job to stop

    async def follow(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        async for lines in self.client.tail_job_logs(self.job_id):
            sys.stdout.write(lines)
            sys.stdout.flush()

    def _on_signal(self, sig: int) -> None:
        now = time.monotonic()
        if self.stop_asked_at is not None and (sig != signal.SIGINT or now - self.stop_asked_at < SAME_STOP_S):
            return  # a SIGTERM, or the same Ctrl-C told twice: the stop asked for goes on, and so does the wait
        if self.stop_asked_at is not None:
            print(f"\nleaving job {self.job_id} running; stop it with `ray job stop {self.job_id}`", file=sys.stderr)
            raise SystemExit(SIGNAL_BASE + sig)
        self.stop_asked_at = now
        print(
            f"\n{signal.Signals(sig).name}: stopping job {self.job_id} (each worker saves a checkpoint); "
            + ("Ctrl-C again leaves it running" if sig == signal.SIGINT else "waiting for its end"),
            file=sys.stderr,
        )
        try:
            self.client.stop_job(self.job_id)
        except (ConnectionError, OSError, RuntimeError) as err:  # the head is gone: nothing left to stop
            print(f"could not reach the job server to stop {self.job_id} ({type(err).__name__})", file=sys.stderr)

    def final_info(self, timeout_s: float = 60.0) -> Any:
        """The job's info once it has ended (the log stream can close a moment before the status does)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.client.get_job_info(self.job_id)
            if status_name(info) in FINAL_STATES or time.monotonic() > deadline:
                return info
            time.sleep(0.5)


def connect(address: str) -> Any:
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    for name, level in CHATTY_LOGGERS.items():  # after the import: Ray's modules set their levels on import
        logging.getLogger(name).setLevel(level)
    try:
        return JobSubmissionClient(address)
    except AuthenticationError:
        fail(
            ExitCode.USAGE,
            f"the job server at {address} refused this token: set RAY_AUTH_MODE=token and the cluster's token "
            "in ~/.ray/auth_token or RAY_AUTH_TOKEN (docs/RAY.md section 1)",
        )
    except (ConnectionError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        fail(ExitCode.CLUSTER, f"no Ray job server at {address}: {first} (is the cluster up? docs/RAY.md section 1)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = runtime_env(args.working_dir, args.runtime_env_json)
    client = connect(args.address)
    entrypoint = shlex.join([*ENTRYPOINT, *args.train_args])
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=env)
    print(f"submitted {job_id}: {entrypoint}", file=sys.stderr, flush=True)
    if args.no_follow:
        print(f"follow: ray job logs -f {job_id}; stop: ray job stop {job_id}", file=sys.stderr)
        return ExitCode.OK
    submission = Submission(client, job_id)
    try:
        asyncio.run(submission.follow())
        info = submission.final_info()
    except (ConnectionError, OSError, RuntimeError) as err:  # the head restarted, the network went
        fail(
            ExitCode.CLUSTER,
            f"lost the job server at {args.address} while following {job_id} ({type(err).__name__}: {err}); "
            f"the job may still run: ray job status {job_id}",
        )
    code = exit_code(status_name(info), info.driver_exit_code)
    print(f"job {job_id} {status_name(info)}: exit {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
