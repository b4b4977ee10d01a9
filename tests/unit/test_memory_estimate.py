"""``train_phase2.py estimate`` (purrsight/estimate/): its arithmetic's promises over all numbers, the
model's own counts, its errors, measured against a CPU run in
tests/integration/test_estimate_peak.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from purrsight.errors import UserError
from purrsight.estimate.command import parse_gpu_memory, parse_size
from purrsight.estimate.memory import HEADROOM, PROCESS_HOST_BYTES, Footprint, footprint
from purrsight.internals.torch_dispatch import LiveBytes
from tests.helpers import REPO, tiny_config

sizes = st.integers(min_value=0, max_value=10**12)
footprints = st.builds(
    Footprint,
    precision=st.just("bf16-mixed"),
    frozen_parameters=sizes,
    trainable_parameters=sizes,
    frozen_bytes=sizes,
    trainable_bytes=sizes,
    all_gather=sizes,
    activations=sizes,
    logits=sizes,
    largest_frozen_bytes=sizes,
    tower_frozen_parameters=st.just(0),
    bucket_copy=st.booleans(),
    accumulates=st.booleans(),
)


@given(footprints, st.integers(min_value=1, max_value=4096))
def test_fsdp_per_gpu_bytes_never_grow_with_gpus_and_ddp_stays(found: Footprint, gpus: int) -> None:
    fewer, more = found.estimate(gpus), found.estimate(gpus + 1)
    assert more.per_gpu["fsdp"].total <= fewer.per_gpu["fsdp"].total
    assert more.per_gpu["ddp"] == fewer.per_gpu["ddp"]
    assert fewer.per_gpu["fsdp"].frozen <= fewer.per_gpu["ddp"].frozen


@given(footprints, st.integers(min_value=1, max_value=64), sizes)
def test_it_fits_exactly_when_the_sum_and_the_headroom_are_within_the_memory(found: Footprint, gpus: int, memory: int) -> None:
    """The JSON's ``fits`` and the printed verdict agree: "tight" is not "fits"."""
    result = found.estimate(gpus)
    for name, part in result.per_gpu.items():
        startable = name not in result.refused
        assert result.fits(name, memory) == (startable and sum(vars(part).values()) + HEADROOM <= memory)
        assert result.fits(name, memory) == (result.verdict(name, memory) == "fits")


@given(footprints, st.integers(min_value=1, max_value=4096), st.integers(min_value=1, max_value=16))
def test_a_node_needs_its_ranks_host_peaks_and_fsdp_needs_no_more_than_ddp(found: Footprint, gpus: int, per_node: int) -> None:
    """Host memory per node: its ranks (never more than the job's GPUs) times a rank's build peak;
    fsdp's shard plus one tensor in flight never holds more than ddp's whole base from 2 GPUs on
    (where fsdp starts at all), nor more with more GPUs."""
    found = Footprint(**{**vars(found), "largest_frozen_bytes": min(found.largest_frozen_bytes, found.frozen_bytes)})
    result, more = found.estimate(gpus, per_node), found.estimate(gpus + 1, per_node)
    assert result.gpus_per_node == min(gpus, per_node)
    for name in ("ddp", "fsdp"):
        assert result.host_per_node[name] == result.gpus_per_node * result.host_per_rank[name]
        assert result.host_per_rank[name] >= PROCESS_HOST_BYTES + found.trainable_bytes
    assert result.host_per_rank["ddp"] == PROCESS_HOST_BYTES + found.frozen_bytes + found.trainable_bytes
    if gpus >= 2:
        assert result.host_per_rank["fsdp"] <= result.host_per_rank["ddp"] + 2  # two ceilings: two bytes at most
    assert more.host_per_rank["fsdp"] <= result.host_per_rank["fsdp"]


def test_sizes_read_as_written_and_a_bad_one_names_itself() -> None:
    assert parse_size("80GB") == 80 * 10**9 and parse_size("80GiB") == 80 * 2**30 and parse_size("141 gb") == 141 * 10**9
    with pytest.raises(UserError, match="--gpu-memory 80XB"):
        parse_size("80XB")


def test_counts_are_the_models_own(synthetic_dir: Path, tmp_path: Path) -> None:
    """The tiny default built for real (training's own builder) holds what the meta build counts."""
    from purrsight.training.model_builder import build_model

    config = tiny_config(synthetic_dir, tmp_path)
    model = build_model(config).model
    found = footprint(config)
    assert found.trainable_parameters == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
    assert found.frozen_parameters == sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert found.logits > 0 and found.activations > 0


