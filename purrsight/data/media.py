"""Decoding one image or audio clip into the tensor its encoder takes.

A real encoder directory brings its own processor (image processor or feature
extractor), which is used as is. The tiny default has none, so it gets a fixed
transform: resize + [-1, 1] scaling for images, zero-mean unit-variance for audio.

Images are taken as a person sees them (real files, docs/DATA.md):

- EXIF orientation is applied: phones store an upright photo rotated, with a tag saying so;
- transparency is composited onto a stated background (``data.image_background``);
- 16-bit grayscale (Pillow mode ``I;16``/``I``) is scaled by its range: converted to RGB
  directly it was clipped at 255, and most pictures came out white;
- an animation gives its first frame;
- a picture above ``data.max_image_pixels`` is refused from its header, before decoding.

Audio reads only the window the encoder uses (``data.audio_seconds`` from the start), in
every format libsndfile reads: an hour-long recording costs what a clip costs.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from purrsight.data.formats.records import Media, MediaBlob
from purrsight.data.pil_processing import fused_normalisation, normalise, plan_for, scale_and_offset, scale_pixels
from purrsight.errors import UserError

WHITE = (255, 255, 255)
SIXTEEN_BIT_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I"}  # how Pillow opens 16-bit grayscale PNG/TIFF
ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}
AUDIO_FORMATS = "WAV, FLAC, Ogg Vorbis, Opus, MP3, AIFF"  # what libsndfile (soundfile) decodes


class SampleError(UserError):
    """A sample whose media cannot be decoded; the message names the file and why."""


def as_displayed_rgb(image: Image.Image, background: Sequence[int] = WHITE) -> Image.Image:
    """An 8-bit RGB picture of ``image`` as a viewer shows it (orientation applied beforehand)."""
    if image.mode in SIXTEEN_BIT_MODES:
        levels = np.asarray(image, dtype=np.float32) / 257.0  # 0..65535 -> 0..255
        image = Image.fromarray(np.clip(levels + 0.5, 0, 255).astype(np.uint8), mode="L")
    elif image.mode == "F":  # float samples: 0..1 by convention
        levels = np.asarray(image, dtype=np.float32) * 255.0
        image = Image.fromarray(np.clip(levels + 0.5, 0, 255).astype(np.uint8), mode="L")
    if image.mode in ALPHA_MODES or "transparency" in image.info:
        canvas = Image.new("RGBA", image.size, (*background, 255))
        canvas.alpha_composite(image.convert("RGBA"))
        return canvas.convert("RGB")
    return image.convert("RGB")


class ImageDecoder:
    def __init__(self, processor: Any | None, size: int, max_pixels: int | None = None, background: Sequence[int] = WHITE) -> None:
        self.processor = processor
        self.size = size
        self.max_pixels = max_pixels
        self.background = tuple(background)
        self.plan = plan_for(processor) if processor is not None else None
        self.normalisation = fused_normalisation(processor)
        self.draft_box = self._draft_box()
        self.pixel_scaling = self._pixel_scaling()
        self._apply_pixel_limit()

    def _apply_pixel_limit(self) -> None:
        if self.max_pixels is not None:
            # Pillow's bomb guard, set to our limit, not switched off: it protects every
            # Image.open in the process, processors' and plotting code's too (a warning above
            # the limit, an error above twice it). load() names the file and the setting.
            Image.MAX_IMAGE_PIXELS = self.max_pixels

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A loader worker (or a prepare worker) gets this decoder unpickled, and the limit is
        # Pillow's process-wide setting, not the decoder's: set it again in the process it lands
        # in (with 2 loader workers a 200-MP scan under a 250-MP limit was refused at Pillow's own
        # 179 MP default).
        self.__dict__.update(state)
        self._apply_pixel_limit()

    def _draft_box(self) -> tuple[int, int] | None:
        """The smallest (width, height) a JPEG is decoded at: twice what the tower's resize keeps.

        libjpeg decodes at 1/2, 1/4 or 1/8 scale for little more than the cost of the smaller
        picture: a 12-MP phone photo fed to a 224-px tower need not be decoded whole. With
        twice the final size left, the resize that follows still does the real filtering
        (tested against the full decode, docs/DATA.md). None: the processor's size is unknown.
        """
        if self.plan is not None:
            if self.plan.shortest_edge is not None:
                side = 2 * self.plan.shortest_edge
                return side, side
            assert self.plan.width is not None and self.plan.height is not None
            return 2 * self.plan.width, 2 * self.plan.height
        return (2 * self.size, 2 * self.size) if self.processor is None else None

    def _pixel_scaling(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale, offset) per channel that turn this decoder's uint8 pixels into the tower's input; None: not uint8."""
        if self.plan is not None:
            return scale_and_offset(self.plan.normalisation)
        if self.processor is None:  # the tiny default's fixed scaling to [-1, 1]
            return torch.full((3, 1, 1), 1 / 127.5), torch.full((3, 1, 1), -1.0)
        return None

    @property
    def storage(self) -> str:
        """What a sample carries of a picture (and a prepared set keeps): ``uint8`` pixels, resized
        and cropped but not yet normalised (4x smaller than floats on disk, through the loader and
        to the GPU, which normalises them: ``pixel_scaling``), or ``float32``, the finished tensor,
        for a processor whose steps are not replayed here."""
        return "uint8" if self.pixel_scaling is not None else "float32"

    def stored(self, image: Image.Image) -> torch.Tensor:
        """The form ``storage`` names, from a picture as displayed."""
        if self.plan is not None:
            return self.plan.pixels(image)
        if self.processor is None:
            resized = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
            return torch.from_numpy(np.array(resized)).permute(2, 0, 1)
        if self.normalisation is None:
            return self.processor(images=image, return_tensors="pt")["pixel_values"][0]
        resized = self.processor(images=image, return_tensors="pt", do_rescale=False, do_normalize=False)["pixel_values"][0]
        return normalise(resized, self.normalisation)

    def finish(self, stored: torch.Tensor) -> torch.Tensor:
        """The tensor the tower takes, from what ``stored`` returned (or a prepared set kept)."""
        if stored.dtype != torch.uint8 or self.pixel_scaling is None:
            return stored
        return scale_pixels(stored, *self.pixel_scaling)

    def _to_tensor(self, image: Image.Image) -> torch.Tensor:
        return self.finish(self.stored(image))

    def load(self, path: Media) -> Image.Image:
        """The picture in ``path`` (a file, or a shard's bytes) as displayed, 8-bit RGB; SampleError when it cannot be used."""
        try:
            with warnings.catch_warnings():
                # Above the limit Pillow warns; the SampleError below says it better.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                opened = Image.open(io.BytesIO(path.data) if isinstance(path, MediaBlob) else path)
            with opened as image:
                width, height = image.size
                if self.max_pixels is not None and width * height > self.max_pixels:
                    raise SampleError(
                        f"{path}: {width}x{height} image ({width * height / 1e6:.0f} megapixels) is above "
                        f"data.max_image_pixels={self.max_pixels}; downscale the file or raise the limit"
                    )
                if self.draft_box is not None and image.format == "JPEG":
                    image.draft(image.mode, self.draft_box)  # the smallest DCT scale still >= the box
                image.load()  # decode now: a truncated file must fail here, not later
                ImageOps.exif_transpose(image, in_place=True)
                return as_displayed_rgb(image, self.background)
        except Image.DecompressionBombError as err:  # above twice the limit: Pillow refuses it at open
            raise SampleError(
                f"{path}: image above data.max_image_pixels={self.max_pixels} ({err}); downscale the file or raise the limit"
            ) from None
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise SampleError(f"{path}: cannot decode image ({err})") from None

    def __call__(self, path: Path) -> torch.Tensor:
        return self._to_tensor(self.load(path))

    def blank(self) -> torch.Tensor:
        """The stored form stood in for a sample without an image (never encoded: its prefix is masked)."""
        return torch.zeros_like(self.stored(Image.new("RGB", (self.size, self.size))))


