"""Atomic file writes: the one helper every write site in dflash uses.

A file is written under a temporary name in the same folder, flushed and fsynced, renamed
over its final name, and the folder is fsynced, so a crash at any instant leaves either the
old file or the new one, never a readable half. Pure Python: the bottom layer, so that
precompute and train share it without importing each other.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def fsync_dir(path: str | Path) -> None:
    """fsync a folder, so that a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """fsync a file written by someone else (e.g. a library that takes a file name)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on a clean exit fsync it and rename it to `path`.

    For writers that take a file name (safetensors' `save_file`, `torch.save`). On an
    exception the temporary file is removed and `path` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write `data` (bytes, or text as UTF-8) to `path` atomically."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def write_json_atomic(path: str | Path, obj: Any, *, indent: int | None = 1, sort_keys: bool = True) -> None:
    """Write `obj` as JSON (one trailing newline) to `path` atomically."""
    separators = (",", ":") if indent is None else None
    write_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, separators=separators) + "\n")


__all__ = ["atomic_path", "fsync_dir", "fsync_file", "write_atomic", "write_json_atomic"]
