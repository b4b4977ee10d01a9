"""The synthetic Phase 2 set: cats of a colour, tones of a pitch, and questions about them.

Deterministic from a seed. Each sample asks about the picture, the sound, or both, so
batches mix samples with and without each modality. The answer depends only on the
media (the prompt never gives it away), so val accuracy above chance means the
projectors carry real signal into the LLM.

    python -m purrsight.data.synthetic --out data/synthetic --num-train 512 --num-val 64
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image, ImageDraw
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from purrsight.atomic_file import publishing_folder

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
PITCHES = {"low": 220.0, "middle": 440.0, "high": 880.0}
SAMPLE_RATE = 16000
CLIP_SECONDS = 0.25
SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>"]

QUESTIONS = {
    "image": ["What colour is the cat?", "Which colour does the cat in the picture have?"],
    "audio": ["Which pitch does the sound have?", "What is the pitch of the tone?"],
    "both": ["What colour is the cat, and what pitch is the sound?"],
}


def draw_cat(rng: np.random.Generator, colour: tuple[int, int, int], size: int) -> Image.Image:
    background = tuple(int(v) for v in rng.integers(150, 256, size=3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    s = size / 32  # the drawing is designed on a 32-px grid
    dx, dy = (float(v) * s for v in rng.integers(-3, 4, size=2))
    draw.ellipse([8 * s + dx, 14 * s + dy, 24 * s + dx, 28 * s + dy], fill=colour)  # body
    draw.ellipse([11 * s + dx, 5 * s + dy, 21 * s + dx, 15 * s + dy], fill=colour)  # head
    draw.polygon([(11 * s + dx, 8 * s + dy), (12 * s + dx, 2 * s + dy), (15 * s + dx, 6 * s + dy)], fill=colour)
    draw.polygon([(21 * s + dx, 8 * s + dy), (20 * s + dx, 2 * s + dy), (17 * s + dx, 6 * s + dy)], fill=colour)
    return image


def tone(rng: np.random.Generator, frequency: float) -> np.ndarray:
    t = np.arange(round(SAMPLE_RATE * CLIP_SECONDS)) / SAMPLE_RATE
    amplitude = rng.uniform(0.3, 0.8)
    wave = amplitude * np.sin(2 * math.pi * frequency * t + rng.uniform(0, 2 * math.pi))
    return (wave + rng.normal(0, 0.02, size=t.shape)).astype(np.float32)


def _answer(colour: str | None, pitch: str | None) -> str:
    if colour and pitch:
        return f"The cat is {colour} and the sound is {pitch}."
    if colour:
        return f"The cat is {colour}."
    return f"The sound is {pitch}."


def write_split(folder: Path, split: str, count: int, rng: np.random.Generator, image_size: int) -> list[str]:
    (folder / "images").mkdir(exist_ok=True)
    (folder / "audio").mkdir(exist_ok=True)
    lines, texts = [], []
    for i in range(count):
        sample_id = f"{split}-{i:05d}"
        kind = ("image", "audio", "both")[int(rng.integers(0, 3))]
        record: dict[str, str] = {"id": sample_id}
        colour = pitch = None
        if kind in ("image", "both"):
            colour = list(COLOURS)[int(rng.integers(0, len(COLOURS)))]
            draw_cat(rng, COLOURS[colour], image_size).save(folder / "images" / f"{sample_id}.png")
            record["image"] = f"images/{sample_id}.png"
        if kind in ("audio", "both"):
            pitch = list(PITCHES)[int(rng.integers(0, len(PITCHES)))]
            soundfile.write(folder / "audio" / f"{sample_id}.wav", tone(rng, PITCHES[pitch]), SAMPLE_RATE, subtype="PCM_16")
            record["audio"] = f"audio/{sample_id}.wav"
        questions = QUESTIONS[kind]
        record["prompt"] = questions[int(rng.integers(0, len(questions)))]
        record["response"] = _answer(colour, pitch)
        lines.append(json.dumps(record))
        texts += [record["prompt"], " " + record["response"]]  # as TextEncoder feeds the response
    (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return texts


# Qwen2's pre-tokenisation (split, then byte-level), so the tiny set's tokenizer is of the
# same family as the tiny Qwen2 LM's real counterpart: AutoTokenizer on an exported folder
# (config.json says qwen2) builds a Qwen2Tokenizer from these files and must get the same
# ids. A word-level tokenizer came back from there as one token per sentence.
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
TOKENIZER_VOCAB = 512  # 256 bytes, 4 specials and merges enough to make every word of the set one token


def train_tokenizer(texts: list[str], folder: Path) -> None:
    """A Qwen2-style byte-level BPE over the set's text, saved as a Hugging Face directory."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    # Here, not at the top: importing transformers costs seconds, and a process that only
    # checks the set exists (the Ray driver, every rank after the first) never gets here.
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )
    wrapped.save_pretrained(str(folder / "tokenizer"))


def generate(out: str | Path, num_train: int, num_val: int, seed: int, image_size: int = 32) -> Path:
    """Write the set into ``out``; a no-op when ``out`` already holds one.

    The set is built in a temporary sibling and renamed into place (purrsight/atomic_file.py), so
    a reader never sees half a set, and nodes racing on a shared filesystem all end with the same one.
    """
    out = Path(out)
    if (out / "train.jsonl").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with publishing_folder(out) as staging:
            rng = np.random.default_rng(seed)
            texts = write_split(staging, "train", num_train, rng, image_size)
            texts += write_split(staging, "val", num_val, rng, image_size)
            train_tokenizer(texts, staging)
    except OSError:
        if not (out / "train.jsonl").is_file():  # lost a race to a complete set: fine
            raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/synthetic", help="folder to create (default: %(default)s)")
    parser.add_argument("--num-train", type=int, default=512, help="training samples (default: %(default)s)")
    parser.add_argument("--num-val", type=int, default=64, help="validation samples (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the set is a pure function of it (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=32, help="image side in pixels (default: %(default)s)")
    args = parser.parse_args(argv)
    if (Path(args.out) / "train.jsonl").is_file():
        print(f"{args.out} already holds a synthetic set; nothing written")
        return 0
    folder = generate(args.out, args.num_train, args.num_val, args.seed, args.image_size)
    print(f"wrote {args.num_train} train + {args.num_val} val samples and a tokenizer to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
