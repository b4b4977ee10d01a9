"""The preflight all-reduce on two real CPU ranks (torchrun, gloo)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from purrsight.distributed.preflight import bus_bandwidth
from tests.helpers import DEFAULT_CONFIG, REPO, fault_env, python_env, tiny_overrides, torchrun_job


def torchrun(tmp: Path, synthetic_dir: Path, env: dict[str, str] | None = None, **overrides: object):  # type: ignore[no-untyped-def]
    command = torchrun_job(
        REPO / "train_phase2.py",
        "--config",
        str(DEFAULT_CONFIG),
        *tiny_overrides(synthetic_dir, tmp, trainer__max_steps=2, **overrides),
    )
    return subprocess.run(
        command, cwd=REPO, env={**python_env(), "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True, text=True, timeout=300
    )


def test_bus_bandwidth_follows_nccl_tests() -> None:
    assert bus_bandwidth(10.0, 2) == 10.0 and bus_bandwidth(10.0, 8) == 17.5


def test_table_sum_check_and_planted_straggler(synthetic_dir: Path, tmp_path: Path) -> None:
    done = torchrun(tmp_path, synthetic_dir, env=fault_env("preflight_delay:1:0.05", python_env()))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "preflight all-reduce over 2 ranks (sum check: exact on every size)" in done.stderr
    assert re.search(r"size +time ms +algbw GB/s +busbw GB/s", done.stderr)
    rows = re.findall(r"^\s*(\d+ (?:KiB|MiB|B))\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", done.stderr, re.M)
    assert len(rows) == 4
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20}
    for size, ms, algbw, busbw in rows:
        assert float(busbw) == float(algbw)  # n = 2: busbw = algbw x 2(n-1)/n
        count, unit = size.split()
        expected = int(count) * units[unit] / (float(ms) / 1e3) / 1e9
        assert abs(float(algbw) - expected) <= 0.05 * expected + 0.002  # algbw = bytes / time
    assert "preflight: straggler rank 1 (node 0)" in done.stderr
    assert "straggler rank 0" not in done.stderr


def test_floor_above_the_fabric_fails_with_exit_3_and_names_the_stragglers_node(synthetic_dir: Path, tmp_path: Path) -> None:
    """With a straggler planted (rank 1), its node goes to the job's bad-node file, for slurm/train.sbatch to exclude."""
    bad_nodes = tmp_path / "bad-nodes"
    planted = fault_env("preflight_delay:1:0.05", python_env())
    env = {**planted, "PURRSIGHT_BAD_NODES_FILE": str(bad_nodes), "SLURMD_NODENAME": "gpu07"}
    done = torchrun(tmp_path, synthetic_dir, env=env, preflight__min_busbw_gbps=1e6)
    assert done.returncode == 3  # the workers' documented reason (the launcher's torchrun; plain torchrun says 1)
    assert re.search(
        r"error: preflight: bus bandwidth [\d.]+ GB/s at the largest size is below "
        r"preflight.min_busbw_gbps=1e\+06",
        done.stderr,
    ), done.stderr[-2000:]
    assert "exitcode: 3" in done.stderr  # each worker exits 3
    assert not (tmp_path / "phase2-tiny" / "checkpoints").exists()  # stopped before training
    assert bad_nodes.read_text() == "gpu07\tpreflight\n"  # named once, by rank 0
