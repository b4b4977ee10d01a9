"""The sharded build in one process (a gloo group of one): what it makes equals the whole build.

The two-rank behaviour (rows split, gradients reduced once per window, checkpoints) is
tests/integration/test_fsdp.py's; here, in seconds, the parts: the units (the decoder layers as
the model declares them, checked against its layer count), the model built on meta and filled
from its files (weights, LoRA, fingerprint) under the keys transformers gives them, the gathered
peak of a forward (tests/fsdp_watch.py), and bf16-mixed's policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from purrsight.internals.transformers_keys import loaded_names
from purrsight.model.loading import ModelLoadError
from purrsight.model.weight_files import WeightFiles, weight_keys
from purrsight.training.fsdp import by_name, by_position, decoder_layers, fill, fsdp_units, materialize, shard_model
from purrsight.training.model_builder import build_model
from tests.fsdp_watch import GatheredPeak, bf16_policy_dtypes, one_unit_bound
from tests.helpers import tiny_config

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
# Three ways a Hugging Face directory differs from Qwen2's names: (config class, its settings,
# LoRA's targets). GPT-NeoX's layers are GPTNeoXLayer (not ...DecoderLayer) and its tied head is
# `gpt_neox.embed_in`; EXAONE is Llama inside, but its files say `transformer.h.N.attn.attention.`
# (save_pretrained writes them back that way), which transformers renames when it loads.
FAMILIES: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": False}, []),
    "gpt_neox-tied": ("GPTNeoXConfig", {"tie_word_embeddings": True}, ["query_key_value", "dense", "dense_h_to_4h"]),
    "exaone-renamed": ("ExaoneConfig", {"num_key_value_heads": 2, "tie_word_embeddings": False}, []),
}


@pytest.fixture
def one_rank_mesh() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def save_llm(folder: Path, synthetic_dir: Path, family: str) -> Path:
    """A random ``family`` LM saved as a user's directory comes: several safetensors files, an index."""
    import transformers
    from transformers import AutoModelForCausalLM

    from purrsight.model.llm import load_tokenizer

    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    class_name, settings, _ = FAMILIES[family]
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    config = getattr(transformers, class_name)(vocab_size=len(tokenizer), **SHAPE, **special, **settings)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="60KB")
    tokenizer.save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory, synthetic_dir: Path) -> Path:
    return save_llm(tmp_path_factory.mktemp("llm"), synthetic_dir, "qwen2")


def family_config(synthetic_dir: Path, tmp_path: Path, folder: Path, family: str) -> Any:
    targets = FAMILIES[family][2]
    extra = {"model__llm__lora__target_modules": f"[{','.join(targets)}]"} if targets else {}
    return tiny_config(synthetic_dir, tmp_path, model__llm__path=str(folder), model__llm__config="null", **extra)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_meta_build_filled_from_files_equals_the_whole_build_and_gathers_one_unit_at_a_time(
    family: str, synthetic_dir: Path, tmp_path: Path, llm_dir: Path, one_rank_mesh: object
) -> None:
    """Fails if a unit is lost (a layer not found stays gathered with the root: the peak grows by
    it), if a weight-file key is not the model's name (EXAONE's), or if a tied head's key is
    not `model.embed_tokens.weight` (GPT-NeoX's)."""
    folder = llm_dir if family == "qwen2" else save_llm(tmp_path / "llm", synthetic_dir, family)
    config = family_config(synthetic_dir, tmp_path, folder, family)
    whole = build_model(config)
    sharded = build_model(config, llm_on_meta=True)
    assert any(p.device.type == "meta" for p in sharded.model.parameters())
    assert sharded.earlier_fingerprints == whole.earlier_fingerprints  # version 3: sampled from the files
    assert sharded.fingerprint == "" and sharded.fingerprint_parts is not None  # version 4: the rows still to be read

    units = shard_model(sharded.model, one_rank_mesh)
    assert units == len(fsdp_units(sharded.model)) + 1
    base: Any = sharded.model.llm.get_base_model()
    layers = list(base.base_model.layers)
    assert [u for u in fsdp_units(sharded.model) if any(u is layer for layer in layers)] == layers
    names = materialize(sharded.model, torch.device("cpu"))
    assert names and all(".llm." in f".{name}" for name in names)
    fill(sharded.model, names, WeightFiles(folder), config.run.seed, sharded.fingerprint_parts)
    assert sharded.fingerprint_parts.combined() == whole.fingerprint  # every row read: a resume across strategies is accepted

    expected = dict(whole.model.named_parameters())
    for name, param in sharded.model.named_parameters():
        assert torch.equal(cast(DTensor, param).full_tensor(), expected[name]), name  # LoRA A too: by name in both

    batch = next(iter(_one_batch(config)))
    peak = GatheredPeak(sharded.model)
    with torch.no_grad():
        assert torch.allclose(sharded.model(batch)[0], whole.model(batch)[0], atol=1e-6)
    assert peak.samples and 0 < peak.peak <= one_unit_bound(sharded.model), (peak.peak, one_unit_bound(sharded.model))


