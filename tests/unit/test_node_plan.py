"""The launcher's one Python step (purrsight/launcher/node_plan.py), run in this process.

The launcher's own use of it (its exit codes, the lines a user sees, the plan sourced by
bash) is covered end to end by tests/shell/cluster_train.bats and tests/launcher.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from purrsight.launcher import node_plan, probe
from tests.helpers import DEFAULT_CONFIG, REPO


def plan_node(tmp_path: Path, *args: str, gpus: int = 0) -> tuple[int, str]:
    """node_plan.main on this node, as if ``gpus`` were visible; (exit code, the plan's text or "")."""
    plan = tmp_path / "plan.sh"
    plan.unlink(missing_ok=True)
    node = probe.NodeInfo("3.x", "2.x", "12.4" if gpus else "none", "2.21" if gpus else "none", gpus, "H100" if gpus else "")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(probe, "probe", lambda: node)
        patch.delenv("OMP_NUM_THREADS", raising=False)  # a node where the user left it unset (conftest.py sets 1)
        code = node_plan.main(
            [
                str(DEFAULT_CONFIG),
                f"run.output_dir={tmp_path / 'runs'}",
                "--plan",
                str(plan),
                "--transcript",
                str(tmp_path / "shown.txt"),
                "--log-dir",
                str(tmp_path / "logs"),
                *args,
            ]
        )
    return code, plan.read_text() if plan.exists() else ""


def sourced(plan: str, *names: str) -> list[str]:
    """The values bash sees after sourcing ``plan`` (arrays joined by |)."""
    script = plan + "\n" + "\n".join(f'(IFS="|"; echo "${{{name}[*]}}")' for name in names)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()


def test_the_plan_is_bash_with_the_placement_the_processes_and_the_exports(tmp_path: Path) -> None:
    code, plan = plan_node(tmp_path, "--no-health", "--master-addr", "127.0.0.1", "--num-nodes", "2")
    assert code == 0
    accelerator, backend, nproc, gpus, exported, master = sourced(
        plan, "ACCELERATOR", "BACKEND", "NPROC", "NODE_GPUS", "EXPORTED", "MASTER_ADDR"
    )
    assert (accelerator, backend, nproc, gpus, master) == ("cpu", "gloo", "1", "0", "127.0.0.1")
    assert "set   OMP_NUM_THREADS=" in exported and "x 2 nodes, all on this machine" in exported
    assert "export PURRSIGHT_ACCELERATOR=cpu PURRSIGHT_BACKEND=gloo" in plan


def test_gpus_decide_nccl_and_one_process_each_unless_gloo_is_asked_for(tmp_path: Path) -> None:
    assert sourced(plan_node(tmp_path, "--no-health", gpus=4)[1], "BACKEND", "NPROC") == ["nccl", "4"]
    assert sourced(plan_node(tmp_path, "--no-health", "--backend", "gloo", gpus=4)[1], "ACCELERATOR", "NPROC") == ["cpu", "1"]


def test_user_mistakes_are_one_line_and_exit_2_before_any_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["trainer.max_stepz=3"], "config error: override trainer.max_stepz=3: unknown key trainer.max_stepz"),
        (["--backend", "nccl"], "backend nccl needs GPUs but no GPU is visible here; use BACKEND=gloo"),
        (["--nproc-per-node", "5"], "NPROC_PER_NODE=5 but only 4 GPU(s) are visible"),
        (["distributed.strategy=fsdp"], "distributed.strategy=fsdp shards the frozen weights over several processes"),
    ]
    for args, culprit in cases:
        code, plan = plan_node(tmp_path, *args, gpus=4 if "--nproc-per-node" in args else 0)
        errors = capsys.readouterr().err
        assert (code, plan) == (2, ""), args
        assert culprit in errors and "Traceback" not in errors, errors
        assert errors.rstrip().endswith("Try './cluster_train.sh --help'.")
    capsys.readouterr()


def test_a_run_folder_holding_a_run_is_refused_unless_resumed_archived_or_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "runs" / "phase2-tiny" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / "step-00000020.ckpt").write_bytes(b"weights")
    assert plan_node(tmp_path, "--no-health")[0] == 2
    refused = capsys.readouterr().err.strip().splitlines()
    assert len(refused) == 1 and "error: run folder" in refused[0]
    assert "already holds a run (checkpoints up to step 20" in refused[0]
    assert plan_node(tmp_path, "--no-health", "--resume", "auto")[0] == 0
    assert plan_node(tmp_path, "--no-health", "run.if_exists=archive")[0] == 0
    assert plan_node(tmp_path, "--no-health", "--dry-run")[0] == 0  # a dry run checks nothing it would not start


def test_health_checks_run_after_the_plan_is_written_and_a_failure_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, plan = plan_node(tmp_path)
    shown = capsys.readouterr().out
    assert code == 0 and "health: 5/5 checks passed" in shown and "health checks took" in shown
    assert (tmp_path / "shown.txt").read_text() == shown  # the transcript the node log gets
    code, plan = plan_node(tmp_path, "--min-free-gb", "1e9")
    assert code == 3 and sourced(plan, "NPROC") == ["1"]  # the launcher still learns what it needs for its log
    assert "error: health check disk:" in capsys.readouterr().out


def test_debug_plans_the_masked_environment_the_workers_get(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    dump = sourced(plan_node(tmp_path, "--no-health", "--log-level", "DEBUG")[1], "ENVIRONMENT_DUMP")[0].split("|")
    assert "HF_TOKEN=****" in dump and "PURRSIGHT_BACKEND=gloo" in dump and "NCCL_DEBUG=INFO" not in dump


def test_the_launchers_steps_do_not_import_torch() -> None:
    """Every module bash runs before torchrun loads without torch (torchrun.py is torch's agent itself)."""
    steps = [path.stem for path in (REPO / "purrsight" / "launcher").glob("*.py") if path.stem not in ("__init__", "torchrun")]
    code = f"import sys; [__import__('purrsight.launcher.' + m) for m in {steps!r}]; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert steps and done.stdout.strip() == "False", done.stderr
