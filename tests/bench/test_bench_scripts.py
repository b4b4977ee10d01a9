"""The benchmark scripts still run (they are run by hand, so nothing else would notice them rot).

These check that each script trains or loads and prints its table; they assert no speed:
figures from a 2-core CI machine mean nothing, and bench/results/ holds the measured ones.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.common import MEASURED_SETTINGS, median_interval, run_plain
from bench.launch import suite_cpu
from bench.launch.interpreters import child_cpu_s
from tests.helpers import run_python


def markdown_rows(output: str, start: str = r"\| ") -> list[list[str]]:
    """The stripped cells of each Markdown table row of ``output`` whose line matches ``start``."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in output.splitlines() if re.match(start, line)]


def table_rows(output: str) -> list[list[str]]:
    """The rows whose first cell is a number (the scripts' figures, not their headers)."""
    return markdown_rows(output, r"\| \d")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.5, 1.5), min_size=1, max_size=20))
def test_the_median_interval_holds_the_median_and_narrows_with_more_repeats(ratios: list[float]) -> None:
    """bench/launch/stack_vs_plain.py's interval: around the median, within the values, reproducible;
    the same spread over four times the repeats gives an interval no wider."""
    low, high = median_interval(ratios, resamples=1000)
    assert min(ratios) <= low <= statistics.median(ratios) <= high <= max(ratios)
    assert median_interval(ratios, resamples=1000) == (low, high)
    if len(set(ratios)) == 1:
        assert low == high == ratios[0]
    more_low, more_high = median_interval(ratios * 4, resamples=1000)
    assert more_high - more_low <= high - low + 1e-12


def test_the_median_interval_tells_a_resolved_target_from_an_unresolved_one() -> None:
    """Seven repeats of this host (the stack's ratios to plain, bench/results/launch.md, 2026-11-29) leave
    0.98 inside the interval; sixty repeats spread from 0.96 to 1.02 around 0.99 place their median above it,
    the first seven of them do not, and the interval is narrower than the values' range."""
    host = [0.893, 1.272, 0.858, 1.028, 0.952, 0.803, 0.985]
    low, high = median_interval(host)
    assert low < 0.98 < high
    spread = [0.96 + 0.06 * ((i * 37) % 60) / 59 for i in range(60)]
    assert min(spread) < 0.98 < max(spread)
    low, high = median_interval(spread)
    assert 0.98 < low < high < 1.0
    assert median_interval(spread[:7])[0] < 0.98
    with pytest.raises(ValueError):
        median_interval([])
    with pytest.raises(ValueError):
        median_interval([1.0] * 3, confidence=1.0)


