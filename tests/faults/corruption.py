"""4. `corruption`: truncation, bit flips in a shard, footer damage, manifest damage, a
missing shard, a shard from another cache of the same configuration.

`verify` reports the damage and names the damaged file; reading every row and training on
the cache either fail with a ValueError naming the cache, or give exactly what the
undamaged cache gives (damage in bytes nobody reads). Anything else is training on wrong
data. Damage that verify passes and that changes neither the rows nor the trained weights
(a manifest field no reader uses) is tallied as "undetected, harmless" and listed, not
failed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from dflash.common.files import SHARD_CHECKSUM_FIELDS
from dflash.shards.reader import shard_checksum
from tests.faults.workspace import Outcome, Workspace, describe, fit_in_process

CORRUPTIONS = ["truncated shard", "bit flips in a shard", "bit flip in row data", "footer damage",
               "manifest damage", "missing shard", "shard from another cache"]
MANIFEST_DAMAGE = ["truncated", "byte flip", "key removed", "checksum changed", "length changed",
                   "shards swapped", "path changed"]


def trial_corruption(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    """Every kind of damage once, on fresh copies of the training cache."""
    root = ws.trial_dir("corruption", trial)
    return [corruption_case(ws, rng, root / f"case{i}", kind) for i, kind in enumerate(CORRUPTIONS)]


def _corrupt(cache: Path, foreign: Path, rng: np.random.Generator, kind: str,
             manifest_damage: str | None = None) -> tuple[str, str]:
    """Damage `cache` in place; returns (the damaged file's name, a description)."""
    manifest = json.loads((cache / "manifest.json").read_text())
    shard_rel = str(rng.choice([s["path"] for s in manifest["shards"]]))
    shard = cache / shard_rel
    data = bytearray(shard.read_bytes())
    if kind == "truncated shard":
        size = int(rng.integers(0, len(data)))
        shard.write_bytes(data[:size])
        return shard_rel, f"{shard_rel} cut to {size} of {len(data)} bytes"
    if kind in ("bit flips in a shard", "footer damage"):
        # Arrow IPC file: ... <footer flatbuffer> <int32 footer length> "ARROW1".
        footer_bytes = int.from_bytes(data[-10:-6], "little")
        footer_start = len(data) - 10 - footer_bytes
        if kind == "bit flips in a shard":
            lo, hi = 8, footer_start
        else:
            lo, hi = footer_start, len(data)
        offsets = rng.integers(lo, hi, size=int(rng.integers(1, 4)))
        for offset in offsets:
            data[int(offset)] ^= 1 << int(rng.integers(0, 8))
        shard.write_bytes(data)
        return shard_rel, f"{shard_rel}: bits flipped at {sorted(int(o) for o in offsets)}"
    if kind == "bit flip in row data":
        offset = _prompt_feature_byte(shard, rng)
        data[offset] ^= 1 << int(rng.integers(0, 8))
        shard.write_bytes(data)
        return shard_rel, f"{shard_rel}: a bit flipped in a row's prompt features, byte {offset}"
    if kind == "missing shard":
        shard.unlink()
        return shard_rel, f"{shard_rel} deleted"
    if kind == "shard from another cache":
        shutil.copyfile(foreign / shard_rel, shard)
        return shard_rel, f"{shard_rel} replaced by the other cache's {shard_rel}"
    how = manifest_damage or str(rng.choice(MANIFEST_DAMAGE))
    return "manifest.json", _damage_manifest(cache / "manifest.json", manifest, rng, how)


def _prompt_feature_byte(shard: Path, rng: np.random.Generator) -> int:
    """File offset of a random byte of a random row's features in the prompt (the first
    third of the synthetic rows, before the loss mask starts): context every block reads."""
    import pyarrow as pa

    from dflash.shards import rows

    mapped = pa.memory_map(str(shard), "r")
    base = mapped.read_buffer(1).address  # the mapping's first byte (zero-copy buffer)
    mapped.seek(0)
    reader = pa.ipc.open_file(mapped)
    batch = reader.get_batch(int(rng.integers(0, reader.num_record_batches)))
    features = rows.list_values(batch.column("features"))  # [T * L * H] uint16 view of the file
    num_tokens = batch.column("num_tokens")[0].as_py()
    per_token = features.size // num_tokens
    index = int(rng.integers(0, (num_tokens // 3) * per_token))
    return features.ctypes.data - base + index * features.itemsize + int(rng.integers(0, features.itemsize))


def _damage_manifest(path: Path, manifest: dict, rng: np.random.Generator, how: str) -> str:
    text = path.read_bytes()
    if how == "truncated":
        size = int(rng.integers(0, len(text)))
        path.write_bytes(text[:size])
        return f"manifest cut to {size} of {len(text)} bytes"
    if how == "byte flip":
        data = bytearray(text)
        offset = int(rng.integers(0, len(data)))
        data[offset] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(data)
        return f"manifest bit flipped at byte {offset} ({text[max(0, offset - 12):offset + 12]!r})"
    if how == "key removed":
        holders = [("", manifest), ("spec.", manifest["spec"]), ("sequences.", manifest["sequences"]),
                   ("shards[0].", manifest["shards"][0])]
        prefix, holder = holders[int(rng.integers(0, len(holders)))]
        key = str(rng.choice(sorted(holder)))
        del holder[key]
        description = f"manifest key {prefix}{key} removed"
    elif how == "checksum changed":
        shard = manifest["shards"][int(rng.integers(0, len(manifest["shards"])))]
        algorithm, digest = shard_checksum(shard)  # sha256, or xxh3-128 (stage one's default)
        shard[SHARD_CHECKSUM_FIELDS[algorithm]] = hashlib.sha256(rng.bytes(8)).hexdigest()[:len(digest)]
        description = f"manifest {algorithm} of {shard['path']} changed"
    elif how == "length changed":
        lengths = manifest["sequences"]["length"]
        i = int(rng.integers(0, len(lengths)))
        lengths[i] += int(rng.choice([-3, -1, 1, 2]))
        description = f"manifest length of sequence {i} changed"
    elif how == "shards swapped":
        a, b = rng.choice(len(manifest["shards"]), size=2, replace=False)
        shards = manifest["shards"]
        shards[a]["path"], shards[b]["path"] = shards[b]["path"], shards[a]["path"]
        description = f"manifest paths of shards {a} and {b} swapped"
    else:  # a path that stays inside the cache but names no file
        shard = manifest["shards"][int(rng.integers(0, len(manifest["shards"])))]
        shard["path"] = shard["path"].replace("rank", "rnak")
        description = f"manifest path of a shard changed to {shard['path']}"
    path.write_text(json.dumps(manifest, separators=(",", ":")))
    return description


def _names(text: str, damaged: str, cache: Path) -> bool:
    """Does `text` say which file is damaged (the file itself, the manifest, or the cache)?"""
    name = Path(damaged).name
    return name in text or str(cache) in text or (name == "manifest.json" and "manifest" in text)


def corruption_case(ws: Workspace, rng: np.random.Generator, root: Path, kind: str,
                     manifest_damage: str | None = None) -> Outcome:
    from dflash.shards import open_cache, verify_cache

    cache = root / "cache"
    shutil.copytree(ws.training_cache, cache)
    damaged, description = _corrupt(cache, ws.foreign_cache, rng, kind, manifest_damage)
    outcome = Outcome(case=kind, notes=[description])
    try:
        verified = verify_cache(cache)
    except Exception as error:  # noqa: BLE001 - verify must report, not crash
        verified = {"ok": False, "problems": []}
        outcome.problems.append(f"verify crashes instead of reporting: {describe(error)}")
    report = json.dumps(verified["problems"])
    detected = not verified["ok"]
    if verified["problems"] and not _names(report, damaged, cache):
        outcome.problems.append(f"verify reports the damage without naming {damaged}: {report[:300]}")

    # Reading every row: a clear error, or exactly the undamaged rows.
    clean = open_cache(ws.training_cache)
    try:
        damaged_cache = open_cache(cache)
        rows_equal = len(damaged_cache) == len(clean) and all(
            _same_row(damaged_cache[i], clean[i]) for i in range(len(clean)))
        read_error = None
    except Exception as error:  # noqa: BLE001 - which exception it is is the finding
        rows_equal, read_error = False, error
    if read_error is not None and not _clear(read_error, damaged, cache):
        outcome.problems.append(f"reading fails without a clear message: {describe(read_error)}")
    elif read_error is None and not rows_equal:
        outcome.problems.append("reading every row succeeds but returns other data than the undamaged cache")

    # Training one epoch: a clear error, or exactly the undamaged cache's weights.
    import torch

    try:
        weights = fit_in_process(ws.fit_config(cache, root / "run", epochs=1))
        fit_error = None
    except Exception as error:  # noqa: BLE001
        weights, fit_error = None, error
    if fit_error is not None and not _clear(fit_error, damaged, cache):
        outcome.problems.append(f"training fails without a clear message: {describe(fit_error)}")
    elif fit_error is None:
        clean_weights = ws.clean_fit_weights
        if not all(torch.equal(weights[k], clean_weights[k]) for k in clean_weights):
            outcome.problems.append("training on the damaged cache succeeds and gives other weights than "
                                    "the undamaged cache: it trained on wrong data silently")
    if not detected:
        if outcome.problems:
            outcome.problems.append("verify passes")
        else:
            outcome.notes.append("undetected, harmless: verify passes, rows and training are unchanged")
    return outcome


def _same_row(a, b) -> bool:
    fields = ("input_ids", "loss_mask", "features", "topk_ids", "topk_logprobs", "tail_mass")
    return a.source == b.source and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in fields)


def _clear(error: BaseException, damaged: str, cache: Path) -> bool:
    """A user error (ValueError) whose message names the damaged file or the cache."""
    return isinstance(error, ValueError) and _names(str(error), damaged, cache)
