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
from purrsight.estimate.memory import PROCESS_HOST_BYTES, footprint
from purrsight.model.llm import load_tokenizer
from purrsight.training.datamodule import Phase2DataModule
from purrsight.training.model_builder import build_model
from tests.helpers import run_python, tiny_config


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


BUILD_PROBE = """
import sys
from pathlib import Path
import torch
from purrsight.training.model_builder import build_model
from tests.helpers import run_python, tiny_config

synthetic, out, llm, dtype = sys.argv[1:]
overrides = {"model.llm.path": llm, "model.llm.config": "null", "model.llm.lora.target_modules": "[q_proj, v_proj]"}
config = tiny_config(Path(synthetic), Path(out), **overrides)
# The tiny default built and dropped first: the modules a build imports on first use (the model's
# classes, peft's layers, the tokenizer) are the process's, not the build's, and stay out of it.
del build_model(tiny_config(Path(synthetic), Path(out) / "warm-up")).model
def kib(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024
Path("/proc/self/clear_refs").write_text("5")  # the peak resident set (VmHWM) starts again from now
before = kib("VmRSS")
built = build_model(config, getattr(torch, dtype))
frozen = {p.dtype for p in built.model.llm.parameters() if not p.requires_grad}
trainable = {p.dtype for p in built.model.parameters() if p.requires_grad}
grown = kib("VmHWM") - before
print("RESULT", grown, sorted(map(str, frozen)), sorted(map(str, trainable)))
"""


def test_a_bf16_build_reads_the_base_straight_into_bf16_never_a_float32_copy(synthetic_dir: Path, tmp_path: Path) -> None:
    """A base of 38M parameters saved in bf16 (77 MB; 153 MB in float32), built whole as under ddp
    in a fresh process: under bf16 precision the peak host memory grows by less than 0.75 of the
    float32 size (transformers reads each tensor straight into bf16), where a float32 build (the
    measure's own check) grows by at least the float32 size. LoRA and the projectors stay float32."""
    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    shape = {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4}
    config = Qwen2Config(vocab_size=65536, intermediate_size=1024, tie_word_embeddings=True, **shape)
    llm = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    fp32_bytes = 4 * sum(p.numel() for p in llm.parameters())
    llm.save_pretrained(tmp_path / "llm")
    tokenizer.save_pretrained(tmp_path / "llm")
    del llm
    grown = {}
    for dtype in ("bfloat16", "float32"):
        done = run_python(["-c", BUILD_PROBE, str(synthetic_dir), str(tmp_path / dtype), str(tmp_path / "llm"), dtype])
        result = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and result, done.stderr[-3000:]
        grown[dtype], frozen, trainable = result[0].split(" ", 2)
        assert frozen == f"['torch.{dtype}']" and trainable == "['torch.float32']", result
    assert int(grown["float32"]) >= fp32_bytes, (grown, fp32_bytes)  # the measure sees a float32 copy
    assert int(grown["bfloat16"]) < 0.75 * fp32_bytes, (grown, fp32_bytes)
    # The estimate's host figure for a ddp rank, less the process it assumes, against the growth measured.
    overrides = {"model.llm.path": tmp_path / "llm", "model.llm.config": "null", "trainer.precision": "bf16-mixed"}
    config = tiny_config(synthetic_dir, tmp_path / "estimate", **overrides, **{"model.llm.lora.target_modules": "[q_proj, v_proj]"})
    estimated = footprint(config).host_per_rank("ddp", 1) - PROCESS_HOST_BYTES
    assert 0.8 * int(grown["bfloat16"]) <= estimated <= 1.25 * int(grown["bfloat16"]), (grown, estimated)  # within 25%
