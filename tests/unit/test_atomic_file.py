"""Publishing a file (purrsight/atomic_file.py): whole or absent, durable, and in order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from purrsight import atomic_file
from purrsight.atomic_file import publish, publishing_folder, stale_temp_files, temp_name, write_json_atomically
from purrsight.data.prepared_manifest import MANIFEST_NAME
from purrsight.datasets.prepare_job import prepare_set
from tests.helpers import tiny_config


class DiskOrder:
    """Records, in order, which files were fsynced and renamed (what reaches the disk, and when)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        fsync, replace = os.fsync, os.replace

        def recording_fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            fsync(fd)

        def recording_replace(src: str | Path, dst: str | Path) -> None:
            replace(src, dst)
            self.events.append(("rename", str(dst)))

        monkeypatch.setattr(atomic_file.os, "fsync", recording_fsync)
        monkeypatch.setattr(atomic_file.os, "replace", recording_replace)


def test_a_file_is_synced_then_renamed_then_its_folder_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order = DiskOrder(monkeypatch)
    target = tmp_path / "ledger.json"
    write_json_atomically(target, {"step": 3})
    (synced_file, tmp), renamed, synced_folder = order.events
    assert synced_file == "fsync" and Path(tmp).name.startswith(".ledger.json.") and tmp.endswith(".tmp")
    assert renamed == ("rename", str(target)) and synced_folder == ("fsync", str(tmp_path))
    assert target.read_text() == '{\n "step": 3\n}\n' and not stale_temp_files(tmp_path)


def test_a_write_that_fails_half_way_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "plan.sh"
    target.write_text("old\n")

    def dies_half_way(stream) -> None:  # type: ignore[no-untyped-def]
        stream.write(b"partial")
        raise KeyboardInterrupt  # what a Ctrl-C during the write looks like to this process

    with pytest.raises(KeyboardInterrupt):
        publish(target, dies_half_way)
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["plan.sh"]


def test_a_folder_is_published_whole_or_not_at_all_and_never_over_one_that_holds_files(tmp_path: Path) -> None:
    out = tmp_path / "export"
    with pytest.raises(KeyboardInterrupt), publishing_folder(out) as folder:
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # a Ctrl-C half way
    assert list(tmp_path.iterdir()) == []  # no OUT, no temp folder
    out.mkdir()  # an empty folder is taken
    with publishing_folder(out) as folder:
        (folder / "sub").mkdir()
        (folder / "sub" / "a.json").write_text("{}")
    assert (out / "sub" / "a.json").read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["export"]
    with pytest.raises(OSError), publishing_folder(out) as folder:
        (folder / "b.json").write_text("{}")
    assert [p.name for p in out.rglob("*")] == ["sub", "a.json"] and not stale_temp_files(tmp_path)


def test_temp_names_differ_between_hosts_that_share_a_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hosts writing into one shared folder can have the same pid."""
    names = set()
    for host in ("node-a", "node-b", "node-b"):
        monkeypatch.setattr(atomic_file.socket, "gethostname", lambda host=host: host)
        names.add(temp_name(tmp_path / "manifest.json").name)
    assert len(names) == 3 and all(f".{os.getpid()}." in name for name in names)
    assert any(".node-a." in name for name in names)


def test_a_prepared_sets_shards_are_on_disk_before_its_manifest(
    synthetic_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest marks the set whole: after a power cut it must never name a shard the disk lacks."""
    order = DiskOrder(monkeypatch)
    out = tmp_path / "set"
    config = tiny_config(synthetic_dir, tmp_path, data__train_index=str(synthetic_dir / "val.jsonl"), data__val_index="null")
    assert prepare_set(config, out, processes=1, part=(0, 1), shard_size=8) is not None
    renames = [path for event, path in order.events if event == "rename"]
    manifest = renames.index(str(out / MANIFEST_NAME))
    shards = [i for i, path in enumerate(renames) if path.endswith(".arrow")]
    assert len(shards) == 4 and max(shards) < manifest  # 32 samples in shards of 8
    for index in shards:  # each shard's data synced before its rename, its folder after
        shard = renames[index]
        at = order.events.index(("rename", shard))
        assert order.events[at - 1][0] == "fsync" and order.events[at + 1] == ("fsync", str(Path(shard).parent))
