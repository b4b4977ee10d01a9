"""The test cluster's host names (tests/cluster/conftest.py) on a machine that already maps them.

Another test cluster had appended `127.0.0.1 node0` and the like to /etc/hosts: appending ours
after it left the old address first, which the resolver takes, and both qsub tests failed on a
fresh clone (`head 127.0.0.1`). Here /etc/hosts is a file in tmp (the real one is the session's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import conftest


def first_address(hosts: str, name: str) -> str:
    """What glibc's files backend answers: the first line that names ``name``."""
    for line in hosts.splitlines():
        words = line.split("#", 1)[0].split()
        if name in words[1:]:
            return words[0]
    return ""


def test_the_clusters_names_win_over_a_machines_earlier_lines_and_are_removed_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = tmp_path / "hosts"
    before = "127.0.0.1 localhost\n127.0.0.1 node0 node1\n10.0.0.9 node2\n"
    hosts.write_text(before)
    monkeypatch.setattr(conftest, "ETC_HOSTS", hosts)
    with conftest.node_names_resolve():
        during = hosts.read_text()
        assert {node: first_address(during, node) for node in conftest.NODES} == conftest.NODE_ADDRS
        assert first_address(during, "localhost") == "127.0.0.1"
    assert hosts.read_text() == before
