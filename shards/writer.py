"""Writing a cache: one `CacheWriter` per rank, then `finalize_cache` on rank 0.

Every file reaches its final name complete or not at all: a shard is written as
`*.arrow.tmp`, fsynced, renamed and the directory fsynced; only then is its record
(`*.json`, same atomic dance) written, and a shard without a record does not exist. A killed
writer therefore leaves only temporaries and unrecorded files, which the next writer of that
rank deletes before it continues. Shard boundaries depend on the row stream alone (rows and
encoded bytes per shard), so a resumed run writes byte-identical shards.

Writes happen in the caller's thread unless `background=True`, in which case validation,
encoding, checksums and disk I/O run in one worker thread, and the worker's exception is
raised in the caller at its next `add`, `reject` or `close`. The rows waiting for the worker
hold at most `queue_tokens` tokens (one row more when a single row is larger): `add`
blocks beyond that, and `wait_s` counts how long the caller waited on the worker. Rows are
written in the order they were added, so the shards are the same bytes either way. A row
may come with `ready`, a callable the worker calls before it reads the row's arrays (the
end of their copy from a device): the caller hands over rows whose bytes are still in
flight. `times` holds the seconds of each part of the work (`rows.PartTimes`).

Each shard's checksum (`shard_checksum`: sha256, or xxh3-128, which makes the manifest
version 3) is computed as its bytes are written (`_HashingFile`), not by reading the file back.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dflash.common.files import (
    SHARD_CHECKSUM_FIELDS,
    file_sha256,
    fsync_dir,
    new_digest,
    write_atomic,
    write_json_atomic,
)
from dflash.shards import rows
from dflash.shards.basis import FeatureBasis
from dflash.shards.layout import (
    BASIS_FILE,
    MANIFEST,
    REJECTED,
    SHARDS_DIR,
    TARGET_DIR,
    done_name,
    record_name,
    shard_name,
    spec_name,
)
from dflash.shards.reader import Cache, open_cache
from dflash.shards.rows import PartTimes
from dflash.shards.spec import XXH3_MANIFEST_VERSION, CacheSpec

# Log-probs may exceed 0 and the top-k mass 1 by float rounding of the producer's softmax.
_LOGPROB_SLACK = 1e-3


def _read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def _check_source(source: Any) -> tuple[str, int]:
    if (
        not isinstance(source, dict)
        or not isinstance(source.get("file"), str)
        or isinstance(source.get("index"), bool)
        or not isinstance(source.get("index"), (int, np.integer))
    ):
        raise ValueError(f'source must be {{"file": str, "index": int}}, got {source!r}')
    return source["file"], int(source["index"])


def validate_row(
    spec: CacheSpec,
    source: dict[str, Any],
    *,
    input_ids: Any,
    loss_mask: Any,
    features: Any,
    topk_ids: Any,
    topk_logprobs: Any,
    tail_mass: Any = None,
    feature_scales: Any = None,
    encoded: bool = False,
) -> dict[str, np.ndarray]:
    """Check one row against the spec; return it as numpy arrays (tail_mass filled in).

    With `encoded=True` the features are the stored values already (`CacheWriter.add`):
    their shape and dtype are checked, and fp8's scales, but not the values, whose
    finiteness the producer checked before encoding. Raises ValueError naming the source
    record and what is wrong.
    """
    where = f"row from {source['file']} record {source['index']}"
    input_ids, loss_mask = np.asarray(input_ids), np.asarray(loss_mask)
    features, topk_ids, topk_logprobs = np.asarray(features), np.asarray(topk_ids), np.asarray(topk_logprobs)
    _check_shapes_and_ids(spec, where, input_ids, loss_mask, features, topk_ids, topk_logprobs)
    if loss_mask.dtype != np.bool_:
        if not np.issubdtype(loss_mask.dtype, np.integer) or not np.isin(loss_mask, (0, 1)).all():
            _fail(where, f"loss_mask must be bool (or 0/1 integers), got dtype {loss_mask.dtype}")
        loss_mask = loss_mask.astype(bool)
    if encoded:
        feature_scales = _checked_encoded(spec, where, features, feature_scales)
    elif feature_scales is not None:
        _fail(where, "feature_scales come with encoded features only (encoded=True)")
    else:
        features = _checked_features(spec, where, features)
    mass = _topk_mass(spec, where, topk_ids, topk_logprobs)
    if tail_mass is None:
        tail_mass = np.maximum(0.0, 1.0 - mass).astype(np.float32)
    else:
        tail_mass = np.asarray(tail_mass, dtype=np.float32)
        if tail_mass.shape != (input_ids.size,):
            _fail(where, f"tail_mass has shape {tail_mass.shape}, expected ({input_ids.size},)")
        if not (np.isfinite(tail_mass).all() and tail_mass.min() >= 0 and tail_mass.max() <= 1):
            _fail(where, "tail_mass must be finite and in [0, 1]")
    row = {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "features": features,
        "topk_ids": topk_ids,
        "topk_logprobs": topk_logprobs,
        "tail_mass": tail_mass,
    }
    if encoded:
        row.update(encoded=True, feature_scales=feature_scales)
    return row


def _fail(where: str, message: str) -> None:
    raise ValueError(f"{where}: {message}")


def _check_shapes_and_ids(spec: CacheSpec, where: str, input_ids: np.ndarray, loss_mask: np.ndarray,
                          features: np.ndarray, topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> None:
    """Every array's shape against input_ids' [T] and the spec; ids are integers in the vocabulary."""
    if input_ids.ndim != 1 or input_ids.size == 0:
        _fail(where, f"input_ids must be a non-empty [T] array, got shape {input_ids.shape}")
    num_tokens = input_ids.size
    if num_tokens > spec.max_length:
        _fail(where, f"{num_tokens} tokens exceed max_length {spec.max_length}")
    shape_t_k = (num_tokens, spec.top_k)
    expected = {
        "loss_mask": (loss_mask, (num_tokens,)),
        "features": (features, (num_tokens, spec.num_layers, spec.hidden_size)),
        "topk_ids": (topk_ids, shape_t_k),
        "topk_logprobs": (topk_logprobs, shape_t_k),
    }
    for name, (array, shape) in expected.items():
        if array.shape != shape:
            _fail(where, f"{name} has shape {array.shape}, expected {shape} ([T={num_tokens}] from input_ids)")
    for name, array in (("input_ids", input_ids), ("topk_ids", topk_ids)):
        if not np.issubdtype(array.dtype, np.integer):
            _fail(where, f"{name} must hold integers, got dtype {array.dtype}")
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= spec.vocab_size:
            _fail(where, f"{name} has values in [{low}, {high}], outside [0, vocab_size={spec.vocab_size})")


def _checked_features(spec: CacheSpec, where: str, features: np.ndarray) -> np.ndarray:
    """Features finite (and within bf16's range for the bf16 codec); floats as float32."""
    if features.dtype == np.uint16:
        # bf16 bit patterns: exponent all ones (magnitude bits >= 0x7F80) is inf or NaN.
        if (features & np.uint16(0x7FFF)).max() >= 0x7F80:
            _fail(where, "features (bf16 bits) hold inf or NaN")
    elif np.issubdtype(features.dtype, np.floating):
        features = features.astype(np.float32, copy=False)
        # Two reductions and no temporary: max and min propagate NaN and reach any inf.
        high, low = float(features.max()), float(features.min())
        if not (np.isfinite(high) and np.isfinite(low)):
            _fail(where, "features hold inf or NaN")
        if spec.feature_codec == "bf16" and max(high, -low) >= 3.3895e38:
            _fail(where, "features exceed the bf16 range (they would round to inf)")
    else:
        _fail(where, f"features must be float or uint16 bf16 bits, got dtype {features.dtype}")
    return features


# The stored dtype of encoded features per codec (bf16 bits may come as int16: torch has no uint16 numpy).
_ENCODED_DTYPES = {"bf16": (np.uint16, np.int16), "fp8": (np.uint8,)}


def _checked_encoded(spec: CacheSpec, where: str, features: np.ndarray, feature_scales: Any) -> np.ndarray | None:
    """Encoded features' dtype, and fp8's scales: [T, L] float32, finite and positive."""
    if spec.feature_codec not in _ENCODED_DTYPES:
        _fail(where, f"feature_codec {spec.feature_codec!r} takes raw features, not encoded ones")
    if features.dtype not in _ENCODED_DTYPES[spec.feature_codec]:
        _fail(where, f"encoded {spec.feature_codec} features must have dtype "
                     f"{' or '.join(np.dtype(d).name for d in _ENCODED_DTYPES[spec.feature_codec])}, "
                     f"got {features.dtype}")
    if spec.feature_codec != "fp8":
        if feature_scales is not None:
            _fail(where, f"feature_codec {spec.feature_codec!r} has no feature_scales")
        return None
    scales = np.asarray(feature_scales)
    if scales.shape != features.shape[:2] or scales.dtype != np.float32:
        _fail(where, f"feature_scales must be [T, L] = {features.shape[:2]} float32, got {scales.shape} {scales.dtype}")
    if not (np.isfinite(scales).all() and scales.min() > 0):
        _fail(where, "feature_scales must be finite and positive")
    return scales


def _topk_mass(spec: CacheSpec, where: str, topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> np.ndarray:
    """[T] float64 probability mass of each position's top-k, after checking that the top-k are
    finite, normalised log-probabilities of distinct ids."""
    if not np.issubdtype(topk_logprobs.dtype, np.floating):
        _fail(where, f"topk_logprobs must be float, got dtype {topk_logprobs.dtype}")
    if not np.isfinite(topk_logprobs).all():
        _fail(where, "topk_logprobs hold inf or NaN")
    if topk_logprobs.max() > _LOGPROB_SLACK:
        _fail(where, f"topk_logprobs must be log-probabilities (<= 0), max is {topk_logprobs.max()}")
    mass = np.exp(topk_logprobs.astype(np.float64)).sum(axis=1)
    if mass.max() > 1 + _LOGPROB_SLACK:
        position = int(mass.argmax())
        _fail(where, f"top-k probabilities sum to {mass.max():.6f} > 1 at position {position}: pass "
                     "full-vocabulary normalised log-probs")
    if mass.min() <= 0:
        _fail(where, f"top-k probabilities sum to 0 at position {int(mass.argmin())}: the top-k of a "
                     "normalised distribution holds at least 1/V")
    if spec.top_k > 1:
        sorted_ids = np.sort(topk_ids, axis=1)
        repeats = (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(axis=1)
        if repeats.any():
            _fail(where, f"topk_ids repeat an id at position {int(repeats.argmax())}")
    return mass


def _value_bytes(column: pa.Array) -> int:
    """Bytes of a column's values (list offsets excluded: they are per row, not per token)."""
    if pa.types.is_large_list(column.type):
        return rows.list_values(column).nbytes
    return column.nbytes


class CacheWriter:
    """Writes one rank's shards of a cache; resumes where an earlier writer of the rank stopped.

    `done_sources` lists the (file, index) of every record already in this rank's complete
    shards, rows and rejects alike: the producer skips those and feeds the rest in the same
    order as before, which reproduces the same shards.
    """

    def __init__(
        self,
        cache_dir: str | Path,
        spec: CacheSpec,
        rank: int = 0,
        world_size: int = 1,
        *,
        background: bool = False,
        queue_tokens: int = 1 << 16,
        basis: FeatureBasis | None = None,
        shard_checksum: str = "sha256",
    ):
        if basis is not None and not spec.is_basis:
            raise ValueError(f"feature_codec {spec.feature_codec!r} stores raw features: pass no basis")
        self.basis: FeatureBasis | None = None
        self._basis_sha256: str | None = None
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
        self.cache_dir = Path(cache_dir)
        self.spec = spec
        new_digest(shard_checksum)  # refuses an unknown algorithm (or a missing xxhash) now
        self.shard_checksum = shard_checksum
        self.rank = rank
        self.world_size = world_size
        self.shards_dir = self.cache_dir / SHARDS_DIR
        self.shards_dir.mkdir(parents=True, exist_ok=True)
        self._schema = rows.shard_schema(spec)
        self._check_layout()
        self._num_shards, self.done_sources, self._pending_rejects = self._recover()
        self._open_sources: set[tuple[str, int]] = set()
        self._sink: _HashingFile | None = None
        self._arrow: pa.ipc.RecordBatchFileWriter | None = None
        self._shard_rows: list[dict[str, Any]] = []
        self._shard_bytes = 0
        self._closed = False
        self._error: BaseException | None = None
        self.times = PartTimes()
        """Seconds per part of the writing work (validate, copy_wait, host_encode, topk, crc32,
        rows, write, shard_checksum, fsync), in the worker thread or the caller's."""
        self.wait_s = 0.0
        """Wall seconds the caller waited on the worker thread (a full queue, the drain at close)."""
        self._queue: collections.deque | None = None
        self._queue_tokens = queue_tokens
        self._pending_tokens = 0
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        if basis is not None:
            self.use_basis(basis)
        if background:
            self._queue = collections.deque()
            self._thread = threading.Thread(target=self._worker, name=f"CacheWriter-{rank}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ resume

    def _check_layout(self) -> None:
        """Refuse a different world size or spec than the one this directory was started with."""
        for path in sorted(self.shards_dir.glob("rank*.spec.json")):
            recorded = _read_json(path)
            if recorded["world_size"] != self.world_size:
                raise ValueError(
                    f"{path}: this cache was started with world_size {recorded['world_size']}, "
                    f"this run has {self.world_size}; resume with the same number of processes "
                    "or write to a new cache directory"
                )
        spec_path = self.shards_dir / spec_name(self.rank)
        if spec_path.exists():
            recorded = _read_json(spec_path)
            old = CacheSpec.from_dict(recorded["spec"])
            differ = old.identity_diff(self.spec)
            if differ:
                raise ValueError(
                    f"{spec_path}: this cache was started with a different configuration "
                    f"(fields {differ} differ); rerun with the original options or write to a "
                    "new cache directory"
                )
            self._basis_sha256 = recorded.get("feature_basis_sha256")
        self._write_spec_record()

    def _write_spec_record(self) -> None:
        record = {"format_version": self.spec.format_version, "world_size": self.world_size,
                  "spec": self.spec.to_dict()}
        if self._basis_sha256 is not None:
            record["feature_basis_sha256"] = self._basis_sha256
        write_json_atomic(self.shards_dir / spec_name(self.rank), record)

    def use_basis(self, basis: FeatureBasis) -> None:
        """Set the basis rows are encoded with (basis codecs; before the first `add`). A resumed
        rank must be given the basis its earlier rows were written with."""
        spec = self.spec
        if not spec.is_basis:
            raise ValueError(f"feature_codec {spec.feature_codec!r} stores raw features: it takes no basis")
        if (basis.input_width, basis.rank) != (spec.num_layers * spec.hidden_size, spec.feature_rank):
            raise ValueError(f"the basis maps {basis.input_width} -> {basis.rank} values, the spec needs "
                             f"{spec.num_layers * spec.hidden_size} -> {spec.feature_rank}")
        digest = basis.sha256()
        if self._basis_sha256 is not None and digest != self._basis_sha256:
            raise ValueError(
                f"{self.shards_dir / spec_name(self.rank)}: this rank's rows were written with feature "
                f"basis {self._basis_sha256}, this writer was given {digest}; resume with the cache's own "
                f"{BASIS_FILE} or write to a new cache directory"
            )
        self.basis, self._basis_sha256 = basis, digest
        self._write_spec_record()

    def _recover(self) -> tuple[int, set[tuple[str, int]], list[dict[str, Any]]]:
        """Keep this rank's recorded shards 0..n-1 whose files are intact; delete the rest."""
        prefix = f"rank{self.rank:05d}-"
        for path in self.shards_dir.glob(prefix + "*.tmp"):
            path.unlink()
        done: set[tuple[str, int]] = set()
        num_shards = 0
        while True:
            record_path = self.shards_dir / record_name(self.rank, num_shards)
            shard_path = self.shards_dir / shard_name(self.rank, num_shards)
            if not record_path.exists():
                break
            record = _read_json(record_path)
            if not shard_path.exists() or shard_path.stat().st_size != record["num_bytes"]:
                break
            seqs = record["sequences"]
            done.update(zip(seqs["source_file"], seqs["source_index"]))
            done.update((r["file"], r["index"]) for r in record["rejects"])
            num_shards += 1
        # Anything numbered at or past the first gap is unrecorded or damaged: rewritten below.
        pattern = re.compile(rf"{prefix}(\d{{5}})\.(arrow|json)$")
        for path in self.shards_dir.glob(prefix + "*"):
            match = pattern.match(path.name)
            if match and int(match.group(1)) >= num_shards:
                path.unlink()
        pending: list[dict[str, Any]] = []
        done_path = self.shards_dir / done_name(self.rank)
        if done_path.exists():
            # Reopening a closed rank: its trailing rejects stay committed, the rank is open again.
            pending = _read_json(done_path)["rejects"]
            done.update((r["file"], r["index"]) for r in pending)
            done_path.unlink()
            fsync_dir(self.shards_dir)
        return num_shards, done, pending

    # ------------------------------------------------------------------ public API

    def add(self, *, source: dict[str, Any], tail_mass: Any = None, ready: Callable[[], Any] | None = None,
            **arrays: Any) -> None:
        """Validate and append one sequence (see FORMAT.md for shapes); ValueError names `source`.

        `features` are raw (float, or uint16 bf16 bits), or with `encoded=True` the stored
        values of the spec's codec (bf16 bits, or fp8 codes with `feature_scales` [T, L]
        float32), as `dflash.precompute.device_codecs` makes them. With background=True the
        row is validated and encoded later in the worker thread (after `ready()`, when given):
        do not modify the arrays after the call; a bad row's ValueError is raised at the next
        call.
        """
        self._raise_pending()
        key = self._claim(source)
        if self.spec.is_basis and self.basis is None:
            raise ValueError(f"feature_codec {self.spec.feature_codec!r}: call use_basis(basis) before add")
        named = {"file": key[0], "index": key[1]}
        if self._queue is None:
            if ready is not None:
                with self.times.part("copy_wait"):
                    ready()
            with self.times.part("validate"):
                arrays = validate_row(self.spec, source, tail_mass=tail_mass, **arrays)
            self._open_sources.add(key)
            self._handle(("row", arrays, named))
            return
        self._open_sources.add(key)
        self._submit(("row", {**arrays, "tail_mass": tail_mass, "ready": ready}, named),
                     tokens=len(arrays["input_ids"]))

    def reject(self, *, source: dict[str, Any], reason: str) -> None:
        """Record an input that was not used; it is listed in rejected.jsonl with `reason`."""
        self._raise_pending()
        key = self._claim(source)
        self._open_sources.add(key)
        self._submit(("reject", {"file": key[0], "index": key[1], "reason": str(reason)}, None), tokens=0)

    def close(self) -> None:
        """Flush the open shard and pending rejects, then mark this rank complete."""
        if self._closed:
            return
        self._stop_worker()
        self._raise_pending()
        self._finish_shard()
        write_json_atomic(
            self.shards_dir / done_name(self.rank),
            {
                "format_version": self.spec.format_version,
                "rank": self.rank,
                "world_size": self.world_size,
                "num_shards": self._num_shards,
                "rejects": self._pending_rejects,
            },
        )

    def _stop_worker(self) -> None:
        """Mark the writer closed and let the background thread (if any) drain and exit."""
        self._closed = True
        if self._thread is not None:
            began = time.perf_counter()
            with self._changed:
                self._queue.append(None)
                self._changed.notify_all()
            self._thread.join()
            self._thread = None
            self.wait_s += time.perf_counter() - began

    def abort(self) -> None:
        """Stop without marking the rank complete; the open shard's temporary is deleted."""
        if self._closed:
            return
        self._stop_worker()
        if self._arrow is not None:
            self._arrow.close()
            self._sink.close()
            self._tmp_path().unlink(missing_ok=True)
            self._arrow = self._sink = None

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ------------------------------------------------------------------ internals

    def _claim(self, source: dict[str, Any]) -> tuple[str, int]:
        if self._closed:
            raise ValueError("this CacheWriter is closed")
        key = _check_source(source)
        if key in self.done_sources or key in self._open_sources:
            raise ValueError(
                f"record {key[1]} of {key[0]} was already written to this cache (rank "
                f"{self.rank}): skip the sources in writer.done_sources"
            )
        return key

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._closed = True
            raise error

    def _submit(self, item: tuple, *, tokens: int) -> None:
        """Queue `item` for the worker (or handle it here without one), waiting while the
        queue holds more than `queue_tokens` tokens."""
        if self._queue is None:
            self._handle(item)
            return
        with self._changed:
            if self._pending_tokens and self._pending_tokens + tokens > self._queue_tokens:
                began = time.perf_counter()
                while self._pending_tokens and self._pending_tokens + tokens > self._queue_tokens:
                    if self._error is not None:  # the worker failed: surface its error, do not hang
                        break
                    self._changed.wait()
                self.wait_s += time.perf_counter() - began
            self._raise_pending()
            self._queue.append((item, tokens))
            self._pending_tokens += tokens
            self._changed.notify_all()

    def _worker(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                entry = self._queue.popleft()
            if entry is None:
                return
            item, tokens = entry
            if self._error is None:  # after a failure only drain; the caller raises on its next call
                try:
                    self._handle_queued(item)
                except BaseException as error:  # noqa: BLE001 - re-raised in the caller
                    if hasattr(error, "add_note"):  # Python >= 3.11
                        error.add_note(f"raised in the background thread of CacheWriter(rank={self.rank})")
                    self._error = error
            with self._changed:
                self._pending_tokens -= tokens
                self._changed.notify_all()

    def _handle_queued(self, item: tuple) -> None:
        """A queued item in the worker: a row is validated here (after its copy is ready)."""
        kind, payload, source = item
        if kind == "row":
            ready = payload.pop("ready")
            if ready is not None:
                with self.times.part("copy_wait"):
                    ready()
            with self.times.part("validate"):
                payload = validate_row(self.spec, source, **payload)
        self._handle((kind, payload, source))

    def _handle(self, item: tuple) -> None:
        kind, payload, source = item
        if kind == "reject":
            self._pending_rejects.append(payload)
            return
        batch = rows.encode_row(self.spec, source=source, basis=self.basis, times=self.times, **payload)
        if self._arrow is None:
            self._sink = _HashingFile(self._tmp_path(), self.times, self.shard_checksum)
            self._arrow = pa.ipc.new_file(
                pa.PythonFile(self._sink, mode="w"), self._schema, options=pa.ipc.IpcWriteOptions(compression=None)
            )
        with self.times.part("write"):
            self._arrow.write_batch(batch)
        self._shard_bytes += batch.nbytes
        self._shard_rows.append(
            {
                "source": source,
                "length": len(payload["input_ids"]),
                "num_loss_tokens": int(payload["loss_mask"].sum()),
                "checksum": batch.column("checksum")[0].as_py(),
                "column_bytes": {name: _value_bytes(batch.column(name)) for name in batch.schema.names},
            }
        )
        if len(self._shard_rows) >= self.spec.shard_max_rows or self._shard_bytes >= self.spec.shard_max_bytes:
            self._finish_shard()

    def _tmp_path(self) -> Path:
        return self.shards_dir / (shard_name(self.rank, self._num_shards) + ".tmp")

    def _finish_shard(self) -> None:
        """Seal the open shard: footer, fsync, rename, fsync dir, then its record."""
        if self._arrow is None:
            return
        with self.times.part("write"):
            self._arrow.close()
        with self.times.part("fsync"):
            os.fsync(self._sink.fileno())
        self._sink.close()
        digest = self._sink.digest.hexdigest()
        self._arrow = self._sink = None
        tmp = self._tmp_path()
        final = self.shards_dir / shard_name(self.rank, self._num_shards)
        # The directory is fsynced once, by the record's atomic write below: a crash before
        # that leaves a shard without a record (or neither), which the next writer deletes.
        os.replace(tmp, final)
        column_bytes: dict[str, int] = {}
        for row in self._shard_rows:
            for name, size in row["column_bytes"].items():
                column_bytes[name] = column_bytes.get(name, 0) + size
        record = {
            "format_version": self.spec.format_version,
            "rank": self.rank,
            "world_size": self.world_size,
            "shard": self._num_shards,
            "path": f"{SHARDS_DIR}/{final.name}",
            SHARD_CHECKSUM_FIELDS[self.shard_checksum]: digest,
            "rows_sha256": rows.shard_rows_sha256(
                self.spec, f"{SHARDS_DIR}/{final.name}",
                [r["source"]["file"] for r in self._shard_rows], [r["source"]["index"] for r in self._shard_rows],
                [r["length"] for r in self._shard_rows], [r["checksum"] for r in self._shard_rows]),
            "num_bytes": final.stat().st_size,
            "num_sequences": len(self._shard_rows),
            "num_tokens": sum(r["length"] for r in self._shard_rows),
            "column_bytes": column_bytes,
            "sequences": {
                "source_file": [r["source"]["file"] for r in self._shard_rows],
                "source_index": [r["source"]["index"] for r in self._shard_rows],
                "length": [r["length"] for r in self._shard_rows],
                "num_loss_tokens": [r["num_loss_tokens"] for r in self._shard_rows],
            },
            "rejects": self._pending_rejects,
        }
        write_json_atomic(self.shards_dir / record_name(self.rank, self._num_shards), record)
        for row in self._shard_rows:
            self.done_sources.add((row["source"]["file"], row["source"]["index"]))
        self.done_sources.update((r["file"], r["index"]) for r in self._pending_rejects)
        self._num_shards += 1
        self._shard_rows = []
        self._shard_bytes = 0
        self._pending_rejects = []


class _HashingFile:
    """A shard's temporary file, written through Arrow's `PythonFile`, that feeds every byte
    it writes to the shard's checksum (what the manifest records), so the file is never read
    back. hashlib and xxhash release the GIL on large updates: the caller's thread keeps running."""

    def __init__(self, path: Path, times: PartTimes, algorithm: str):
        self._file = open(path, "wb", buffering=0)
        self._times = times
        self._position = 0
        self.digest = new_digest(algorithm)
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        with self._times.part("shard_checksum"):
            self.digest.update(view)
        while view:
            view = view[self._file.write(view):]
        self._position += size
        return size

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self._file.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self._file.close()
        self.closed = True


def finalize_cache(cache_dir: str | Path, spec: CacheSpec, world_size: int) -> Cache:
    """Merge every rank's records into rejected.jsonl and manifest.json (written last,
    atomically); returns the opened Cache. Call on one process after all writers closed."""
    cache_dir = Path(cache_dir)
    shards_dir = cache_dir / SHARDS_DIR
    shards, rejects, sequences = _gather_ranks(cache_dir, spec, world_size)
    rejects.sort(key=lambda r: (r["file"], r["index"]))
    write_atomic(
        cache_dir / REJECTED,
        "".join(json.dumps(r, sort_keys=True) + "\n" for r in rejects).encode(),
    )
    source_files = sorted(set(sequences["source_file"]))
    file_ids = {name: i for i, name in enumerate(source_files)}
    feature_basis = None
    if spec.is_basis:
        feature_basis = _basis_entry(cache_dir, shards_dir, world_size)
    column_bytes: dict[str, int] = {}
    for shard in shards:
        for name, size in shard["column_bytes"].items():
            column_bytes[name] = column_bytes.get(name, 0) + size
    xxh3 = any(SHARD_CHECKSUM_FIELDS["xxh3-128"] in shard for shard in shards)
    manifest = {
        "format": "dflash-cache",
        "format_version": XXH3_MANIFEST_VERSION if xxh3 else spec.format_version,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "spec": spec.to_dict(),
        "world_size": world_size,
        "num_shards": len(shards),
        "num_sequences": len(sequences["length"]),
        "num_tokens": int(sum(sequences["length"])),
        "num_loss_tokens": int(sum(sequences["num_loss_tokens"])),
        "num_rejected": len(rejects),
        "column_bytes": column_bytes,
        "rejected": REJECTED,
        "target_dir": TARGET_DIR,
        **({"feature_basis": feature_basis} if feature_basis is not None else {}),
        "shards": shards,
        "source_files": source_files,
        "sequences": {
            "length": sequences["length"],
            "num_loss_tokens": sequences["num_loss_tokens"],
            "source_file": [file_ids[f] for f in sequences["source_file"]],
            "source_index": sequences["source_index"],
        },
    }
    write_atomic(cache_dir / MANIFEST, json.dumps(manifest, separators=(",", ":")).encode())
    return open_cache(cache_dir)


def _gather_ranks(cache_dir: Path, spec: CacheSpec, world_size: int) -> tuple[list, list, dict[str, list]]:
    """(shard entries, rejects, per-sequence columns) of every rank's closed writer, checked:
    no rank beyond world_size, every rank done with the same spec, every shard at its size."""
    shards_dir = cache_dir / SHARDS_DIR
    for path in shards_dir.glob("rank*.spec.json"):
        rank = int(path.name[4:9])
        if rank >= world_size:
            raise ValueError(
                f"{path}: rank {rank} wrote to this cache but world_size is {world_size}; "
                "finalize with the world size the cache was written with"
            )
    shards: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    sequences: dict[str, list] = {"source_file": [], "source_index": [], "length": [], "num_loss_tokens": []}
    for rank in range(world_size):
        done_path = shards_dir / done_name(rank)
        if not done_path.exists():
            raise ValueError(
                f"rank {rank} has not closed its writer ({done_path} is missing): rerun the "
                "producer so that every rank finishes, then finalize"
            )
        recorded = CacheSpec.from_dict(_read_json(shards_dir / spec_name(rank))["spec"])
        differ = recorded.identity_diff(spec)
        if differ:
            raise ValueError(
                f"rank {rank} wrote this cache with a different configuration (fields {differ} "
                "differ from the spec given to finalize_cache)"
            )
        done = _read_json(done_path)
        rejects += done["rejects"]
        for index in range(done["num_shards"]):
            record = _read_json(shards_dir / record_name(rank, index))
            shard_path = cache_dir / record["path"]
            if not shard_path.exists() or shard_path.stat().st_size != record["num_bytes"]:
                raise ValueError(
                    f"{shard_path} is missing or not {record['num_bytes']} bytes as recorded; "
                    f"rerun the producer to rewrite rank {rank}'s shards"
                )
            rejects += record["rejects"]
            for key in sequences:
                sequences[key] += record["sequences"][key]
            shards.append({key: record[key] for key in (
                "path", "rank", *SHARD_CHECKSUM_FIELDS.values(), "rows_sha256", "num_bytes", "num_sequences",
                "num_tokens", "column_bytes") if key in record})
    return shards, rejects, sequences


def _basis_entry(cache_dir: Path, shards_dir: Path, world_size: int) -> dict[str, Any]:
    """The manifest's record of CACHE/feature_basis.safetensors, checked against the basis
    every rank wrote its rows with."""
    path = cache_dir / BASIS_FILE
    basis = FeatureBasis.load(path)
    digest = file_sha256(path)
    for rank in range(world_size):
        recorded = _read_json(shards_dir / spec_name(rank)).get("feature_basis_sha256")
        if recorded != digest:
            raise ValueError(
                f"rank {rank} wrote its rows with feature basis {recorded}, but {path} has sha256 "
                f"{digest}; the cache mixes bases: rebuild it with --overwrite"
            )
    return {"path": BASIS_FILE, "sha256": digest, "num_bytes": path.stat().st_size, **basis.info()}
