from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from purrsight.config import Config, ConfigError, apply_overrides, load_config, write_resolved
from tests.helpers import DEFAULT_CONFIG, REPO, run_python


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_precedence_cli_over_file_over_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer:\n  max_steps: 7\n  accumulate_grad_batches: 3\nmodel:\n  llm: {config: {}}\n")
    config = load_config(path, ["trainer.max_steps=9"], check_paths=False)
    assert config.trainer.max_steps == 9  # CLI wins over the file
    assert config.trainer.accumulate_grad_batches == 3  # file wins over the default (1)
    assert config.trainer.gradient_clip_val == Config().trainer.gradient_clip_val == 1.0  # default
    assert config.overridden == {"trainer.max_steps"}  # what this command said, as against the file (a prepared set's check)
    assert config.model_copy().overridden == config.overridden


def test_bare_yaml_off_means_off(tmp_path: Path) -> None:
    """YAML 1.1 reads `off` as false; preflight.mode accepts it in the file and as an override."""
    path = write(tmp_path, "preflight:\n  mode: off\nmodel:\n  llm: {config: {}}\n")
    assert load_config(path, check_paths=False).preflight.mode == "off"
    assert load_config(path, ["preflight.mode=quick"], check_paths=False).preflight.mode == "quick"
    assert load_config(DEFAULT_CONFIG, ["preflight.mode=off"], check_paths=False).preflight.mode == "off"
    with pytest.raises(ConfigError, match=r"preflight\.mode"):
        load_config(path, ["preflight.mode=true"], check_paths=False)


def test_every_problem_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "optim:\n  lr: -1\n  betaz: [0.9, 0.99]\ntrainer:\n  max_steps: '8'\nrunn: {}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["data.batch_size=abc"], check_paths=False)
    text = "\n".join(caught.value.problems)
    assert len(caught.value.problems) == 5
    assert "unknown key optim.betaz; did you mean optim.betas?" in text
    assert "unknown key runn; did you mean run?" in text
    assert "optim.lr: Input should be greater than 0" in text
    assert "trainer.max_steps: Input should be a valid integer (got '8')" in text
    assert "data.batch_size" in text


def test_override_parsing_keeps_types_and_rejects_bad_syntax() -> None:
    data = apply_overrides({}, ["optim.lr=1e-3", "model.llm.lora.target_modules=[q_proj, v_proj]", "run.name=x y"])
    assert data == {
        "optim": {"lr": 1e-3},
        "model": {"llm": {"lora": {"target_modules": ["q_proj", "v_proj"]}}},
        "run": {"name": "x y"},
    }
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        apply_overrides({}, ["trainer.max_steps"])


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer:\n  max_steps: [1,\n")
    with pytest.raises(ConfigError, match=r"c.yaml: line \d+: YAML syntax error"):
        load_config(path)


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  llm:\n    path: models/nope\n")
    with pytest.raises(ConfigError, match=r"model\.llm\.path: path models/nope does not exist"):
        load_config(path)


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = load_config(DEFAULT_CONFIG, ["trainer.max_steps=3"], check_paths=False)
    written = write_resolved(config, tmp_path / "run")
    assert load_config(written, check_paths=False) == config


@pytest.mark.parametrize(
    ("override", "culprit"),
    [
        ("trainer.max_stepz=5", "unknown key trainer.max_stepz; did you mean trainer.max_steps?"),
        ("trainer.max_steps=many", "trainer.max_steps: Input should be a valid integer (got 'many')"),
        ("optim.lr=-0.1", "optim.lr: Input should be greater than 0 (got -0.1)"),
        ("model.llm.path=/nonexistent/Qwen2.5", "model.llm.path: path /nonexistent/Qwen2.5 does not exist"),
        # The synthetic set's own indexes may be missing (generated on first use); another may not.
        ("data.train_index=nope.jsonl", "data.train_index: index file nope.jsonl does not exist"),
    ],
)
def test_check_command_one_line_exit_2(override: str, culprit: str) -> None:
    result = run_python(
        [
            "-m",
            "purrsight.config",
            "check",
            str(DEFAULT_CONFIG),
            override,
            *(["model.llm.config=null"] if "llm.path" in override else []),
        ]
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"config error: override {override}: "), lines[0]  # labelled as the override
    assert culprit in lines[0]
    assert "Traceback" not in result.stderr


def test_problems_in_the_file_are_labelled_with_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer:\n  max_steps: 0\nmodel:\n  llm: {config: {}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["trainer.val_every_n_steps=0"], check_paths=False)
    assert sorted(caught.value.problems) == [
        f"{path}: trainer.max_steps: Input should be greater than 0 (got 0)",
        "override trainer.val_every_n_steps=0: trainer.val_every_n_steps: Input should be greater than 0 (got 0)",
    ]


def test_empty_config_file_is_refused(tmp_path: Path) -> None:
    """An empty file would otherwise train the built-in defaults, which is never what was meant."""
    for text in ("", "# only a comment\n"):
        path = write(tmp_path, text)
        result = run_python(["-m", "purrsight.config", "check", str(path)])
        assert result.returncode == 2
        expected = f"config error: {path}: the config file is empty (copy config/train_config.yaml and edit it)"
        assert result.stderr.strip() == expected


def test_generated_indexes_may_be_missing_but_others_may_not(tmp_path: Path) -> None:
    base = load_config(DEFAULT_CONFIG, check_paths=False)
    synthetic = tmp_path / "synthetic"
    overrides = [
        f"data.synthetic_dir={synthetic}",
        f"data.train_index={synthetic}/train.jsonl",
        f"data.val_index={synthetic}/val.jsonl",
    ]
    config = load_config(DEFAULT_CONFIG, overrides)  # nothing generated yet: fine
    assert config.data.train_index == f"{synthetic}/train.jsonl" != base.data.train_index
    with pytest.raises(ConfigError, match=r"override data\.val_index=elsewhere\.jsonl: data\.val_index: index file"):
        load_config(DEFAULT_CONFIG, [*overrides, "data.val_index=elsewhere.jsonl"])


def test_every_shipped_yaml_passes_check(tmp_path: Path) -> None:
    """Each config under config/ validates; local model folders it names are stood in by empty ones."""
    shipped = sorted((REPO / "config").glob("*.yaml"))
    assert DEFAULT_CONFIG in shipped and len(shipped) >= 2
    for path in shipped:
        config = load_config(path, check_paths=False)
        for folder in (config.model.llm.path, config.model.image_encoder.path, config.model.audio_encoder.path):
            if folder:
                (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        if config.data.synthetic_dir is None:
            for index in (config.data.train_index, config.data.val_index):
                if index:
                    (tmp_path / index).parent.mkdir(parents=True, exist_ok=True)
                    (tmp_path / index).touch()
        shutil.copy(path, tmp_path / path.name)
        result = run_python(["-m", "purrsight.config", "check", path.name], cwd=tmp_path)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"


def test_every_schema_field_is_documented_in_the_default_yaml() -> None:
    """The embedded default lists every key with a comment, so the file is the reference."""
    text = DEFAULT_CONFIG.read_text()

    def fields(model: type, prefix: str = "") -> list[str]:
        names = []
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                names += fields(annotation, f"{prefix}{name}.")
            else:
                names.append(f"{prefix}{name}")
        return names

    for dotted in fields(Config):
        key = dotted.rsplit(".", 1)[-1]
        lines = [line for line in text.splitlines() if line.strip().startswith(f"{key}:")]
        assert lines, f"{dotted} missing from {DEFAULT_CONFIG.name}"
        assert any("#" in line for line in lines) or key == "config", f"{dotted} has no comment"
