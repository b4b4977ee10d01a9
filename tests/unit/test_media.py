from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from purrsight.data.media import AudioDecoder, ImageDecoder, SampleError, resample


def test_image_fixed_transform_shape_and_range(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    Image.new("RGB", (50, 40), (255, 0, 0)).save(path)
    tensor = ImageDecoder(None, 32)(path)
    assert tensor.shape == (3, 32, 32)
    assert torch.allclose(tensor[0], torch.ones(32, 32)) and torch.allclose(tensor[1], -torch.ones(32, 32))
    assert ImageDecoder(None, 32).blank().abs().sum() == 0


@pytest.mark.parametrize("processor_class", ["SiglipImageProcessor", "CLIPImageProcessor"])
def test_processor_output_is_kept_with_the_fused_normalisation(processor_class: str, tmp_path: Path) -> None:
    """Rescale + normalise done by the decoder in float32 equals the processor's own (crop included for CLIP)."""
    import transformers

    processor = getattr(transformers, processor_class)()
    path = tmp_path / "photo.jpg"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (300, 260, 3), dtype=np.uint8)).save(path, quality=90)
    decoder = ImageDecoder(processor, size=224)
    assert decoder.normalisation is not None
    with Image.open(path) as image:
        expected = processor(images=image.convert("RGB"), return_tensors="pt")["pixel_values"][0]
    got = decoder(path)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.allclose(got, expected.float(), atol=1e-5)


def test_truncated_png_is_a_sample_error(tmp_path: Path) -> None:
    path = tmp_path / "t.png"
    Image.new("RGB", (64, 64), (1, 2, 3)).save(path)
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(SampleError, match=r"t.png: cannot decode image"):
        ImageDecoder(None, 32)(path)


def test_audio_crop_pad_and_mono(tmp_path: Path) -> None:
    long_path, short_path = tmp_path / "long.wav", tmp_path / "short.wav"
    soundfile.write(long_path, np.random.default_rng(0).normal(size=(8000, 2)).astype(np.float32), 16000)
    soundfile.write(short_path, np.ones(1000, dtype=np.float32) * 0.5, 16000)
    decoder = AudioDecoder(None, 16000, 0.25, resample=True)
    assert decoder(long_path).shape == (4000,)
    short = decoder(short_path)
    assert short.shape == (4000,)
    assert abs(float(short.mean())) < 1e-5  # normalised to zero mean


def test_audio_rate_mismatch_resampled_or_refused(tmp_path: Path) -> None:
    path = tmp_path / "r8k.wav"
    t = np.arange(2000) / 8000
    soundfile.write(path, np.sin(2 * np.pi * 440 * t).astype(np.float32), 8000)
    assert AudioDecoder(None, 16000, 0.25, resample=True)(path).shape == (4000,)
    with pytest.raises(SampleError, match="sample rate 8000 Hz, the encoder expects 16000 Hz"):
        AudioDecoder(None, 16000, 0.25, resample=False)(path)


def test_resample_keeps_the_pitch() -> None:
    t = np.arange(8000) / 8000
    wave = resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), 8000, 16000)
    spectrum = np.abs(np.fft.rfft(wave))
    assert abs(np.argmax(spectrum) * 16000 / len(wave) - 440) < 2


def test_not_audio_is_a_sample_error(tmp_path: Path) -> None:
    path = tmp_path / "fake.wav"
    path.write_text("this is not a wave file")
    with pytest.raises(SampleError, match=r"fake\.wav: cannot decode audio"):
        AudioDecoder(None, 16000, 0.25, resample=True)(path)
