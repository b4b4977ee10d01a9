"""Decoding one image or audio clip into the tensor its encoder takes.

A real encoder directory brings its own processor (image processor or feature
extractor), which is used as is. The tiny default has none, so it gets a fixed
transform: resize + [-1, 1] scaling for images, zero-mean unit-variance for audio.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import torch
from PIL import Image, UnidentifiedImageError


class SampleError(ValueError):
    """A sample whose media cannot be decoded; the message names the file and why."""


def fused_normalisation(processor: Any | None) -> tuple[float, torch.Tensor, torch.Tensor] | None:
    """(rescale factor, mean, std) of a processor that rescales, then normalises, as most do.

    Hugging Face's PIL backend does both steps in float64 NumPy: a quarter of the decoding
    time of a 224-px sample (bench/README.md). Done here in float32 on the processor's
    resized uint8 output, the result equals the processor's to within 1e-6.
    """
    if processor is None or not (getattr(processor, "do_rescale", False) and getattr(processor, "do_normalize", False)):
        return None
    factor, mean, std = (getattr(processor, name, None) for name in ("rescale_factor", "image_mean", "image_std"))
    if factor is None or mean is None or std is None:
        return None
    return float(factor), _per_channel(mean), _per_channel(std)


def _per_channel(value: float | list[float]) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32).reshape(-1, 1, 1)


class ImageDecoder:
    def __init__(self, processor: Any | None, size: int) -> None:
        self.processor = processor
        self.size = size
        self.normalisation = fused_normalisation(processor)

    def _to_tensor(self, image: Image.Image) -> torch.Tensor:
        if self.processor is not None:
            if self.normalisation is None:
                return self.processor(images=image, return_tensors="pt")["pixel_values"][0]
            factor, mean, std = self.normalisation
            resized = self.processor(images=image, return_tensors="pt", do_rescale=False, do_normalize=False)["pixel_values"][0]
            return (resized.float() * factor - mean) / std
        resized = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
        array = np.asarray(resized, dtype=np.float32) / 127.5 - 1.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()

    def __call__(self, path: Path) -> torch.Tensor:
        try:
            with Image.open(path) as image:
                image.load()  # decode now: a truncated file must fail here, not later
                return self._to_tensor(image.convert("RGB"))
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise SampleError(f"{path}: cannot decode image ({err})") from None

    def blank(self) -> torch.Tensor:
        """The tensor stood in for a sample without an image (zero-weighted in the model)."""
        return torch.zeros_like(self._to_tensor(Image.new("RGB", (self.size, self.size))))


def resample_linear(wave: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """Linear-interpolation resampling: cheap and adequate for pitch-level content.

    It does not low-pass filter, so content above the new Nyquist aliases; point a real
    run at audio already at the encoder's rate, or set data.resample=false to refuse it.
    """
    duration = len(wave) / source_rate
    target_len = max(1, round(duration * target_rate))
    source_t = np.arange(len(wave)) / source_rate
    target_t = np.arange(target_len) / target_rate
    return np.interp(target_t, source_t, wave).astype(np.float32)


class AudioDecoder:
    def __init__(self, feature_extractor: Any | None, sample_rate: int, seconds: float, resample: bool) -> None:
        self.feature_extractor = feature_extractor
        self.sample_rate = sample_rate
        self.num_samples = round(sample_rate * seconds)
        self.resample = resample

    def _features(self, wave: np.ndarray) -> torch.Tensor:
        if self.feature_extractor is not None:
            out = self.feature_extractor(wave, sampling_rate=self.sample_rate, return_tensors="pt")
            return out[self.feature_extractor.model_input_names[0]][0]
        std = float(wave.std())
        return torch.from_numpy((wave - wave.mean()) / (std + 1e-7)).float()

    def __call__(self, path: Path) -> torch.Tensor:
        try:
            wave, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        except (RuntimeError, soundfile.LibsndfileError, OSError) as err:
            raise SampleError(f"{path}: cannot decode audio ({err})") from None
        wave = wave.mean(axis=1)  # mono: average the channels
        if rate != self.sample_rate:
            if not self.resample:
                raise SampleError(
                    f"{path}: sample rate {rate} Hz, the encoder expects {self.sample_rate} Hz "
                    "(convert the file, or set data.resample=true)"
                )
            wave = resample_linear(wave, rate, self.sample_rate)
        wave = np.pad(wave[: self.num_samples], (0, max(0, self.num_samples - len(wave))))  # crop or pad
        return self._features(wave)

    def blank(self) -> torch.Tensor:
        return torch.zeros_like(self._features(np.zeros(self.num_samples, dtype=np.float32)))
