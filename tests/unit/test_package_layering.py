"""Which package may import which (README "Layout"): read from the source, so a slip fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "purrsight"

# package -> the purrsight packages its modules must not import (at any depth, lazily too)
FORBIDDEN = {
    "purrsight.data": ("purrsight.model", "purrsight.config", "purrsight.training", "purrsight.launcher", "purrsight.ray_engine"),
    "purrsight.model": ("purrsight.data", "purrsight.config", "purrsight.training", "purrsight.launcher", "purrsight.ray_engine"),
    "purrsight.distributed": ("purrsight.training", "purrsight.launcher", "purrsight.ray_engine"),
    "purrsight.launcher": ("purrsight.model", "purrsight.distributed", "purrsight.ray_engine"),
    "purrsight.training": ("purrsight.launcher", "purrsight.ray_engine"),
}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_package_imports_a_layer_it_must_not() -> None:
    slips = []
    for package, forbidden in FORBIDDEN.items():
        folder = PACKAGE / package.split(".", 1)[1]
        modules = sorted(folder.glob("*.py"))
        assert modules, folder
        for module in modules:
            for name in imports_of(module):
                if name.startswith(forbidden):
                    slips.append(f"{module.relative_to(REPO)} imports {name}")
    assert not slips, "\n".join(slips)


def test_the_check_reads_lazy_imports_too() -> None:
    """The launcher's prepare step imports the config inside a function; the walk must see it."""
    assert "purrsight.config" in imports_of(PACKAGE / "launcher" / "prepare.py")
