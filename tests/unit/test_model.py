from __future__ import annotations

import contextlib
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from purrsight.config import Config
from purrsight.model.aligner import Phase1Aligner, load_aligner, save_aligner
from purrsight.model.loading import ModelLoadError
from purrsight.training.datamodule import Phase2DataModule
from purrsight.training.model_builder import build_model
from purrsight.training.module import Phase2Module
from tests.helpers import run_python, tiny_config


def first_batch(config: Config) -> dict:
    data = Phase2DataModule(config)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def test_frozen_parts_never_train_and_optimizer_holds_only_projectors_and_lora(synthetic_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(synthetic_dir, tmp_path)
    module = Phase2Module(config)
    module.configure_model()
    model = module.model
    assert model is not None
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("projectors.") or "lora_" in n for n in trainable)
    assert any(n.startswith("encoders.image") for n in frozen) and any(n.startswith("encoders.audio") for n in frozen)
    assert any(n.startswith("llm.") and "lora_" not in n for n in frozen)

    optimizer = module.configure_optimizers()["optimizer"]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if n in trainable}

    batch = first_batch(config)
    model.train()
    assert not model.encoders["image"].tower.training  # frozen encoders stay in eval mode
    for _ in range(3):
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    for name, param in model.named_parameters():
        if name in frozen:
            assert param.grad is None, name
            assert torch.equal(param, frozen[name]), f"frozen {name} changed"


def test_missing_modality_keeps_every_projector_in_the_graph(synthetic_dir: Path, tmp_path: Path) -> None:
    """A batch without any image still gives the image projector a (zero) gradient, as DDP needs."""
    config = tiny_config(synthetic_dir, tmp_path)
    built = build_model(config)
    batch = first_batch(config)
    batch["has_image"] = torch.zeros_like(batch["has_image"])
    batch["image_rows"] = torch.zeros(0, dtype=torch.long)
    loss = built.model(batch).loss
    loss.backward()
    grads = [p.grad for p in built.model.projectors["image"].parameters()]
    assert all(g is not None for g in grads)
    assert all(torch.count_nonzero(g) == 0 for g in grads)  # zero-weighted: no influence on the loss
    assert any(torch.count_nonzero(p.grad) for p in built.model.projectors["audio"].parameters())


def test_padding_to_a_multiple_does_not_change_the_loss(synthetic_dir: Path, tmp_path: Path) -> None:
    """data.pad_to_multiple_of: the same samples padded to the next multiple of 48 tokens give the
    loss of the batch padded to its longest (the padding is masked and carries no label)."""
    longest = first_batch(tiny_config(synthetic_dir, tmp_path / "a"))
    padded = first_batch(tiny_config(synthetic_dir, tmp_path / "b", data__pad_to_multiple_of=48, data__max_length=96))
    assert longest["ids"] == padded["ids"] and padded["input_ids"].shape[1] % 48 == 0
    assert padded["input_ids"].shape[1] > longest["input_ids"].shape[1]  # padding was added: the check means something
    model = build_model(tiny_config(synthetic_dir, tmp_path / "a")).model
    model.eval()
    assert torch.allclose(model(longest)[0], model(padded)[0], atol=1e-5)


def test_absent_image_does_not_change_the_loss(synthetic_dir: Path, tmp_path: Path) -> None:
    """A sample marked image-less must give the same loss whatever pixels stand in for the image."""
    config = tiny_config(synthetic_dir, tmp_path)
    built = build_model(config)
    built.model.eval()
    batch = first_batch(config)
    batch["has_image"] = torch.zeros_like(batch["has_image"])
    batch["image_rows"] = torch.zeros(0, dtype=torch.long)
    loss_a = built.model(batch)[0]
    assert batch["image"].dtype == torch.uint8  # pictures travel as uint8 and are normalised in the model
    batch["image"] = torch.randint_like(batch["image"], 0, 256)
    loss_b = built.model(batch)[0]
    assert torch.allclose(loss_a, loss_b, atol=1e-6)


