"""distributed.strategy=fsdp on real ranks (torchrun, gloo, CPU), against DDP on the same samples.

The tiny default's model, its LLM saved as a local directory the way a user's Qwen2.5 folder
comes (``save_pretrained``: safetensors split over several files, tied embeddings), so FSDP
builds it on the meta device and each rank reads its own rows; 2 micro-batches per optimizer
step, and no loader workers: they sit below the strategy (the data position with workers is
tests/integration/test_prepared_training.py's). Five runs share the work: DDP for reference,
FSDP to step 10, a DDP checkpoint resumed under FSDP, an FSDP checkpoint resumed under DDP, and
one resumed under FSDP on four ranks. Two more, with probes in the trainer (fsdp_probe.py,
ddp_probe.py), count FSDP's reduce-scatters per accumulation window and measure what each rank
gathers at once.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from purrsight.training.export import export
from tests.helpers import (
    DEFAULT_CONFIG,
    REPO,
    check_every_sample_once,
    column,
    noise_in,
    python_env,
    read_metrics,
    record_samples_env,
    tiny_overrides,
    torchrun_job,
    trainable_state,
)

RUN = "phase2-tiny"
LOOP = {"data__num_workers": 0, "trainer__accumulate_grad_batches": 2, "data__batch_size": 8, "logging__every_n_steps": 1}
TOLERANCE = 1e-5  # fp32 on CPU: the same reductions in another grouping


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory, synthetic_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from purrsight.model.llm import load_tokenizer

    folder = tmp_path_factory.mktemp("qwen2-like")
    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = Qwen2Config(vocab_size=len(tokenizer), intermediate_size=128, tie_word_embeddings=True, **shape)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="100KB")
    tokenizer.save_pretrained(folder)
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # an index and several files, as large bases come
    return folder


def torchrun(
    ranks: int, llm: Path, synthetic_dir: Path, out: Path, *extra: str, env: dict[str, str] | None = None, **overrides: object
) -> subprocess.CompletedProcess[str]:
    overrides_ = [*tiny_overrides(synthetic_dir, out, **{**LOOP, **overrides}), f"model.llm.path={llm}", "model.llm.config=null"]
    command = torchrun_job(REPO / "train_phase2.py", "--config", str(DEFAULT_CONFIG), *extra, *overrides_, ranks=ranks)
    result = subprocess.run(command, cwd=REPO, env={**python_env(), **(env or {})}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def checkpoint(out: Path, step: int) -> Path:
    return out / RUN / "checkpoints" / f"step-{step:08d}.ckpt"


def resumed_from(source: Path, out: Path) -> Path:
    """A fresh run folder holding only ``source``: the resume must start from it."""
    folder = out / RUN / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copy2(source, folder / source.name)
    return out


def assert_states_close(a: Path, b: Path) -> None:
    first, second = trainable_state(a), trainable_state(b)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.allclose(first[name], second[name], atol=TOLERANCE), name


@pytest.mark.timeout(900)
def test_fsdp_trains_as_ddp_holds_half_the_frozen_weights_and_resumes_across_strategies_and_world_sizes(
    synthetic_dir: Path, tmp_path: Path, llm_dir: Path
) -> None:
    ddp = tmp_path / "ddp"
    whole = torchrun(2, llm_dir, synthetic_dir, ddp, trainer__max_steps=20, checkpoint__every_n_steps=10)

    # FSDP to step 10 (mid-epoch: 4 steps of 32 make an epoch of 128 on two ranks), the samples recorded
    fsdp, records = tmp_path / "fsdp", tmp_path / "records"
    sharded = torchrun(
        2, llm_dir, synthetic_dir, fsdp, env=record_samples_env(records), trainer__max_steps=10, distributed__strategy="fsdp"
    )
    replicas = {float(mib) for mib in re.findall(r"frozen weights whole; this rank holds ([\d.]+) MiB", whole.stderr)}
    held = [
        float(mib) for mib in re.findall(r"sharded over 2 ranks in \d+ FSDP units; this rank holds ([\d.]+) MiB", sharded.stderr)
    ]
    assert len(replicas) == 1 and len(held) == 2, sharded.stderr[-3000:]
    replica = replicas.pop()
    for mine in held:
        assert abs(mine - replica / 2) <= replica / 20, (held, replica)  # about 1/N: each tensor is split in whole rows
    assert column(read_metrics(fsdp / RUN), "train/loss") == pytest.approx(
        column(read_metrics(ddp / RUN), "train/loss")[:10], abs=TOLERANCE
    )
    assert_states_close(checkpoint(fsdp, 10), checkpoint(ddp, 10))
    assert checkpoint(fsdp, 10).stat().st_size < 2 * checkpoint(ddp, 10).stat().st_size  # trainables only, as DDP's

    # DDP's checkpoint resumed under FSDP, mid-epoch: DDP's own step 20
    onto_fsdp = resumed_from(checkpoint(ddp, 10), tmp_path / "ddp-to-fsdp")
    resumed = torchrun(2, llm_dir, synthetic_dir, onto_fsdp, "--resume", trainer__max_steps=20, distributed__strategy="fsdp")
    assert noise_in(resumed.stdout + resumed.stderr) == []
    assert_states_close(checkpoint(onto_fsdp, 20), checkpoint(ddp, 20))

    # FSDP's checkpoint resumed under DDP: DDP's own step 20 again
    onto_ddp = resumed_from(checkpoint(fsdp, 10), tmp_path / "fsdp-to-ddp")
    torchrun(2, llm_dir, synthetic_dir, onto_ddp, "--resume", trainer__max_steps=20)
    assert_states_close(checkpoint(onto_ddp, 20), checkpoint(ddp, 20))

    # FSDP's checkpoint on four ranks (320 samples done: 5 steps of 64): epochs 0-3, each sample once in each
    four = resumed_from(checkpoint(fsdp, 10), tmp_path / "four")
    torchrun(
        4,
        llm_dir,
        synthetic_dir,
        four,
        "--resume",
        env=record_samples_env(records),
        trainer__max_steps=13,
        distributed__strategy="fsdp",
    )
    every_id = {json.loads(line)["id"] for line in (synthetic_dir / "train.jsonl").read_text().splitlines()}
    check_every_sample_once(records, every_id, whole_epochs=4, accumulation=2)

    # export reads an FSDP checkpoint as a DDP one (in this process: the command's own path is
    # tests/integration/test_train_single.py's)
    exported = {
        name: export(source, tmp_path / f"export-{name}")  # beside the run folders: an export never writes into a folder with files
        for name, source in (("fsdp", checkpoint(fsdp, 10)), ("ddp", checkpoint(ddp, 10)))
    }
    ours = sorted(p.relative_to(exported["fsdp"]) for p in exported["fsdp"].rglob("*.safetensors"))
    assert ours and ours == sorted(p.relative_to(exported["ddp"]) for p in exported["ddp"].rglob("*.safetensors"))
    from safetensors.torch import load_file

    for relative in ours:
        a, b = load_file(exported["fsdp"] / relative), load_file(exported["ddp"] / relative)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=TOLERANCE) for k in a), relative


def probed(script: str, llm: Path, synthetic_dir: Path, out: Path, **overrides: object) -> tuple[str, list[dict[str, Any]]]:
    """``script`` (a probe in this folder) on two ranks under torchrun; its output and each rank's record."""
    settings = tiny_overrides(synthetic_dir, out, **{**LOOP, **overrides})
    args = [str(out), str(DEFAULT_CONFIG), *settings, f"model.llm.path={llm}", "model.llm.config=null"]
    command = torchrun_job(REPO / "tests" / "integration" / script, *args)
    result = subprocess.run(command, cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout + result.stderr, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.timeout(600)
def test_fsdp_reduce_scatters_once_per_accumulation_window_trains_as_ddp_and_gathers_one_unit_at_a_time(
    synthetic_dir: Path, tmp_path: Path, llm_dir: Path
) -> None:
    """3 micro-batches per optimizer step: 8 an epoch on each rank (128 samples, 2 ranks x 8) make
    windows of 3, 3 and 2, so the epoch's last window ends early (the mean of its 2, as under
    DDP: purrsight/runs/step_windows.py). Each unit with trainable parameters (the LoRA layers,
    the projectors) reduce-scatters once per window, the short one too, where it reduced once per
    micro-batch before; losses and weights stay DDP's. The gathered peak: one unit at a time."""
    run = {"trainer__accumulate_grad_batches": 3, "trainer__max_steps": 6, "data__num_workers": 0}
    run |= {"trainer__val_every_n_steps": 100, "checkpoint__every_n_steps": 100}
    _, ddp = probed("ddp_probe.py", llm_dir, synthetic_dir, tmp_path / "ddp", **run)
    output, fsdp = probed("fsdp_probe.py", llm_dir, synthetic_dir, tmp_path / "fsdp", distributed__strategy="fsdp", **run)
    assert noise_in(output) == []

    for rank in fsdp:
        assert rank["micro_batches"] == [3, 3, 2, 3, 3, 2]
        assert rank["units_with_gradients"] == 2 + 2  # two decoder layers with LoRA, two projectors
        assert rank["reduce_scatters"] == [rank["units_with_gradients"]] * 6
        assert rank["lora_gathered"] == "torch.float32"  # 32-true: no mixed-precision policy
        assert rank["broadcasts"] == 0  # Lightning's per-micro-batch SIGTERM broadcast skipped under FSDP too
        assert 0 < rank["gathered_peak"] <= rank["one_unit_bound"], rank["gathered_peak"]
    assert column(read_metrics(tmp_path / "fsdp" / RUN), "train/loss") == pytest.approx(
        column(read_metrics(tmp_path / "ddp" / RUN), "train/loss"), abs=TOLERANCE
    )
    for name, weight in ddp[0]["weights"].items():
        assert torch.allclose(fsdp[0]["weights"][name], weight, atol=TOLERANCE), name
