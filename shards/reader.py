"""Reading a cache: `open_cache` parses manifest.json only; rows are read on demand.

The manifest lists every shard (path, checksum, size, row count) and every sequence's
length and source in shard order, so locating sequence i is a binary search over
cumulative row counts and reading it is one record-batch lookup in a memory-mapped file.
Opened shards stay mapped in a small LRU. `cache[i]` decodes to float32 and friends;
`cache.raw(i)` hands out read-only views of the mapped file for the features (no Arrow
allocation, no copy), undecoded, and the top-k decoded on the host (the packed codec is
unpacked here). Training reinterprets bf16 feature bits as bfloat16 without a decode and
dequantises fp8 codes with their scales to float32 on the host, while it lays out a batch
(train/data.py); neither decodes on the device.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dflash.common.files import SHARD_CHECKSUM_FIELDS, file_digest
from dflash.shards import codecs, rows
from dflash.shards.basis import FeatureBasis
from dflash.shards.layout import MANIFEST
from dflash.shards.spec import CacheSpec, check_format_version


@dataclass
class Sequence:
    """One decoded sequence. T tokens, L layers, hidden size H, top-k k."""

    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] bool
    features: np.ndarray  # [T, L, H] float32 (basis codecs: the coefficients, [T, 1, r])
    topk_ids: np.ndarray  # [T, k] int32 (packed codec: descending probability)
    topk_logprobs: np.ndarray  # [T, k] float32, full-vocabulary log-probs
    tail_mass: np.ndarray  # [T] float32, 1 - sum(exp(topk_logprobs))
    source: dict[str, Any]  # {"file": str, "index": int}


@dataclass
class RawSequence:
    """One sequence with its big columns as read-only views of the memory-mapped shard."""

    input_ids: np.ndarray  # [T] int32, view
    loss_mask: np.ndarray  # [T] bool, view
    features: np.ndarray  # [T, L, H] view (basis codecs: [T, 1, r]): uint16 bf16 bits, or uint8 e4m3 codes
    feature_scales: np.ndarray | None  # [T, L] (basis-fp8: [T, 1]) float32 view: value = e4m3 * scale; else None
    feature_codec: str  # spec.feature_codec
    topk_ids: np.ndarray | None  # [T, k] int32, decoded (None: raw(i, decode_topk=False) of a packed row)
    topk_logprobs: np.ndarray | None  # [T, k] float32, decoded (None as topk_ids)
    tail_mass: np.ndarray | None  # [T] float32, decoded (None as topk_ids)
    source: dict[str, Any]
    topk_packed: np.ndarray | None = None  # [T, bytes] uint8 view of the packed codec's rows; else None


def _inside(root: Path, relative: Any, field: str) -> Path:
    """Join a manifest path to the cache directory, refusing one that leaves it.

    The check is lexical (no system call, so opening a cache of many shards stays fast);
    symbolic links are checked when a path is opened (`_check_resolved`).
    """
    if not isinstance(relative, str) or not relative or os.path.isabs(relative):
        raise ValueError(
            f"{root / MANIFEST}: {field} must be a relative path inside the cache, got {relative!r}; "
            "the manifest is damaged or not from dflash"
        )
    normal = os.path.normpath(relative)
    if normal == os.pardir or normal.startswith(os.pardir + os.sep):
        raise ValueError(
            f"{root / MANIFEST}: {field} {relative!r} points outside the cache directory; "
            "refusing to read it (the manifest is damaged or not from dflash)"
        )
    return root / normal


def _check_resolved(root: Path, path: Path) -> None:
    """Refuse a path that a symbolic link takes outside the cache directory."""
    if not path.resolve().is_relative_to(root.resolve()):
        raise ValueError(
            f"{path} resolves to {path.resolve()}, outside the cache directory {root}; "
            "refusing to read it"
        )


class Cache:
    """A finalized cache. Index with cache[i] (decoded) or cache.raw(i) (zero-copy).

    Not thread-safe (its shard LRU is shared state): use one Cache per thread. Forked
    processes may inherit one; the mappings are read-only.
    """

    def __init__(self, path: str | Path, *, check_rows: bool = True, check_once: bool = False,
                 max_open_shards: int = 64):
        self.path = Path(path)  # the cache directory, as given (not resolved)
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            raise ValueError(
                f"{manifest_path} does not exist: not a dflash cache, or its producer did not "
                "finish (rerun dflash-precompute to complete it)"
            )
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(
                f"{manifest_path} is not valid JSON ({error}); rebuild the cache (re-run "
                f"dflash-precompute into it) or restore {MANIFEST} from a copy"
            ) from error
        if not isinstance(manifest, dict) or manifest.get("format") != "dflash-cache":
            raise ValueError(f"{manifest_path} is not a dflash cache manifest")
        check_format_version(manifest.get("format_version"), str(manifest_path))
        self.manifest = manifest
        check = _ManifestFields(manifest_path)
        spec = check.field(manifest, "spec", dict)
        try:
            self.spec = CacheSpec.from_dict(spec)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{manifest_path}: field spec is not a valid cache spec ({error}); the manifest is "
                f"damaged or from another dflash: {check.remedy}"
            ) from error
        self.shards = check.field(manifest, "shards", list)
        for i, entry in enumerate(self.shards):
            if not isinstance(entry, dict):
                raise ValueError(f"{manifest_path}: field shards[{i}] must be an object; the manifest "
                                 f"is damaged: {check.remedy}")
            for key, kind in _SHARD_FIELDS.items():
                check.field(entry, key, kind, f"shards[{i}].{key}")
            shard_checksum(entry, check, i)
        self.shard_paths = [_inside(self.path, s["path"], f"shards[{i}].path") for i, s in enumerate(self.shards)]
        self.target_dir = _inside(self.path, check.field(manifest, "target_dir", str), "target_dir")
        self.rejected_path = _inside(self.path, check.field(manifest, "rejected", str), "rejected")
        _check_resolved(self.path, self.target_dir)
        _check_resolved(self.path, self.rejected_path)
        seqs = check.field(manifest, "sequences", dict)
        self._source_files = check.field(manifest, "source_files", list)
        columns = {key: check.int_list(seqs, key, f"sequences.{key}") for key in _SEQUENCE_FIELDS}
        self.lengths = columns["length"]  # [N] int64
        self.num_loss_tokens = columns["num_loss_tokens"]  # [N] int64
        self._source_file = columns["source_file"]  # [N] int64, into source_files
        self._source_index = columns["source_index"]  # [N] int64
        if len({len(c) for c in columns.values()}) != 1:
            raise ValueError(
                f"{manifest_path}: the sequences columns have different lengths "
                f"({ {k: len(c) for k, c in columns.items()} }); the manifest is damaged: {check.remedy}"
            )
        if len(self._source_file) and not 0 <= self._source_file.min() <= self._source_file.max() < len(
                self._source_files):
            raise ValueError(
                f"{manifest_path}: field sequences.source_file points outside source_files; the "
                f"manifest is damaged: {check.remedy}"
            )
        counts = np.asarray([s["num_sequences"] for s in self.shards], dtype=np.int64)
        self._shard_starts = np.concatenate([[0], np.cumsum(counts)])  # [S + 1]
        if self._shard_starts[-1] != len(self.lengths):
            raise ValueError(
                f"{manifest_path}: shards hold {self._shard_starts[-1]} sequences but "
                f"{len(self.lengths)} are listed; the manifest is damaged"
            )
        self.feature_basis_entry: dict[str, Any] | None = None
        if self.spec.is_basis:
            entry = check.field(manifest, "feature_basis", dict)
            check.field(entry, "sha256", str, "feature_basis.sha256")
            self.feature_basis_path = _inside(self.path, check.field(entry, "path", str, "feature_basis.path"),
                                              "feature_basis.path")
            self.feature_basis_entry = entry
        self.check_rows = check_rows
        # check_once: a row whose crc32 passed is not checked again by this Cache (a trainer
        # reads every row once an epoch; the mapping is read-only and shards are never
        # rewritten in place). [N] bool, one byte per sequence.
        self._checked = np.zeros(len(self.lengths), dtype=bool) if check_rows and check_once else None
        self._max_open = max_open_shards
        self._open: OrderedDict[int, pa.ipc.RecordBatchFileReader] = OrderedDict()

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def source(self, i: int) -> dict[str, Any]:
        i = self._index(i)
        return {"file": self._source_files[self._source_file[i]], "index": int(self._source_index[i])}

    @property
    def feature_basis_sha256(self) -> str | None:
        """sha256 of the basis this cache's coefficients are in; None for raw-feature caches."""
        return None if self.feature_basis_entry is None else self.feature_basis_entry["sha256"]

    def load_feature_basis(self) -> FeatureBasis:
        """The cache's basis (P, D), its file checked against the manifest's sha256."""
        if self.feature_basis_entry is None:
            raise ValueError(f"{self.path} stores raw features ({self.spec.feature_codec}); it has no basis")
        _check_resolved(self.path, self.feature_basis_path)
        return FeatureBasis.load(self.feature_basis_path, self.feature_basis_entry["sha256"])

    def locate(self, i: int) -> tuple[Path, int]:
        """(shard path, row within the shard) of sequence i."""
        _, shard, row = self._shard_row(i)
        return self.shard_paths[shard], row

    def __getitem__(self, i: int) -> Sequence:
        raw = self.raw(i)
        if raw.feature_codec in ("bf16", "basis-bf16"):
            features = codecs.bf16_to_f32(raw.features)
        else:
            features = codecs.fp8_to_f32(raw.features, raw.feature_scales)
        return Sequence(
            input_ids=raw.input_ids.copy(),
            loss_mask=raw.loss_mask.copy(),
            features=features,
            topk_ids=raw.topk_ids,
            topk_logprobs=raw.topk_logprobs,
            tail_mass=raw.tail_mass,
            source=raw.source,
        )

    def raw(self, i: int, *, decode_topk: bool = True) -> RawSequence:
        """Sequence i with its big columns as views of the mapping (checked when check_rows).

        decode_topk=False leaves a packed top-k undecoded (`topk_packed`; the decoded fields
        None), for a reader that needs a few positions of it: decoding is per position, so
        `codecs.decode_topk_packed(raw.topk_packed[positions], ...)` equals the full decode
        at those positions.
        """
        i, shard, row = self._shard_row(i)
        path = self.shard_paths[shard]
        spec = self.spec
        try:
            batch = self._reader(shard).get_batch(row)
            check = self.check_rows and not (self._checked is not None and self._checked[i])
            columns = rows.read_row(batch, spec, check=check)
        except (pa.ArrowException, ValueError, OSError) as error:
            raise ValueError(
                f"{path}: cannot read row {row} (sequence {i}): {error}; the shard is damaged, "
                "run `dflash-shards verify` on the cache and re-run dflash-precompute for it"
            ) from error
        if columns.num_tokens != self.lengths[i] or columns.source != self.source(i):
            raise ValueError(
                f"{path}: row {row} holds {columns.source} with {columns.num_tokens} tokens, the "
                f"manifest lists {self.source(i)} with {self.lengths[i]}; the cache is inconsistent"
            )
        if check and self._checked is not None:
            self._checked[i] = True
        num_tokens, k = columns.num_tokens, spec.top_k
        values = columns.values
        topk_packed = None
        if spec.topk_codec == "packed" and not decode_topk:
            topk_packed = values["topk"].reshape(num_tokens, -1)
            topk_ids = topk_logprobs = tail_mass = None
        elif spec.topk_codec == "packed":
            topk = values["topk"].reshape(num_tokens, -1)
            topk_ids, topk_logprobs, tail_mass = codecs.decode_topk_packed(topk, k, spec.vocab_size)
        else:
            topk_ids = values["topk_ids"].reshape(num_tokens, k)
            topk_logprobs = values["topk_logprobs"].reshape(num_tokens, k)
            tail_mass = values["tail_mass"]
        scales = values.get("feature_scales")
        return RawSequence(
            input_ids=values["input_ids"],
            loss_mask=values["loss_mask"].view(np.bool_),
            features=values["features"].reshape(num_tokens, *spec.feature_shape),
            feature_scales=None if scales is None else scales.reshape(num_tokens, spec.feature_shape[0]),
            feature_codec=spec.feature_codec,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            tail_mass=tail_mass,
            source=columns.source,
            topk_packed=topk_packed,
        )

    def loss_mask(self, i: int) -> np.ndarray:
        """[T] bool read-only view of sequence i's loss mask, and nothing else of the row.

        For scans over every sequence (counting a cache's trainable positions): it touches
        about one byte per token of the mapped shard where `raw(i)` touches every byte (the
        row checksum covers the whole row, and the packed top-k is decoded), which for a
        Qwen3-8B-sized cache is 20 to 40 KB per token. The mask is not checksummed here;
        reading the row with `raw(i)` later checks it.
        """
        return self._small_column(i, "loss_mask", "loss mask").view(np.bool_)

    def input_ids(self, i: int) -> np.ndarray:
        """[T] int32 read-only view of sequence i's token ids, and nothing else of the row
        (about 4 bytes per token: for scans such as counting a draft vocabulary; not
        checksummed here, as `loss_mask`)."""
        return self._small_column(i, "input_ids", "token ids")

    def _small_column(self, i: int, column: str, what: str) -> np.ndarray:
        i, shard, row = self._shard_row(i)
        path = self.shard_paths[shard]
        try:
            values = rows.list_values(self._reader(shard).get_batch(row).column(column))
        except (pa.ArrowException, KeyError, ValueError, OSError) as error:
            raise ValueError(
                f"{path}: cannot read the {what} of row {row} (sequence {i}): {error}; the shard is "
                "damaged, run `dflash-shards verify` on the cache and re-run dflash-precompute for it"
            ) from error
        if values.size != self.lengths[i]:
            raise ValueError(
                f"{path}: row {row} has {what} of {values.size} tokens, the manifest lists "
                f"{self.lengths[i]}; the cache is inconsistent"
            )
        return values

    def close(self) -> None:
        self._open.clear()

    # ------------------------------------------------------------------ internals

    def _index(self, i: int) -> int:
        n = len(self.lengths)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for a cache of {n}")
        return i + n if i < 0 else i

    def _shard_row(self, i: int) -> tuple[int, int, int]:
        """(non-negative sequence index, shard, row within the shard) of sequence i."""
        i = self._index(i)
        shard = int(np.searchsorted(self._shard_starts, i, side="right")) - 1
        return i, shard, int(i - self._shard_starts[shard])

    def _reader(self, shard: int) -> pa.ipc.RecordBatchFileReader:
        reader = self._open.get(shard)
        if reader is not None:
            self._open.move_to_end(shard)
            return reader
        reader = open_shard(self.path, self.shard_paths[shard], self.shards[shard], self.spec)
        self._open[shard] = reader
        if len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return reader


