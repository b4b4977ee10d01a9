"""Ray inside a SLURM job against the launcher: sbatch -> first step, and USR1 -> the requeued run's first step.

On the tests' three-node SLURM cluster (tests/cluster/conftest.py: real slurmctld and slurmd on
this machine, 2 CPUs a node), 2 nodes a job, the tiny default, one process per node:

- slurm/train.sbatch: the launcher on each node, torchrun;
- slurm/ray.sbatch: the job's own Ray (head and one worker), the training submitted to it.

Each repeat runs each script once (each first in turn). Times come from the log lines' milliseconds:

- start: from ``sbatch`` to rank 0's first step line;
- requeue: from USR1 to the batch script (sent at step 20 or later) to rank 0's first step line
  of the requeued run; "held" is the part SLURM holds a requeued job before starting it again
  (its credential lifetime, cred_expire=15 s on this cluster, 120 s by default, plus a
  scheduling pass), the same for both scripts.

    .venv/bin/python -m bench.launch.batch_start --repeats 2      # from the repository root, as root
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import REPO, machine
from purrsight.data.synthetic import generate
from tests.cluster.conftest import SlurmCluster, running_cluster
from tests.helpers import log_time, rank0_steps, tiny_overrides

SCRIPTS = {"train.sbatch": "purrsight-phase2", "ray.sbatch": "purrsight-ray"}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \[\w+\.sbatch \d+\] (.*)$", re.M)


def script_line(text: str, words: str) -> float:
    return next(log_time(match.group(1)) for match in STAMP.finditer(text) if words in match.group(2))


def run(cluster: SlurmCluster, script: str, work: Path, data: Path) -> dict[str, float]:
    work.mkdir(parents=True)
    env = dict(cluster.env, LOG_DIR=str(work / "logs"), OMP_NUM_THREADS="1", PATH=f"{REPO / '.venv' / 'bin'}:{cluster.env['PATH']}")
    overrides = tiny_overrides(data, work / "runs", trainer__max_steps=200, checkpoint__every_n_steps=50, logging__every_n_steps=1)
    args = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--mem=1000", "--nodes=2"]
    args += [f"--output={work}/%x-%j.out", f"slurm/{script}", "config/train_config.yaml", *overrides]
    submitted = time.time()
    job = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()
    out = work / f"{SCRIPTS[script]}-{job}.out"
    deadline = time.monotonic() + 600
    while not any(step >= 20 for _, step in rank0_steps(out.read_text(errors="replace") if out.exists() else "")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{script} job {job} did not reach step 20")
        time.sleep(0.2)
    signalled = time.time()
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    state = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=900)
    text = out.read_text(errors="replace")
    if state != "COMPLETED":
        raise RuntimeError(f"{script} job {job} ended {state}:\n{text[-3000:]}")
    resumed_at = text.index("resume=auto: continuing from")
    return {
        "start": rank0_steps(text)[0][0] - submitted,
        "requeue": rank0_steps(text[resumed_at:])[0][0] - signalled,
        "held": script_line(text, "after a requeue: resuming") - script_line(text, "requeueing; the next run resumes"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {script: [] for script in SCRIPTS}
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as folder:
        root = Path(folder)
        data = generate(root / "data", num_train=128, num_val=32, seed=0)
        (root / "slurm").mkdir()
        with running_cluster(root / "slurm") as cluster:
            for repeat in range(args.repeats):
                order = list(SCRIPTS) if repeat % 2 == 0 else list(reversed(SCRIPTS))
                for script in order:
                    result = run(cluster, script, root / f"{script}-{repeat}", data)
                    print(f"repeat {repeat} {script}: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.items()), flush=True)
                    results[script].append(result)
    print(f"\n{machine()}; medians of {args.repeats}:")
    print("| script | sbatch -> first step | USR1 -> requeued first step | of which SLURM holds the job | the rest (ours) |")
    print("|---|---|---|---|---|")
    for script, runs in results.items():
        median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        ours = statistics.median(r["requeue"] - r["held"] for r in runs)
        print(f"| `slurm/{script}` | {median['start']:.1f} s | {median['requeue']:.1f} s | {median['held']:.1f} s | {ours:.1f} s |")


if __name__ == "__main__":
    main()
