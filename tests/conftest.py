from __future__ import annotations

from pathlib import Path

import pytest

from purrsight.data.synthetic import generate


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small synthetic set for the whole session (generation is deterministic)."""
    return generate(tmp_path_factory.mktemp("data") / "synthetic", num_train=128, num_val=32, seed=0)
