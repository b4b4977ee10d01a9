"""The frozen-source fingerprint (training/fingerprint.py): what changes it, what does not, and how
a checkpoint of each version is checked.

Real parts: LLM folders written by ``save_pretrained`` (safetensors split over several files, as
a user's base comes) and by safetensors' own ``save_file``, aligners written by ``save_aligner``,
the model built by the trainer's ``build_model``. What a rank reads to compute it is measured on
real ranks in tests/integration/test_start_reads.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from purrsight.model.aligner import Phase1Aligner, save_aligner
from purrsight.model.weight_files import WeightFiles
from purrsight.training.fingerprint import FINGERPRINT_VERSION, ROW_SUM_MODULUS, FingerprintParts, row_share
from purrsight.training.model_builder import build_model, fingerprint_v2
from purrsight.training.module import CheckpointMismatchError, Phase2Module, verify_checkpoint
from tests.helpers import REPO, python_env, tiny_config

SHAPE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def save_llm(folder: Path, tokenizer_dir: Path, seed: int, shard_size: str = "60KB") -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from purrsight.model.llm import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=len(tokenizer), **SHAPE))
    model.save_pretrained(folder, max_shard_size=shard_size)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory, synthetic_dir: Path) -> Path:
    folder = save_llm(tmp_path_factory.mktemp("llm") / "llm", synthetic_dir / "tokenizer", seed=0)
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


def with_one_tensor_changed(source: Path, target: Path, key: str) -> Path:
    """A copy of ``source`` whose tensor ``key`` is scaled by 1.01; the file that holds it."""
    shutil.copytree(source, target)
    holder = target / WeightFiles(target).weight_map[key]
    tensors = load_file(holder)
    tensors[key] = tensors[key] * 1.01
    save_file(tensors, holder, metadata={"format": "pt"})
    return holder


def test_the_fingerprint_changes_with_the_frozen_weights_and_only_with_them(
    synthetic_dir: Path, tmp_path: Path, llm_dir: Path
) -> None:
    def fingerprint(llm: Path | None = None, aligner: Path | None = None, **extra: object) -> str:
        overrides: dict[str, object] = dict(extra)
        if llm is not None:
            overrides.update({"model.llm.path": llm, "model.llm.config": "null"})
        if aligner is not None:
            overrides["model.aligner_checkpoint"] = aligner
        return build_model(tiny_config(synthetic_dir, tmp_path, **overrides)).fingerprint

    original = fingerprint(llm_dir)
    # the same weights split over other files, in another folder, or held in bf16: the same model
    resplit = save_llm(tmp_path / "resplit", synthetic_dir / "tokenizer", seed=0, shard_size="200KB")
    assert len(list(resplit.glob("*.safetensors"))) != len(list(llm_dir.glob("*.safetensors")))
    assert fingerprint(resplit) == original
    config = tiny_config(synthetic_dir, tmp_path, model__llm__path=llm_dir, model__llm__config="null")
    assert build_model(config, torch.bfloat16).fingerprint == original
    # other weights: another folder's, or one tensor of one file changed
    assert fingerprint(save_llm(tmp_path / "other", synthetic_dir / "tokenizer", seed=1)) != original
    holder = with_one_tensor_changed(llm_dir, tmp_path / "changed", "model.layers.1.mlp.down_proj.weight")
    assert holder.name != sorted(p.name for p in llm_dir.glob("model-*.safetensors"))[0]  # not only the first file counts
    assert fingerprint(tmp_path / "changed") != original

    # the tiny default's towers and LLM, random-initialised from a seed, and the aligner's file
    assert fingerprint() == fingerprint() != fingerprint(run__seed=7)
    widths = {"image": 32, "audio": 32}
    for seed in (0, 1):
        torch.manual_seed(seed)
        save_aligner(Phase1Aligner(widths, 256), tmp_path / f"aligner-{seed}.pt")
    shutil.copy(tmp_path / "aligner-0.pt", tmp_path / "aligner-0-moved.pt")
    with_aligner = fingerprint(aligner=tmp_path / "aligner-0.pt")
    assert with_aligner == fingerprint(aligner=tmp_path / "aligner-0-moved.pt")
    assert len({with_aligner, fingerprint(aligner=tmp_path / "aligner-1.pt"), fingerprint()}) == 3


def test_an_edit_that_no_sample_reads_changes_the_fingerprint(synthetic_dir: Path, tmp_path: Path, llm_dir: Path) -> None:
    """Version 3 hashed four 64-byte windows a tensor: an edit between them went unseen. Version 4
    hashes every byte: one value in the middle of a row between the windows changes it; version 3
    (still computed, for its checkpoints) stays blind to it, which shows the edit is one it missed."""
    key = "model.layers.0.mlp.up_proj.weight"
    target = tmp_path / "edited"
    shutil.copytree(llm_dir, target)
    holder = target / WeightFiles(target).weight_map[key]
    tensors = load_file(holder)
    rows = tensors[key].shape[0]
    tensors[key][rows // 2 - 3, 7] += 0.5  # past the first third's window, before the middle's
    save_file(tensors, holder, metadata={"format": "pt"})

    def built(folder: Path) -> Any:
        return build_model(tiny_config(synthetic_dir, tmp_path, model__llm__path=folder, model__llm__config="null"))

    original, edited = built(llm_dir), built(target)
    assert edited.earlier_fingerprints[3] == original.earlier_fingerprints[3]  # the sample missed it
    assert edited.fingerprint != original.fingerprint


def test_a_base_transformers_converts_is_counted_by_its_files_in_any_run_dtype(synthetic_dir: Path, tmp_path: Path) -> None:
    """A Mixtral-style base whose experts transformers merges on load (so no parameter is a file's
    tensor as it lies) is counted by its files' rows, read: a float32 and a bf16 run of an fp16
    base agree (counted from memory, the bf16 run's rounded values differed), and other weights differ."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from purrsight.model.llm import load_tokenizer
    from purrsight.training.model_builder import llm_weight_keys

    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    shape |= {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(MixtralConfig(vocab_size=len(tokenizer), **shape)).to(torch.float16)
        model.save_pretrained(tmp_path / f"moe-{seed}")
        tokenizer.save_pretrained(tmp_path / f"moe-{seed}")
        folders.append(tmp_path / f"moe-{seed}")

    def built(folder: Path, dtype: torch.dtype) -> Any:
        targets = {"model.llm.lora.target_modules": "[q_proj, v_proj]"}
        config = tiny_config(synthetic_dir, tmp_path, model__llm__path=folder, model__llm__config="null", **targets)
        return build_model(config, dtype)

    full, half = built(folders[0], torch.float32), built(folders[0], torch.bfloat16)
    assert llm_weight_keys(full.model.llm, WeightFiles(folders[0])) is None  # converted: the case under test
    assert full.fingerprint == half.fingerprint
    assert built(folders[1], torch.bfloat16).fingerprint != half.fingerprint


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 40), world=st.integers(1, 9), width=st.integers(1, 5), start=st.integers(0, 12))
@example(rows=7, world=3, width=2, start=5)  # a last rank with fewer rows, a read that starts mid-share
@example(rows=2, world=8, width=1, start=0)  # ranks with no rows at all
def test_the_row_sum_is_the_same_for_any_split_over_ranks_and_reads(rows: int, world: int, width: int, start: int) -> None:
    """However the rows are split over ranks (FSDP's shards) and over reads (a rank's read covering
    more or less than its share), each row is counted once: the sums add up to one process's."""
    tensor = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
    alone = FingerprintParts("layout")
    alone.add_share("t", tensor, rows)
    ranks = [FingerprintParts("layout", rank, world) for rank in range(world)]
    for part in ranks:
        first, last = row_share(rows, part.rank, part.world)
        begin = max(0, min(first, start))  # a read from ``start`` or the share's start, whichever is first
        part.add_share("t", tensor[begin:last], rows, begin)
    assert sum(part.rows for part in ranks) % ROW_SUM_MODULUS == alone.rows
    assert (alone.rows == 0) == (rows == 0)


