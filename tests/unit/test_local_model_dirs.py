"""Local Hugging Face directories load through the same code path as a user's Qwen2.5 folder.

Tiny models are saved with save_pretrained (nothing is downloaded), then the config points
model.llm.path, model.image_encoder.path and model.audio_encoder.path at them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Qwen2Config,
    ViTConfig,
    ViTImageProcessor,
    ViTModel,
    Wav2Vec2Config,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2Model,
)

from purrsight.config import Config
from purrsight.model.llm import load_tokenizer
from purrsight.training.datamodule import Phase2DataModule
from purrsight.training.model_builder import build_model
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, synthetic_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    llm = AutoModelForCausalLM.from_config(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            max_position_embeddings=128,
        )
    )
    llm.save_pretrained(root / "llm")
    tokenizer.save_pretrained(root / "llm")
    ViTModel(
        ViTConfig(image_size=32, patch_size=8, hidden_size=24, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48),
        add_pooling_layer=False,
    ).save_pretrained(root / "vit")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root / "vit")
    Wav2Vec2Model(
        Wav2Vec2Config(
            hidden_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=48,
            conv_dim=(16, 16),
            conv_kernel=(10, 3),
            conv_stride=(5, 2),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
        )
    ).save_pretrained(root / "w2v")
    Wav2Vec2FeatureExtractor(sampling_rate=16000).save_pretrained(root / "w2v")
    return {"llm": root / "llm", "vit": root / "vit", "w2v": root / "w2v"}


def test_directories_load_and_train_a_step(model_dirs: dict[str, Path], synthetic_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(
        synthetic_dir,
        tmp_path,
        **{
            "model.llm.path": model_dirs["llm"],
            "model.llm.config": "null",
            "model.image_encoder.path": model_dirs["vit"],
            "model.image_encoder.config": "null",
            "model.audio_encoder.path": model_dirs["w2v"],
            "model.audio_encoder.config": "null",
            "model.llm.lora.target_modules": "[q_proj, v_proj]",
        },
    )
    built = build_model(config)
    model = built.model
    assert model.encoders["image"].width == 24 and model.encoders["audio"].width == 24
    assert built.tokenizer.name_or_path == str(model_dirs["llm"])  # tokenizer taken from the LLM folder
    reference = AutoModelForCausalLM.from_pretrained(model_dirs["llm"])
    base = model.llm.get_base_model()
    assert torch.equal(base.model.embed_tokens.weight, reference.model.embed_tokens.weight)  # the saved weights

    data = Phase2DataModule(config)
    data.setup("fit")
    assert data.train_set is not None and data.train_set.image is not None
    assert data.train_set.image.processor is not None  # the directory's processor, not the fixed transform
    batch = next(iter(data.train_dataloader()))
    loss = model(batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.trainable_parameters())
    assert build_model(config).fingerprint == built.fingerprint


def test_a_moved_model_folder_is_the_same_model(model_dirs: dict[str, Path], synthetic_dir: Path, tmp_path: Path) -> None:
    """Checkpoints name their frozen sources by architecture and weights, not by path.

    A model folder moved, or mounted elsewhere on another node, must not strand every
    checkpoint; changed weights in the same place must still be refused.
    """

    def fingerprint(folder: Path, encoder: Path) -> str:
        overrides = {
            "model.llm.path": folder,
            "model.llm.config": "null",
            "model.llm.lora.target_modules": "[q_proj, v_proj]",
            "model.image_encoder.path": encoder,
            "model.image_encoder.config": "null",
        }
        return build_model(tiny_config(synthetic_dir, tmp_path, **overrides)).fingerprint

    original = fingerprint(model_dirs["llm"], model_dirs["vit"])
    moved_llm, moved_vit = tmp_path / "mnt" / "llm", tmp_path / "mnt" / "vit"
    shutil.copytree(model_dirs["llm"], moved_llm)
    shutil.copytree(model_dirs["vit"], moved_vit)
    assert fingerprint(moved_llm, moved_vit) == original
    retrained = AutoModelForCausalLM.from_pretrained(moved_llm)
    with torch.no_grad():
        retrained.model.layers[0].mlp.up_proj.weight.mul_(1.01)
    retrained.save_pretrained(moved_llm)
    assert fingerprint(moved_llm, moved_vit) != original


def test_a_base_of_pytorch_model_bin_builds_whole_and_is_fingerprinted_from_memory(
    model_dirs: dict[str, Path], synthetic_dir: Path, tmp_path: Path
) -> None:
    """transformers loads a folder of pytorch_model.bin; under ddp the model is built whole, so only
    the sharded (fsdp) build needs safetensors, and both fingerprint versions count the LLM from memory."""
    from purrsight.training.model_builder import fingerprint_v2

    def saved_as_bin(folder: Path, scale: float) -> Path:
        llm = AutoModelForCausalLM.from_pretrained(model_dirs["llm"])
        with torch.no_grad():
            llm.model.layers[0].mlp.up_proj.weight.mul_(scale)
        # transformers 5 writes safetensors whatever safe_serialization says; a .bin base (as older
        # tools and many hub folders hold) is written as they wrote it, and transformers still loads it.
        llm.config.save_pretrained(folder)
        torch.save(llm.state_dict(), folder / "pytorch_model.bin")
        load_tokenizer(model_dirs["llm"]).save_pretrained(folder)
        assert (folder / "pytorch_model.bin").is_file() and not list(folder.glob("*.safetensors"))
        return folder

    def config(folder: Path) -> Config:
        overrides = {
            "model.llm.path": folder,
            "model.llm.config": "null",
            "model.llm.lora.target_modules": "[q_proj, v_proj]",
            "distributed.strategy": "ddp",
        }
        return tiny_config(synthetic_dir, tmp_path, **overrides)

    same, other = config(saved_as_bin(tmp_path / "bin", 1.0)), config(saved_as_bin(tmp_path / "bin-changed", 1.01))
    built = build_model(same)
    reference = AutoModelForCausalLM.from_pretrained(model_dirs["llm"])
    assert torch.equal(built.model.llm.get_base_model().model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert build_model(other).fingerprint != built.fingerprint  # the LLM's weights count, read from memory
    assert fingerprint_v2(same) != fingerprint_v2(other)
