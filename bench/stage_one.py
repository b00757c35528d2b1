"""Stage one's host side per token: what the cache writer costs beside the target forward.

Two modes.

`--mode host` (the default) runs no model: a stub forward hands over precomputed tensors at
Qwen3-8B's widths (5 x 4096 features in bf16, top-32 of 151,936) as the target's device
would, and the bench times, in microseconds per token, every part of what happens to them:

    device encode   feature encoding on the target's device (torch; fp8 codes and scales)
    copy to host    the encoded bytes to host memory
    validate        the row checks
    topk            the packed top-k encoding (numpy, on the host)
    host encode     feature encoding on the host (today's path; basis codecs still)
    checksum        the rows' crc32 and the shards' file checksum
    rows            building the Arrow rows (everything of encode_row but the above)
    write           Arrow IPC writes to the shard file (page cache)
    fsync           fsync of every sealed shard

for two paths over the same tensors: `legacy`, the path before issue 41 (features crossed to
the host as bf16, validated in the caller, encoded in numpy, the shard re-read for its
sha256), timed step by step here with the library's own functions; and `device`, the path
stage one runs now (`dflash.precompute.device_codecs` on the device, then
`CacheWriter.add` of the encoded bytes, whose per-part timers this reads). Times are CPU
seconds of the thread that did the work (fsync: wall), so a machine shared with other jobs
does not inflate them much; "after copy" sums everything past the copy to the host, which
is what one host core must keep up with.

`--mode forward` builds a small random Llama (5 x 2048 features) and runs
`dflash-precompute`'s own code (`run_precompute`) over synthetic records, with the writer
in its background thread, and reports the forward, the wall time and how long the main loop
waited on the writer (the goal: at most 5% of the wall time).

    python -m bench.stage_one [--mode host|forward] [--codecs bf16,fp8,basis-fp8] [--json]
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

from dflash.shards import CacheSpec, codecs, rows
from dflash.shards.basis import FeatureBasis
from dflash.shards.files import file_sha256
from dflash.shards.writer import validate_row

# Qwen3-8B: 36 layers of hidden 4096, vocabulary 151,936; the DFlash rule's 5 feature layers.
QWEN3_8B = {"hidden_size": 4096, "vocab_size": 151_936, "layer_ids": [1, 9, 17, 25, 33]}
PARTS = ("device_encode", "copy_to_host", "validate", "topk", "host_encode", "checksum", "rows", "write", "fsync")
AFTER_COPY = PARTS[2:]


class Parts:
    """Seconds per part: CPU time of the calling thread (fsync: wall time)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def timed(self, name: str, fn, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        result = fn(*args, **kwargs)
        self.seconds[name] += (time.perf_counter() - wall) if name == "fsync" else (time.thread_time() - cpu)
        return result


def stub_batch(seed: int, num_tokens: int, spec: CacheSpec, device: torch.device):
    """What the target hands over for one batch of `num_tokens` positions: features
    [N, L, H] bf16 (N(0, 1) with a few large channels, as real hidden states have), top-k
    ids [N, k] int32 (distinct) and full-vocabulary log-probs [N, k] float32, on `device`."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn((num_tokens, spec.num_layers, spec.hidden_size), generator=gen)  # [N, L, H]
    features[:, :, :8] *= 40.0
    steps = torch.randint(1, spec.vocab_size // (2 * spec.top_k), (num_tokens, spec.top_k), generator=gen)
    ids = (torch.randint(0, spec.vocab_size, (num_tokens, 1), generator=gen) + steps.cumsum(1)) % spec.vocab_size
    logits = torch.randn((num_tokens, spec.top_k), generator=gen).sort(dim=1, descending=True).values * 2.0
    logprobs = torch.log_softmax(logits, dim=1) + np.log(0.9)  # [N, k], 0.1 of the mass in the tail
    return (features.to(torch.bfloat16).to(device), ids.int().to(device), logprobs.float().to(device))


def legacy_path(spec: CacheSpec, batches, lengths: list[int], out: Path, basis: FeatureBasis | None) -> Parts:
    """The host side before issue 41, step by step with the library's functions: bf16 bits to
    the host, validate_row in the caller, encode_row (numpy), Arrow writes, fsync, re-read."""
    parts = Parts()
    schema = rows.shard_schema(spec)
    sink = pa.OSFile(str(out), "wb")
    writer = pa.ipc.new_file(sink, schema, options=pa.ipc.IpcWriteOptions(compression=None))
    index = 0
    for features, ids, logprobs in batches:
        features_np = parts.timed("copy_to_host", lambda t: t.view(torch.int16).cpu().numpy().view(np.uint16), features)
        ids_np, logprobs_np = parts.timed("copy_to_host", lambda a, b: (a.cpu().numpy(), b.cpu().numpy()), ids, logprobs)
        start = 0
        for length in lengths:
            sl = slice(start, start + length)
            start += length
            source = {"file": "bench.jsonl", "index": index}
            index += 1
            row = parts.timed("validate", validate_row, spec, source, input_ids=ids_np[sl, 0],
                              loss_mask=np.ones(length, bool), features=features_np[sl], topk_ids=ids_np[sl],
                              topk_logprobs=logprobs_np[sl])
            # encode_row's parts, each timed alone, then the whole: "rows" is the rest.
            separate = sum(parts.seconds[k] for k in ("host_encode", "topk", "checksum"))
            f32 = parts.timed("host_encode", codecs.bf16_to_f32, row["features"])
            if basis is not None:
                encoded = parts.timed("host_encode", codecs.f32_to_fp8, parts.timed("host_encode", basis.encode, f32))
            elif spec.feature_codec == "fp8":
                encoded = parts.timed("host_encode", codecs.f32_to_fp8, f32)
            else:
                encoded = (row["features"],)
            packed = parts.timed("topk", codecs.encode_topk_packed, row["topk_ids"], row["topk_logprobs"],
                                 row["tail_mass"], spec.vocab_size)
            parts.timed("checksum", rows.row_checksum,
                        [row["input_ids"].astype(np.int32), row["loss_mask"].astype(np.uint8), *encoded, packed])
            separate = sum(parts.seconds[k] for k in ("host_encode", "topk", "checksum")) - separate
            cpu = time.thread_time()
            batch = rows.encode_row(spec, source=source, basis=basis, **row)
            parts.seconds["rows"] += max(0.0, time.thread_time() - cpu - separate)
            parts.timed("write", writer.write_batch, batch)
    parts.timed("write", writer.close)
    parts.timed("fsync", os.fsync, sink.fileno())
    sink.close()
    parts.timed("checksum", file_sha256, out)
    return parts
