"""One sequence <-> one Arrow record batch of one row: the shard schema and its codecs.

Every per-token column is a `large_list` of a fixed-width primitive, flat in row-major
order, so a row's values are one contiguous, aligned slice of the memory-mapped file that
numpy views without a copy. One row per record batch makes a random row read one footer
lookup. A crc32 of the row's value bytes travels in the row, so a reader catches flipped
bytes in exactly what it reads: ISA-L's crc32 (the `isal` package) checks about 27 GB a
second of one core, zlib's, the fallback where isal is missing, 2 to 4 (`row_checksum`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dflash.shards import codecs
from dflash.shards.spec import CacheSpec

VERSION_KEY = b"dflash.format_version"
SPEC_KEY = b"dflash.spec"

# Per-token list columns, in the order their bytes enter the row checksum.
_FEATURE_VALUE_TYPES = {"bf16": pa.uint16(), "fp8": pa.uint8(), "basis-bf16": pa.uint16(), "basis-fp8": pa.uint8()}


def list_columns(spec: CacheSpec) -> list[tuple[str, pa.DataType]]:
    """(name, value type) of the per-token columns this spec stores, in schema order."""
    columns = [
        ("input_ids", pa.int32()),
        ("loss_mask", pa.uint8()),
        ("features", _FEATURE_VALUE_TYPES[spec.feature_codec]),
    ]
    if spec.feature_codec in ("fp8", "basis-fp8"):
        columns.append(("feature_scales", pa.float32()))
    if spec.topk_codec == "packed":
        columns.append(("topk", pa.uint8()))
    else:
        columns += [
            ("topk_ids", pa.int32()),
            ("topk_logprobs", pa.float32()),
            ("tail_mass", pa.float32()),
        ]
    return columns


def values_per_token(spec: CacheSpec) -> dict[str, int]:
    """Number of list values each per-token column holds per token."""
    k = spec.top_k
    return {
        "input_ids": 1,
        "loss_mask": 1,
        "features": spec.feature_width,
        "feature_scales": spec.feature_shape[0],
        "topk": codecs.packed_bytes_per_token(k, spec.vocab_size),
        "topk_ids": k,
        "topk_logprobs": k,
        "tail_mass": 1,
    }


def bytes_per_token(spec: CacheSpec) -> dict[str, int]:
    """Stored bytes per token of each per-token column."""
    counts = values_per_token(spec)
    return {name: counts[name] * dtype.bit_width // 8 for name, dtype in list_columns(spec)}


def shard_schema(spec: CacheSpec) -> pa.Schema:
    fields = [
        pa.field("source_file", pa.string(), nullable=False),
        pa.field("source_index", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
    ]
    fields += [pa.field(name, pa.large_list(dtype), nullable=False) for name, dtype in list_columns(spec)]
    fields.append(pa.field("checksum", pa.uint32(), nullable=False))
    identity = json.dumps(spec.identity(), sort_keys=True, separators=(",", ":"))
    return pa.schema(fields, metadata={VERSION_KEY: str(spec.format_version).encode(), SPEC_KEY: identity.encode()})


# pa.array() and Array.to_numpy() import pandas on first use (0.15 s per process); building
# arrays from buffers and viewing buffers with numpy avoids that, and never copies.
def _buffer(array: np.ndarray) -> pa.Buffer:
    return pa.py_buffer(np.ascontiguousarray(array))


def _array(values: np.ndarray, dtype: pa.DataType) -> pa.Array:
    return pa.Array.from_buffers(dtype, values.size, [None, _buffer(values)])


# Value types of the list columns, as numpy dtypes (`DataType.to_pandas_dtype()` needs pandas
# in some pyarrow releases).
_NUMPY_DTYPES = {pa.uint8(): np.dtype(np.uint8), pa.uint16(): np.dtype(np.uint16),
                 pa.int32(): np.dtype(np.int32), pa.int64(): np.dtype(np.int64),
                 pa.float16(): np.dtype(np.float16), pa.float32(): np.dtype(np.float32)}


def list_values(column: pa.Array) -> np.ndarray:
    """Read-only numpy view of all values of a large_list column of primitives (no nulls).

    Reads the offsets and the child buffer directly: `ListArray.flatten()` would import
    pyarrow.compute (another 0.15 s per process) and build a new array.
    """
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int64, count=len(column) + 1,
                            offset=column.offset * 8)
    child = column.values
    dtype = _NUMPY_DTYPES[child.type]
    start = child.offset + int(offsets[0])
    return np.frombuffer(child.buffers()[1], dtype=dtype, count=int(offsets[-1] - offsets[0]),
                         offset=start * dtype.itemsize)


def shard_rows_sha256(spec: CacheSpec, path: str, files: list[str], indices: list[int],
                      lengths: list[int], checksums: list[int]) -> str:
    """sha256 tying a shard's rows to its cache and place: the spec identity, the shard's
    relative path, and every row's source, token count and crc32, in row order.

    Recorded per shard in the manifest; a reader recomputes it from the rows' small columns
    when it opens the shard (no pass over the row data), so a shard from another cache with
    the same spec (other values: other crc32s) is refused. Deterministic: a resumed run
    records the same value.
    """
    text = json.dumps([spec.identity_sha256(), path, files, [int(i) for i in indices],
                       [int(n) for n in lengths], [int(c) for c in checksums]], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def shard_rows_sha256_of(reader: pa.ipc.RecordBatchFileReader, spec: CacheSpec, path: str) -> str:
    """`shard_rows_sha256` of an opened shard, from each row's source, num_tokens and checksum."""
    files, indices, lengths, checksums = [], [], [], []
    for b in range(reader.num_record_batches):
        batch = reader.get_batch(b)  # one footer lookup; the list columns are not touched
        files.append(batch.column("source_file")[0].as_py())
        indices.append(batch.column("source_index")[0].as_py())
        lengths.append(batch.column("num_tokens")[0].as_py())
        checksums.append(batch.column("checksum")[0].as_py())
    return shard_rows_sha256(spec, path, files, indices, lengths, checksums)


