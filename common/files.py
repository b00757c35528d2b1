"""Atomic file writes: the one module every write site in dflash goes through.

A file is written under a temporary name in the same folder, flushed and fsynced, renamed
over its final name, and the folder is fsynced, so a crash at any instant leaves either the
old file or the new one, never a readable half. `write_atomic` (bytes, text),
`write_json_atomic`, `write_npz_atomic` (numpy arrays, e.g. a run's anchor index) and
`atomic_path` (for libraries that take a file name) write one file; a folder of files
published together (a checkpoint, an export, CACHE/target) is written the same way as a whole
by `atomic_dir`. `file_sha256` is the checksum the manifest records for each file it lists.
Python and numpy only: the bottom layer, so that precompute and train share
it without importing each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
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
        os.chmod(tmp, 0o666 & ~current_umask())  # safetensors and mkstemp-style writers make 0600 files
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, fsync_files: bool = True) -> Iterator[Path]:
    """Yield an empty temporary folder `.NAME.tmp` beside `path` to fill; on a clean exit
    publish it as `path`: fsync its files (unless `fsync_files` is False: the caller fsynced
    each one as it wrote it) and folders, rename it to `path`, fsync the parent.

    `path` is complete or absent at any instant of a crash; an existing `path` is replaced
    (renamed to `.NAME.stale` first, deleted after). On an exception the temporary folder is
    deleted and `path` is as it was. A temporary folder left by a crash is deleted on entry.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    stale = path.with_name(f".{path.name}.stale")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        publish_readable(tmp)
        for inner in sorted(tmp.rglob("*"), reverse=True):  # a folder's entries before the folder
            if inner.is_dir():
                fsync_dir(inner)
            elif fsync_files:
                fsync_file(inner)
        fsync_dir(tmp)
        if path.exists():
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(path, stale)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if stale.exists() and not path.exists():  # the final rename failed: put the old one back
            os.replace(stale, path)
        raise
    fsync_dir(path.parent)
    shutil.rmtree(stale, ignore_errors=True)


def current_umask() -> int:
    """The process umask, read without changing it where the system allows (os.umask sets it
    to read it: a file another thread creates in between would get the wrong mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_readable(folder: Path) -> None:
    """Give `folder` and everything in it the modes a plain `open()` / `mkdir()` would (0644 /
    0755 under the usual umask 022): safetensors writes its files 0600, which a serving process
    (or a trainer) running as another user cannot read. `atomic_dir` and `atomic_path` apply
    it to what they publish."""
    mask = current_umask()
    for path in [Path(folder), *Path(folder).rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


# A shard's checksum in the manifest: the entry's field for each algorithm. xxh3-128 (the
# `xxhash` package) hashes about 7x faster on one core than sha256, so that stage one's host
# keeps up with its GPU: dflash-precompute's default; it makes the manifest format version 3.
# sha256 (cryptographic, read by older readers) is CacheWriter's default, for the writers
# that no GPU paces (transcode, synthetic caches) and `--shard-checksum sha256`.
SHARD_CHECKSUM_FIELDS = {"sha256": "sha256", "xxh3-128": "xxh3_128"}


def new_digest(algorithm: str) -> Any:
    """A fresh hash object of a shard checksum algorithm (a key of SHARD_CHECKSUM_FIELDS)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3-128":
        try:
            import xxhash
        except ImportError as error:
            raise ValueError("the xxh3-128 shard checksum needs the xxhash package: pip install xxhash") from error
        return xxhash.xxh3_128()
    raise ValueError(f"unknown shard checksum {algorithm!r}; choose one of {sorted(SHARD_CHECKSUM_FIELDS)}")


def file_digest(path: str | Path, algorithm: str, chunk_bytes: int = 8 * 2**20) -> str:
    """The checksum (hex) of the file at `path` with `algorithm`, read in chunks."""
    digest = new_digest(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | Path, chunk_bytes: int = 8 * 2**20) -> str:
    """The sha256 of the file at `path` (hex), read in chunks of `chunk_bytes`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


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


def write_npz_atomic(path: str | Path, **arrays: Any) -> None:
    """Write `arrays` as an uncompressed .npz (`np.savez`, read back by `np.load`) to `path`
    atomically. The archive goes through a file object: given a name, `np.savez` would append
    ".npz" to the temporary one."""
    import numpy as np

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)


__all__ = ["atomic_dir", "atomic_path", "file_sha256", "fsync_dir", "fsync_file", "write_atomic", "write_json_atomic",
           "write_npz_atomic"]