def two_ranks(script: str, *args: object, timeout: float = 180) -> list[tuple[int, str, str]]:
    """``script`` as ranks 0 and 1, each a real process (``python -c script RANK ARGS...``): each
    one's exit code, stdout and stderr."""
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), *map(str, args)],
            cwd=REPO,
            env=python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=timeout) for rank in ranks]
    return [(rank.returncode, out, err) for rank, (out, err) in zip(ranks, outputs, strict=True)]


# Two real processes in a gloo group, each building the same model whole and hashing its half.
TWO_RANKS_BUILD = """
import sys
from pathlib import Path
import torch.distributed as dist
from purrsight.training.model_builder import build_model
from tests.helpers import tiny_config

rank, store, synthetic, out, llm = int(sys.argv[1]), *sys.argv[2:]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
config = tiny_config(Path(synthetic), Path(out), model__llm__path=llm, model__llm__config="null")
built = build_model(config, fingerprint_group=dist.group.WORLD)
print("FINGERPRINT", built.fingerprint, built.earlier_fingerprints[3])
dist.barrier()
dist.destroy_process_group()
"""


def test_ranks_that_share_the_hashing_give_one_process_fingerprint(synthetic_dir: Path, tmp_path: Path, llm_dir: Path) -> None:
    """Two ranks each hash half of every frozen tensor's rows (the encoders' from memory, the LLM's
    from its files' dtype) and add their sums: the fingerprint one process computes alone. The
    meta build filled from the files gives it too (tests/unit/test_fsdp_build.py), and a resume
    across strategies and world sizes on real ranks (tests/integration/test_fsdp.py) depends on it."""
    config = tiny_config(synthetic_dir, tmp_path, model__llm__path=llm_dir, model__llm__config="null")
    alone = build_model(config)
    for code, out, err in two_ranks(TWO_RANKS_BUILD, tmp_path / "store", synthetic_dir, tmp_path, llm_dir):
        lines = [line.split()[1:] for line in out.splitlines() if line.startswith("FINGERPRINT ")]
        assert code == 0 and lines, err[-3000:]
        assert lines[0] == [alone.fingerprint, alone.earlier_fingerprints[3]]


