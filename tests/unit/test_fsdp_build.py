"""The sharded build in one process (a gloo group of one): what it makes equals the whole build.

The two-rank behaviour (rows split, gradients reduced, checkpoints) is
tests/integration/test_fsdp.py's; here, in a second, the parts: the frozen units, the model
built on meta and filled from its files (weights, LoRA, fingerprint), and a sharded forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from purrsight.model.weight_files import WeightFiles
from purrsight.training.fsdp import by_name, by_position, fill, frozen_units, materialize, shard_model
from purrsight.training.model_builder import build_model
from tests.helpers import tiny_config


@pytest.fixture
def one_rank_mesh() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory, synthetic_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from purrsight.model.llm import load_tokenizer

    folder = tmp_path_factory.mktemp("llm")
    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, tie_word_embeddings=False,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="60KB")
    tokenizer.save_pretrained(folder)
    return folder


def test_the_meta_build_filled_from_files_equals_the_whole_build(
    synthetic_dir: Path, tmp_path: Path, llm_dir: Path, one_rank_mesh: object
) -> None:
    config = tiny_config(synthetic_dir, tmp_path, model__llm__path=str(llm_dir), model__llm__config="null")
    whole = build_model(config)
    sharded = build_model(config, llm_on_meta=True)
    assert any(p.device.type == "meta" for p in sharded.model.parameters())
    assert sharded.fingerprint == whole.fingerprint  # sampled from the files: a resume across strategies is accepted

    units = shard_model(sharded.model, one_rank_mesh)
    assert units == len(frozen_units(sharded.model)) + 1
    names = materialize(sharded.model, torch.device("cpu"))
    assert names and all(".llm." in f".{name}" for name in names)
    fill(sharded.model, names, WeightFiles(llm_dir), config.run.seed)

    expected = dict(whole.model.named_parameters())
    for name, param in sharded.model.named_parameters():
        assert torch.equal(param.full_tensor(), expected[name]), name  # LoRA A too: initialised by name in both

    batch = next(iter(_one_batch(config)))
    with torch.no_grad():
        assert torch.allclose(sharded.model(batch)[0], whole.model(batch)[0], atol=1e-6)


def _one_batch(config: object) -> Iterator[dict[str, object]]:
    from purrsight.training.datamodule import Phase2DataModule

    datamodule = Phase2DataModule(config)  # type: ignore[arg-type]
    datamodule.setup("fit")
    yield next(iter(datamodule.train_dataloader()))


def test_a_tied_head_stays_with_its_embeddings_in_the_root_unit(synthetic_dir: Path, tmp_path: Path) -> None:
    untied = build_model(tiny_config(synthetic_dir, tmp_path)).model
    tied = build_model(tiny_config(synthetic_dir, tmp_path, model__llm__config__tie_word_embeddings=True)).model
    assert tied.llm.get_input_embeddings() not in frozen_units(tied)
    assert tied.llm.get_output_embeddings() not in frozen_units(tied)
    assert {untied.llm.get_input_embeddings(), untied.llm.get_output_embeddings()} <= set(frozen_units(untied))


def test_optimizer_states_by_name_and_by_position_are_one_state() -> None:
    names = ["model.a.lora_A", "model.a.lora_B", "model.projectors.image.0.weight"]
    positional = {
        "state": {0: {"step": torch.tensor(3.0)}, 2: {"step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}],
    }
    named = by_name(positional, names)
    assert named["param_groups"][1]["params"] == ["model.projectors.image.0.weight"]
    assert set(named["state"]) == {"model.a.lora_A", "model.projectors.image.0.weight"}
    assert by_position(named, names) == positional
