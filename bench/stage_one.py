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
    crc32           the rows' checksum (in the shard format)
    rows            building the Arrow rows (everything of encode_row but the above)
    write           Arrow IPC writes to the shard file (page cache)
    shard_checksum  the shards' file checksum (the manifest's: sha256, or xxh3-128)
    fsync           fsync of every sealed shard

for three paths over the same tensors: `legacy`, the path before issue 41 (features crossed
to the host as bf16, validated in the caller, encoded in numpy, the shard re-read for its
sha256), timed step by step here with the library's own functions; `device`, the path
stage one runs now (`dflash.precompute.device_codecs` on the device, then
`CacheWriter.add` of the encoded bytes, whose per-part timers this reads) with
`--shard-checksum sha256`; and `device-xxh3`, the same with xxh3-128, stage one's
default. Times are CPU seconds of the thread that did the work (fsync: wall), so a machine
shared with other jobs does not inflate them much; "after copy" sums everything past the copy to the host, which
is what one host core must keep up with.

`--mode forward` builds a small random Llama (5 x 2048 features) and runs
`dflash-precompute`'s own code (`run_precompute`) over synthetic records, with the writer
in its background thread, and reports the forward, the wall time and how long the main loop
waited on the writer (the goal: at most 5% of the wall time).

    python -m bench.stage_one [--mode host|forward] [--codecs bf16,fp8,basis-fp8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

from dflash.common.files import file_sha256
from dflash.precompute.device_codecs import DEVICE_CODECS, encode_features
from dflash.precompute.target import _features_to_numpy, to_host
from dflash.shards import CacheSpec, CacheWriter, codecs, rows
from dflash.shards.basis import FeatureBasis
from dflash.shards.writer import validate_row

# Qwen3-8B: 36 layers of hidden 4096, vocabulary 151,936; the DFlash rule's 5 feature layers.
QWEN3_8B = {"hidden_size": 4096, "vocab_size": 151_936, "layer_ids": [1, 9, 17, 25, 33]}
PARTS = ("device_encode", "copy_to_host", "validate", "topk", "host_encode", "crc32", "rows", "write",
         "shard_checksum", "fsync")
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
        features_np = parts.timed("copy_to_host", _features_to_numpy, features)
        ids_np, logprobs_np = parts.timed("copy_to_host", lambda a, b: (a.cpu().numpy(), b.cpu().numpy()),
                                          ids, logprobs)
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
            separate = sum(parts.seconds[k] for k in ("host_encode", "topk", "crc32"))
            if basis is not None:
                f32 = parts.timed("host_encode", codecs.bf16_to_f32, row["features"])
                encoded = parts.timed("host_encode", codecs.f32_to_fp8, parts.timed("host_encode", basis.encode, f32))
            elif spec.feature_codec == "fp8":
                f32 = parts.timed("host_encode", codecs.bf16_to_f32, row["features"])
                encoded = parts.timed("host_encode", codecs.f32_to_fp8, f32)
            else:
                encoded = (row["features"],)
            packed = parts.timed("topk", codecs.encode_topk_packed, row["topk_ids"], row["topk_logprobs"],
                                 row["tail_mass"], spec.vocab_size)
            parts.timed("crc32", rows.row_checksum,
                        [row["input_ids"].astype(np.int32), row["loss_mask"].astype(np.uint8), *encoded, packed])
            separate = sum(parts.seconds[k] for k in ("host_encode", "topk", "crc32")) - separate
            cpu = time.thread_time()
            batch = rows.encode_row(spec, source=source, basis=basis, **row)
            parts.seconds["rows"] += max(0.0, time.thread_time() - cpu - separate)
            parts.timed("write", writer.write_batch, batch)
    parts.timed("write", writer.close)
    parts.timed("fsync", os.fsync, sink.fileno())
    sink.close()
    parts.timed("shard_checksum", file_sha256, out)
    return parts


def device_path(spec: CacheSpec, batches, lengths: list[int], out: Path, basis: FeatureBasis | None,
                device: torch.device, shard_checksum: str = "sha256") -> Parts:
    """The host side stage one runs now: features encoded on the device (bf16, fp8), the
    encoded bytes copied to the host, `CacheWriter.add` (in the caller's thread here, so that
    its per-part CPU times are this thread's; the writer thread does the same work)."""
    parts = Parts()
    writer = CacheWriter(out, spec, basis=basis, shard_checksum=shard_checksum)
    index = 0
    for features, ids, logprobs in batches:
        if spec.feature_codec in DEVICE_CODECS:
            encoded = parts.timed("device_encode", _encode_synchronized, features, spec.feature_codec, device)
            host, ready = parts.timed("copy_to_host", to_host,
                                      {**encoded, "topk_ids": ids, "topk_logprobs": logprobs}, device)
            if ready is not None:
                parts.timed("copy_to_host", ready)
            scales = host.get("feature_scales")
            features_np, extra = host["features"], {"encoded": True}
        else:  # basis codecs encode on the host
            features_np = parts.timed("copy_to_host", _features_to_numpy, features)
            host = parts.timed("copy_to_host", to_host, {"topk_ids": ids, "topk_logprobs": logprobs}, device)[0]
            scales, extra = None, {}
        start = 0
        for length in lengths:
            sl = slice(start, start + length)
            start += length
            if scales is not None:
                extra["feature_scales"] = scales[sl]
            writer.add(source={"file": "bench.jsonl", "index": index}, input_ids=host["topk_ids"][sl, 0],
                       loss_mask=np.ones(length, bool), features=features_np[sl], topk_ids=host["topk_ids"][sl],
                       topk_logprobs=host["topk_logprobs"][sl], **extra)
            index += 1
    writer.close()
    for name, seconds in writer.times.seconds.items():
        parts.seconds[name] += seconds
    return parts


def _encode_synchronized(features: torch.Tensor, codec: str, device: torch.device) -> dict[str, torch.Tensor]:
    encoded = encode_features(features, codec)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return encoded


def random_basis(spec: CacheSpec, seed: int = 0) -> FeatureBasis:
    """An orthonormal random basis of the spec's rank (the cost of encoding does not depend on
    which basis)."""
    rng = np.random.default_rng(seed)
    width = spec.num_layers * spec.hidden_size
    projection = np.linalg.qr(rng.standard_normal((width, spec.feature_rank)).astype(np.float32))[0]
    return FeatureBasis(projection=projection, scale=np.ones(width, np.float32), eigenvalues=np.ones(width),
                        num_tokens=1)


def host_mode(args: argparse.Namespace) -> dict:
    """Both paths over the same stub batches, per codec: microseconds per token by part."""
    device = torch.device(args.device)
    lengths = [args.sequence_tokens] * (args.batch_tokens // args.sequence_tokens)
    num_tokens = sum(lengths) * args.num_batches
    results = {}
    for codec in args.codecs.split(","):
        spec = CacheSpec(vocab_size=QWEN3_8B["vocab_size"], hidden_size=QWEN3_8B["hidden_size"],
                         layer_ids=QWEN3_8B["layer_ids"], top_k=32, feature_codec=codec,
                         feature_rank=args.feature_rank if codec.startswith("basis") else None,
                         max_length=max(lengths))
        basis = random_basis(spec) if spec.is_basis else None
        batches = [stub_batch(seed, sum(lengths), spec, device) for seed in range(args.num_batches)]
        work = Path(tempfile.mkdtemp(prefix="stage_one-", dir=args.work_dir))
        try:
            results[codec] = {}
            for path in args.paths.split(","):
                if path == "legacy":
                    parts = legacy_path(spec, batches, lengths, work / "legacy.arrow", basis)
                else:
                    checksum = "xxh3-128" if path == "device-xxh3" else "sha256"
                    parts = device_path(spec, batches, lengths, work / path, basis, device, checksum)
                us = {name: 1e6 * parts.seconds.get(name, 0.0) / num_tokens for name in PARTS}
                if "copy_wait" in parts.seconds:
                    us["copy_to_host"] += 1e6 * parts.seconds["copy_wait"] / num_tokens
                results[codec][path] = {
                    "us_per_token": us,
                    "after_copy_us_per_token": sum(us[name] for name in AFTER_COPY),
                    "after_copy_cpu_us_per_token": sum(us[name] for name in AFTER_COPY if name != "fsync"),
                    "total_us_per_token": sum(us.values()),
                }
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return {"mode": "host", "device": args.device, "widths": "Qwen3-8B: 5 x 4096 features, top-32 of 151,936",
            "num_tokens": num_tokens, "sequence_tokens": args.sequence_tokens, "results": results}


def print_host(result: dict) -> None:
    print(f"stage_one host side: {result['widths']}, {result['num_tokens']:,} tokens per codec and path, "
          f"stub forward on {result['device']}; microseconds per token (CPU of the working thread; fsync wall)")
    header = ["codec/path"] + list(PARTS) + ["after copy", "of it CPU", "total"]
    print("  " + "  ".join(f"{h:>13}" for h in header))
    for codec, paths in result["results"].items():
        for path, r in paths.items():
            cells = [f"{codec}/{path}"] + [f"{r['us_per_token'][p]:.2f}" for p in PARTS] + [
                f"{r['after_copy_us_per_token']:.1f}", f"{r['after_copy_cpu_us_per_token']:.1f}",
                f"{r['total_us_per_token']:.1f}"]
            print("  " + "  ".join(f"{c:>13}" for c in cells))


# ----------------------------------------------------------------------------- forward mode

def build_random_llama(path: Path, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                       intermediate_size: int, vocab_size: int, dtype: torch.dtype, device: str = "cpu") -> int:
    """Save a random-weight Llama of these shapes with a byte-level BPE tokenizer built in code
    (dflash.testing) into `path`; returns its parameter count. Weights are made on `device`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dflash.testing.builders import build_tokenizer

    tokenizer = build_tokenizer("llama3")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
                         max_position_embeddings=8192, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def synthetic_records(path: Path, *, num_records: int, words_per_record: tuple[int, int], seed: int = 0) -> Path:
    """JSONL of `text` records of random words (the tokenizer's training sentences' words)."""
    from dflash.testing.builders import CORPUS

    words = sorted({w for sentence in CORPUS for w in sentence.split()})
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_records):
            count = int(rng.integers(*words_per_record))
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=count))}) + "\n")
    return path


def shard_digests(cache: Path) -> dict[str, str]:
    """sha256 of every shard file of a cache, by name."""
    return {p.name: file_sha256(p) for p in sorted((cache / "shards").glob("*.arrow"))}


def forward_mode(args: argparse.Namespace) -> dict:
    """run_precompute with the writer thread on and off over the same small target and records:
    the split, the main loop's wait on the writer, and whether the shards are the same bytes."""
    from dflash.precompute.config import PrecomputeConfig
    from dflash.precompute.run import run_precompute

    work = Path(tempfile.mkdtemp(prefix="stage_one-forward-", dir=args.work_dir))
    try:
        params = build_random_llama(work / "target", hidden_size=2048, num_layers=6, num_heads=16,
                                    num_kv_heads=8, intermediate_size=2048, vocab_size=8192,
                                    dtype=torch.float32)
        data = synthetic_records(work / "records.jsonl", num_records=args.num_records, words_per_record=(40, 160))
        runs = {}
        for writer_thread in ("on", "off"):
            config = PrecomputeConfig(target=work / "target", data=[data], out=work / f"cache-{writer_thread}",
                                      feature_layers=[0, 1, 2, 3, 4], top_k=32, feature_codec="fp8",
                                      max_length=1024, batch_tokens=args.batch_tokens, device=args.device,
                                      dtype="float32", writer_thread=writer_thread, progress=False)
            summary = run_precompute(config)
            runs[writer_thread] = {
                "wall_s": summary.wall_s, "forward_s": summary.forward_s, "encode_s": summary.encode_s,
                "host_s": summary.host_s, "host_parts_s": summary.host_parts_s,
                "writer_wait_s": summary.writer_wait_s, "writer_wait_fraction": summary.writer_wait_s / summary.wall_s,
                "tokens": summary.written_tokens, "tokens_per_s": summary.tokens_per_s,
            }
        identical = shard_digests(work / "cache-on") == shard_digests(work / "cache-off")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"mode": "forward", "device": args.device, "target": f"random Llama, {params / 1e6:.0f} M parameters, "
            "5 x 2048 features, fp8", "threads": torch.get_num_threads(), "runs": runs,
            "shards_identical_with_and_without_writer_thread": identical}


def print_forward(result: dict) -> None:
    print(f"stage_one forward: {result['target']} on {result['device']} ({result['threads']} torch thread(s))")
    print(f"  {'writer thread':<14}{'tokens':>9}{'wall s':>9}{'forward s':>11}{'encode s':>10}{'host s':>9}"
          f"{'waited s':>10}{'waited %':>10}{'tokens/s':>10}")
    for name, r in result["runs"].items():
        print(f"  {name:<14}{r['tokens']:>9,}{r['wall_s']:>9.1f}{r['forward_s']:>11.1f}{r['encode_s']:>10.2f}"
              f"{r['host_s']:>9.2f}{r['writer_wait_s']:>10.2f}{100 * r['writer_wait_fraction']:>9.1f}%"
              f"{r['tokens_per_s']:>10.1f}")
    print(f"  shards identical with and without the writer thread: "
          f"{result['shards_identical_with_and_without_writer_thread']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("host", "forward"), default="host")
    parser.add_argument("--codecs", default="bf16,fp8,basis-fp8", help="host mode: feature codecs, comma-separated")
    parser.add_argument("--paths", default="legacy,device,device-xxh3",
                        help="host mode: legacy, device (sha256 shard checksums), "
                             "device-xxh3 (xxh3-128, stage one's default)")
    parser.add_argument("--feature-rank", type=int, default=1024, help="host mode: the basis codecs' rank")
    parser.add_argument("--num-batches", type=int, default=2, help="host mode: stub batches per codec and path")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch")
    parser.add_argument("--sequence-tokens", type=int, default=512, help="host mode: tokens per sequence")
    parser.add_argument("--num-records", type=int, default=12, help="forward mode: synthetic records")
    parser.add_argument("--device", default="cpu", help="where the stub tensors or the target live")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--work-dir", type=Path, default=None, help="where shards are written (default: temp)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "host":
        result = host_mode(args)
        print_host(result)
    else:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        result = forward_mode(args)
        print_forward(result)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
