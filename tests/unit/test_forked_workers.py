"""Workers forked from the launcher's preloaded server (purrsight/launcher/forked_workers.py): each
gets what torchrun's subprocess workers get, checked inside real workers of a real torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from purrsight.launcher.forked_workers import PRELOAD, SERVER_IGNORES, asked_for
from tests.helpers import REPO, free_port, python_env

PROBE = """
import atexit, json, os, signal, sys, time
import torch

out = sys.argv[1]
rank = int(os.environ["RANK"])
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
seen = {
    "rank": rank,
    "own_session": os.getsid(0) == os.getpid(),
    "held": sorted(int(s) for s in blocked & {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}),
    "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
    "sigint_python": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "title": open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode().strip(),
    "argv": sys.argv,
    "threads": torch.get_num_threads(),
    "forked_from_server": "multiprocessing.forkserver" in parent,
    "preloaded": "purrsight.training.run" in sys.modules,
    "comm": open("/proc/self/comm").read().strip(),
    "lightning_rank": getattr(sys.modules["lightning_fabric.utilities.rank_zero"].rank_zero_only, "rank", None),
}
# torch's multiprocessing context records the first worker it sees fail, and stops the rest: rank 2
# raises once torchrun, having seen rank 1's exit, asks it to stop (not before, or the job's code would
# depend on which of the two exits torchrun saw first); rank 1 exits once rank 2 listens for that.
asked = []
if rank == 2:
    signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
with open(f"{out}/rank{rank}.json", "w") as sink:
    json.dump(seen, sink)
atexit.register(lambda: open(f"{out}/rank{rank}.exit", "w").write("ran"))
if rank == 2:
    while not asked:
        time.sleep(0.05)
    raise RuntimeError("boom from rank two")
if rank == 1:
    while not os.path.exists(f"{out}/rank2.json"):
        time.sleep(0.05)
