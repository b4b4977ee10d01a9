"""What an MLflow tracker costs a training step: none, a live server, and a server that dies.

The tiny default in one process, every step logged (``logging.every_n_steps=1``: the most a
tracker is ever asked), side by side in one run, alternating, ``--repeats`` times each:

- no tracker;
- a real ``mlflow server`` on loopback (sqlite store), up the whole run;
- the same, SIGKILLed (its process group) once the run's 20th step is logged: the outage case,
  which before the sender thread (purrsight/observability/tracker_sender.py) froze training in
  MLflow's own retries (minutes per call).

Samples/s over steps 20..(steps - 10), from the telemetry's step times (bench/common.py).

    .venv/bin/python -m bench.launch.tracker_cost          # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.common import (
    PYTHON,
    REPO,
    TINY_CONFIG,
    bench_env,
    free_port,
    machine,
    steps_overrides,
    telemetry_step_times,
    timing_from_step_times,
)
from tests.mlflow_server import kill_server, start_mlflow  # the tracker tests' real server

BATCH = 8


def kill_when_logged(server: subprocess.Popen[bytes], log: Path, step: int) -> None:
    while f"step {step}/" not in (log.read_text(errors="replace") if log.exists() else ""):
        time.sleep(0.05)
    kill_server(server)


def one_run(work: Path, case: str, steps: int) -> float:
    run_dir = work / f"{case}-{time.time_ns()}"
    overrides = [*steps_overrides(steps, run_dir, BATCH), "logging.every_n_steps=1", "logging.progress=lines"]
    server = None
    if case != "no tracker":
        port = free_port()
        server, uri = start_mlflow(work / f"mlflow-{port}", port), f"http://127.0.0.1:{port}"
        overrides += [f"logging.mlflow_tracking_uri={uri}", "logging.mlflow_experiment=bench"]
    log = run_dir / "trainer.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    killer = None
    if server is not None and case == "server killed at step 20":
        killer = threading.Thread(target=kill_when_logged, args=(server, log, 20), daemon=True)
        killer.start()
    try:
        with log.open("w") as out:
            launched = time.time()
            command = [PYTHON, str(REPO / "train_phase2.py"), "--config", str(TINY_CONFIG), *overrides]
            done = subprocess.run(command, cwd=REPO, env=bench_env(), stdout=out, stderr=subprocess.STDOUT, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"bench: the {case} run failed; see {log}")
    finally:
        if server is not None and server.poll() is None:
            kill_server(server)
    names = {p.name for p in run_dir.iterdir()}
    (folder,) = [run_dir / n for n in names if (run_dir / n / "telemetry").is_dir()]
    return timing_from_step_times(launched, telemetry_step_times(folder), steps, BATCH).samples_per_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    cases = ("no tracker", "server up", "server killed at step 20")
    rates: dict[str, list[float]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for case in cases:
                rates[case].append(one_run(Path(tmp), case, args.steps))
                print(f"  {case}: {rates[case][-1]:.1f} samples/s", flush=True)
    base = statistics.median(rates["no tracker"])
    print(f"\n{args.steps} steps, every step logged, median of {args.repeats}")
    print("| tracker | samples/s | against no tracker |")
    print("|---|---|---|")
    for case in cases:
        median = statistics.median(rates[case])
        print(f"| {case} | {median:.1f} | {median / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