# Fields a reader relies on, with their JSON types (bool is excluded from int below).
_SHARD_FIELDS = {"path": str, "rows_sha256": str, "num_bytes": int, "num_sequences": int}


def shard_checksum(entry: dict[str, Any], check: _ManifestFields | None = None, index: int = 0) -> tuple[str, str]:
    """(algorithm, hex digest) of a manifest shard entry: its sha256 or xxh3_128 field."""
    for algorithm, key in SHARD_CHECKSUM_FIELDS.items():
        if key in entry:
            if check is not None:
                check.field(entry, key, str, f"shards[{index}].{key}")
            return algorithm, entry[key]
    if check is not None:
        check.field(entry, "sha256", str, f"shards[{index}].sha256")  # names the missing field
    raise ValueError(f"shard entry {entry.get('path')!r} has no checksum field")
_SEQUENCE_FIELDS = ("length", "num_loss_tokens", "source_file", "source_index")


class _ManifestFields:
    """Reads manifest fields, turning a missing or mistyped one into a ValueError that names
    manifest.json and the field (a damaged manifest must not surface as KeyError/TypeError)."""

    def __init__(self, path: Path):
        self.path = path
        self.remedy = (f"rebuild the cache (re-run dflash-precompute into it) or restore {path.name} "
                       "from a copy")

    def field(self, holder: dict, key: str, kind: type, name: str | None = None) -> Any:
        name = name or key
        if key not in holder:
            raise ValueError(f"{self.path}: field {name} is missing; the manifest is damaged: {self.remedy}")
        value = holder[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(
                f"{self.path}: field {name} must be a {kind.__name__}, got {type(value).__name__}; the "
                f"manifest is damaged: {self.remedy}"
            )
        return value

    def int_list(self, holder: dict, key: str, name: str) -> np.ndarray:
        values = self.field(holder, key, list, name)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(
                f"{self.path}: field {name} must hold integers only; the manifest is damaged: {self.remedy}"
            )
        return np.asarray(values, dtype=np.int64).reshape(-1)  # [N]


def open_shard(root: Path, path: Path, entry: dict[str, Any], spec: CacheSpec) -> pa.ipc.RecordBatchFileReader:
    """Map one shard and check it against its manifest entry (size, version, schema, row count,
    and rows_sha256: the rows' sources, lengths and crc32 are the ones this cache recorded)."""
    if not path.exists():
        raise ValueError(f"{path} is missing; the cache is incomplete (re-run dflash-precompute)")
    _check_resolved(root, path)
    size = path.stat().st_size
    if size != entry["num_bytes"]:
        raise ValueError(
            f"{path} is {size} bytes, the manifest records {entry['num_bytes']}: the shard is "
            "truncated or was replaced; re-run dflash-precompute to rewrite it"
        )
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    except (pa.ArrowException, OSError) as error:
        # pyarrow reports a damaged footer as a plain OSError ("Verification of
        # flatbuffer-encoded Footer failed"), not an ArrowException: both mean a broken shard.
        raise ValueError(
            f"{path} is not a readable Arrow file ({error}): the shard is damaged; run "
            "`dflash-shards verify` on the cache and re-run dflash-precompute to rebuild it"
        ) from error
    metadata = reader.schema.metadata or {}
    version = metadata.get(rows.VERSION_KEY)
    check_format_version(int(version) if version is not None and version.isdigit() else version, str(path))
    expected = rows.shard_schema(spec)
    if not reader.schema.equals(expected, check_metadata=True):
        raise ValueError(
            f"{path}: schema does not match the manifest's spec (got {reader.schema}); the "
            "shard belongs to another cache or is damaged"
        )
    if reader.num_record_batches != entry["num_sequences"]:
        raise ValueError(
            f"{path} holds {reader.num_record_batches} rows, the manifest records "
            f"{entry['num_sequences']}"
        )
    # Ties the shard to this cache without hashing the file: a shard from another cache of the
    # same spec has the same size and schema, and rows whose own crc32 are valid.
    try:
        rows_sha256 = rows.shard_rows_sha256_of(reader, spec, entry["path"])
    except (pa.ArrowException, OSError, ValueError, IndexError) as error:
        raise ValueError(
            f"{path}: cannot read its rows' sources and checksums ({error}): the shard is damaged; run "
            "`dflash-shards verify` on the cache and re-run dflash-precompute to rebuild it"
        ) from error
    if rows_sha256 != entry["rows_sha256"]:
        raise ValueError(
            f"{path}: its rows (sources, lengths, crc32) do not match the manifest's rows_sha256: the "
            "shard belongs to another cache (e.g. a run of the same configuration with another seed) "
            "or was replaced; run `dflash-shards verify` and re-run dflash-precompute to rewrite it"
        )
    return reader


def open_cache(path: str | Path, *, check_rows: bool = True, check_once: bool = False) -> Cache:
    """Open a finalized cache; only manifest.json is read until a row is asked for.

    check_rows verifies each row's crc32 as it is read (ISA-L's: ~27 GB/s of stored bytes on
    one core; zlib's 2 to 4 where the isal package is missing: `rows.row_checksum`);
    check_once only the first time this Cache reads the row.
    """
    return Cache(path, check_rows=check_rows, check_once=check_once)


def verify_cache(path: str | Path) -> dict[str, Any]:
    """Recompute every shard's checksum (sha256 or xxh3-128), check its schema and decode every row.

    Returns {"ok": bool, "problems": [{"shard": path or None, "problem": str}],
    "num_shards": int, "num_sequences": int}.
    """
    problems: list[dict[str, Any]] = []
    try:
        cache = Cache(path)
    except ValueError as error:  # a damaged manifest too: Cache names manifest.json and the field
        return {"ok": False, "problems": [{"shard": None, "problem": str(error)}], "num_shards": 0,
                "num_sequences": 0}
    for shard, (shard_path, entry) in enumerate(zip(cache.shard_paths, cache.shards)):
        name = entry["path"]
        if not shard_path.exists():
            problem = f"file is missing (listed in {MANIFEST} shards[{shard}].path)"
            problems.append({"shard": name, "problem": problem})
            continue
        algorithm, recorded = shard_checksum(entry)
        digest = file_digest(shard_path, algorithm)
        if digest != recorded:
            problems.append(
                {"shard": name, "problem": f"{algorithm} {digest} does not match the manifest's {recorded}"}
            )
        try:
            cache._reader(shard)
        except ValueError as error:
            problems.append({"shard": name, "problem": str(error)})
            continue
        for i in range(int(cache._shard_starts[shard]), int(cache._shard_starts[shard + 1])):
            try:
                seq = cache[i]
                _check_decoded(seq, cache.spec)
            except ValueError as error:
                problems.append({"shard": name, "problem": str(error)})
        cache._open.pop(shard, None)
    if cache.spec.is_basis:
        try:
            basis = cache.load_feature_basis()
            if (basis.input_width, basis.rank) != (cache.spec.num_layers * cache.spec.hidden_size,
                                                   cache.spec.feature_rank):
                raise ValueError(f"{cache.feature_basis_path} maps {basis.input_width} -> {basis.rank} "
                                 f"values; the spec needs rank {cache.spec.feature_rank}")
        except ValueError as error:
            problems.append({"shard": None, "problem": str(error)})
    if not cache.rejected_path.exists():
        problems.append({"shard": None, "problem": f"{cache.rejected_path} is missing"})
    return {
        "ok": not problems,
        "problems": problems,
        "num_shards": len(cache.shards),
        "num_sequences": len(cache),
    }


def _check_decoded(seq: Sequence, spec: CacheSpec) -> None:
    where = f"sequence {seq.source}"
    if seq.input_ids.min() < 0 or seq.input_ids.max() >= spec.vocab_size:
        raise ValueError(f"{where}: input_ids outside [0, {spec.vocab_size})")
    if seq.topk_ids.min() < 0 or seq.topk_ids.max() >= spec.vocab_size:
        raise ValueError(f"{where}: topk_ids outside [0, {spec.vocab_size})")
    for name in ("features", "topk_logprobs", "tail_mass"):
        if not np.isfinite(getattr(seq, name)).all():
            raise ValueError(f"{where}: {name} holds inf or NaN")
