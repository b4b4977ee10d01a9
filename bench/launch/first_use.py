"""CPU seconds of a worker forked from the launcher's server, with and without training/first_use.py.

The launcher's fork server imports ``forked_workers.PRELOAD``; ``purrsight.training.first_use``
(part of that list) also builds what a trainer otherwise builds at its first use. Two parents, one
importing the list without it and one with it, each fork ``--runs`` trainer runs of the tiny default
(``--steps`` optimizer steps, the tests' batch and intervals) and add up their children's CPU seconds
(user + system, the kernel's count of each reaped child: the trainer process itself, not a loader
server it leaves to end on its own); the two take turns, ``--repeats`` times. A run that fails
stops the measure with its traceback.

    .venv/bin/python -m bench.launch.first_use --repeats 3         # from the repository root
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile

from bench.common import PYTHON, REPO, TINY_CONFIG, bench_env, ensure_synthetic_set, machine

FIRST_USE = "purrsight.training.first_use"

# The parent: imports its list, then forks and reaps each run; prints its children's CPU seconds per run.
PARENT = """
import importlib, os, resource, runpy, sys, traceback
modules, runs, argv = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3:]
for name in modules:
    importlib.import_module(name)
for run in range(runs):
    pid = os.fork()
    if pid == 0:
        sys.argv = ["train_phase2.py", *argv, f"run.name=run{run}"]
        code = 0
        try:
            runpy.run_path("train_phase2.py", run_name="__main__")
        except BaseException as err:  # a failed run must not count as a cheap one
            code = 0 if isinstance(err, SystemExit) and err.code in (None, 0) else 1
            if code:
                traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"run {run} failed (exit {os.waitstatus_to_exitcode(status)})")
used = resource.getrusage(resource.RUSAGE_CHILDREN)
print((used.ru_utime + used.ru_stime) / runs)
"""


def per_run_cpu(modules: list[str], runs: int, steps: int, out: str) -> float:
    overrides = [
        f"run.output_dir={out}", f"trainer.max_steps={steps}", "data.batch_size=8", "trainer.val_every_n_steps=10",
        "checkpoint.every_n_steps=10", "logging.progress=lines",
    ]  # fmt: skip
    argv = ["--config", str(TINY_CONFIG), *overrides]
    done = subprocess.run(
        [PYTHON, "-c", PARENT, ",".join(modules), str(runs), *argv],
        cwd=REPO, env=bench_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:  # the failed run's traceback and its parent's line, not a bare exit status
        raise SystemExit(done.stderr[-4000:])
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="forked trainer runs per parent")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from purrsight.launcher.forked_workers import PRELOAD

    ensure_synthetic_set()
    variants = {"without first_use": [m for m in PRELOAD if m != FIRST_USE], "with first_use (PRELOAD)": list(PRELOAD)}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name, modules in variants.items():
            with tempfile.TemporaryDirectory(prefix="bench-first-use-") as out:
                seconds[name].append(per_run_cpu(modules, args.runs, args.steps, out))
            print(f"repeat {repeat + 1}: {name}: {seconds[name][-1]:.2f} CPU-s per forked run", flush=True)
    print(f"\n{machine()}; the tiny default, {args.steps} steps, {args.runs} forked runs per parent\n")
    print("| parent imports | CPU s per forked run (median) | runs |\n|---|---|---|")
    for name, values in seconds.items():
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
