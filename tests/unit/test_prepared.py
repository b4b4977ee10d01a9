"""Prepared sets: the raw path's samples, refused when stale or partial, continued, made in parts.

The media are real files built from public packages' media (as in test_real_media.py):
matplotlib's photograph as a JPEG and as a 12-MP phone JPEG stored turned with an EXIF
orientation tag, its RGBA icon, a 16-bit grayscale PNG of its MRI slice, and Debian's
speech and Vorbis recordings at 48 kHz (resampled), as MP3 and as an empty clip.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import CLIPImageProcessor, SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

from purrsight.atomic_file import stale_temp_files
from purrsight.config import Config
from purrsight.data.prepared_manifest import MANIFEST_NAME, PLAN_NAME, PreparedSetError, read_manifest, tokenizer_digest
from purrsight.datasets.builder import build_datasets, build_decoders
from purrsight.datasets.duplicate_ids import IdHashes, duplicate_lines
from purrsight.datasets.prepare_job import prepare_set
from tests.helpers import REPO, fault_env, python_env, tiny_config
from tests.unit.test_real_media import SPEECH, STEREO_VORBIS, png_16bit, sample_data

EXIF_ORIENTATION = 0x0112


@pytest.fixture(scope="module")
def real_media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An index over real files of the kinds users bring; the tokenizer is the synthetic set's."""
    root = tmp_path_factory.mktemp("real")
    with Image.open(sample_data("grace_hopper.jpg")) as opened:
        photo = opened.convert("RGB")
    photo.save(root / "photo.jpg", quality=92)
    phone = photo.resize((3000, 4000), Image.Resampling.BICUBIC).transpose(Image.Transpose.ROTATE_90)  # stored turned
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6  # "rotate 90 to display": upright in a viewer
    phone.save(root / "phone.jpg", quality=90, exif=exif)
    with Image.open(sample_data("Minduka_Present_Blue_Pack.png")) as icon:
        icon.save(root / "icon.png")
    with gzip.open(sample_data("s1045.ima.gz")) as handle:
        mri = np.frombuffer(handle.read(), np.uint16).reshape(256, 256)
    png_16bit(mri.astype(np.uint16) * 16, root / "mri.png")
    speech, rate = soundfile.read(SPEECH, dtype="float32")
    soundfile.write(root / "speech.wav", speech, rate, subtype="PCM_16")
    soundfile.write(root / "speech.mp3", speech, rate, format="MP3")
    soundfile.write(root / "empty.wav", np.zeros(0, np.float32), 22050)
    (root / "alarm.oga").write_bytes(STEREO_VORBIS.read_bytes())
    samples = [
        ("photo", "photo.jpg", "speech.wav"),
        ("phone", "phone.jpg", None),
        ("icon", "icon.png", "alarm.oga"),
        ("mri", "mri.png", "speech.mp3"),
        ("voice", None, "empty.wav"),
        ("both", "photo.jpg", "alarm.oga"),
    ]
    lines = []
    for number, (name, image, audio) in enumerate(samples):
        record = {"id": name, "prompt": f"Describe item {number}.", "response": f"It is the {name}."}
        record.update({key: value for key, value in (("image", image), ("audio", audio)) if value})
        lines.append(json.dumps(record))
    (root / "index.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def image_towers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny SigLIP tower saved with a processor replayed here (stored uint8) and one called as is (stored float32)."""
    root = tmp_path_factory.mktemp("towers")
    tower = SiglipVisionModel(
        SiglipVisionConfig(
            image_size=32, patch_size=8, hidden_size=24, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48
        )
    )
    folders = {"siglip": root / "siglip", "clip-other-rule": root / "clip"}
    for folder in folders.values():
        tower.save_pretrained(folder)
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folders["siglip"])
    CLIPImageProcessor(size={"shortest_edge": 40, "longest_edge": 48}, crop_size={"height": 32, "width": 32}).save_pretrained(
        folders["clip-other-rule"]
    )
    return folders


