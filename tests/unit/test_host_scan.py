"""The leftover checks of tests/host_scan.py find what they promise to find, and nothing else."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from tests.host_scan import processes_using, processes_with_env

# A daemon as an admin fears one: it changes to /, closes every file it had, and lives on.
DAEMON = """
import os, sys, time
os.chdir("/")
for fd in range(3, 256):
    try:
        os.close(fd)
    except OSError:
        pass
os.close(0); os.close(1); os.close(2)
time.sleep(60)
"""


def test_a_daemon_that_leaves_the_job_folder_and_closes_its_files_is_still_found_by_its_environment(tmp_path: Path) -> None:
    tag = secrets.token_hex(6)
    opened = (tmp_path / "held").open("w")  # the daemon inherits it, then closes it
    try:
        daemon = subprocess.Popen(
            [sys.executable, "-c", DAEMON], cwd=tmp_path, env={**os.environ, "JOB_TAG": tag}, pass_fds=(opened.fileno(),)
        )
    finally:
        opened.close()
    try:
        deadline = time.monotonic() + 30
        while processes_using(str(tmp_path)) and time.monotonic() < deadline:  # until it has left
            time.sleep(0.1)
        assert daemon.pid not in processes_using(str(tmp_path))  # the file and folder check misses it
        assert daemon.pid in processes_with_env("JOB_TAG", tag)
        assert daemon.pid not in processes_with_env("JOB_TAG", tag[:-1])  # the whole value, not a prefix
        assert not processes_with_env("JOB_TAG", "another-" + tag)
    finally:
        daemon.kill()
        daemon.wait()
    assert daemon.pid not in processes_with_env("JOB_TAG", tag)


def test_the_secret_watch_reads_commands_that_live_less_than_its_scan_interval(tmp_path: Path) -> None:
    """As root, every exec is read when the kernel reports it: five commands of 0.1 s each with
    the secret on their command line are all caught (the scan alone, twice a second, would catch
    each about one time in five). Where the kernel refuses the events (not root), the test says so."""
    import pytest

    from tests.host_scan import SecretWatch, exec_events

    probe = exec_events()
    if probe is None:
        pytest.skip("the process events connector needs root")
    probe.close()
    secret = f"secret-{secrets.token_hex(8)}"
    with SecretWatch(lambda: [secret]) as watch:
        deadline = time.monotonic() + 30
        while secret not in watch.seen:  # the scan has picked up what to look for
            assert time.monotonic() < deadline, "the scan never ran"
            time.sleep(0.05)
        started = [subprocess.Popen(["sh", "-c", "sleep 0.1; true", secret]) for _ in range(5)]
        for proc in started:
            proc.wait()
        time.sleep(0.5)
    caught = {int(hit.split(":", 1)[0]) for hit in watch.hits}
    assert {proc.pid for proc in started} <= caught, (watch.hits, watch.execs_read)
    assert watch.execs_read >= 5
