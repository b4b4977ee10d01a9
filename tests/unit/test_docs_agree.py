"""The reference texts agree with the code they describe: --help, docs tables, the YAML's comments."""

from __future__ import annotations

import re
import subprocess
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel

from purrsight.config import Config
from purrsight.errors import ExitCode
from tests.helpers import DEFAULT_CONFIG, REPO

# Variables the launcher reads that are not its settings: the schedulers' and the system's.
NOT_SETTINGS = {"SLURM_JOB_ID", "PBS_JOBID", "TMPDIR", "LOCAL_ADDR", "RUN_NAME", "PYTHON_SOURCE", "EPOCHREALTIME"}


def launcher_help() -> str:
    return subprocess.run([str(REPO / "cluster_train.sh"), "--help"], capture_output=True, text=True, check=True).stdout


def help_variables() -> dict[str, str]:
    """NAME -> its default as --help states it (the first word in its [brackets])."""
    section = launcher_help().split("Environment variables", 1)[1].split("\nExamples:", 1)[0]
    entries: dict[str, str] = {}
    name = None
    for line in section.splitlines()[1:]:
        match = re.match(r"^  ([A-Z_]+)\s+(.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2)
        elif name and line.startswith("    "):
            entries[name] += " " + line.strip()
    defaults = {}
    for name, text in entries.items():
        bracket = re.search(r"\[([^\]]*)\]", text)
        assert bracket, f"--help gives no [default] for {name}"
        defaults[name] = re.split(r"[:;,]", bracket.group(1))[0].strip()
    return defaults


def test_launcher_docs_table_matches_help() -> None:
    table = {}
    for line in (REPO / "docs" / "LAUNCHER.md").read_text().splitlines():
        match = re.match(r"^\| `([A-Z_]+)` \| ([^|]+) \|", line)
        if match:
            table[match.group(1)] = match.group(2).strip()
    assert table == help_variables()


def test_every_variable_the_launcher_reads_is_in_help() -> None:
    script = (REPO / "cluster_train.sh").read_text()
    read = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):[-=]", script)) - NOT_SETTINGS
    assert read - set(help_variables()) == set(), "read by cluster_train.sh but missing from --help"


def test_readme_lists_every_exit_code() -> None:
    section = (REPO / "README.md").read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    codes = re.findall(r"^\| (\d+|128\+N) \|", section, flags=re.MULTILINE)
    assert codes == [str(code.value) for code in ExitCode] + ["128+N"]


