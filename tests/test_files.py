"""dflash.common.files: a failed write leaves the old file or folder and no temporary."""

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from dflash.common import files
from dflash.common.files import atomic_dir, atomic_path, write_atomic, write_json_atomic, write_npz_atomic


def _write_with_atomic_path(path, text):
    with atomic_path(path) as tmp:
        tmp.write_text(text)


WRITERS = {
    "write_atomic bytes": lambda path, text: write_atomic(path, text.encode()),
    "write_atomic str": write_atomic,
    "write_json_atomic": lambda path, text: write_json_atomic(path, {"text": text}),
    "atomic_path": _write_with_atomic_path,
}


def _read(path):
    text = path.read_text()
    return json.loads(text)["text"] if text.startswith("{") else text


@pytest.mark.parametrize("writer", WRITERS)
def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path, writer):
    path = tmp_path / "f.json"
    WRITERS[writer](path, "old")
    WRITERS[writer](path, "new")
    assert _read(path) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("fails", ["fsync", "rename"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, writer, fails):
    path = tmp_path / "f.json"
    WRITERS[writer](path, "old")
    if fails == "fsync":
        monkeypatch.setattr(files, "fsync_file", _full_disk)
    else:
        monkeypatch.setattr(files.os, "replace", _full_disk)
    with pytest.raises(OSError) as raised:
        WRITERS[writer](path, "new")
    assert raised.value.errno == errno.ENOSPC  # the caller's error, unchanged
    assert _read(path) == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_a_writer_failing_midway_leaves_the_old_file(tmp_path):
    path = tmp_path / "weights.bin"
    write_atomic(path, b"old")
    with pytest.raises(RuntimeError, match="short write"):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"half of the n")
            raise RuntimeError("short write")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]


@pytest.mark.parametrize("indent,sort_keys,expected", [
    (1, True, '{\n "a": [\n  1\n ],\n "b": 2\n}\n'),
    (2, False, '{\n  "b": 2,\n  "a": [\n    1\n  ]\n}\n'),
    (None, True, '{"a":[1],"b":2}\n'),
])
def test_write_json_atomic_formats(tmp_path, indent, sort_keys, expected):
    write_json_atomic(tmp_path / "x.json", {"b": 2, "a": [1]}, indent=indent, sort_keys=sort_keys)
    assert (tmp_path / "x.json").read_text() == expected


def _fill(folder, content):
    (folder / "a.txt").write_text(content)
    (folder / "sub").mkdir()
    (folder / "sub" / "b.txt").write_text(content * 2)


def _content(folder):
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*.txt"))}


@pytest.mark.parametrize("existing", [False, True])
def test_atomic_dir_publishes_the_folder_and_leaves_no_temporary(tmp_path, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "only-in-old.txt").write_text("x")
    with atomic_dir(out) as tmp:
        assert tmp.parent == tmp_path and not out.joinpath("a.txt").exists()
        _fill(tmp, "new")
    assert _content(out) == {"a.txt": "new", "sub/b.txt": "newnew"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("fails", ["body", "fsync", "rename"])
def test_a_failed_atomic_dir_leaves_the_old_folder_and_no_temporary(tmp_path, monkeypatch, fails):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        _fill(tmp, "old")
    if fails == "fsync":
        monkeypatch.setattr(files, "fsync_file", _full_disk)
    elif fails == "rename":
        real_replace = os.replace

        def replace(src, dst):
            if str(src).endswith(".out.tmp"):
                _full_disk()
            real_replace(src, dst)

        monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(OSError) as raised:
        with atomic_dir(out) as tmp:
            _fill(tmp, "new")
            if fails == "body":
                _full_disk()
    assert raised.value.errno == errno.ENOSPC
    assert _content(out) == {"a.txt": "old", "sub/b.txt": "oldold"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("fsync_files,expected", [(True, ["a.txt", "b.txt"]), (False, [])])
def test_atomic_dir_fsyncs_the_files_unless_the_caller_did(tmp_path, monkeypatch, fsync_files, expected):
    synced = []
    monkeypatch.setattr(files, "fsync_file", lambda path: synced.append(os.path.basename(path)))
    with atomic_dir(tmp_path / "out", fsync_files=fsync_files) as tmp:
        _fill(tmp, "x")
    assert sorted(synced) == expected


def test_atomic_dir_deletes_a_temporary_left_by_a_crash(tmp_path):
    crashed = tmp_path / ".out.tmp"
    crashed.mkdir()
    (crashed / "half.txt").write_text("h")
    with atomic_dir(tmp_path / "out") as tmp:
        assert list(tmp.iterdir()) == []
        (tmp / "a.txt").write_text("a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert _content(tmp_path / "out") == {"a.txt": "a"}


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_what_is_published_follows_the_umask(tmp_path, mask, file_mode, dir_mode):
    """safetensors writes 0600 files: the cache's target/head.safetensors and basis file, a
    checkpoint's or an export's weights were unreadable by a trainer or server running as
    another user. Both publishers give them the modes a plain open() would."""
    import stat

    import torch
    from safetensors.torch import save_file

    old = os.umask(mask)
    try:
        with atomic_path(tmp_path / "basis.safetensors") as tmp:
            save_file({"p": torch.zeros(2)}, str(tmp))
        with atomic_dir(tmp_path / "target") as tmp:
            save_file({"p": torch.zeros(2)}, str(tmp / "head.safetensors"))
            (tmp / "sub").mkdir()
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "basis.safetensors") == file_mode
    assert mode(tmp_path / "target" / "head.safetensors") == file_mode
    assert mode(tmp_path / "target") == mode(tmp_path / "target" / "sub") == dir_mode


def test_write_npz_atomic_replaces_the_archive_fsynced_and_leaves_no_temporary(tmp_path, monkeypatch):
    synced = []
    fsync_file = files.fsync_file
    monkeypatch.setattr(files, "fsync_file", lambda path: (synced.append(Path(path).name), fsync_file(path)))
    path = tmp_path / "anchor_index.npz"
    write_npz_atomic(path, fingerprint=np.array("old"), num_eligible=np.arange(3))
    write_npz_atomic(path, fingerprint=np.array("new"), num_eligible=np.arange(5, 10, dtype=np.int64))
    with np.load(path) as archive:
        assert str(archive["fingerprint"]) == "new" and archive["num_eligible"].tolist() == [5, 6, 7, 8, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anchor_index.npz"]
    assert synced == ["anchor_index.npz.tmp"] * 2