def test_decoder_layers_come_from_the_models_declaration_or_the_build_stops_with_one_line(synthetic_dir: Path) -> None:
    """BioGPT declares no ``_no_split_modules`` (its layers' class names end in DecoderLayer: a
    name rule would have found them, and would miss GPT-NeoX's, above); a Qwen2 with a layer
    taken out but its config unchanged (as a pruned model saved carelessly) finds one layer too few;
    a declaration of the attention alone finds one module a layer, and is refused too."""
    from transformers import AutoModelForCausalLM, BioGptConfig, Qwen2Config

    shape: dict[str, Any] = {
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
    }
    biogpt = AutoModelForCausalLM.from_config(BioGptConfig(**shape))
    with pytest.raises(ModelLoadError) as undeclared:
        decoder_layers(biogpt)
    assert str(undeclared.value) == (
        "distributed.strategy=fsdp finds no decoder layers to shard one by one in BioGptForCausalLM: it declares no "
        "_no_split_modules (without them every step gathers the whole base); use distributed.strategy=ddp for this model"
    )
    qwen2 = AutoModelForCausalLM.from_config(Qwen2Config(**shape))
    assert decoder_layers(qwen2) == list(qwen2.model.layers)
    # A declaration naming a class nested in each layer finds num_hidden_layers modules, but not the layers.
    qwen2._no_split_modules = ["Qwen2Attention"]
    nested = r"names 3 modules, each a Qwen2Attention, not the children of one ModuleList \(the rest of each layer"
    with pytest.raises(ModelLoadError, match=nested):
        decoder_layers(qwen2)
    qwen2._no_split_modules = ["Qwen2DecoderLayer"]
    del qwen2.model.layers[2]
    pruned = r"_no_split_modules \['Qwen2DecoderLayer'\] names 2 modules and config.num_hidden_layers is 3"
    with pytest.raises(ModelLoadError, match=pruned):
        decoder_layers(qwen2)


def test_a_tensor_transformers_merges_as_it_loads_stops_the_sharded_build_with_one_line(tmp_path: Path) -> None:
    """Mixtral's files hold each expert's matrices (save_pretrained writes them back that way);
    transformers merges them into one tensor a layer, which no row range of the files holds."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    shape: dict[str, Any] = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    mixtral = AutoModelForCausalLM.from_config(
        MixtralConfig(num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, **shape)
    )
    mixtral.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as merged:
        weight_keys(mixtral, WeightFiles(tmp_path), loaded_names)
    assert str(merged.value) == (
        f"{tmp_path}: transformers makes the LLM's model.layers.0.mlp.experts.gate_up_proj from "
        "model.layers.0.block_sparse_moe.experts.0.w1.weight and other tensors (merged or split); "
        "distributed.strategy=fsdp reads each tensor's rows as they lie in the files: use distributed.strategy=ddp for this model"
    )


def test_under_bf16_mixed_units_gather_trainables_in_bf16_and_reduce_in_fp32(
    synthetic_dir: Path, tmp_path: Path, one_rank_mesh: object
) -> None:
    """The policy's dtypes on one CPU rank (tests/gpu/test_fsdp_gpu.py runs the same on a GPU)."""
    config = tiny_config(synthetic_dir, tmp_path)
    model = build_model(config, torch.bfloat16).model
    seen = bf16_policy_dtypes(torch.device("cpu"), one_rank_mesh, model, next(iter(_one_batch(config))))
    assert seen == {
        "lora_gathered": "torch.bfloat16",
        "projector_gathered": "torch.bfloat16",
        "trainable_sharded": "torch.float32",  # the optimizer's master weights
        "gradients": "torch.float32",  # reduced (and accumulated over a window) in fp32
        "frozen": "torch.bfloat16",
        "loss_finite": "True",
    }


def _one_batch(config: object) -> Iterator[dict[str, object]]:
    from purrsight.training.datamodule import Phase2DataModule

    datamodule = Phase2DataModule(config)  # type: ignore[arg-type]
    datamodule.setup("fit")
    yield next(iter(datamodule.train_dataloader()))


def test_a_tied_head_stays_with_its_embeddings_in_the_root_unit(synthetic_dir: Path, tmp_path: Path) -> None:
    untied = build_model(tiny_config(synthetic_dir, tmp_path)).model
    tied = build_model(tiny_config(synthetic_dir, tmp_path, model__llm__config__tie_word_embeddings=True)).model
    assert tied.llm.get_input_embeddings() not in fsdp_units(tied)
    assert tied.llm.get_output_embeddings() not in fsdp_units(tied)
    assert {untied.llm.get_input_embeddings(), untied.llm.get_output_embeddings()} <= set(fsdp_units(untied))


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