def _crc32_function():
    """(crc32, its name): ISA-L's when the `isal` package imports (a dependency: carry-less
    multiplication, ~27 GB per CPU-second on a 2-core EPYC where zlib 1.2.13 does 2-4; the
    first read of a row in training is mostly this), zlib's otherwise (a machine where dflash
    runs uninstalled, such as the GPU check's). Both compute the same CRC-32 (the zlib / IEEE
    802.3 polynomial, start value 0, chaining through the second argument): the shard format
    does not depend on which."""
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        from zlib import crc32
        return crc32, "zlib"
    return crc32, "isal"


crc32, CRC32_IMPL = _crc32_function()


def row_checksum(values: list[np.ndarray]) -> int:
    """The row's crc32: over each list column's value bytes, in schema order, chained."""
    crc = 0
    for array in values:
        crc = crc32(memoryview(np.ascontiguousarray(array)).cast("B"), crc)
    return crc


class PartTimes:
    """Seconds per part of the host's work on rows: CPU seconds of the working thread
    (`time.thread_time`), wall seconds for the parts in `WALL_PARTS` (which wait rather than
    compute). A part timed inside another is not counted in the outer one. One thread at a
    time: the writer's worker, or the caller when there is none."""

    WALL_PARTS = ("fsync", "copy_wait")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        clock = time.perf_counter if name in self.WALL_PARTS else time.thread_time
        began = clock()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = clock() - began
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - self._inner.pop()
            if self._inner:
                self._inner[-1] += elapsed


def encode_row(
    spec: CacheSpec,
    *,
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    features: np.ndarray,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    tail_mass: np.ndarray,
    source: dict[str, Any],
    basis: Any = None,
    feature_scales: np.ndarray | None = None,
    encoded: bool = False,
    times: PartTimes | None = None,
) -> pa.RecordBatch:
    """Encode one validated sequence (see CacheWriter.add for shapes) as a one-row batch.

    Basis codecs project the raw features with `basis` (a FeatureBasis) first. With
    `encoded=True` the features (and fp8's feature_scales) are already the stored values
    (encoded on the target's device, bit for bit what this function would make). `times`
    gathers the CPU time of the parts: host_encode, topk, crc32 (the row checksum), rows (the rest).
    """
    times = times if times is not None else PartTimes()
    with times.part("rows"):
        return _encode_row(spec, input_ids=input_ids, loss_mask=loss_mask, features=features, topk_ids=topk_ids,
                           topk_logprobs=topk_logprobs, tail_mass=tail_mass, source=source, basis=basis,
                           feature_scales=feature_scales, encoded=encoded, times=times)


