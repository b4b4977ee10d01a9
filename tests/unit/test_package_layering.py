"""Which package may import which (README "Layout", each package's ``__init__`` docstring): read
from the source, so a slip fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "purrsight"
BASE = "base"  # the top-level modules: errors, config, atomic_file, run_folder, ...

# package -> the packages its modules may import (lazily too), besides the base modules
ALLOWED: dict[str, set[str]] = {
    BASE: set(),
    "internals": set(),
    "data": {"internals"},  # internals import nothing of ours: a leaf any package may stand on
    "model": set(),
    "distributed": {"internals"},
    "datasets": {"data", "model", "distributed"},
    "runs": {"distributed", "internals"},
    "observability": {"model", "runs"},
    "training": {"internals", "data", "model", "distributed", "datasets", "runs", "observability", "estimate", "launcher"},
    "estimate": {"internals", "data", "model"},  # config files and meta tensors: nothing trains here
    "launcher": {"internals", "data"},
    "ray_node": {"launcher"},  # a batch job's Ray node stands on the launcher's node facts (addresses, CPUs)
    "ray_engine": {"internals", "data", "distributed", "datasets", "runs", "observability", "training"},
}
MAX_MODULES = 12  # a package a maintainer reads as one concern


def package_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else BASE


def imported_package(name: str) -> str | None:
    """The purrsight package a dotted import name lands in; None outside purrsight."""
    parts = name.split(".")
    if parts[0] != "purrsight" or len(parts) == 1:
        return None
    return parts[1] if (PACKAGE / parts[1]).is_dir() else BASE


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_package_imports_a_layer_it_must_not() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert {package_of(module) for module in modules} == set(ALLOWED)  # a new package gets its rule here
    slips = []
    for module in modules:
        here = package_of(module)
        for name in imports_of(module):
            there = imported_package(name)
            if there not in (None, BASE, here) and there not in ALLOWED[here]:
                slips.append(f"{module.relative_to(REPO)} imports {name}")
    assert not slips, "\n".join(slips)


def test_the_base_modules_import_no_package() -> None:
    """They are the floor every package stands on (the launcher among them: no torch there)."""
    slips = [
        f"{module.relative_to(REPO)} imports {name}"
        for module in sorted(PACKAGE.glob("*.py"))
        for name in imports_of(module)
        if imported_package(name) not in (None, BASE)
    ]
    assert not slips, "\n".join(slips)


def test_the_rules_have_no_circle() -> None:
    seen: set[str] = set()

    def below(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, " -> ".join((*path, package))
        if package not in seen:
            for lower in ALLOWED[package]:
                below(lower, (*path, package))
            seen.add(package)

    for package in ALLOWED:
        below(package, ())


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def purrsight_modules_imported(path: Path, modules: set[str]) -> set[str]:
    """The purrsight modules ``path`` imports: ``from purrsight.a import b`` names the module a.b when b is one."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            dotted = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name if name in modules else node.module for name in dotted]
        found.update(name for name in names if name in modules and name != "purrsight")
    return found - {module_name(path)}


def test_no_module_is_part_of_an_import_circle() -> None:
    """Within a package too (lazy imports count): a circle means two modules that are one concern, or
    one that belongs below both (the Ray node and its wait imported each other)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: purrsight_modules_imported(path, set(paths)) for name, path in paths.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "import circle: " + " -> ".join((*path[path.index(name) :], name))
        if name not in done:
            for imported in sorted(graph[name]):
                visit(imported, (*path, name))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())


def test_no_package_is_a_flat_folder_of_everything() -> None:
    crowded = {
        folder.name: count
        for folder in PACKAGE.iterdir()
        if folder.is_dir() and (count := len(list(folder.glob("*.py")))) > MAX_MODULES
    }
    assert not crowded, crowded


def test_the_check_reads_lazy_imports_too() -> None:
    """The node plan imports the config inside a function; the walk must see it."""
    assert "purrsight.config" in imports_of(PACKAGE / "launcher" / "node_plan.py")