RESAMPLE_MARGIN = 256  # frames mirrored (and read past the window) so the spectrum sees no jump at the edges


def resample(wave: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """Band-limited resampling through the spectrum: what lies above the lower rate's
    Nyquist frequency is dropped, not folded back into the band (as linear interpolation did).

    The FFT takes the window as one period of a periodic signal, so a jump between its two
    ends would ring into both; the window is mirrored at each end first and cropped after.
    Cheap on the short windows decoded here (one FFT of the window each way).
    """
    if len(wave) == 0 or source_rate == target_rate:
        return wave
    # Source samples per whole number of target samples (6 for 96 -> 16 kHz, 441 for 44.1 ->
    # 16 kHz): margins and length in multiples of it keep the output on the input's grid,
    # instead of shifted or stretched by a fraction of a sample.
    period = source_rate // math.gcd(source_rate, target_rate)
    margin = min(math.ceil(RESAMPLE_MARGIN / period) * period, (len(wave) - 1) // period * period)
    padded = np.pad(wave, margin, mode="reflect") if margin else wave
    padded = np.pad(padded, (0, -len(padded) % period))
    padded_len = len(padded) * target_rate // source_rate
    spectrum = np.fft.rfft(padded)
    bins = padded_len // 2 + 1
    spectrum = spectrum[:bins] if len(spectrum) >= bins else np.pad(spectrum, (0, bins - len(spectrum)))
    out = np.fft.irfft(spectrum, n=padded_len) * (padded_len / len(padded))
    start = margin * target_rate // source_rate
    return out[start : start + max(1, round(len(wave) * target_rate / source_rate))].astype(np.float32)


class AudioDecoder:
    def __init__(self, feature_extractor: Any | None, sample_rate: int, seconds: float, resample: bool) -> None:
        self.feature_extractor = feature_extractor
        self.sample_rate = sample_rate
        self.seconds = seconds
        self.num_samples = round(sample_rate * seconds)
        self.resample = resample

    def features(self, wave: np.ndarray) -> torch.Tensor:
        if self.feature_extractor is not None:
            out = self.feature_extractor(wave, sampling_rate=self.sample_rate, return_tensors="pt")
            return out[self.feature_extractor.model_input_names[0]][0]
        std = float(wave.std())
        return torch.from_numpy((wave - wave.mean()) / (std + 1e-7)).float()

    def read_window(self, path: Media) -> tuple[np.ndarray, int]:
        """(the first ``seconds`` of ``path``, mono float32, at the file's rate; that rate)."""
        try:
            source = io.BytesIO(path.data) if isinstance(path, MediaBlob) else str(path)
            with soundfile.SoundFile(source) as sound:
                rate = sound.samplerate
                if rate != self.sample_rate and not self.resample:
                    raise SampleError(
                        f"{path}: sample rate {rate} Hz, the encoder expects {self.sample_rate} Hz "
                        "(convert the file, or set data.resample=true)"
                    )
                # Only the frames used: decoding stops there, whatever the file's length.
                frames = self.num_samples if rate == self.sample_rate else math.ceil(self.seconds * rate) + RESAMPLE_MARGIN
                wave = sound.read(frames=frames, dtype="float32", always_2d=True)
        except (RuntimeError, soundfile.LibsndfileError, OSError) as err:
            kind = f"{path.suffix} file" if path.suffix else "file"
            raise SampleError(f"{path}: cannot decode audio, {kind} ({err}); readable formats: {AUDIO_FORMATS}") from None
        return wave.mean(axis=1), rate  # mono: average the channels

    def window(self, path: Media) -> np.ndarray:
        """The clip the encoder hears: mono, at the encoder's rate, cropped or zero-padded to
        ``num_samples`` (float32). What a prepared set stores; ``features`` finishes it."""
        wave, rate = self.read_window(path)
        wave = resample(wave, rate, self.sample_rate)  # read_window refused another rate when resample is off
        return np.pad(wave[: self.num_samples], (0, max(0, self.num_samples - len(wave)))).astype(np.float32, copy=False)

    def __call__(self, path: Path) -> torch.Tensor:
        return self.features(self.window(path))

    def blank(self) -> torch.Tensor:
        return torch.zeros_like(self.features(np.zeros(self.num_samples, dtype=np.float32)))
