"""End-to-end runs of train_phase2.py in a real subprocess, one CPU process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from purrsight.training.export import load_trained
from purrsight.training.optim import warmup_cosine
from tests.helpers import (
    CHANCE_ACCURACY,
    DEFAULT_CONFIG,
    LEARNED_NATS,
    REPO,
    column,
    fault_env,
    log_time,
    noise_in,
    python_env,
    rank0_steps,
    read_metrics,
    run_python,
    tiny_overrides,
    train_tiny,
    trainable_state,
)
from tests.preloaded import PreloadedTrainer

TRAIN = str(REPO / "train_phase2.py")


@pytest.fixture(scope="module")
def trained(synthetic_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real training run shared by the checks below: 100 steps, checkpoints every 10.

    100, not fewer: the response accuracy climbs between steps 50 and 100 (about 0.4 -> 0.8 on
    the default), and at 60 it sat near the threshold, so the check below hung on noise.
    """
    out = tmp_path_factory.mktemp("runs")
    result = train_tiny(synthetic_dir, out, trainer__max_steps=100, data__batch_size=16, trainer__val_every_n_steps=50)
    assert result.returncode == 0, result.stderr[-3000:]
    assert noise_in(result.stdout + result.stderr) == []
    return out / "phase2-tiny"


def test_trains_end_to_end(trained: Path) -> None:
    rows = read_metrics(trained)
    losses = column(rows, "train/loss")
    assert len(losses) >= 10
    assert sum(losses[:2]) / 2 - sum(losses[-3:]) / 3 > LEARNED_NATS, losses
    accuracy = column(rows, "val/accuracy")[-1]
    assert accuracy > CHANCE_ACCURACY + 0.2, accuracy
    assert (trained / "resolved_config.yaml").is_file()


def test_checkpoint_rotation_and_last(trained: Path) -> None:
    folder = trained / "checkpoints"
    assert sorted(p.name for p in folder.glob("step-*.ckpt")) == ["step-00000080.ckpt", "step-00000090.ckpt", "step-00000100.ckpt"]
    assert (folder / "last.ckpt").samefile(folder / "step-00000100.ckpt")
    assert not list(folder.glob(".*tmp"))  # no temp file left behind


def test_checkpoint_holds_trainable_state_only(trained: Path, synthetic_dir: Path) -> None:
    checkpoint = trained / "checkpoints" / "last.ckpt"
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    keys = set(state["state_dict"])
    assert keys and all(k.startswith("model.projectors.") or "lora_" in k for k in keys)
    assert {"optimizer_states", "lr_schedulers", "loops", "purrsight"} <= set(state)
    # The data position, in our own entry: 128 samples in batches of 16 are 8 steps an epoch, so
    # step 100 is 4 batches (64 samples) into epoch 12.
    position = state["purrsight"]["position"]
    assert position == {"epoch": 12, "consumed": 64, "world_size": 1, "batch_size": 16, "accumulation": 1}
    _, model, _ = load_trained(checkpoint)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen_bytes = model_bytes - trainable_bytes
    overhead = 200_000  # loops, loader position, config, pickle framing
    assert frozen_bytes > overhead  # so frozen weights could not hide inside the allowance below
    # weights + two AdamW moments of the trainable part, plus bookkeeping; never the frozen model
    assert checkpoint.stat().st_size < 3 * trainable_bytes + overhead