def test_a_version_3_checkpoint_resumes_and_other_frozen_weights_are_still_refused(
    synthetic_dir: Path, tmp_path: Path, llm_dir: Path
) -> None:
    """Through the module's own hook: checkpoints saved before version 4 carry version 3, which the
    build computes beside version 4; another base's version 3 is refused."""
    config = tiny_config(synthetic_dir, tmp_path, model__llm__path=llm_dir, model__llm__config="null")
    module = Phase2Module(config)
    module.configure_model()
    state = {name: torch.zeros(shape) for name, shape in module.trainable_shapes().items()}

    def saved_by_version_3(fingerprint: str) -> dict[str, object]:
        meta = {"fingerprint": fingerprint, "fingerprint_version": 3, "projector": config.model.projector}
        return {"purrsight": meta, "state_dict": state}

    other = save_llm(tmp_path / "other", synthetic_dir / "tokenizer", seed=1)
    then, elsewhere = (
        build_model(tiny_config(synthetic_dir, tmp_path, model__llm__path=folder, model__llm__config="null")).earlier_fingerprints[
            3
        ]
        for folder in (llm_dir, other)
    )
    assert then != module.fingerprint and then != elsewhere  # two versions, two bases
    module.on_load_checkpoint(saved_by_version_3(then))
    with pytest.raises(CheckpointMismatchError, match="fingerprint differs"):
        module.on_load_checkpoint(saved_by_version_3(elsewhere))


def test_rows_read_from_the_files_are_the_saved_tensors(llm_dir: Path) -> None:
    files = WeightFiles(llm_dir)
    saved: dict[str, torch.Tensor] = {}
    for path in llm_dir.glob("*.safetensors"):
        saved.update(load_file(path))
    assert set(files.weight_map) == set(saved)
    for key, tensor in saved.items():
        rows = tensor.shape[0] if tensor.dim() else 1
        assert torch.equal(files.rows(key, 0, rows), tensor), key
        assert torch.equal(files.rows(key, 1, 3), tensor[1:3]), key
        assert torch.equal(files.rows(key, rows - 1, rows + 5), tensor[rows - 1 :]), key  # a last shard runs short


def never(version: int) -> str | None:
    raise AssertionError(f"version {version} was computed for a checkpoint that did not need it")


def test_a_checkpoint_is_checked_against_the_fingerprint_of_its_own_version(caplog: pytest.LogCaptureFixture) -> None:
    shapes = {"model.a": [2, 3]}

    def checkpoint(fingerprint: str, version: int | None) -> dict[str, object]:
        meta: dict[str, object] = {"fingerprint": fingerprint, "projector": "tokens"}
        if version is not None:
            meta["fingerprint_version"] = version
        return {"purrsight": meta, "state_dict": {"model.a": torch.zeros(2, 3)}}

    verify_checkpoint(checkpoint("now", FINGERPRINT_VERSION), "now", shapes, "tokens", never)  # the earlier one not computed
    with pytest.raises(CheckpointMismatchError, match="fingerprint differs"):
        verify_checkpoint(checkpoint("other", FINGERPRINT_VERSION), "now", shapes, "tokens", never)
    asked: list[int] = []

    def version2(version: int) -> str | None:
        asked.append(version)
        return "then"

    verify_checkpoint(checkpoint("then", 2), "now", shapes, "tokens", version2)
    assert asked == [2]
    with pytest.raises(CheckpointMismatchError, match="fingerprint differs"):
        verify_checkpoint(checkpoint("else", 2), "now", shapes, "tokens", version2)
    with pytest.raises(CheckpointMismatchError, match=r"fingerprint is version 9, which this PurrSight cannot compute"):
        verify_checkpoint(checkpoint("then", 9), "now", shapes, "tokens", lambda version: None)
    verify_checkpoint(checkpoint("path-bound", None), "now", shapes, "tokens", never)  # version 1: a warning
    assert "cannot be checked" in caplog.text