def media_config(real_media: Path, synthetic_dir: Path, out: Path, tower: Path | None = None, **extra: object) -> Config:
    settings: dict[str, object] = {
        "data__train_index": str(real_media / "index.jsonl"),
        "data__val_index": "null",
        "data__synthetic_dir": "null",
        "model__llm__tokenizer": str(synthetic_dir / "tokenizer"),
        "data__audio_seconds": 1.0,
        "data__batch_size": 2,
    }
    if tower is not None:
        settings.update(model__image_encoder__path=str(tower), model__image_encoder__config="null")
    return tiny_config(synthetic_dir, out, **{**settings, **extra})


@pytest.mark.parametrize("tower", [None, "siglip", "clip-other-rule"])
def test_a_prepared_sample_is_the_raw_paths_sample(
    tower: str | None, real_media: Path, image_towers: dict[str, Path], synthetic_dir: Path, tmp_path: Path
) -> None:
    """Pictures to 1e-5, audio and tokens exactly, with each way a picture is stored."""
    config = media_config(real_media, synthetic_dir, tmp_path, image_towers[tower] if tower else None)
    raw = build_datasets(config, world_size=1).train
    decoder = build_decoders(config)[0]
    assert decoder is not None
    manifest = prepare_set(config, tmp_path / "prepared", processes=1, part=(0, 1), shard_size=4)
    assert manifest is not None and manifest["splits"]["train"]["samples"] == len(raw) == 6  # type: ignore[arg-type]
    prepared = build_datasets(with_prepared(config, tmp_path / "prepared"), 1).train
    expected_storage = "float32" if tower == "clip-other-rule" else "uint8"
    assert manifest["settings"]["image"]["storage"] == expected_storage
    for i in range(len(raw)):  # type: ignore[arg-type]
        want, got = raw[i], prepared[i]
        assert (got.id, got.input_ids, got.labels) == (want.id, want.input_ids, want.labels)
        assert (got.image is None) == (want.image is None) and (got.audio is None) == (want.audio is None), want.id
        if want.image is not None:
            assert got.image is not None and got.image.shape == want.image.shape and got.image.dtype == want.image.dtype
            assert str(got.image.dtype) == f"torch.{expected_storage}"
            # What the tower gets from each (test_model.py: the model normalises as finish() does).
            assert torch.allclose(decoder.finish(got.image), decoder.finish(want.image), atol=1e-5, rtol=0), want.id
        if want.audio is not None:
            assert got.audio is not None and torch.equal(got.audio, want.audio), want.id


def test_a_phone_photo_is_stored_upright(real_media: Path, synthetic_dir: Path, tmp_path: Path) -> None:
    config = media_config(real_media, synthetic_dir, tmp_path)
    prepare_set(config, tmp_path / "p", processes=1, part=(0, 1), shard_size=64)
    phone = build_datasets(with_prepared(config, tmp_path / "p"), 1).train[1]
    with Image.open(sample_data("grace_hopper.jpg")) as opened:
        upright = np.asarray(opened.convert("RGB").resize((32, 32), Image.Resampling.BILINEAR), np.float32)
    assert phone.id == "phone" and phone.image is not None
    assert float(np.abs(phone.image.permute(1, 2, 0).numpy() - upright).mean()) < 12  # levels of 255; turned, it is ~50


def with_prepared(config: Config, folder: Path, **data: object) -> Config:
    return config.model_copy(update={"data": config.data.model_copy(update={"prepared": str(folder), **data})})