def yaml_comments(text: str) -> dict[str, str]:
    """dotted key -> its comment (continuation comment lines joined) in a commented config."""
    comments: dict[str, str] = {}
    path: list[tuple[int, str]] = []
    last = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and last is None):
            continue
        if stripped.startswith("#"):
            comments[last] += " " + stripped.lstrip("# ")  # type: ignore[index]
            continue
        match = re.match(r"^( *)([A-Za-z_][\w]*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
        path = [(i, k) for i, k in path if i < indent] + [(indent, key)]
        last = ".".join(k for _, k in path)
        comments[last] = rest.split("#", 1)[1].strip() if "#" in rest else ""
    return comments


def type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return "|".join("null" if arg is type(None) else type_name(arg) for arg in get_args(annotation))
    if origin is Literal:  # one allowed word is named (bool|auto); a choice of several is a str
        values = get_args(annotation)
        return str(values[0]) if len(values) == 1 else "str"
    if origin is list:
        return f"list[{type_name(get_args(annotation)[0])}]"
    if origin is dict:
        return "dict"
    return getattr(annotation, "__name__", str(annotation))


def schema_fields(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found.update(schema_fields(annotation, f"{prefix}{name}."))
        else:
            found[f"{prefix}{name}"] = field
    return found


def test_yaml_type_and_default_comments_match_the_schema() -> None:
    """Each "(type, default)" at the end of a key's comment in the embedded default is the schema's."""
    comments = yaml_comments(DEFAULT_CONFIG.read_text())
    wrong = []
    for dotted, field in schema_fields(Config).items():
        note = re.search(r"\(([^()]*)\)\s*$", comments.get(dotted, ""))
        if note is None:
            if not dotted.endswith(".config"):  # encoder and LLM config dicts are documented by their items
                wrong.append(f"{dotted}: no (type, default) note")
            continue
        stated_type, _, stated_default = (part.strip() for part in note.group(1).partition(","))
        if stated_type != type_name(field.annotation):
            wrong.append(f"{dotted}: type {stated_type!r}, schema {type_name(field.annotation)!r}")
        default = field.get_default(call_default_factory=True)
        stated = yaml.safe_load(stated_default) if stated_default else None
        if isinstance(default, float) and isinstance(stated, str):
            stated = float(stated)  # YAML 1.1 reads 2e-3 as a string; the schema coerces it
        if stated_default and stated != default:
            wrong.append(f"{dotted}: default {stated_default!r}, schema {default!r}")
    assert wrong == []


def config_key_exists(dotted: str) -> bool:
    model: Any = Config
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False
        model = fields[part].annotation
    return True


def test_scaling_settings_exist_and_name_tests_that_exist() -> None:
    """docs/SCALING.md's table of settings to change: each setting is real, each test it names exists."""
    text = (REPO / "docs" / "SCALING.md").read_text()
    table = text.split("## Settings to change", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 8
    launcher = set(help_variables())
    for row in rows:
        setting, *_, tests = [cell.strip() for cell in row.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", setting):
            assert name in launcher if name.isupper() else config_key_exists(name), f"SCALING.md recommends unknown {name}"
        named = re.findall(r"`(tests/[^`:]+)(?:::(\w+))?`", tests)
        assert named, f"no test named for {setting}"
        for path, function in named:
            assert (REPO / path).is_file(), path
            assert not function or f"def {function}(" in (REPO / path).read_text(), f"{path}::{function}"


def test_every_test_a_document_names_exists() -> None:
    """Docs name the test behind each promise (`tests/...py::test_name`): each must exist, or the
    promise points at nothing (a renamed test once left RELIABILITY.md naming a test that was gone)."""
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "README.md"]:
        for path, function in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", doc.read_text()):
            file = REPO / path
            if not file.is_file():
                missing.append(f"{doc.name}: {path}")
            elif function and not re.search(rf"def {function}\b", file.read_text()):
                missing.append(f"{doc.name}: {path}::{function}")
    assert missing == []


BENCH = REPO / "bench"
BENCH_SHARED = {"__init__.py", "common.py"}  # not scripts: the package markers and the one shared module


def bench_docs() -> list[Path]:
    """The texts that show benchmark commands or link into bench/: the manual, the READMEs, bench's own pages."""
    return [REPO / "README.md", REPO / "tests" / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(BENCH.rglob("*.md"))]


def test_bench_readme_is_an_index() -> None:
    """bench/README.md stays an index of the concerns; measured results belong in bench/results/<concern>.md."""
    lines = (BENCH / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"bench/README.md has {len(lines)} lines (at most 150): move results to bench/results/"


def test_every_bench_script_is_named_in_its_concerns_readme() -> None:
    """Each script lives in a concern's folder (bench/<concern>/) whose README names it, with its question and command."""
    unnamed = []
    for script in sorted(BENCH.rglob("*.py")):
        if script.name in BENCH_SHARED:
            continue
        readme = script.parent / "README.md"
        if script.parent == BENCH:
            unnamed.append(f"{script.relative_to(REPO)}: a script belongs in a concern's folder, bench/<concern>/")
        elif not readme.is_file() or not re.search(rf"(?<!\w){re.escape(script.name)}", readme.read_text()):
            unnamed.append(f"{script.relative_to(REPO)}: not named in {readme.relative_to(REPO)}")
    assert unnamed == []


def test_every_bench_command_in_the_docs_names_a_module_that_exists() -> None:
    """`python -m bench.<concern>.<script>` in a doc (or a script's docstring) runs: a moved script left none behind."""
    missing = []
    for doc in [*bench_docs(), *sorted(BENCH.rglob("*.py"))]:
        for module in re.findall(r"-m (bench(?:\.\w+)+)", doc.read_text()):
            path = REPO.joinpath(*module.split("."))
            if not (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()):
                missing.append(f"{doc.relative_to(REPO)}: {module}")
    assert missing == []


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_bench_name_files_and_headings_that_exist() -> None:
    """A link into bench/ (its results move between files) points at a file that exists, and at a heading of it."""
    broken = []
    for doc in bench_docs():
        for target, anchor in re.findall(r"\]\(([^)#\s:]+)(?:#([^)\s]+))?\)", doc.read_text()):
            path = (doc.parent / target).resolve()
            if BENCH not in path.parents:
                continue
            if not path.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
            elif anchor and path.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)
                if anchor not in {github_anchor(heading) for heading in headings}:
                    broken.append(f"{doc.relative_to(REPO)}: {target}#{anchor}")
    assert broken == []
