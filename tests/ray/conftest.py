"""The session's two-node Ray cluster (tests/ray/cluster.py), started once for every Ray test."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray engine's tests need the ray extra (scripts/test.sh installs it)")

from tests.ray.cluster import RayCluster


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    root = Path(tempfile.mkdtemp(prefix="prs-ray-", dir="/tmp"))  # short: Ray's socket paths fit 107 bytes
    cluster = RayCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
