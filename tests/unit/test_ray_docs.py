"""docs/RAY.md's commands stay runnable: every Ray CLI option exists in the pinned Ray, every
trainer argument and override parses, and --resume stands where the trainer gets it.

The commands themselves run against a real two-node cluster in tests/ray (submit, follow,
stop, resume, kill); what needs real nodes and addresses (ray start, scp, iptables) is
checked here for its options only.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray engine needs the ray extra (scripts/test.sh installs it)")

import train_phase2
from purrsight.config import ConfigError, load_config
from purrsight.ray_engine import submit
from tests.helpers import REPO

RAY_DOC = REPO / "docs" / "RAY.md"


def shell_commands(markdown: str) -> list[list[str]]:
    """The commands of the doc's bash blocks: continuations joined, comments and sub-shells opened."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for part in " ".join(words).strip("()").split(" && "):  # (umask 077 && ray ...)
                command = shlex.split(part.split(" > ")[0])
                while command and re.match(r"^[A-Z_]+=", command[0]):  # VAR=value before the command
                    command = command[1:]
                if command:
                    commands.append(command)
    return commands


def ray_options(path: list[str]) -> set[str]:
    """The options of ``ray PATH...`` as the installed Ray's click commands declare them."""
    from ray.scripts.scripts import cli

    command = cli
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    return {option for param in command.params for option in (*param.opts, *param.secondary_opts)}


def check_trainer_args(args: list[str]) -> None:
    """``train_phase2.py`` ARGS parse, and the config with its overrides loads."""
    parsed = train_phase2.parse_train_args(args)
    load_config(REPO / parsed.config, parsed.overrides, check_paths=False)


def check(command: list[str]) -> str:
    """What kind of command it is, after checking its arguments; raises on a wrong one."""
    if command[0] == "ray":
        path = command[1:3] if command[1] == "job" else command[1:2]
        rest = command[1 + len(path) :]
        own, _, entry = (rest[: rest.index("--")], "--", rest[rest.index("--") + 1 :]) if "--" in rest else (rest, "", [])
        unknown = {word.split("=")[0] for word in own if word.startswith("--")} - ray_options(path)
        assert not unknown, f"`ray {' '.join(path)}` has no option {sorted(unknown)}"
        if entry:
            assert entry[:2] == ["python", "train_phase2.py"], entry
            check_trainer_args(entry[2:])
        return "ray " + " ".join(path)
    if command[:3] == ["python", "-m", "purrsight.ray_engine.submit"]:
        args = submit.parse_args(command[3:])
        check_trainer_args(["--engine", "ray", *args.train_args])
        return "submit"
    return command[0]


def test_every_command_in_ray_md_parses() -> None:
    kinds = [check(command) for command in shell_commands(RAY_DOC.read_text())]
    for needed in ("ray start", "ray status", "ray job submit", "ray job logs", "ray job stop", "submit", "iptables"):
        assert needed in kinds, f"docs/RAY.md lost its {needed} command"
    resumes = [c for c in shell_commands(RAY_DOC.read_text()) if "--resume" in c]
    assert len(resumes) == 2  # a full resume command for each way of submitting
    for command in resumes:
        assert command.index("--resume") > command.index("--"), "before --, --resume is the submitter's, not ours"


def test_the_check_catches_what_the_old_doc_said() -> None:
    """--resume among `ray job submit`'s options, and a key the config does not have."""
    misplaced = "ray job submit --address http://h:8265 --resume --working-dir . -- python train_phase2.py --engine ray"
    with pytest.raises(AssertionError, match=r"no option \['--resume'\]"):
        check(shlex.split(misplaced))
    with pytest.raises(ConfigError, match=r"ray\.shared_folder"):
        check(shlex.split("python -m purrsight.ray_engine.submit --address http://h:8265 -- ray.shared_folder=/s"))


def test_the_config_comment_points_at_the_ray_doc() -> None:
    (line,) = [line for line in (REPO / "config" / "train_config.yaml").read_text().splitlines() if line.startswith("ray:")]
    pointer = re.search(r"\((docs/\w+\.md)\)", line)
    assert pointer and (REPO / pointer.group(1)).is_file(), line
    assert Path(pointer.group(1)).name == RAY_DOC.name