def test_resume_mid_epoch_matches_an_uninterrupted_run(
    synthetic_dir: Path, tmp_path: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    """Stopped at step 20 (mid-epoch 1: 16 steps per epoch) and resumed == never stopped, to 1e-6.

    Past epoch 0 on purpose: a sampler that skips seen samples before set_epoch replays epoch 0.
    """
    common = {"trainer__max_steps": 30, "run__deterministic": "true", "checkpoint__keep_last": 5}
    whole = train_tiny(synthetic_dir, tmp_path / "a", preloaded=preloaded_trainer, **common)
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped_at = tmp_path / "a" / "phase2-tiny" / "checkpoints" / "step-00000020.ckpt"
    resumed = train_tiny(synthetic_dir, tmp_path / "b", "--resume", str(stopped_at), preloaded=preloaded_trainer, **common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from checkpoint {stopped_at}" in resumed.stderr
    a = trainable_state(tmp_path / "a" / "phase2-tiny" / "checkpoints" / "last.ckpt")
    b = trainable_state(tmp_path / "b" / "phase2-tiny" / "checkpoints" / "last.ckpt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=0), key
    assert not torch.equal(a[next(iter(a))], trainable_state(stopped_at)[next(iter(a))])  # it did train on


def long_validation_set(synthetic_dir: Path, folder: Path, copies: int) -> Path:
    """The synthetic validation set ``copies`` times over (media paths made absolute, ids unique)."""
    lines = (synthetic_dir / "val.jsonl").read_text().splitlines()
    out = folder / "long_val.jsonl"
    with out.open("w") as stream:
        for copy in range(copies):
            for line in lines:
                record = json.loads(line)
                record["id"] = f"{record['id']}-{copy}"
                for media in ("image", "audio"):
                    if media in record:
                        record[media] = str(synthetic_dir / record[media])
                stream.write(json.dumps(record) + "\n")
    return out


def test_sigterm_saves_a_checkpoint_and_exits_within_a_step_not_a_validation_pass(
    synthetic_dir: Path, tmp_path: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    """SIGTERM to the trainer's whole process group, as a scheduler's preemption or a terminal's
    Ctrl-C sends it, in the shipped real config's shape: 2 loader workers, 2 micro-batches per
    step. The workers must outlive it until the stop checkpoint is written (they once died of it,
    and the trainer failed with "DataLoader worker exited unexpectedly" instead of saving).

    With a validation set whose pass takes at least ten steps' time (measured in the same run, at
    step 10), the stop must not wait for one: the signal lands as step 20's validation starts, and
    that pass ends at its next batch, unlogged (a stop once ran a whole pass after its checkpoint,
    and at real size that outlived a preemption's grace period). The stop's last line (checkpoint and report written)
    comes within a fraction of that pass; the interpreter's teardown after it (freeing torch's and
    Lightning's modules: 1-2 s on a busy 2-core machine) is bounded apart."""
    real_shape = {"data__num_workers": 2, "data__batch_size": 4, "trainer__accumulate_grad_batches": 2}
    args = [
        sys.executable,
        TRAIN,
        "--config",
        str(DEFAULT_CONFIG),
        *tiny_overrides(synthetic_dir, tmp_path, trainer__max_steps=100000, logging__every_n_steps=1, **real_shape),
        f"data.val_index={long_validation_set(synthetic_dir, tmp_path, copies=24)}",
        "trainer.val_every_n_steps=10",
    ]
    proc = subprocess.Popen(args, cwd=REPO, env=python_env(), stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 180
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "step 20/" in line or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGTERM)
    signalled = time.time()
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, rest[-3000:]
    exited = time.time()
    stopped = next(log_time(line) for line in rest.splitlines() if "stopped by SIGTERM at step" in line)
    before = "".join(seen)
    steps = dict((step, when) for when, step in rank0_steps(before))
    validation = next(log_time(line) for line in seen if "validation at step 10" in line)
    step_s = (steps[9] - steps[3]) / 6
    validation_s = validation - steps[10]
    assert validation_s >= 10 * step_s, f"the validation pass ({validation_s:.2f} s) is not ten steps ({step_s:.3f} s)"
    stop_s = stopped - signalled
    assert stop_s < validation_s / 2, f"stopped {stop_s:.2f} s after the signal; validation takes {validation_s:.2f} s"
    assert exited - stopped < 20, f"the process ended {exited - stopped:.1f} s after its last line"  # teardown, on a busy machine
    assert "validation at step" not in rest, rest[-2000:]
    assert "stop while validating step 20: the pass ends here" in rest and "stopped by SIGTERM at step 20" in rest, rest[-2000:]
    folder = tmp_path / "phase2-tiny" / "checkpoints"
    saved = sorted(folder.glob("step-*.ckpt"))[-1]
    step = int(saved.stem.split("-")[1])
    assert step == 20 and f"checkpoint: {saved}" in rest
    # Saved at a step's end, never between its 2 micro-batches (whose first would count as
    # trained while its gradient is in no file): the position is whole steps of 4 x 2 samples.
    assert torch.load(saved, weights_only=True)["purrsight"]["position"]["consumed"] % (4 * 2) == 0
    again = train_tiny(synthetic_dir, tmp_path, "--resume", preloaded=preloaded_trainer, trainer__max_steps=step + 3, **real_shape)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from checkpoint {saved}" in again.stderr
    assert (folder / f"step-{step + 3:08d}.ckpt").is_file()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"run__seed": 99}, "frozen-source fingerprint differs"),
        ({"model__projector_hidden": 64}, "model.projectors.audio.net.1.bias: checkpoint shape [128], model shape [64]"),
    ],
)
def test_mismatched_checkpoint_is_refused(
    trained: Path,
    synthetic_dir: Path,
    tmp_path: Path,
    override: dict[str, object],
    message: str,
    preloaded_trainer: PreloadedTrainer,
) -> None:
    last = str(trained / "checkpoints" / "last.ckpt")
    result = train_tiny(synthetic_dir, tmp_path, "--resume", last, preloaded=preloaded_trainer, trainer__max_steps=110, **override)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_export_loads_with_plain_transformers(trained: Path, tmp_path: Path) -> None:
    """The README's promise: AutoTokenizer + AutoModelForCausalLM on the folder give the trained model's ids and logits."""
    out = tmp_path / "x"
    result = run_python([TRAIN, "export", "--checkpoint", str(trained / "checkpoints" / "last.ckpt"), "--out", str(out)])
    assert result.returncode == 0, result.stderr[-2000:]
    assert noise_in(result.stdout + result.stderr) == []
    tokenizer = AutoTokenizer.from_pretrained(out)  # picked by config.json's model type, as a user's would be
    exported = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no peft
    _, model, trained_tokenizer = load_trained(trained / "checkpoints" / "last.ckpt")
    text = "What colour is the cat in the picture?"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 9  # one token per word and the question mark
    assert ids.tolist() == trained_tokenizer(text, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        expected = model.llm(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    assert torch.allclose(expected, got, atol=1e-5)
    projectors = load_file(str(out / "projectors.safetensors"))
    checkpoint = trainable_state(trained / "checkpoints" / "last.ckpt")
    assert projectors.keys() == {k.removeprefix("model.projectors.") for k in checkpoint if k.startswith("model.projectors.")}
    for key, tensor in projectors.items():
        assert torch.equal(tensor, checkpoint[f"model.projectors.{key}"]), key


def test_export_refuses_a_tokenizer_that_would_not_reload(trained: Path, tmp_path: Path) -> None:
    """A word-level tokenizer (older synthetic sets) comes back from AutoTokenizer as a Qwen2Tokenizer: refused."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from purrsight.training.export import ExportError, check_tokenizer_reloads

    words = Tokenizer(models.WordLevel({"<unk>": 0, "What": 1, "colour": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")
    out = tmp_path / "x"
    AutoModelForCausalLM.from_config(
        Qwen2Config(
            vocab_size=3, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16
        )
    ).save_pretrained(out)
    word_level.save_pretrained(out)
    with pytest.raises(ExportError, match="Qwen2Tokenizer that splits 'What colour is the cat in the picture"):
        check_tokenizer_reloads(word_level, out)


def test_an_export_killed_mid_write_publishes_nothing_and_the_next_one_does(finished_run: Path, tmp_path: Path) -> None:
    """SIGKILL with projectors.safetensors half written (tests/fault_injection: kill_during_export_write):
    no OUT at all, not a folder that loads half a model; the next export removes what the killed one
    left and publishes OUT whole; a third into the same OUT is refused, the second's files untouched."""
    out = tmp_path / "x"
    args = [TRAIN, "export", "--checkpoint", str(finished_run / "checkpoints" / "last.ckpt"), "--out", str(out)]
    killed = run_python(args, env=fault_env("kill_during_export_write"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists()  # before the fix: OUT held the model, the tokenizer and half the projectors
    (left,) = tmp_path.glob(".x.*.tmp")
    assert (left / "model.safetensors").is_file()
    again = run_python(args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"removing {left}, left by an interrupted export" in again.stderr and not left.exists()
    assert {"model.safetensors", "projectors.safetensors", "resolved_config.yaml"} <= {p.name for p in out.iterdir()}
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    third = run_python(args)
    assert third.returncode == 2 and f"error: export: {out} already exists and holds files" in third.stderr, third.stderr
    assert "Traceback" not in third.stderr and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == written


def test_resume_without_checkpoint_and_bad_config_are_one_line(
    synthetic_dir: Path, tmp_path: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    result = train_tiny(synthetic_dir, tmp_path, "--resume", preloaded=preloaded_trainer)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: --resume: no checkpoint in")
    bad = train_tiny(synthetic_dir, tmp_path, preloaded=preloaded_trainer, optim__lr=-1)
    assert bad.returncode == 2 and "optim.lr: Input should be greater than 0" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_help_is_a_runbook() -> None:
    result = run_python([TRAIN, "--help"])
    assert result.returncode == 0
    for needle in ("torchrun --nproc-per-node 8", "2 1 10.0.0.1 29500", "--resume", "export --checkpoint"):
        assert needle in result.stdout


def test_a_moved_run_folder_still_exports(trained: Path, tmp_path: Path) -> None:
    """A run folder moved to other storage still exports: its checkpoints need no path of where it was."""
    moved = tmp_path / "moved"
    shutil.copytree(trained, moved)
    aside = trained.with_name(trained.name + ".aside")
    trained.rename(aside)  # the original location no longer exists while the copy is used
    try:
        checkpoint = moved / "checkpoints" / "last.ckpt"
        result = run_python([TRAIN, "export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")])
    finally:
        aside.rename(trained)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "projectors.safetensors").is_file()


def test_a_resume_with_a_longer_horizon_and_a_new_peak_continues_the_learning_rate(
    synthetic_dir: Path, tmp_path: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    """The schedule of a finished 40-step run, resumed to 70 steps with twice the peak LR: no jump.

    Without the join the restored scheduler would start the new horizon's cosine at step 40,
    about 0.6 x the old peak where the run had reached its floor (0.1 x).
    """
    common = {"logging__every_n_steps": 1, "checkpoint__every_n_steps": 20}
    first = train_tiny(synthetic_dir, tmp_path, preloaded=preloaded_trainer, trainer__max_steps=40, optim__lr=3e-3, **common)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train_tiny(
        synthetic_dir, tmp_path, "--resume", preloaded=preloaded_trainer, trainer__max_steps=70, optim__lr=6e-3, **common
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed with another schedule: optim.lr 0.003 -> 0.006, trainer.max_steps 40 -> 70" in resumed.stderr
    rows = [row for row in read_metrics(tmp_path / "phase2-tiny") if row.get("train/lr")]
    lr = {int(float(row["step"])): float(row["train/lr"]) for row in rows}
    assert lr[41] == pytest.approx(3e-3 * warmup_cosine(40, 10, 40, 0.1), rel=1e-3), lr  # where the old schedule was
    assert lr[41] == pytest.approx(lr[40], rel=0.03), lr  # one step of the old decay (2.4% this close to its end), no jump
    assert lr[70] == pytest.approx(6e-4, rel=0.02)  # the new floor at the new end
