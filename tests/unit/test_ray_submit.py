"""The scriptable submit (purrsight.ray_engine.submit) without a cluster: arguments, exit codes, refusals.

Submitting, following and the driver's codes on a real two-node cluster are in tests/ray.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

pytest.importorskip("ray", reason="the Ray engine needs the ray extra (scripts/test.sh installs it)")

from purrsight.ray_engine import submit
from tests.helpers import free_port


def test_everything_after_the_separator_goes_to_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    args = submit.parse_args(["--", "--config", "c.yaml", "--resume", "ray.shared_dir=/s"])
    assert args.address == "http://head:8265" and args.working_dir == "."
    assert args.train_args == ["--config", "c.yaml", "--resume", "ray.shared_dir=/s"]  # --resume is the trainer's


def test_no_address_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in submit.ADDRESS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit:
        submit.parse_args(["--", "x=1"])
    assert exit.value.code == 2 and "pass --address http://HEAD:8265 or set RAY_ADDRESS" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("status", "driver", "code"),
    [
        ("SUCCEEDED", 0, 0),
        ("FAILED", 2, 2),  # a typo: `ray job submit` would say 1
        ("FAILED", 3, 3),  # a cluster too small
        ("FAILED", 86, 86),  # the progress watchdog
        ("STOPPED", 143, 143),  # our driver relayed the stop and returned 128+SIGTERM
        ("STOPPED", None, 143),  # killed before it could return
        ("FAILED", None, 1),  # never ran (runtime env setup failed)
        ("SUCCEEDED", None, 0),
    ],
)
def test_the_shell_gets_the_drivers_code(status: str, driver: int | None, code: int) -> None:
    assert submit.exit_code(status, driver) == code


def test_a_runtime_env_that_is_not_json_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        submit.runtime_env(".", "{env_vars: 1}")
    assert exit.value.code == 2 and "--runtime-env-json is not JSON" in capsys.readouterr().err
    assert submit.runtime_env("code", '{"env_vars": {"A": "1"}}') == {"working_dir": "code", "env_vars": {"A": "1"}}


def test_no_job_server_is_a_cluster_error(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(SystemExit) as exit:
        submit.connect(address)
    assert exit.value.code == 3
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: no Ray job server at {address}") and "docs/RAY.md" in line


class VanishingJobServer:
    """Stands in for a job server that goes away while its log is followed (a head node restarted):
    on the real test cluster that would mean killing the head under the other Ray tests."""

    def submit_job(self, entrypoint: str, runtime_env: dict[str, object]) -> str:
        return "raysubmit_gone"

    async def tail_job_logs(self, job_id: str) -> AsyncIterator[str]:
        yield "step 10/40\n"
        raise ConnectionResetError("Connection reset by peer")


def test_a_job_server_lost_while_following_is_one_line_and_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(submit, "connect", lambda address: VanishingJobServer())
    with pytest.raises(SystemExit) as exit:
        submit.main(["--address", "http://head:8265", "--", "x=1"])
    assert exit.value.code == 3
    out, err = capsys.readouterr()
    assert out == "step 10/40\n"  # what came before is printed
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "lost the job server at http://head:8265 while following raysubmit_gone" in line
    assert "ray job status raysubmit_gone" in line and "Traceback" not in err


class StopRecorder:
    """A job client that records stop requests; ``gone`` makes them fail as a dead head's would."""

    def __init__(self, gone: bool = False) -> None:
        self.stops: list[str] = []
        self.gone = gone

    def stop_job(self, job_id: str) -> None:
        self.stops.append(job_id)
        if self.gone:
            raise ConnectionError("Connection reset by peer")


def test_a_later_sigterm_never_leaves_the_job_and_only_a_second_ctrl_c_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """scancel signals the wrapper and the batch script, which relays it; the time limit's SIGTERM
    comes long after the script's own stop, while the checkpoint is written. Neither may detach:
    the script would then tear Ray down under the checkpoint. A second Ctrl-C at a keyboard does."""
    client = StopRecorder()
    following = submit.Submission(client, "raysubmit_1")
    clock = [100.0]
    monkeypatch.setattr(submit.time, "monotonic", lambda: clock[0])
    following._on_signal(15)
    clock[0] += 0.5
    following._on_signal(15)  # the relay
    clock[0] += 60
    following._on_signal(15)  # the time limit's, a minute into the checkpoint
    assert client.stops == ["raysubmit_1"] and "leaving" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        following._on_signal(2)  # a real second Ctrl-C
    assert exit.value.code == 130 and "leaving job raysubmit_1 running" in capsys.readouterr().err
    clock[0] += 60
    pressed = submit.Submission(StopRecorder(), "raysubmit_3")
    pressed._on_signal(2)
    clock[0] += 0.5
    pressed._on_signal(2)  # the terminal's echo of the same press
    assert "Ctrl-C again leaves it running" in capsys.readouterr().err


def test_a_stop_the_head_cannot_take_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    submit.Submission(StopRecorder(gone=True), "raysubmit_2")._on_signal(15)
    assert "could not reach the job server to stop raysubmit_2 (ConnectionError)" in capsys.readouterr().err
