"""NCCL/socket decisions over fake /sys/class/infiniband trees and fake `ip route get` output."""

from __future__ import annotations

from pathlib import Path

import pytest

from purrsight.launcher.cpus import usable_cpus
from purrsight.launcher.launch_env import mask, nccl_settings, plan, threads_per_process
from purrsight.launcher.network import Route, active_ib_ports, parse_route


def fake_port(
    root: Path, device: str, port: int, state: str, link_layer: str = "InfiniBand", gids: dict[int, tuple[str, str]] | None = None
) -> None:
    folder = root / device / "ports" / str(port)
    folder.mkdir(parents=True)
    (folder / "state").write_text(f"{state}\n")
    (folder / "link_layer").write_text(f"{link_layer}\n")
    for index, (kind, gid) in (gids or {}).items():
        (folder / "gid_attrs" / "types").mkdir(parents=True, exist_ok=True)
        (folder / "gids").mkdir(exist_ok=True)
        (folder / "gid_attrs" / "types" / str(index)).write_text(f"{kind}\n")
        (folder / "gids" / str(index)).write_text(f"{gid}\n")


def test_active_infiniband_ports(tmp_path: Path) -> None:
    fake_port(tmp_path, "mlx5_0", 1, "4: ACTIVE")
    fake_port(tmp_path, "mlx5_1", 1, "4: ACTIVE")
    fake_port(tmp_path, "mlx5_2", 1, "1: DOWN")
    ports = active_ib_ports(tmp_path)
    assert [(p.device, p.port) for p in ports] == [("mlx5_0", 1), ("mlx5_1", 1)]
    settings = dict((n, v) for n, v, _ in nccl_settings("auto", ports, Route("ib0", "10.0.0.2"), debug=False))
    assert settings == {
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_DEBUG": "WARN",
    }


def test_all_ports_down_or_no_tree_means_sockets(tmp_path: Path) -> None:
    fake_port(tmp_path, "mlx5_0", 1, "1: DOWN")
    for root in (tmp_path, tmp_path / "absent"):
        ports = active_ib_ports(root)
        assert ports == []
        settings = dict((n, v) for n, v, _ in nccl_settings("auto", ports, Route("eth0", "192.168.1.5"), debug=True))
        assert settings == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO"}


def test_roce_v2_gid_index(tmp_path: Path) -> None:
    fake_port(
        tmp_path,
        "mlx5_0",
        1,
        "4: ACTIVE",
        "Ethernet",
        gids={
            0: ("IB/RoCE v1", "fe80:0000:0000:0000:0000:0000:0000:0001"),
            1: ("RoCE v2", "fe80:0000:0000:0000:0000:0000:0000:0001"),
            3: ("RoCE v2", "0000:0000:0000:0000:0000:ffff:0a00:0002"),
        },
    )
    ports = active_ib_ports(tmp_path)
    assert ports[0].gid_index == 3
    settings = dict((n, v) for n, v, _ in nccl_settings("auto", ports, None, debug=False))
    assert settings["NCCL_IB_GID_INDEX"] == "3" and "NCCL_SOCKET_IFNAME" not in settings


def test_presets_override_detection(tmp_path: Path) -> None:
    fake_port(tmp_path, "mlx5_0", 1, "4: ACTIVE")
    ports = active_ib_ports(tmp_path)
    assert dict((n, v) for n, v, _ in nccl_settings("ethernet", ports, None, False))["NCCL_IB_DISABLE"] == "1"
    assert dict((n, v) for n, v, _ in nccl_settings("ib", [], None, False))["NCCL_IB_DISABLE"] == "0"
    assert nccl_settings("none", ports, Route("ib0", None), False) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1 dev ib0 src 10.0.0.2 uid 0 \\    cache", Route("ib0", "10.0.0.2")),
        ("local 127.0.0.1 dev lo table local src 127.0.0.1 uid 0", Route("lo", "127.0.0.1")),
        ("10.0.0.1 via 192.168.1.1 dev eth1 src 192.168.1.7", Route("eth1", "192.168.1.7")),
        ("RTNETLINK answers: Network is unreachable", None),
    ],
)
def test_parse_route(text: str, expected: Route | None) -> None:
    assert parse_route(text) == expected


def test_parse_address_owner() -> None:
    from purrsight.launcher.network import parse_address_owner

    assert parse_address_owner("2: ib0    inet 10.0.0.1/24 brd 10.0.0.255 scope global ib0") == "ib0"
    assert parse_address_owner("") is None