def test_same_config_builds_identical_frozen_weights_and_fingerprint(synthetic_dir: Path, tmp_path: Path) -> None:
    a = build_model(tiny_config(synthetic_dir, tmp_path))
    b = build_model(tiny_config(synthetic_dir, tmp_path))
    c = build_model(tiny_config(synthetic_dir, tmp_path, run__seed=7))
    assert a.fingerprint == b.fingerprint != c.fingerprint
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_siglip_vision_tower_from_a_config_dict(synthetic_dir: Path, tmp_path: Path) -> None:
    """model_type siglip: the real config's vision architecture, random-initialised (bench/ builds it at full size)."""
    config = tiny_config(synthetic_dir, tmp_path, **{"model.image_encoder.model_type": "siglip"})
    built = build_model(config)
    tower = built.model.encoders["image"].tower
    assert type(tower).__name__ == "SiglipVisionModel"
    loss = built.model(first_batch(config)).loss
    loss.backward()
    assert any(p.grad is not None and torch.count_nonzero(p.grad) for p in built.model.projectors["image"].parameters())


def test_lora_target_absent_from_the_model(synthetic_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(synthetic_dir, tmp_path, **{"model.llm.lora.target_modules": "[q_proj, qkv_proj]"})
    with pytest.raises(ModelLoadError, match=r"target_modules: qkv_proj not found in the LLM; its linear layers are: .*q_proj"):
        build_model(config)


def test_aligner_round_trip_and_key_errors(tmp_path: Path) -> None:
    widths = {"image": 32, "audio": 16}
    aligner = Phase1Aligner(widths, 8)
    save_aligner(aligner, tmp_path / "a.pt")
    loaded = load_aligner(tmp_path / "a.pt", widths, 8)
    assert torch.equal(loaded.heads["image"].weight, aligner.heads["image"].weight)
    assert not any(p.requires_grad for p in loaded.parameters())

    state = aligner.heads.state_dict()
    del state["audio.bias"]
    torch.save({"state_dict": state}, tmp_path / "missing.pt")
    with pytest.raises(ModelLoadError, match=r"aligner key 'audio.bias' missing \(expected shape \[8\]\)"):
        load_aligner(tmp_path / "missing.pt", widths, 8)
    with pytest.raises(ModelLoadError, match=r"aligner key 'image.weight' has shape \[8, 32\], expected \[8, 64\]"):
        load_aligner(tmp_path / "a.pt", {"image": 64, "audio": 16}, 8)


class _Exploit:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch pwned",))


def test_malicious_aligner_pickle_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "evil.pt"
    with path.open("wb") as handle:
        pickle.dump({"image.weight": _Exploit()}, handle)
    monkeypatch.chdir(tmp_path)  # where the exploit would write its marker
    with pytest.raises(ModelLoadError, match="cannot load the aligner checkpoint safely"):
        load_aligner(path, {"image": 4}, 2)
    assert not (tmp_path / "pwned").exists()


def test_aligner_in_the_model(synthetic_dir: Path, tmp_path: Path) -> None:
    widths = {"image": 32, "audio": 32}
    save_aligner(Phase1Aligner(widths, 24), tmp_path / "aligner.pt")
    config = tiny_config(synthetic_dir, tmp_path, model__aligner_checkpoint=tmp_path / "aligner.pt", model__aligner_dim=24)
    built = build_model(config)
    assert built.model.projectors["image"].net[1].in_features == 24
    assert not any(p.requires_grad for p in built.model.aligner.parameters())
    loss = built.model(first_batch(config)).loss
    assert torch.isfinite(loss)


def test_model_package_stands_alone() -> None:
    """model/ knows tensors, not files or configs: importing it loads no config, data or training code."""
    probe = (
        "import sys, purrsight.model.multimodal, purrsight.model.llm, purrsight.model.encoders, purrsight.model.aligner; "
        "print(sorted(m for m in sys.modules if m.startswith(('purrsight.config', 'purrsight.data', 'purrsight.training'))))"
    )
    result = run_python(["-c", probe])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_uint8_pictures_are_normalised_in_the_model_as_the_decoder_would(synthetic_dir: Path, tmp_path: Path) -> None:
    """Batches carry uint8 pictures (a quarter of the bytes to the GPU); the tower gets the decoder's tensor."""
    from purrsight.datasets.builder import build_decoders

    config = tiny_config(synthetic_dir, tmp_path)
    built = build_model(config)
    batch = first_batch(config)
    decoder = build_decoders(config)[0]
    assert decoder is not None and batch["image"].dtype == torch.uint8
    expected = torch.stack([decoder.finish(picture) for picture in batch["image"]])
    assert torch.equal(built.model.tower_input(batch, "image"), expected)
    assert float(expected.min()) >= -1.0 and float(expected.max()) <= 1.0 and float(expected.std()) > 0.1
    assert not any("pixel" in key for key in built.model.state_dict())  # fixed by the processor: not checkpointed


def test_the_attention_mask_built_on_the_device_gives_transformers_own_loss(synthetic_dir: Path, tmp_path: Path) -> None:
    """The 4-D SDPA mask (built so transformers need not read the 2-D one on the host) and the
    no-mask path of an unpadded batch give the loss transformers computes from the 2-D mask."""
    config = tiny_config(synthetic_dir, tmp_path)
    model = build_model(config).model.eval()
    batch = first_batch(config)
    batch["has_image"][0] = False
    batch["image_rows"] = batch["image_rows"][batch["image_rows"] != 0]
    assert batch["padded"] and int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()
    with torch.no_grad():
        inputs = model.build_inputs(batch)
        assert inputs["attention_mask"] is not None and inputs["attention_mask"].dim() == 4
        ours = model.llm(**inputs).loss
        two_d = inputs["attention_mask"][:, 0, -1, :].long()  # the last query row sees every real key
        theirs = model.llm(inputs_embeds=inputs["inputs_embeds"], attention_mask=two_d, labels=inputs["labels"]).loss
        assert torch.isfinite(ours) and torch.allclose(ours, theirs, atol=1e-5)
        # A batch with no masked position: no mask at all, the same loss as an all-ones 2-D mask.
        full = {k: v[:1] if isinstance(v, torch.Tensor) and k not in ("image_rows", "audio_rows") else v for k, v in batch.items()}
        length = int(full["attention_mask"].sum())
        for key in ("input_ids", "labels", "attention_mask"):
            full[key] = full[key][:, :length]
        full.update(has_image=torch.ones(1, dtype=torch.bool), has_audio=torch.ones(1, dtype=torch.bool))
        full.update(image_rows=torch.zeros(1, dtype=torch.long), audio_rows=torch.zeros(1, dtype=torch.long), padded=False)
        unmasked = model.build_inputs(full)
        assert unmasked["attention_mask"] is None
        ones = torch.ones(unmasked["inputs_embeds"].shape[:2], dtype=torch.long)
        expected = model.llm(inputs_embeds=unmasked["inputs_embeds"], attention_mask=ones, labels=unmasked["labels"]).loss
        assert torch.allclose(model.llm(**unmasked).loss, expected, atol=1e-5)


def test_under_bf16_frozen_weights_are_held_in_bf16_and_trainable_ones_in_float32(synthetic_dir: Path, tmp_path: Path) -> None:
    from purrsight.training.model_builder import frozen_dtype

    assert frozen_dtype("bf16-mixed") == frozen_dtype("bf16-true") == torch.bfloat16
    assert frozen_dtype("32-true") == frozen_dtype("16-mixed") == torch.float32  # fp16's range is too narrow for weights
    config = tiny_config(synthetic_dir, tmp_path)
    full = build_model(config)
    half = build_model(config, torch.bfloat16)
    assert half.fingerprint == full.fingerprint  # a bf16 run and a float32 run resume each other
    params = dict(half.model.named_parameters())
    assert {p.dtype for p in params.values() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert half.model.pixel_scale.dtype == torch.float32  # buffers keep their precision
    rotary = [b for n, b in half.model.named_buffers() if n.endswith("inv_freq")]
    assert rotary and all(b.dtype == torch.float32 for b in rotary)
    # The loss under bf16 autocast stays close to float32's (bf16 keeps 8 bits of mantissa).
    batch = first_batch(config)
    full.model.eval(), half.model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss_half = half.model(batch)[0].float()
    with torch.no_grad():
        loss_full = full.model(batch)[0]
    assert abs(loss_half - loss_full) / loss_full < 0.02


def test_the_trainer_under_bf16_builds_the_model_with_bf16_frozen_weights(synthetic_dir: Path, tmp_path: Path) -> None:
    import pytorch_lightning as pl

    module = Phase2Module(tiny_config(synthetic_dir, tmp_path))
    module.trainer = pl.Trainer(precision="bf16-mixed", accelerator="cpu", logger=False, enable_progress_bar=False)
    module.configure_model()
    assert module.model is not None
    assert next(p for p in module.model.parameters() if not p.requires_grad).dtype == torch.bfloat16
    # and leaves the LoRA layers' input casts to autocast (model/llm.py: leave_lora_casts_to_autocast)
    lora_layers = [m for m in module.model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert lora_layers and not any(layer.cast_input_dtype_enabled for layer in lora_layers)


def test_the_compiled_trainable_path_trains_like_eager_and_keeps_checkpoint_names(
    synthetic_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """trainer.compile (decoder layers, projectors, the loss's chunk scorer): the same losses and
    gradients as eager (inductor on CPU), the same names. With data.pad_to_multiple_of the layers
    compile statically, for every padded shape a run meets; trainer.cuda_graphs compiles them (and
    them alone) in reduce-overhead mode."""
    import torch._dynamo.config as dynamo

    from purrsight.model.linear_cross_entropy import SCORER, score_chunk
    from purrsight.training.model_builder import compile_trainable_path, padded_shapes

    config = tiny_config(synthetic_dir, tmp_path, data__pad_to_multiple_of=16, data__max_length=64)
    shapes = padded_shapes(config)
    assert shapes == 4 * (4 + 1)  # 16, 32, 48, 64 and 64 itself; training's and validation's, full and last
    # torch's default, set back after the test by torch's own patch: monkeypatch (pytest 9) would
    # delete it, as a config module keeps no value in its instance __dict__.
    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)
    stack.enter_context(dynamo.patch(recompile_limit=8))
    eager, compiled = build_model(config).model, build_model(config).model
    names = list(compiled.state_dict())
    modes: list[str | None] = []  # the real compile (lazy: at the first call), its mode noted
    compile_module = torch.nn.Module.compile

    def noted(module: torch.nn.Module, **kwargs: Any) -> None:
        modes.append(kwargs.get("mode"))
        compile_module(module, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", noted)
    layers = config.model.llm.config["num_hidden_layers"]
    assert compile_trainable_path(compiled, shapes) == layers
    assert modes == [None] * (layers + len(compiled.projectors))
    # trainer.cuda_graphs reaches the layers alone (on a CPU inductor would record no graph); not run
    modes.clear()
    compile_trainable_path(build_model(config).model, shapes, cuda_graphs=True)
    assert modes == ["reduce-overhead"] * layers + [None] * len(compiled.projectors)
    assert dynamo.recompile_limit == shapes  # each padded length compiled once, none left to eager
    assert all(projector._compiled_call_impl is not None for projector in compiled.projectors.values())
    assert getattr(compiled.head, SCORER) is not score_chunk and getattr(eager.head, SCORER) is score_chunk
    assert list(compiled.state_dict()) == names  # checkpoints load either way
    batch = first_batch(config)
    assert batch["input_ids"].shape[1] % 16 == 0
    for model in (eager, compiled):
        model.eval()  # no LoRA dropout: the two runs draw no random numbers
        model(batch)[0].backward()
    loss_eager, loss_compiled = eager(batch)[0], compiled(batch)[0]
    assert torch.allclose(loss_eager, loss_compiled, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        if a.requires_grad:
            assert torch.allclose(a.grad, b.grad, atol=1e-5), name


def test_lora_a_init_is_a_cpu_value_whatever_the_default_device() -> None:
    """Lightning builds the model under `torch.device("cuda")` on a GPU; the LoRA A values come
    from a CPU generator and must be made on the CPU there too (every GPU run failed on it).
    The meta device stands in for CUDA as the default device: both differ from the generator's."""
    from purrsight.model.llm import lora_a_init

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    plain = lora_a_init(name, torch.Size([4, 16]), seed=3)
    with torch.device("meta"):
        under_other_default = lora_a_init(name, torch.Size([4, 16]), seed=3)
    assert under_other_default.device.type == "cpu"
    assert torch.equal(under_other_default, plain)
