from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from purrsight.distributed.process_group import order_ranks_by_node, worker_generation
from purrsight.launcher.health import (
    CheckFailedError,
    CheckSkippedError,
    check_data,
    check_disk,
    check_gpus,
    check_master,
    check_packages,
    check_writable,
)
from purrsight.launcher.logwriter import parse_ranks, prune_runs
from tests.helpers import REPO, python_env, tiny_config


def run_logwriter(log_dir: Path, stamp: str, lines: list[str], **options: object) -> str:
    args = [
        sys.executable,
        "-m",
        "purrsight.launcher.logwriter",
        "--log-dir",
        str(log_dir),
        "--node-rank",
        "1",
        "--nproc",
        "2",
        "--timestamp",
        stamp,
    ]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(
        args, input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=REPO, env=python_env(), timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_lines_are_prefixed_and_console_filtered(tmp_path: Path) -> None:
    console = run_logwriter(
        tmp_path, "20260101_000000", ["banner", "[default0]:from local 0", "[default1]:from local 1"], console_ranks="0"
    )
    text = (tmp_path / "cluster_train_20260101_000000_node1.log").read_text()
    assert text.splitlines() == ["[node1 launcher] banner", "[node1 rank2] from local 0", "[node1 rank3] from local 1"]
    assert "rank3" not in console and "[node1 rank2] from local 0" in console
    assert (tmp_path / "latest_node1.log").resolve() == (tmp_path / "cluster_train_20260101_000000_node1.log").resolve()


def test_rotation_by_size_and_pruning_of_old_runs(tmp_path: Path) -> None:
    for i in range(4):
        stamp = f"2026010{i + 1}_000000"
        (tmp_path / f"cluster_train_{stamp}_node1").mkdir()  # torchrun's folder of that run
        run_logwriter(tmp_path, stamp, [f"line {n} " + "x" * 80 for n in range(60)], max_bytes=1000, backups=2, keep_runs=2)
    (tmp_path / "cluster_train_20250101_000000_node0.log").write_text("another node's run")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "cluster_train_20260104_000000_node1.log.1" in names and "cluster_train_20260104_000000_node1.log.2" in names
    assert "cluster_train_20260104_000000_node1.log.3" not in names  # backup count honoured
    assert not any(n.startswith(("cluster_train_20260101", "cluster_train_20260102")) for n in names)
    assert "cluster_train_20260103_000000_node1" in names  # kept run keeps its torchrun folder
    assert "cluster_train_20250101_000000_node0.log" in names  # other nodes' logs untouched
    assert prune_runs(tmp_path, 1, 2) == []


def test_parse_ranks() -> None:
    assert parse_ranks("all") is None and parse_ranks("0,2") == {0, 2}


def test_ranks_follow_the_node_rank() -> None:
    env = {
        "PURRSIGHT_NODE_RANK": "1",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "RANK": "1",
        "GROUP_RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    note = order_ranks_by_node(env)
    assert env["RANK"] == "3" and env["GROUP_RANK"] == "1" and note and "torchrun assigned 1" in note
    assert env["PURRSIGHT_TORCHRUN_RANK"] == "1"  # kept: torchrun's rank 0 hosts the store
    order_ranks_by_node(env)  # idempotent: the original torchrun rank is not overwritten
    assert env["PURRSIGHT_TORCHRUN_RANK"] == "1" and env["RANK"] == "3"
    misfit = {**env, "PURRSIGHT_NODE_RANK": "2", "RANK": "1"}
    assert "does not fit" in (order_ranks_by_node(misfit) or "") and misfit["RANK"] == "1"
    assert order_ranks_by_node({"RANK": "0"}) is None


def test_master_check_waits_then_fails_with_hints() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connections are refused
        start = time.monotonic()
        with pytest.raises(CheckFailedError, match=rf"Cannot connect to master node at 127.0.0.1:{port} after 2 s.*firewall"):
            check_master("127.0.0.1", port, timeout_s=2, interval_s=0.2)
        assert 1.5 < time.monotonic() - start < 10
        probe.listen()
        assert "answered" in check_master("127.0.0.1", port, timeout_s=2)


def test_disk_and_writable(tmp_path: Path) -> None:
    assert "GiB free" in check_disk([tmp_path / "not" / "yet"], 0.001)
    with pytest.raises(CheckFailedError, match="HEALTH_MIN_FREE_GB"):
        check_disk([tmp_path], 10**9)
    assert check_writable(tmp_path / "out") == str(tmp_path / "out")
    (tmp_path / "a_file").write_text("")  # a folder under a regular file cannot exist, even for root
    with pytest.raises(CheckFailedError, match="a_file/out: not writable"):
        check_writable(tmp_path / "a_file" / "out")


def test_packages_are_found_with_versions_and_a_missing_one_is_named() -> None:
    found = check_packages({"torch": "torch", "yaml": "PyYAML"})
    assert found.startswith("torch 2.") and "yaml 6." in found
    with pytest.raises(CheckFailedError, match=r"cannot import no_such_pkg_xyz \(activate .*CONDA_ENV or VENV"):
        check_packages({"torch": "torch", "no_such_pkg_xyz": "no-such-pkg-xyz"})


def test_gpu_check_trusts_the_probe_count_on_cpu_nodes() -> None:
    with pytest.raises(CheckSkippedError, match="no GPU"):
        check_gpus(expect_gpus=False, visible=0)
    with pytest.raises(CheckFailedError, match="BACKEND=nccl but no CUDA device"):
        check_gpus(expect_gpus=True, visible=0)
    with pytest.raises(CheckSkippedError, match="no GPU"):  # no count given: torch is asked (a CPU build here)
        check_gpus(expect_gpus=False)


def test_worker_generation_counts_starts_on_this_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A healthy node's workers restarted for a new rendezvous round know they are not the first."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # markers live in the node's temp folder
    env = {"PURRSIGHT_LAUNCH_ID": "job-1", "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert [worker_generation(dict(env)) for _ in range(3)] == [0, 1, 2]
    assert worker_generation({**env, "PURRSIGHT_LAUNCH_ID": "job-2"}) == 0  # another launch starts afresh
    assert worker_generation({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2  # plain torchrun: its own count


@pytest.mark.no_gpu_driver
def test_probe_on_a_cpu_node_does_not_import_torch() -> None:
    """No GPU driver here: the probe reports no GPU and reads torch's version from its metadata."""
    code = "import sys, purrsight.launcher.probe as p; info = p.probe(); print(info.gpus, info.torch, 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), check=True)
    import torch

    assert done.stdout.split() == ["0", torch.__version__, "False"]


def test_probe_with_a_driver_asks_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver file (here a stand-in under tmp) means torch must be asked; this CPU build says no GPU."""
    from purrsight.launcher import probe

    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(probe, "GPU_DRIVER_FILES", (str(tmp_path / "nvidiactl"),))
    assert not probe._no_gpu_possible()
    assert probe.probe().gpus == 0


def test_only_node_0_reads_every_index_line_and_a_prepared_set_needs_its_manifest(synthetic_dir: Path, tmp_path: Path) -> None:
    """A million-line index checked by every node is millions of metadata calls each on a shared filesystem."""
    from tests.helpers import tiny_config

    lines = (synthetic_dir / "train.jsonl").read_text().splitlines()[:4]
    lines.append('{"id": "x", "prompt": "p", "response": "r", "image": "images/absent.png"}')
    lines.append('{"id": "y", "prompt": "p", "response": "r", "image": "images/gone.png"}')
    for media in ("images", "audio"):
        (tmp_path / media).symlink_to(synthetic_dir / media)
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    config = tiny_config(synthetic_dir, tmp_path, data__train_index=str(tmp_path / "train.jsonl"), data__val_index="null")
    # Every missing file in one pass (up to MAX_LISTED_PROBLEMS), not one per run.
    both = r"(?s)train.jsonl:5 \(id 'x'\): image file .*absent.png does not exist\n.*:6 .*gone.png"
    with pytest.raises(CheckFailedError, match=both):
        check_data(config, node_rank=0)
    # The index's content is the same on every node: node 0, which reads it, is not named a bad node for it.
    from purrsight.launcher.health import run_check

    assert not run_check("data", lambda: check_data(config, node_rank=0)).nodes_fault
    assert run_check("data", lambda: check_data(config.model_copy(update={"data": config.data.model_copy(
        update={"prepared": str(tmp_path / "absent-set")})}), node_rank=0)).nodes_fault  # fmt: skip
    llava = tmp_path / "llava.json"
    turns = [{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "a cat"}]
    llava.write_text(json.dumps([{"id": n, "image": f"images/{n}.png", "conversations": turns} for n in ("p", "q", "r")]))
    with pytest.raises(CheckFailedError, match=r"(?s)id 'p'.*p.png does not exist\n.*id 'q'.*q.png does not exist\n.*id 'r'"):
        check_data(config.model_copy(update={"data": config.data.model_copy(update={"train_index": str(llava)})}), node_rank=0)
    assert "readable (node 0 checks every line)" in check_data(config, node_rank=1)
    (tmp_path / "train.jsonl").chmod(0)
    if os.geteuid() != 0:  # root reads any file
        with pytest.raises(CheckFailedError, match="cannot read the index"):
            check_data(config, node_rank=1)
    (tmp_path / "train.jsonl").chmod(0o644)

    prepared = config.model_copy(update={"data": config.data.model_copy(update={"prepared": str(tmp_path / "set")})})
    for node_rank in (0, 1):
        with pytest.raises(CheckFailedError, match=r"set does not exist; make it with `python train_phase2.py prepare"):
            check_data(prepared, node_rank)


def test_node_0_refuses_a_prepared_set_made_from_another_index_before_torchrun(synthetic_dir: Path, tmp_path: Path) -> None:
    """The index this command names (an override) against the one the set was made from; the set's own
    source is not read (it may be gone, or changed: the prepared set is what trains)."""
    from purrsight.datasets.prepare_job import prepare_set
    from tests.helpers import tiny_config

    index = tmp_path / "train.jsonl"
    index.write_text((synthetic_dir / "train.jsonl").read_text())
    for media in ("images", "audio"):
        (tmp_path / media).symlink_to(synthetic_dir / media)
    config = tiny_config(synthetic_dir, tmp_path, data__train_index=str(index), data__val_index="null")
    prepare_set(config, tmp_path / "set", processes=1, part=(0, 1), shard_size=64)
    prepared = config.model_copy(update={"data": config.data.model_copy(update={"prepared": str(tmp_path / "set")})})
    assert "train 128 samples" in check_data(prepared, node_rank=0)
    index.unlink()  # the source gone: the prepared set trains alone
    assert "train 128 samples" in check_data(prepared, node_rank=0)
    same = prepared.model_copy(
        update={"data": prepared.data.model_copy(update={"train_index": str(synthetic_dir / "train.jsonl")})}
    )
    assert "train 128 samples" in check_data(same, node_rank=0)  # named at another path, the same content: the same source
    changed = tmp_path / "changed.jsonl"
    changed.write_text((synthetic_dir / "train.jsonl").read_text().replace("The cat is red.", "The cat is blue."))
    other = prepared.model_copy(update={"data": prepared.data.model_copy(update={"train_index": str(changed)})})
    other._overridden = frozenset()  # as the config file's own value: the raw path's index, not this run's
    assert "train 128 samples" in check_data(other, node_rank=0)
    other._overridden = frozenset({"data.train_index"})  # named by this command's overrides: refused, naming both
    with pytest.raises(CheckFailedError, match=r"data.train_index=.*changed.jsonl names other data than data.prepared="):
        check_data(other, node_rank=0)
    assert "train 128 samples" in check_data(other, node_rank=1)  # other nodes check the manifest only: rank 0 refuses


def test_a_node_names_itself_for_exclusion_only_for_failures_of_its_own(tmp_path: Path) -> None:
    from purrsight.bad_nodes import name_bad_node

    bad = tmp_path / "bad-nodes"
    environ = {"PURRSIGHT_BAD_NODES_FILE": str(bad), "SLURMD_NODENAME": "gpu17"}
    assert name_bad_node(["config", "master reachable"], environ) is None  # the job's fault, or the master's
    assert name_bad_node(["disk"], {"SLURMD_NODENAME": "gpu17"}) is None  # not under slurm/train.sbatch
    assert name_bad_node(["config", "gpus", "disk"], environ) == "gpu17\tgpus, disk"
    assert name_bad_node(["preflight"], environ, node="gpu03") == "gpu03\tpreflight"  # rank 0 names a straggler's node
    assert bad.read_text() == "gpu17\tgpus, disk\ngpu03\tpreflight\n"


def llava_file_beside_its_media_root(tmp_path: Path) -> tuple[Path, Path]:
    """A LLaVA JSON whose image paths are relative to a media root, not to the file's folder (as
    llava_v1_5_mix665k.json's are to the folder of coco/, gqa/, ...): (the file, the root)."""
    from PIL import Image

    from tests.format_sets import Item, write_llava

    (tmp_path / "annotations").mkdir()
    (tmp_path / "media" / "coco").mkdir(parents=True)
    Image.new("RGB", (8, 8), (200, 30, 30)).save(tmp_path / "media" / "coco" / "a.png")
    items = [Item("a", "What colour?", "Red.", image=Path("coco/a.png")), Item("b", "Hello?", "Hi.")]
    return write_llava(tmp_path / "annotations", items), tmp_path / "media"


def test_node_0_reads_a_llava_file_as_the_trainer_does_with_its_media_root(synthetic_dir: Path, tmp_path: Path) -> None:
    """data.media_root and data.format reach the health check's reading: without them the check
    looked for annotations/coco/a.png and failed a set the trainer reads."""
    index, media = llava_file_beside_its_media_root(tmp_path)
    overrides = {"data__train_index": str(index), "data__val_index": "null", "data__format": "llava"}
    config = tiny_config(synthetic_dir, tmp_path, **overrides, data__media_root=str(media))
    assert check_data(config, node_rank=0) == f"{index}: 2 samples"
    without_root = tiny_config(synthetic_dir, tmp_path, **overrides)
    with pytest.raises(CheckFailedError, match=r"llava.json:\d+ \(id 'a'\): image file .*annotations/coco/a.png does not exist"):
        check_data(without_root, node_rank=0)


def test_an_elastic_round_with_a_gap_in_its_node_ranks_orders_ranks_among_the_nodes_present() -> None:
    """Node 1 of 0-2 lost: nodes 0 and 2 remain, two processes each, torchrun's ranks in another
    order. Through one store each process takes its place among the nodes present: node 0's are
    ranks 0-1, node 2's ranks 2-3 (group rank 1); two nodes with one node_rank are refused."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from purrsight.distributed.process_group import ranks_among_present_nodes
    from purrsight.errors import UserError

    def round_of(placements: list[tuple[int, int]]) -> list[dict[str, str]]:
        store = dist.HashStore()
        store.set_timeout(timedelta(seconds=30))
        environs = [
            {"PURRSIGHT_NODE_RANK": str(node), "LOCAL_RANK": str(local), "WORLD_SIZE": str(len(placements)),
             "RANK": str(torchrun), "PURRSIGHT_TORCHRUN_RANK": str(torchrun), "PURRSIGHT_ELASTIC_NODES": "2:3"}
            for torchrun, (node, local) in enumerate(placements)
        ]  # fmt: skip
        errors: list[BaseException] = []

        def join(environ: dict[str, str]) -> None:
            try:
                ranks_among_present_nodes(store, environ)
            except BaseException as error:  # reported below, per process
                errors.append(error)

        threads = [threading.Thread(target=join, args=(environ,)) for environ in environs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        if errors:
            raise errors[0]
        return environs

    # torchrun ordered the nodes by address: node 2's processes first
    environs = round_of([(2, 0), (2, 1), (0, 0), (0, 1)])
    assert [(e["RANK"], e["GROUP_RANK"]) for e in environs] == [("2", "1"), ("3", "1"), ("0", "0"), ("1", "0")]
    assert [e["PURRSIGHT_TORCHRUN_RANK"] for e in environs] == ["0", "1", "2", "3"]  # kept: its rank 0 hosts the store
    with pytest.raises(UserError, match="same node_rank"):
        round_of([(0, 0), (1, 0), (1, 0)])