def test_a_stale_set_is_refused_naming_what_differs(real_media: Path, synthetic_dir: Path, tmp_path: Path) -> None:
    config = media_config(real_media, synthetic_dir, tmp_path)
    folder = tmp_path / "p"
    prepare_set(config, folder, processes=1, part=(0, 1), shard_size=4)
    build_datasets(with_prepared(config, folder), 1)  # made for this config: accepted

    with pytest.raises(PreparedSetError, match=r"other settings \(max_length differ"):
        build_datasets(with_prepared(config, folder, max_length=48), 1)
    with pytest.raises(PreparedSetError, match=r"other settings \(audio.seconds differ"):
        build_datasets(with_prepared(config, folder, audio_seconds=2.0), 1)
    # A prepared set trains alone: its source is not read (nor needed) at a start, and an index the
    # config file names is the raw path's; one this command's overrides name, if another, is refused.
    other = tmp_path / "other.jsonl"
    other.write_text((real_media / "index.jsonl").read_text().replace("It is the photo.", "It is a photo."))
    standing = with_prepared(config, folder, train_index=str(tmp_path / "gone.jsonl"))
    standing._overridden = frozenset()
    build_datasets(standing, 1)
    said = with_prepared(config, folder, train_index=str(other))
    said._overridden = frozenset({"data.train_index"})
    with pytest.raises(
        PreparedSetError, match=r"data.train_index=.*other.jsonl names other data than data.prepared=.* was made from"
    ):
        build_datasets(said, 1)
    # The same folder cannot take a prepare of something else: its plan names what it holds.
    with pytest.raises(PreparedSetError, match=r"holds a prepare of other sources or settings \(settings.max_length differ"):
        prepare_set(with_prepared(config, folder, max_length=48), folder, processes=1, part=(0, 1), shard_size=4)


def test_a_partial_set_is_refused_and_a_second_prepare_continues_it(real_media: Path, synthetic_dir: Path, tmp_path: Path) -> None:
    config = media_config(real_media, synthetic_dir, tmp_path)
    folder = tmp_path / "p"
    prepare_set(config, folder, processes=1, part=(0, 1), shard_size=2)  # 3 shards
    # What a prepare killed in its second shard leaves: shard 0 whole, no receipt for 1 and 2, no manifest.
    (folder / MANIFEST_NAME).unlink()
    for number in (1, 2):
        (folder / "train" / f"shard-0000{number}.json").unlink()
    (folder / "train" / "shard-00002.arrow").unlink()
    kept = (folder / "train" / "shard-00000.arrow").stat().st_mtime_ns
    with pytest.raises(PreparedSetError, match=r"is not complete \(no manifest.json: a prepare was interrupted.*continue it with"):
        read_manifest(folder)
    with pytest.raises(PreparedSetError, match="is not complete"):
        build_datasets(with_prepared(config, folder), 1)
    manifest = prepare_set(config, folder, processes=1, part=(0, 1), shard_size=2)
    assert manifest is not None and manifest["splits"]["train"]["samples"] == 6
    assert (folder / "train" / "shard-00000.arrow").stat().st_mtime_ns == kept  # done work is not redone
    assert len(build_datasets(with_prepared(config, folder), 1).train) == 6  # type: ignore[arg-type]


CUT = json.dumps({"id": "cut", "prompt": "p", "response": "r", "image": "truncated.jpg"})  # does not decode
GONE = json.dumps({"id": "gone", "prompt": "p", "response": "r", "audio": "absent.wav"})  # no such file