def _encode_row(spec: CacheSpec, *, input_ids: np.ndarray, loss_mask: np.ndarray, features: np.ndarray,
                topk_ids: np.ndarray, topk_logprobs: np.ndarray, tail_mass: np.ndarray, source: dict[str, Any],
                basis: Any, feature_scales: np.ndarray | None, encoded: bool, times: PartTimes) -> pa.RecordBatch:
    values: dict[str, np.ndarray] = {
        "input_ids": input_ids.astype(np.int32, copy=False),
        "loss_mask": loss_mask.astype(np.uint8, copy=False),
    }
    with times.part("host_encode"):
        values.update(_encoded_features(spec, features, feature_scales, encoded, basis))
    with times.part("topk"):
        if spec.topk_codec == "packed":
            values["topk"] = codecs.encode_topk_packed(topk_ids, topk_logprobs, tail_mass, spec.vocab_size)
        else:
            values["topk_ids"] = topk_ids.astype(np.int32, copy=False)
            values["topk_logprobs"] = topk_logprobs.astype(np.float32, copy=False)
            values["tail_mass"] = tail_mass.astype(np.float32, copy=False)

    schema = shard_schema(spec)
    ordered = [np.ascontiguousarray(values[name]).reshape(-1) for name, _ in list_columns(spec)]
    file_bytes = source["file"].encode()
    arrays = [
        pa.StringArray.from_buffers(1, _buffer(np.array([0, len(file_bytes)], np.int32)), pa.py_buffer(file_bytes)),
        _array(np.array([source["index"]], np.int64), pa.int64()),
        _array(np.array([len(input_ids)], np.int32), pa.int32()),
    ]
    for flat, (_, dtype) in zip(ordered, list_columns(spec)):
        offsets = _array(np.array([0, flat.size], np.int64), pa.int64())
        arrays.append(pa.LargeListArray.from_arrays(offsets, _array(flat, dtype)))
    with times.part("crc32"):
        checksum = row_checksum(ordered)
    arrays.append(_array(np.array([checksum], np.uint32), pa.uint32()))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _encoded_features(spec: CacheSpec, features: np.ndarray, feature_scales: np.ndarray | None, encoded: bool,
                      basis: Any) -> dict[str, np.ndarray]:
    """The stored feature columns ("features", and "feature_scales" for the fp8 codecs)."""
    if encoded:
        stored = {"features": features.view(np.uint16) if features.dtype == np.int16 else features}
        if feature_scales is not None:
            stored["feature_scales"] = feature_scales
        return stored
    if features.dtype == np.uint16:
        features_f32 = None
        bf16 = features
    else:
        features_f32 = np.asarray(features, dtype=np.float32)
        bf16 = None
    if spec.is_basis:
        if features_f32 is None:
            features_f32 = codecs.bf16_to_f32(bf16)
        coefficients = basis.encode(features_f32)  # [T, r] float32
        if spec.feature_codec == "basis-bf16":
            return {"features": codecs.f32_to_bf16(coefficients)}
        codes, scales = codecs.f32_to_fp8(coefficients)
        return {"features": codes, "feature_scales": scales}
    if spec.feature_codec == "bf16":
        return {"features": bf16 if bf16 is not None else codecs.f32_to_bf16(features_f32)}
    if features_f32 is None:
        features_f32 = codecs.bf16_to_f32(bf16)
    codes, scales = codecs.f32_to_fp8(features_f32)
    return {"features": codes, "feature_scales": scales}


@dataclass
class RowColumns:
    """The stored per-token columns of one row as read-only numpy views of the shard."""

    source: dict[str, Any]
    num_tokens: int
    values: dict[str, np.ndarray]  # name -> flat view, e.g. features [T * L * H]


def read_row(batch: pa.RecordBatch, spec: CacheSpec, *, check: bool) -> RowColumns:
    """Views of a one-row batch's columns (no copy); raises ValueError on a checksum mismatch
    or on a column whose length does not fit the row's token count."""
    if batch.num_rows != 1:
        raise ValueError(f"record batch holds {batch.num_rows} rows, the format has one per batch")
    num_tokens = batch.column("num_tokens")[0].as_py()
    counts = values_per_token(spec)
    values = {}
    for name, _ in list_columns(spec):
        flat = list_values(batch.column(name))
        if flat.size != num_tokens * counts[name]:
            raise ValueError(
                f"column {name} holds {flat.size} values, expected {num_tokens} tokens x "
                f"{counts[name]}"
            )
        values[name] = flat
    if check:
        stored = batch.column("checksum")[0].as_py()
        actual = row_checksum(list(values.values()))
        if stored != actual:
            raise ValueError(f"row checksum mismatch (stored crc32 {stored:08x}, data {actual:08x})")
    source = {
        "file": batch.column("source_file")[0].as_py(),
        "index": batch.column("source_index")[0].as_py(),
    }
    return RowColumns(source=source, num_tokens=num_tokens, values=values)