@pytest.mark.parametrize(("repeats", "interval_shown"), [(3, False), (11, True)])
def test_stack_vs_plains_table_gives_the_interval_from_ten_repeats_on(
    repeats: int, interval_shown: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's ratio table, its runs stood in for by fixed timings (a real set trains for minutes):
    six cells a row, each run's median ratio, and the interval only where enough repeats make it mean something."""
    import bench.launch.stack_vs_plain as stack_vs_plain
    from bench.common import Timing

    rates = iter(range(1000))
    monkeypatch.setattr(stack_vs_plain, "ensure_synthetic_set", lambda: None)
    monkeypatch.setattr(stack_vs_plain, "run_plain", lambda *args, **kwargs: Timing(5.0, 400.0 + next(rates) % 7))
    monkeypatch.setattr(stack_vs_plain, "run_stack", lambda *args, **kwargs: Timing(5.5, 392.0))
    monkeypatch.setattr(sys, "argv", ["stack_vs_plain", "--repeats", str(repeats)])
    assert stack_vs_plain.main() == 0
    ratio_table = [row for row in markdown_rows(capsys.readouterr().out) if len(row) == 6]  # the CPU table has 8 cells
    rows = {row[0]: row for row in ratio_table if row[0] in ("plain", "trainer", "stack")}
    assert set(rows) == {"plain", "trainer", "stack"} and all(len(row) == 6 for row in rows.values())
    assert rows["plain"][4] == "1.000" and rows["plain"][5] == ("1.000 - 1.000" if interval_shown else "-")
    low, _, high = rows["stack"][5].partition(" - ") if interval_shown else ("0", "", "2")
    assert float(low) <= float(rows["stack"][4]) <= float(high) and float(rows["stack"][4]) < 0.99


def test_gpu_script_smoke_run_on_cpu() -> None:
    """--smoke builds the model through build_model and trains it on CPU: the GPU path minus CUDA."""
    done = run_python(["-m", "bench.gpu.gpu_throughput", "--smoke"], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = table_rows(done.stdout)
    assert [row[0] for row in rows] == ["16", "32"]
    assert all(float(row[2]) > 0 for row in rows)  # tokens/s


def test_the_auto_choices_table_fills_each_gpus_share_of_the_global_batch() -> None:
    """bench/model/auto_choices.py on the 0.5B preset as it ships (global batch 256) over 8 GPUs of
    141 GB: the choice's row, one micro-batch of the 32-sample share."""
    done = run_python(["-m", "bench.model.auto_choices", "--presets", "0.5b", "--gpus", "8", "--gpu-memory", "141"], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.strip("|").split("|") for line in done.stdout.splitlines() if line.startswith("| 0.5b")]
    assert [[cell.strip() for cell in row[:7]] for row in rows] == [["0.5b", "256", "8", "141", "32", "off", "1"]]


def test_data_pipeline_script_small_run() -> None:
    """Batches of 2, two timed (one of the four 12-MP JPEGs): a run of seconds that still reads every figure."""
    done = run_python(
        [
            "-m",
            "bench.data.data_pipeline",
            "--samples",
            "6",
            "--large-samples",
            "4",
            "--batch-size",
            "2",
            "--workers",
            "1",
            "--batches",
            "2",
            "--repeats",
            "1",
        ],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    consumption = re.search(r"one H100 at 40% MFU consumes ([\d.]+) samples/s \(([\d.]+) TFLOP per sample\)", done.stdout)
    assert consumption, done.stdout
    # 1088 tokens x about 2.3 GFLOP per token (4 x 0.5B parameters, plus attention), plus the towers
    assert 1.5 < float(consumption.group(2)) < 4
    workers, *side_by_side = table_rows(done.stdout)
    assert workers[0] == "1" and float(workers[1]) > 0
    assert [row[0] for row in side_by_side] == ["224 px", "4000x3000", "224 px + 5-min 44.1 kHz stereo audio"]
    assert all(float(row[2]) > 0 for row in side_by_side)
    assert re.search(r"a 4000x3000 JPEG costs [\d.]+x a 224-px one", done.stdout)


def test_plain_ddp_loop_on_two_ranks(tmp_path: Path) -> None:
    timing = run_plain(nproc=2, steps=40, per_process_batch=8, work=tmp_path)
    assert timing.first_step_s > 0 and timing.samples_per_s > 0


def test_scaling_model_prints_its_tables(tmp_path: Path) -> None:
    """--trainable skips building the 0.8B-parameter model; the checkpoint write is still real."""
    done = run_python(["-m", "bench.scale.scaling_model", "--trainable", "2000000", "--checkpoint-dir", str(tmp_path)], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = table_rows(done.stdout.replace("| 100 Gb/s", "| 100").replace("| 200 Gb/s", "| 200").replace("| 400 Gb/s", "| 400"))
    assert [row[0] for row in rows] == ["100", "200", "400"]
    assert re.search(r"checkpoint: 0\.02 GB, written in [\d.]+ s", done.stdout)  # 2M x (4 + 8) bytes
    assert re.search(r"failures: 4\.74e-04 per GPU-day -> 0\.48 per day on 1024 GPUs", done.stdout)
    assert list(tmp_path.iterdir()) == []  # the timed checkpoint is removed


def test_allreduce_model_matches_the_textbook_bandwidth_terms() -> None:
    from bench.scale.scaling_model import allreduce_time, young_daly

    size, gbps = 1e9, 100
    line_rate = gbps * 1e9 / 8
    ring = allreduce_time("ring", size, gbps, nodes=128, per_node=8)
    assert ring.bandwidth_s == pytest.approx(2 * size * (1023 / 1024) / line_rate)  # nccl-tests: busbw = algbw x 2(p-1)/p
    tree = allreduce_time("tree", size, gbps, nodes=128, per_node=8)
    assert tree.bandwidth_s == pytest.approx(2 * size / (0.9 * line_rate))
    # latency: the ring's grows with every rank, the tree's with log2 of the nodes
    assert allreduce_time("ring", size, gbps, 256, 8).latency_s > 1.9 * ring.latency_s
    assert allreduce_time("tree", size, gbps, 256, 8).latency_s < 1.2 * tree.latency_s
    assert young_daly(checkpoint_s=2.0, mtbf_s=20_000.0) == pytest.approx(80_000**0.5 - 2)  # sqrt(2 C M) - C


def test_node_scaling_script_one_node(tmp_path: Path) -> None:
    """One launcher, a clean job and a job whose worker is killed: the script reads every figure it reports.

    40 steps: the kill (polled every 0.5 s once step 5 is reached) must land before the job's end;
    with 12, a fast machine finished first and the restart trained nothing to time (CI failure)."""
    done = run_python(
        ["-m", "bench.scale.node_scaling", "--nodes", "1", "--steps", "40", "--kill-after", "5", "--plot", str(tmp_path / "p.png")],
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = table_rows(done.stdout)
    assert row[:2] == ["1", "loopback"]
    assert float(row[8]) > 0  # restart after kill -9
    assert (tmp_path / "p.png").stat().st_size > 0


def test_index_table_script_small_run() -> None:
    done = run_python(["-m", "bench.data.index_table", "--records", "2000", "--reads", "100", "--repeats", "1"], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("RecordTable", "datasets"))]
    assert [row[0] for row in rows] == ["RecordTable", "datasets.from_list"], done.stdout
    assert all(float(value) > 0 for row in rows for value in row[-3:])  # build s, read us, first table s


def test_interpreters_script_counts_a_childs_cpu_and_names_a_failing_one() -> None:
    """bench/launch/interpreters.py's measure, on a child that burns a known share of CPU (the whole script
    trains under each interpreter: too long for a check that it runs)."""
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    assert 0.3 <= child_cpu_s([sys.executable, "-c", burn], {}) < 3
    with pytest.raises(SystemExit, match="exited 3"):
        child_cpu_s([sys.executable, "-c", "import sys; sys.exit(3)"], {})


def acct_v3(pid: int, ppid: int, started: int, alive_s: float, utime: int, comm: bytes, forked: bool = False) -> bytes:
    """One record as the kernel writes it (linux/acct.h's struct acct_v3), CPU as a comp_t."""
    flag = suite_cpu.AFORK if forked else 0
    return suite_cpu.ACCT_V3.pack(flag, 3, 0, 0, 0, 0, pid, ppid, started, alive_s * 100, utime, 0, 0, 0, 0, 0, 0, 0, comm)


def test_suite_cpu_reads_the_kernels_records_and_names_each_process_by_its_command_or_its_ancestors(tmp_path: Path) -> None:
    """A comp_t with an exponent (13 bits of mantissa, 3 of base-8 exponent); a pid used twice, each
    use named by the command logged nearest its start; a forked worker named after the server it
    was forked from, and that worker's own forked loader worker too; a child of a process that was
    still running (no record, only its line); a process of another program by its name."""
    records = tmp_path / "pacct"
    records.write_bytes(
        acct_v3(40, 1, 1000, 500, (1 << 13) | 150, b"python")  # 150 << 3 ticks: 12 s, alive 1000-1500
        + acct_v3(41, 40, 1200, 10, 30, b"python", forked=True)  # a worker forked 200 s after the server's start
        + acct_v3(43, 41, 1201, 5, 20, b"pt_data_worker", forked=True)  # its loader worker
        + acct_v3(40, 1, 2000, 5, 20, b"python")  # pid 40 again, 1,000 s later
        + acct_v3(44, 50, 3000, 1, 10, b"python", forked=True)  # pid 50 had not ended
        + acct_v3(42, 1, 1000, 1, 7, b"bash")
    )
    ended = suite_cpu.read_records(records)
    first_two = [(r.pid, r.ppid, r.cpu_s, r.alive_s, r.forked) for r in ended[:2]]
    assert first_two == [(40, 1, 12.0, 500, False), (41, 40, 0.3, 10, True)]
    lines = {
        40: [
            (1001, "/v/bin/python -u -m purrsight.launcher.torchrun --nnodes 2"),
            (2002, "/v/bin/python -X importtime -c import torch"),
        ],
        50: [(2500, "/v/bin/python -m tests.preloaded")],
    }
    cpu, count = suite_cpu.by_kind(ended, lines, prefix="/v/")
    server = "bin/python -m purrsight.launcher.torchrun"
    assert dict(cpu) == pytest.approx(
        {
            server: 12.0,
            f"python forked from: {server}": 0.3,
            f"pt_data_worker forked from: {server}": 0.2,
            "bin/python -c import torch": 0.2,
            "python forked from: bin/python -m tests.preloaded": 0.1,
            "[bash]": 0.07,
        }
    )
    assert sum(count.values()) == 6


@pytest.mark.root
def test_suite_cpu_counts_a_commands_processes_the_forked_ones_too() -> None:
    """bench/launch/suite_cpu.py on a Python process that burns 0.4 CPU-s and forks a child that
    burns as much: both counted, the child under its parent's command; its logger gone after. (The
    kernel's records count CPU in clock ticks, sampled, less the time its hypervisor took: 0.23-0.30
    of the 0.4 beside a full suite.)
    Skipped inside a measure of the suite (the kernel has one accounting file) and where root lacks
    CAP_SYS_PACCT (a container's default)."""
    if suite_cpu.LOG_VARIABLE in os.environ or not suite_cpu.may_account():
        pytest.skip("inside bench/launch/suite_cpu.py's own measure, or no CAP_SYS_PACCT")
    burner = (
        "burner=1; import os, time\n"
        "def spin():\n    end = time.process_time() + 0.4\n    while time.process_time() < end: pass\n"
        "child = os.fork()\nspin()\nif child == 0: os._exit(0)\nos.waitpid(child, 0)\n"
    )
    site = Path(sysconfig.get_paths()["purelib"])
    try:
        done = run_python(["-m", "bench.launch.suite_cpu", "--top", "50", "--", sys.executable, "-c", burner], timeout=120)
    finally:  # a script killed by the timeout removes nothing
        suite_cpu.account_to(None)
        for left in site.glob("_purrsight_cmdline_log_*"):
            left.unlink()
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split(None, 4)[4]: float(line.split()[0]) for line in done.stdout.splitlines()[2:]}
    parent = next((kind for kind in rows if "-c burner=1; import os, time" in kind and "forked" not in kind), None)
    child = next((kind for kind in rows if kind.endswith(f"forked from: {parent}")), None)
    assert parent and child and rows[parent] >= 0.1 and rows[child] >= 0.1, done.stdout
    assert "_purrsight_cmdline_log_" not in " ".join(path.name for path in site.iterdir()), "the logger was left installed"


def test_prepare_memory_script_small_run() -> None:
    """Two photos behind 16 lines, one shard size: the script prepares through the CLI and reads its memory."""
    args = ["-m", "bench.data.prepare_memory", "--photos", "2", "--lines", "16", "--shard-sizes", "8"]
    done = run_python(args, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.strip("|").split("|") for line in done.stdout.splitlines() if line.startswith("| this tree")]
    assert len(rows) == 1 and rows[0][1].strip() == "8"
    assert float(rows[0][3]) > 0 and float(rows[0][4]) > 0  # the main process's and a worker's peak (2 shards: a pool)


def test_the_model_memory_table_counts_known_sizes_and_fsdp_fits_what_ddp_cannot(tmp_path: Path) -> None:
    """bench/model/model_memory.py's table, through train_phase2.py estimate on the meta device: the Qwen2.5
    sizes as published, and the docs/SCALING.md verdicts on 8 GPUs of 80 GB."""
    from bench.model.model_memory import GPU_MEMORY, GPUS, REPO, shapes
    from purrsight.config import load_config
    from purrsight.estimate.memory import footprint

    bases = shapes(tmp_path)
    towers = [f"model.image_encoder.path={tmp_path}/siglip-base-patch16-224", f"model.audio_encoder.path={tmp_path}/wav2vec2-base"]
    config = load_config(REPO / "config" / "qwen2.5-7b.yaml", [*towers, *MEASURED_SETTINGS], check_paths=False)
    results = {name: footprint(config, path).estimate(GPUS) for name, path in bases.items()}
    # Qwen2.5-7B, -32B, -72B as published (7.6, 32.8, 72.7) plus the two frozen towers (0.19B)
    assert [round(result.frozen_parameters / 1e9, 1) for result in results.values()] == [7.8, 33.0, 72.9]
    for name, result in results.items():
        assert result.fits("fsdp", GPU_MEMORY), name
        assert result.per_gpu["fsdp"].total < result.per_gpu["ddp"].total, name
    assert not results["Qwen2.5-72B"].fits("ddp", GPU_MEMORY)  # a 72B replica does not fit an 80 GB GPU


def test_the_fsdp_memory_bench_reads_the_trainers_build_line() -> None:
    import bench.model.fsdp_memory as fsdp_memory

    line = (
        "model built: frozen weights sharded over 2 ranks in 7 FSDP units; "
        "this rank holds 942.39 MiB of them; peak RSS so far 1641 MiB"
    )
    assert fsdp_memory.BUILT.findall(line) == [("sharded", "942.39", "1641")]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--window", "0"], "--window 0: must be at least 1"),
        (["--kill-at", "10", "--window", "20"], "--kill-at 10: must exceed --window 20"),
        (["--kill-at", "45", "--join-at", "60"], "--join-at 60: must exceed --kill-at + --window = 65"),
        (["--steps", "100"], "--steps 100: must exceed --join-at + 2 x --window = 190"),
    ],
)
def test_the_elastic_change_bench_refuses_steps_that_leave_no_window_to_measure(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused in one line before any launcher starts (the bench itself is a 3-node job: by hand only)."""
    from bench.scale.elastic_change import main

    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    assert named in capsys.readouterr().err


def test_every_option_the_gpu_session_passes_is_one_its_script_takes() -> None:
    """bench/gpu_session.sh runs only where a GPU is lent, minutes a session: an option a script
    renamed would cost a part of that time, and nothing on a CPU runs the session. Each part's
    options must appear in its script's ``--help`` (``profile``'s for step_profile's subcommand)."""
    session = (Path(__file__).resolve().parents[2] / "bench" / "gpu_session.sh").read_text()
    parts = re.findall(r'^part \S+ \d+ "\$\{PY\}" -m (bench\.[\w.]+) (.*)$', session, flags=re.MULTILINE)
    assert {module for module, _ in parts} == {"bench.gpu.step_profile", "bench.gpu.gpu_throughput", "bench.gpu.loss_scorer"}
    helps: dict[tuple[str, str], str] = {}
    for module, line in parts:
        words = line.split("#")[0].split()
        command = [module, *(["profile"] if words and words[0] == "profile" else [])]
        if tuple(command) not in helps:
            shown = run_python(["-m", *command, "--help"], timeout=120)
            assert shown.returncode == 0, shown.stderr[-2000:]
            helps[tuple(command)] = shown.stdout
        for option in (word.split("=")[0] for word in words if word.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[tuple(command)]), (
                f"{module}: {option} not in its --help"
            )
