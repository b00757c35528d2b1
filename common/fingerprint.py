"""The fingerprint of a target's weights: which model a cache, a run and an online target are.

Stage one records it (CACHE/target/target.json `fingerprint`, and the manifest's
`spec.target.fingerprint`); fit records its caches' in RUN/run.json; eval compares a cache's,
or an online `--target` folder's, with the run's. Everyone computes it here, from the files of
a Hugging Face model folder, so precompute and train agree without importing each other.

What is hashed: the model's safetensors files (the ones `model.safetensors.index.json` lists,
else `model.safetensors`, else every `*.safetensors`), tensor by tensor in name order: the
name, dtype and shape, and the bytes of up to `NUM_WINDOWS` evenly spaced `WINDOW_BYTES`
windows of the tensor's data (all of it when it is smaller than that). Why: it is cheap (about
64 KiB read per tensor, a few hundred MB for the largest models, against the whole checkpoint
for a full hash), independent of how the tensors are split over files, and two models of the
same config with different weights (another seed, a fine-tune, a merge) differ in every
sampled window of every changed tensor. What it cannot see: a change confined to bytes no
window covers (a handful of edited weights in a large tensor); and the same weights saved in
another dtype are another fingerprint (their bytes differ).

A folder without safetensors files (only pytorch_model.bin) has no fingerprint (None): its
identity cannot be checked, and the tools say so.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

FINGERPRINT_PREFIX = "st-sample-v1:"
NUM_WINDOWS = 16
WINDOW_BYTES = 4096
_INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the model's weights (empty when there are none)."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{index}: not a safetensors index ({error}); repair or re-download the model") from None
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(model_dir.glob("*.safetensors"))


def _header(path: Path) -> tuple[dict, int]:
    """(tensor entries, offset of the data section) of one safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(length))
        except ValueError as error:
            raise ValueError(f"{path}: unreadable safetensors header ({error})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


def target_fingerprint(model_dir: str | Path) -> str | None:
    """The fingerprint of the weights in Hugging Face model folder `model_dir` (see the module
    docstring), or None when the folder holds no safetensors file."""
    files = safetensors_files(model_dir)
    if not files:
        return None
    tensors = []  # (name, file, entry, data offset)
    for path in files:
        header, data_start = _header(path)
        tensors += [(name, path, entry, data_start) for name, entry in header.items()]
    tensors.sort(key=lambda t: t[0])
    digest = hashlib.sha256()
    handles: dict[Path, object] = {}
    try:
        for name, path, entry, data_start in tensors:
            begin, end = entry["data_offsets"]
            digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode() + b"\0")
            f = handles.get(path) or handles.setdefault(path, open(path, "rb"))
            for offset, size in _windows(end - begin):
                f.seek(data_start + begin + offset)
                digest.update(f.read(size))
    finally:
        for f in handles.values():
            f.close()
    return FINGERPRINT_PREFIX + digest.hexdigest()


def _windows(num_bytes: int) -> list[tuple[int, int]]:
    """(offset, size) of the sampled windows of a tensor of `num_bytes` bytes."""
    if num_bytes <= NUM_WINDOWS * WINDOW_BYTES:
        return [(0, num_bytes)]
    last = num_bytes - WINDOW_BYTES
    return [(round(i * last / (NUM_WINDOWS - 1)), WINDOW_BYTES) for i in range(NUM_WINDOWS)]


def short(fingerprint: str | None) -> str:
    """A fingerprint as messages show it."""
    return "none recorded" if fingerprint is None else fingerprint.removeprefix(FINGERPRINT_PREFIX)[:16]


__all__ = ["FINGERPRINT_PREFIX", "safetensors_files", "short", "target_fingerprint"]