def media_with_bad_samples(real_media: Path, tmp_path: Path, lines: list[str]) -> Path:
    """A folder of the real media plus a truncated JPEG, indexed by ``lines``; its index."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in real_media.iterdir():
        if item.name != "index.jsonl":
            (broken / item.name).symlink_to(item)
    (broken / "truncated.jpg").write_bytes((real_media / "photo.jpg").read_bytes()[:3000])
    (broken / "index.jsonl").write_text("\n".join(lines) + "\n")
    return broken / "index.jsonl"


def test_bad_samples_are_listed_all_at_once_or_left_out_and_listed(real_media: Path, synthetic_dir: Path, tmp_path: Path) -> None:
    index = media_with_bad_samples(real_media, tmp_path, [*(real_media / "index.jsonl").read_text().splitlines(), CUT, GONE])
    broken = index.parent
    config = media_config(broken, synthetic_dir, tmp_path, data__train_index=str(index))
    with pytest.raises(PreparedSetError) as refused:
        prepare_set(config, tmp_path / "p", processes=1, part=(0, 1), shard_size=4)
    problems = refused.value.lines()
    assert problems[0].startswith(f"{broken / 'index.jsonl'}:7 (id 'cut'): ") and "cannot decode image" in problems[0]
    assert problems[1].startswith(f"{broken / 'index.jsonl'}:8 (id 'gone'): ") and "absent.wav" in problems[1]
    assert "2 bad sample(s): fix or remove them" in problems[2]
    assert not (tmp_path / "p" / MANIFEST_NAME).exists()

    skipping = with_prepared(config, tmp_path / "p", on_bad_sample="skip")
    manifest = prepare_set(skipping, tmp_path / "q", processes=1, part=(0, 1), shard_size=4)
    assert manifest is not None and manifest["splits"]["train"] == {**manifest["splits"]["train"], "samples": 6, "bad": 2}
    listed = [json.loads(line) for line in (tmp_path / "q" / "bad_samples.jsonl").read_text().splitlines()]
    assert [entry["where"].rpartition(" ")[2] for entry in listed] == ["'cut')", "'gone')"]


def skipping_with_a_cap_of_one(real_media: Path, synthetic_dir: Path, tmp_path: Path) -> Config:
    """Two shards of 4 samples, one bad sample in each: under a cap of 1 each, over it together."""
    good = (real_media / "index.jsonl").read_text().splitlines()
    index = media_with_bad_samples(real_media, tmp_path, [CUT, *good[:3], GONE, *good[3:6]])
    return media_config(
        index.parent, synthetic_dir, tmp_path, data__train_index=str(index), data__on_bad_sample="skip", data__max_bad_samples=1
    )


def test_parts_each_under_the_bad_sample_cap_but_over_it_together_publish_no_manifest(
    real_media: Path, synthetic_dir: Path, tmp_path: Path
) -> None:
    """--part 0/2 and 1/2 (a SLURM array): each leaves one sample out, the cap is 1: the part that
    finishes the set refuses it (before the fix: each part counted its own and published)."""
    config = skipping_with_a_cap_of_one(real_media, synthetic_dir, tmp_path)
    folder = tmp_path / "p"
    assert prepare_set(config, folder, processes=1, part=(0, 2), shard_size=4) is None  # half the set, 1 bad: under
    with pytest.raises(PreparedSetError) as refused:
        prepare_set(config, folder, processes=1, part=(1, 2), shard_size=4)
    assert refused.value.lines()[-1].startswith("2 bad sample(s): above data.max_bad_samples=1 across the set")
    assert "train/shard-00000.json, train/shard-00001.json" in refused.value.lines()[-1]
    assert not (folder / MANIFEST_NAME).exists()
    raised = with_prepared(config, folder, max_bad_samples=2)  # the way out the message names
    manifest = prepare_set(raised, folder, processes=1, part=(1, 2), shard_size=4)
    assert manifest is not None and manifest["splits"]["train"]["bad"] == 2 and manifest["splits"]["train"]["samples"] == 6


def test_a_rerun_after_a_bad_sample_refusal_refuses_again(real_media: Path, synthetic_dir: Path, tmp_path: Path) -> None:
    """Its shards are done (receipts kept), so it decodes nothing: before the fix it counted no bad
    sample and published the set over the cap."""
    config = skipping_with_a_cap_of_one(real_media, synthetic_dir, tmp_path)
    folder = tmp_path / "p"
    for _ in range(2):
        with pytest.raises(PreparedSetError) as refused:
            prepare_set(config, folder, processes=1, part=(0, 1), shard_size=4)
        assert refused.value.lines()[-1].startswith("2 bad sample(s): above data.max_bad_samples=1")
        assert not (folder / MANIFEST_NAME).exists()


def test_an_index_with_bad_lines_lists_them_all_before_decoding(synthetic_dir: Path, tmp_path: Path) -> None:
    lines = (synthetic_dir / "train.jsonl").read_text().splitlines()[:5]
    lines[1] = "{not json"
    lines[3] = lines[0]  # a duplicate id
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    config = tiny_config(synthetic_dir, tmp_path, data__train_index=str(tmp_path / "train.jsonl"), data__val_index="null")
    with pytest.raises(Exception) as refused:
        prepare_set(config, tmp_path / "p", processes=1, part=(0, 1), shard_size=4)
    assert [line.split(": ", 1)[0] for line in refused.value.lines()] == [  # type: ignore[attr-defined]
        f"{tmp_path / 'train.jsonl'}:2",
        f"{tmp_path / 'train.jsonl'}:4",
        f"{tmp_path / 'train.jsonl'}",
    ]
    assert not (tmp_path / "p").exists()  # nothing decoded, nothing written


def test_two_parts_prepared_by_two_processes_make_one_set(synthetic_dir: Path, tmp_path: Path) -> None:
    """``--part 0/2`` and ``--part 1/2`` at once, as two machines of a SLURM array would: the last one done joins them.

    The second runs from another folder with relative paths, as another machine may name the same files.
    """
    relative = ["data.synthetic_dir=.", "data.train_index=train.jsonl", "data.val_index=val.jsonl"]
    absolute = [
        f"data.synthetic_dir={synthetic_dir}",
        f"data.train_index={synthetic_dir}/train.jsonl",
        f"data.val_index={synthetic_dir}/val.jsonl",
    ]
    command = [sys.executable, str(REPO / "train_phase2.py"), "prepare", "--config", str(REPO / "config" / "train_config.yaml")]
    parts = [
        subprocess.Popen(
            [*command, "--out", str(tmp_path / "p"), "--num-proc", "1", "--shard-size", "16", "--part", f"{i}/2", *overrides],
            cwd=cwd,
            env=python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, (overrides, cwd) in enumerate([(absolute, REPO), (relative, synthetic_dir)])
    ]
    outputs = [part.communicate(timeout=300) for part in parts]
    assert [part.returncode for part in parts] == [0, 0], outputs
    assert sum("prepared set complete" in out for out, _ in outputs) >= 1
    manifest = read_manifest(tmp_path / "p")
    assert manifest["splits"]["train"]["samples"] == 128 and len(manifest["splits"]["train"]["shards"]) == 8
    assert manifest["splits"]["val"]["samples"] == 32
    assert (tmp_path / "p" / PLAN_NAME).is_file()
    config = tiny_config(synthetic_dir, tmp_path, data__prepared=str(tmp_path / "p"), data__val_index="null")
    train = build_datasets(config, 1).train
    assert sorted(train[i].id for i in range(len(train))) == sorted(  # type: ignore[arg-type]
        json.loads(line)["id"] for line in (synthetic_dir / "train.jsonl").read_text().splitlines()
    )


def test_a_prepare_killed_mid_way_is_refused_then_continued(synthetic_dir: Path, tmp_path: Path) -> None:
    """SIGKILL of a real prepare half way through writing its 4th shard (tests/fault_injection:
    kill_during_shard_write): no manifest, whole shards, the torn one's temp file; a rerun removes
    that, loses a worker to SIGKILL and says so; a third finishes."""
    out = tmp_path / "p"
    args = [str(REPO / "train_phase2.py"), "prepare", "--config", str(REPO / "config" / "train_config.yaml"), "--out", str(out)]
    args += ["--num-proc", "1", "--shard-size", "4", f"data.synthetic_dir={synthetic_dir}"]
    args += [f"data.train_index={synthetic_dir}/train.jsonl", f"data.val_index={synthetic_dir}/val.jsonl"]
    killed = subprocess.run(
        [sys.executable, *args], env={**python_env(), **fault_env("kill_during_shard_write:4")}, capture_output=True, timeout=300
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    receipts = sorted(p.name for p in (out / "train").glob("*.json"))
    assert len(receipts) == 3, receipts  # killed part of the way through the 32 training shards
    assert not (out / MANIFEST_NAME).exists()
    (torn,) = stale_temp_files(out / "train")
    assert torn.name.startswith(".shard-00003.arrow.")
    for receipt in receipts:  # every shard with a receipt is whole
        assert (out / "train" / receipt.replace(".json", ".arrow")).stat().st_size > 0
    config = tiny_config(synthetic_dir, tmp_path, data__prepared=str(out))
    with pytest.raises(PreparedSetError, match="is not complete"):
        build_datasets(config, 1)
    # Then one of two workers killed alone (the OOM killer): one line naming its shard, exit 1, the
    # others ended and their cut shards removed. Under multiprocessing.Pool this waited forever.
    two = [a if a != "1" or args[i - 1] != "--num-proc" else "2" for i, a in enumerate(args)]
    env = {**python_env(), **fault_env("kill_during_shard_write:2")}
    lost = subprocess.run([sys.executable, *two], env=env, capture_output=True, text=True, timeout=300)
    assert lost.returncode == 1 and "Traceback" not in lost.stderr, lost.stderr[-2000:]
    assert f"removed 1 half-written shard file(s) left by an interrupted prepare ({torn}, ...)" in lost.stderr
    assert re.search(r"prepare stopped: the process working on shard \d+ \(train, from .*\) was killed by SIGKILL", lost.stderr)
    assert not torn.exists() and stale_temp_files(out / "train") == []  # before the fix: left there for good
    receipts = sorted(p.name for p in (out / "train").glob("*.json"))
    done = subprocess.run([sys.executable, *args], env=python_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{32 + 8 - len(receipts)} shards to do" in done.stderr
    assert len(build_datasets(config, 1).train) == 128  # type: ignore[arg-type]


def test_the_tokenizer_digest_reads_the_tokenizer_not_the_weights_beside_it(synthetic_dir: Path, tmp_path: Path) -> None:
    """model.llm.path is usually both: hashing its gigabytes of weights on every start would cost minutes."""
    folder = tmp_path / "llm"
    shutil.copytree(synthetic_dir / "tokenizer", folder)
    before = tokenizer_digest(folder)
    (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    (folder / "config.json").write_text("{}")
    assert tokenizer_digest(folder) == before
    (folder / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text().replace("<pad>", "<PAD>"))
    assert tokenizer_digest(folder) != before


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f"]), max_size=30), st.booleans())
def test_duplicate_ids_are_named_as_a_dict_of_every_id_names_them(ids: list[str], all_collide: bool) -> None:
    """The survey's 8-bytes-a-line check (datasets/duplicate_ids.py) against the dict it replaced;
    with every hash a suspect (as if all collided), the second read still names only true duplicates."""
    hashes = IdHashes()
    for sample_id in ids:
        hashes.add(sample_id)
    first: dict[str, int] = {}
    expected = []
    for line, sample_id in enumerate(ids, 1):
        if sample_id in first:
            expected.append((sample_id, line, first[sample_id]))
        else:
            first[sample_id] = line
    suspects = {hash(i) for i in ids} if all_collide else hashes.suspects()
    assert duplicate_lines(((i, line) for line, i in enumerate(ids, 1)), suspects) == expected


def test_the_surveys_duplicate_list_stops_at_its_cap(synthetic_dir: Path, tmp_path: Path) -> None:
    """A million lines with one id repeated listed 50 duplicates before the hashes; after them too."""
    from purrsight.data.formats.records import ReadOptions
    from purrsight.data.index import IndexFileError
    from purrsight.datasets.prepare_job import MAX_LISTED_PROBLEMS, survey

    index = tmp_path / "same.jsonl"
    index.write_text("".join(json.dumps({"id": "a", "prompt": "p", "response": "r"}) + "\n" for _ in range(200)))
    config = tiny_config(synthetic_dir, tmp_path, data__train_index=str(index), data__val_index="null")
    with pytest.raises(IndexFileError) as refused:
        survey(str(index), config, ReadOptions(), 16)
    lines = refused.value.lines()
    assert len(lines) == MAX_LISTED_PROBLEMS + 1 and lines[0] == f"{index}:2: duplicate id 'a' (first on line 1)"
    assert lines[-1].endswith(f"{MAX_LISTED_PROBLEMS} bad line(s) (the first {MAX_LISTED_PROBLEMS}; the scan stopped there)")