sys.exit(2 if rank == 1 else 0)
"""


def test_asked_for_reads_torchruns_own_options_before_the_script() -> None:
    forked = ["--run-path", "--start-method", "forkserver"]
    assert asked_for([*forked, "--nnodes", "1", "/abs/train_phase2.py", "--config", "x.yaml"])
    assert asked_for(["--run_path", "--start_method=forkserver", "/abs/train_phase2.py"])
    assert not asked_for(["--start-method", "forkserver", "/abs/train_phase2.py"])  # no --run-path: subprocesses
    assert not asked_for(["--run-path", "--start-method", "spawn", "/abs/train_phase2.py"])
    assert not asked_for(["--run-path", "/abs/train_phase2.py", "--start-method", "forkserver"])  # the script's own argument


def test_each_worker_gets_what_a_subprocess_worker_gets(tmp_path: Path) -> None:
    """Three workers: a session each, no stop signal held or ignored (the server holds them),
    Python's own SIGINT handler, the subprocess worker's command line as title, its arguments,
    OMP_NUM_THREADS applied to torch, its atexit handlers run, and its exit code the job's (2).
    Rank 2 raises, on torchrun's stop after rank 1's exit: its traceback printed as an interpreter
    prints it (torch's multiprocessing wrapper only pickles it into a file)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    done = subprocess.run(
        [sys.executable, "-m", "purrsight.launcher.torchrun", "--run-path", "--start-method", "forkserver",
         "--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         str(probe), str(tmp_path)],
        cwd=REPO, env={**python_env(), "OMP_NUM_THREADS": "3"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]  # the worker's documented reason, as with subprocess workers
    assert "rank 1 (local rank 1" in done.stderr and "exited with code 2" in done.stderr
    assert "Traceback (most recent call last)" in done.stderr and "RuntimeError: boom from rank two" in done.stderr
    assert f'File "{probe}", line ' in done.stderr, done.stderr[-3000:]
    for rank in (0, 1, 2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["forked_from_server"] and seen["preloaded"], seen  # a fork of the server that imported the trainer
        assert seen["own_session"] and seen["held"] == [], seen
        assert seen["sigterm_default"] and seen["sigint_python"], seen
        assert seen["title"] == f"{sys.executable} -u {probe} {tmp_path}", seen
        assert seen["argv"] == [str(probe), str(tmp_path)]
        assert seen["threads"] == 3
        assert seen["comm"] == os.path.basename(sys.executable)[:15]  # top and pgrep -x see an interpreter
        assert seen["lightning_rank"] == rank  # not the server's 0: rank-zero-only output on rank 0 alone
        assert (tmp_path / f"rank{rank}.exit").read_text() == "ran"


def test_the_preload_list_is_the_trainers_start(tmp_path: Path) -> None:
    """Every module the server preloads exists, and importing them is what a trainer imports first;
    what a worker would build at its first step is built there too (training/first_use.py): pandas
    loaded for pyarrow, transformers' conversion table for peft. A transformers that moves the table
    fails this test, not a run: the head start is then lost, and this says so."""
    check = (
        "import importlib, sys; [importlib.import_module(name) for name in sys.argv[1:]]; "
        "from transformers import conversion_mapping; "
        "print('pandas' in sys.modules, conversion_mapping._checkpoint_conversion_mapping_cache is not None)"
    )
    done = subprocess.run([sys.executable, "-c", check, *PRELOAD], cwd=REPO, env=python_env(), capture_output=True, text=True)
    assert done.stdout.strip() == "True True", done.stderr[-2000:]
    assert (REPO / "train_phase2.py").read_text().count("from purrsight.training.run import train") == 1


def test_the_server_outlives_the_signals_a_scheduler_sends_every_process(tmp_path: Path) -> None:
    """SLURM signals every process of a step, PBS's qdel and a terminal's hangup too. The server
    ignores them: a dead server would take its workers' exit codes with it (multiprocessing reads
    them through it: each would read 255, a failed job). Signalled, then the workers end cleanly:
    the job ends 0."""
    probe, ready, done_flag = tmp_path / "probe.py", tmp_path / "ready", tmp_path / "finish"
    ready.mkdir()
    probe.write_text(
        "import os, pathlib, sys, time\n"
        f"pathlib.Path('{ready}').joinpath(os.environ['RANK']).write_text(str(os.getppid()))\n"
        f"while not pathlib.Path('{done_flag}').exists():\n    time.sleep(0.1)\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "purrsight.launcher.torchrun", "--run-path", "--start-method", "forkserver",
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(probe)],
        cwd=REPO, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 2:
            assert agent.poll() is None and time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        (server,) = {int(path.read_text()) for path in ready.iterdir()}  # both workers' parent
        for stop in SERVER_IGNORES:
            os.kill(server, stop)
        time.sleep(1)
        os.kill(server, 0)  # alive
        done_flag.touch()
        output, _ = agent.communicate(timeout=120)
    finally:
        agent.kill()
    assert agent.returncode == 0, output


FORK_AT_ONCE = """
import multiprocessing, multiprocessing.forkserver, os, signal, sys, time
from purrsight.launcher import forked_workers

multiprocessing.set_forkserver_preload(["purrsight.launcher.forked_workers"])
multiprocessing.forkserver.ensure_running()  # started as multiprocessing starts one again: no help from the agent
context = multiprocessing.get_context("forkserver")
warm = context.Process(target=time.sleep, args=(0,))
warm.start()
warm.join()  # the server has imported its preload
server = multiprocessing.forkserver._forkserver._forkserver_pid
for stop in forked_workers.SERVER_IGNORES:
    os.kill(server, stop)
child = context.Process(target=time.sleep, args=(60,))
child.start()
os.kill(child.pid, signal.SIGTERM)  # at once: the worker has not reached run_worker's own reset
started = time.monotonic()
child.join(30)
print(child.exitcode, round(time.monotonic() - started, 1), flush=True)
"""


def test_a_fork_has_the_default_stop_signals_at_once_and_a_restarted_server_ignores_them() -> None:
    """The server ignores the stop signals from its own first import on (so one multiprocessing
    starts again after an OOM kill is as immune), and each fork has the defaults back at the fork
    itself: a SIGTERM to a worker still starting ends it at once, not after torch's 30 s grace."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_AT_ONCE], cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    code, seconds = done.stdout.split()
    assert int(code) == -15 and float(seconds) < 5, done.stdout  # the server, signalled, still forked it