def test_master_node_uses_the_interface_holding_its_address(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On node 0, `ip route get <own address>` says 'dev lo'; the address's own interface is meant."""
    from purrsight.launcher import network

    answers = {
        ("route", "get", "10.0.0.1"): "local 10.0.0.1 dev lo table local src 10.0.0.1 uid 0",
        ("addr", "show", "to", "10.0.0.1"): "3: ib0    inet 10.0.0.1/16 brd 10.0.255.255 scope global ib0",
        ("route", "get", "127.0.0.1"): "local 127.0.0.1 dev lo table local src 127.0.0.1 uid 0",
    }
    monkeypatch.setattr(network, "_ip", lambda *args: answers.get(args))
    assert network.route_to("10.0.0.1") == Route("ib0", "10.0.0.1")
    assert network.route_to("127.0.0.1") == Route("lo", "127.0.0.1")  # a loopback master really is on lo


def test_user_exported_values_survive() -> None:
    environ = {"NCCL_SOCKET_IFNAME": "bond0", "NCCL_DEBUG": "TRACE", "OMP_NUM_THREADS": "7"}
    entries = {e.name: e for e in plan(environ, "10.0.0.1", 29500, 8, "nccl", "INFO", "auto", [], Route("eth0", "10.0.0.2"), 64)}
    for name, value in environ.items():
        assert entries[name].kept and entries[name].value == value
    assert not entries["NCCL_IB_DISABLE"].kept and entries["NCCL_IB_DISABLE"].value == "1"
    assert entries["MASTER_PORT"].value == "29500" and entries["TORCH_NCCL_ASYNC_ERROR_HANDLING"].value == "3"
    fresh = {e.name: e.value for e in plan({}, "10.0.0.1", 29500, 8, "nccl", "DEBUG", "auto", [], None, 64)}
    assert fresh["OMP_NUM_THREADS"] == "8" and fresh["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and fresh["NCCL_DEBUG"] == "INFO"
    gloo = {e.name: e.value for e in plan({}, "127.0.0.1", 1, 2, "gloo", "INFO", "auto", [], Route("lo", "127.0.0.1"), 2)}
    assert gloo["GLOO_SOCKET_IFNAME"] == "lo" and not any(name.startswith("NCCL_") for name in gloo)


def test_nodes_behind_a_loopback_master_share_this_machines_cores() -> None:
    """A loopback master is reachable from this machine only: every node of the job runs here."""
    assert threads_per_process(16, 2, 4, "127.0.0.1")[1] == "2"  # 16 cores / (2 processes x 4 nodes)
    assert "4 nodes, all on this machine" in threads_per_process(16, 2, 4, "127.0.0.1")[2]
    assert threads_per_process(16, 2, 4, "::1")[1] == "2"
    assert threads_per_process(16, 2, 4, "10.0.0.1")[1] == "8"  # real nodes: their own cores
    assert threads_per_process(2, 1, 16, "127.0.0.1")[1] == "1"  # never below one
    assert threads_per_process(16, 2, 4, "node0.cluster")[1] == "8"  # a name, not an address: nothing to infer


def test_secrets_are_masked() -> None:
    assert mask("HF_TOKEN", "abc") == "****" and mask("AWS_SECRET_ACCESS_KEY", "x") == "****"
    assert mask("NCCL_DEBUG", "INFO") == "INFO"


def test_straggler_is_judged_against_the_other_ranks() -> None:
    from purrsight.distributed.preflight import find_stragglers

    assert len(find_stragglers({0: (0, 0.001), 1: (1, 0.050)}, 2.0)) == 1  # two ranks: the plain median would hide it
    assert find_stragglers({0: (0, 0.010), 1: (0, 0.011), 2: (1, 0.012), 3: (1, 0.010)}, 2.0) == []
    named = find_stragglers({0: (0, 0.010), 1: (0, 0.011), 2: (1, 0.090), 3: (1, 0.010)}, 2.0)
    assert named == ["rank 2 (node 1): local work 90.0 ms vs median 10.0 ms"]


def test_threads_follow_the_cpus_the_job_was_given_not_the_machine() -> None:
    """A rank's threads come from the affinity mask and SLURM's count, whichever is smaller."""
    assert usable_cpus({}, affinity=set(range(32))) == (32, "affinity mask")
    assert usable_cpus({"SLURM_CPUS_PER_TASK": "8"}, affinity=set(range(32))) == (8, "SLURM_CPUS_PER_TASK")
    assert usable_cpus({"SLURM_CPUS_PER_TASK": "64"}, affinity=set(range(32)))[0] == 32  # the mask binds
    assert usable_cpus({"SLURM_CPUS_PER_TASK": "junk"}, affinity={0})[0] == 1
    # --cpus-per-task=32 on a 128-core node, 8 ranks: 4 threads each, not 16
    cpus, source = usable_cpus({"SLURM_CPUS_PER_TASK": "32"}, affinity=set(range(128)))
    assert threads_per_process(cpus, 8, 1, "10.0.0.1", source)[1:] == ("4", "32 CPUs (SLURM_CPUS_PER_TASK) / 8 processes")