def test_a_version_2_checkpoint_resumes_and_other_frozen_weights_are_still_refused(synthetic_dir: Path, tmp_path: Path) -> None:
    """Through the module's own hook: version 2 is computed for the checkpoint, on demand."""
    config = tiny_config(synthetic_dir, tmp_path)
    module = Phase2Module(config)
    module.configure_model()
    shapes = module.trainable_shapes()
    state = {name: torch.zeros(shape) for name, shape in shapes.items()}

    def saved_by_version_2(fingerprint: str) -> dict[str, object]:
        meta = {"fingerprint": fingerprint, "fingerprint_version": 2, "projector": config.model.projector}
        return {"purrsight": meta, "state_dict": state}

    then = fingerprint_v2(config)
    assert then != module.fingerprint  # two versions: the check below must compute the earlier one
    module.on_load_checkpoint(saved_by_version_2(then))
    with pytest.raises(CheckpointMismatchError, match="fingerprint differs"):
        module.on_load_checkpoint(saved_by_version_2(fingerprint_v2(tiny_config(synthetic_dir, tmp_path, run__seed=7))))


# Two real processes in a gloo group: rank 0 computes (a value, then an error), rank 1 never does.
RANK_COMPUTES = """
import sys
import torch.distributed as dist
from purrsight.distributed.process_group import computed_on_rank_zero
from purrsight.model.loading import ModelLoadError

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

def compute(what):
    if rank != 0:
        raise AssertionError(f"rank {rank} computed")
    if what == "error":
        raise ModelLoadError("model.safetensors: not a safetensors file")
    return "fingerprint of rank 0"

print(computed_on_rank_zero(lambda: compute("value"), dist.group.WORLD))
try:
    computed_on_rank_zero(lambda: compute("error"), dist.group.WORLD)
except ModelLoadError as error:
    print(f"ModelLoadError: {error}")
# Both ranks out of the last broadcast, then out without tearing gloo down: its teardown at exit
# aborted one of the two processes now and then ("terminate called without an active exception",
# exit -6), before the barrier was added 3 runs in 8, with it and destroy_process_group once in a
# whole suite (2026-11-28): gloo's threads meet the interpreter's finalisation either way
# (pytorch/pytorch#190489). What is tested here ends at the barrier.
dist.barrier()
sys.stdout.flush()
import os
os._exit(0)
"""


def test_rank_0_alone_computes_and_its_error_is_raised_on_every_rank(tmp_path: Path) -> None:
    """A fingerprint rank 0 cannot compute (an unreadable weight file) stops every rank with its
    line, instead of leaving the others in the broadcast until the collective timeout."""
    for code, out, err in two_ranks(RANK_COMPUTES, tmp_path / "store"):
        assert code == 0, err[-2000:]
        assert out.splitlines() == ["fingerprint of rank 0", "ModelLoadError: model.safetensors: not a safetensors file"]


def test_an_export_checks_a_version_2_checkpoint_against_version_2(synthetic_dir: Path, tmp_path: Path) -> None:
    """Every checkpoint saved before version 3 carries version 2: export computes it, as a resume does."""
    from purrsight.config import dump_config
    from purrsight.training.export import load_trained

    config = tiny_config(synthetic_dir, tmp_path)
    module = Phase2Module(config)
    module.configure_model()
    state = {name: torch.zeros(shape) for name, shape in module.trainable_shapes().items()}

    def saved_by_version_2(fingerprint: str) -> Path:
        meta = {
            "fingerprint": fingerprint,
            "fingerprint_version": 2,
            "projector": config.model.projector,
            "config": dump_config(config),
        }
        path = tmp_path / f"{fingerprint[:8]}.ckpt"
        torch.save({"purrsight": meta, "state_dict": state}, path)
        return path

    _, model, _ = load_trained(saved_by_version_2(fingerprint_v2(config)))
    assert all(not p.any() for n, p in model.named_parameters() if p.requires_grad)  # the checkpoint's weights, restored
    with pytest.raises(CheckpointMismatchError, match="fingerprint differs"):
        load_trained(saved_by_version_2(fingerprint_v2(tiny_config(synthetic_dir, tmp_path, run__seed=7))))


def test_a_version_2_checkpoint_checked_without_version_2_is_not_told_it_is_beyond_this_purrsight() -> None:
    checkpoint = {"purrsight": {"fingerprint": "then", "fingerprint_version": 2, "projector": "tokens"}, "state_dict": {}}
    with pytest.raises(
        CheckpointMismatchError, match=r"^the checkpoint's frozen-source fingerprint is version 2, and this check was given no way"
    ):
        verify_checkpoint(checkpoint, "now", {}, "tokens")
