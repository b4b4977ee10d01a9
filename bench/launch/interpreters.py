"""The same work under two or more Python interpreters: CPU seconds of the trainer's import
and of a short training run, the two things the test suite does some 250 times.

Each interpreter is a venv's python with this repository installed (``pip install -e .``);
the venvs differ only in the interpreter they were made from. Runs alternate between the
interpreters, ``--repeats`` times, and the figure per interpreter is the median; the ratio
is against the first one. CPU seconds (user + system of the child, from ``wait4``), not wall
time: the suite is CPU-bound on its two cores, so CPU is what it pays.

    .venv/bin/python -m bench.launch.interpreters --python .venv/bin/python --python /tmp/debian-venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.common import REPO, TINY_CONFIG, bench_env, machine

IMPORT = ["-c", "import purrsight.training.run"]


def child_cpu_s(command: list[str], env: dict[str, str]) -> float:
    """User + system CPU seconds of ``command`` and its children."""
    # stderr to a file, not a pipe: nobody reads a pipe until wait4 returns, and a trainer that
    # logs more than the pipe holds would block on it for ever.
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"bench: {' '.join(command)} exited {process.returncode}:\n{tail}")
    return usage.ru_utime + usage.ru_stime


def train_command(python: str, work: Path, run_name: str, steps: int) -> list[str]:
    """The tiny default with the tests' data size and batch (tests/helpers.tiny_overrides), but the
    default's validation and checkpoint intervals; one synthetic set for every run."""
    return [
        python,
        str(REPO / "train_phase2.py"),
        "--config",
        str(TINY_CONFIG),
        f"run.output_dir={work / 'runs'}",
        f"run.name={run_name}",
        f"data.synthetic_dir={work / 'synthetic'}",
        f"data.train_index={work / 'synthetic' / 'train.jsonl'}",
        f"data.val_index={work / 'synthetic' / 'val.jsonl'}",
        "data.synthetic.num_train=128",
        "data.synthetic.num_val=32",
        "data.batch_size=8",
        f"trainer.max_steps={steps}",
        "logging.progress=lines",
    ]


def version(python: str) -> str:
    probe = "import sys; print(sys.version.split()[0], sys._base_executable)"  # the interpreter the venv was made from
    return subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", required=True, help="a venv's python (repeat; the first is the reference)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of the training run")
    args = parser.parse_args()
    env = bench_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as scripts/test.sh: each source compiled once, not per process
    imports: dict[str, list[float]] = {python: [] for python in args.python}
    trains: dict[str, list[float]] = {python: [] for python in args.python}
    with tempfile.TemporaryDirectory(prefix="bench-interp-") as folder:
        work = Path(folder)
        for n, python in enumerate(args.python):  # warm-up: byte-compile each venv's sources; the first writes the set
            child_cpu_s([python, *IMPORT], env)
            child_cpu_s(train_command(python, work, f"warm{n}", 1), env)
        for repeat in range(args.repeats):
            for n, python in enumerate(args.python):
                imports[python].append(child_cpu_s([python, *IMPORT], env))
                trains[python].append(child_cpu_s(train_command(python, work, f"run{repeat}-{n}", args.steps), env))
    print(machine())
    print(f"median of {args.repeats}, CPU seconds (user + system); ratio against the first interpreter\n")
    print(f"{'import':>8} {'ratio':>6} {f'train {args.steps} steps':>16} {'ratio':>6}  interpreter (version, made from)")
    first = args.python[0]
    base_import, base_train = statistics.median(imports[first]), statistics.median(trains[first])
    for python in args.python:
        imp, train = statistics.median(imports[python]), statistics.median(trains[python])
        print(f"{imp:8.2f} {imp / base_import:6.2f} {train:16.2f} {train / base_train:6.2f}  {python} ({version(python)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