def test_the_step_tracker_counts_a_known_peak() -> None:
    """Two 1 MiB fp32 tensors alive at once, then one: the peak is 2 MiB, views of existing weights count nothing."""
    weight = torch.empty(1024, 256, device="meta")
    with LiveBytes() as tracker:
        first = torch.empty(1024, 256, device="meta") + 1
        second = first * 2
        del first
        _ = weight.t()
        del second
    assert tracker.peak_bytes == 2 * 2**20


def run_estimate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "train_phase2.py", "estimate", *args], cwd=REPO, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (["--gpus", "0"], "--gpus 0"),
        (["--gpu-memory", "80XB"], "--gpu-memory 80XB"),
        (["--config", "missing.yaml"], "missing.yaml"),
    ],
)
def test_bad_input_is_one_line_naming_it_and_exit_2(args: list[str], culprit: str) -> None:
    done = run_estimate(*args)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(lines) == 1 and culprit in lines[0], done.stderr


NEOX = {
    "model_type": "gpt_neox",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


@pytest.mark.parametrize(
    ("llm_config", "targets", "culprit"),
    [
        (NEOX, None, r"LoRA target_modules: .*v_proj not found in the LLM; its linear layers are: dense,"),
        (None, "[nonexistent]", r"LoRA target_modules: nonexistent not found in the LLM"),
        (None, "[]", r"LoRA target_modules is empty: name at least one of the LLM's linear layers: down_proj,"),
        (
            {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64},
            None,
            r"does not give the LLM's intermediate_size, num_hidden",
        ),
    ],
)
def test_a_model_the_config_cannot_build_is_one_line_as_in_training(
    synthetic_dir: Path, tmp_path: Path, llm_config: dict[str, object] | None, targets: str | None, culprit: str
) -> None:
    """LoRA targets missing from the LLM, and a config.json without its shape (not priced at
    Qwen2Config's defaults), are a UserError (one line, exit 2) as training's are, not a traceback."""
    import json

    from purrsight.estimate.meta_model import meta_model

    config = tiny_config(synthetic_dir, tmp_path, **({"model.llm.lora.target_modules": targets} if targets else {}))
    path = None
    if llm_config is not None:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(llm_config))
    with pytest.raises(UserError, match=culprit) as raised:
        meta_model(config, path)
    assert "\n" not in str(raised.value)


def test_fsdp_is_refused_with_one_gpu_and_fits_keeps_headroom(synthetic_dir: Path, tmp_path: Path) -> None:
    """As training: fsdp with one process does not start; "fits" leaves 2 GB for what is not counted."""
    from purrsight.estimate.memory import FSDP_ONE_PROCESS, HEADROOM

    found = footprint(tiny_config(synthetic_dir, tmp_path))
    alone, two = found.estimate(1), found.estimate(2)
    assert alone.refused == {"fsdp": FSDP_ONE_PROCESS} and two.refused == {}
    assert alone.verdict("fsdp", 10**12) == "refused" and alone.verdict("ddp", 10**12) == "fits"
    total = two.per_gpu["ddp"].total
    assert two.verdict("ddp", total + HEADROOM) == "fits"
    assert two.verdict("ddp", total + HEADROOM - 1) == two.verdict("ddp", total) == "tight"
    assert two.verdict("ddp", total - 1) == "does not fit"
    with pytest.raises(UserError, match=r"^--gpu-memory 0GB: a GPU's memory is more than nothing"):
        parse_gpu_memory("0GB")


def test_a_model_fsdp_cannot_shard_is_refused_in_the_estimate_as_in_training(synthetic_dir: Path, tmp_path: Path) -> None:
    """training/fsdp.py's decoder-layer search, shared: BioGPT declares no _no_split_modules."""
    import json

    config = tiny_config(synthetic_dir, tmp_path, **{"model.llm.lora.target_modules": "[q_proj, v_proj]"})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "biogpt", **{k: v for k, v in NEOX.items() if k != "model_type"}}))
    result = footprint(config, path).estimate(8)
    assert result.refused["fsdp"].startswith("distributed.strategy=fsdp finds no decoder layers to shard one by one in BioGpt")
    assert result.verdict("fsdp", 10**12) == "refused" and result.verdict("ddp", 10**12) == "fits"
