"""Shard I/O benchmark: bytes per token, write and read speed, open time, against two baselines.

Synthetic caches shaped like SmolLM2-135M (H 576, 5 layers, V 49152) and Qwen3-8B (H 4096,
5 layers, V 151936), k = 32, in three codec pairs (bf16/packed, fp8/packed, bf16/raw). The
same rows are also written the way peers do it, one `torch.save` file and one safetensors
file per sample (bf16 features, int32 ids, fp16 log-probs, fp32 tail), and read back.

Reads run in a fresh single-threaded subprocess each, so "peak RSS" is the reader's own
(memory-mapped pages it touched count, as the kernel counts them). The page cache is warm
(files were just written): this measures the decode path, not the disk. Top-k codec error is
measured on Zipf-like logits over the full vocabulary.

    python bench/shard_io.py            # about two minutes on a 2-core machine
    python bench/shard_io.py --json     # ... and one JSON object as the last line
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "smollm2-135m": {"hidden_size": 576, "layer_ids": [1, 8, 14, 20, 27], "vocab_size": 49152},
    "qwen3-8b": {"hidden_size": 4096, "layer_ids": [1, 9, 17, 25, 33], "vocab_size": 151936},
}
CODECS = [("bf16", "packed"), ("fp8", "packed"), ("bf16", "raw")]
TOP_K = 32
RAW_TOPK_BYTES = TOP_K * (4 + 2) + 4  # int32 id + fp16 log-prob per candidate + fp32 tail: 196


def single_thread_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = "1"
    return env


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM): unlike ru_maxrss, it does not carry over
    the parent's peak into a freshly exec'd subprocess."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- workers
# Each runs in its own process and prints one JSON line.


class Clock:
    """Wall-clock and CPU (process) time of a block. The machine may be shared: CPU time
    per byte is what one core costs, wall time is what this run saw."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def read_result(first_s: float, tokens: int, decoded_bytes: int, clock: Clock, raw: tuple | None) -> dict:
    return {
        "first_sample_s": first_s,
        "tokens_per_s": tokens / clock.wall,
        "tokens_per_cpu_s": tokens / clock.cpu,
        "decoded_gb_per_s": decoded_bytes / clock.wall / 1e9,
        "decoded_gb_per_cpu_s": decoded_bytes / clock.cpu / 1e9,
        "raw_gb_per_cpu_s": None if raw is None else raw[0] / raw[1].cpu / 1e9,
        "peak_rss_mb": peak_rss_mb(),
    }


def worker_read_cache(path: str, seed: int) -> dict:
    from dflash.shards import open_cache

    start = time.perf_counter()
    cache = open_cache(path)
    cache[0]
    first_s = time.perf_counter() - start
    order = np.random.default_rng(seed).permutation(len(cache))
    decoded_bytes = stored_bytes = 0
    with Clock() as decoded:
        for i in order:
            decoded_bytes += cache[int(i)].features.nbytes
    with Clock() as raw:
        for i in order:
            stored_bytes += cache.raw(int(i)).features.nbytes
    # What fit's first start does once per cache (Corpus counts every sequence's anchors):
    # every loss mask alone, against every row through raw() (checksum + top-k decode).
    tokens = int(cache.lengths.sum())
    with Clock() as masks:
        for i in order:
            cache.loss_mask(int(i))
    result = read_result(first_s, tokens, decoded_bytes, decoded, (stored_bytes, raw))
    return result | {"raw_tokens_per_cpu_s": tokens / raw.cpu, "mask_tokens_per_cpu_s": tokens / masks.cpu}


def worker_read_files(path: str, seed: int, kind: str) -> dict:
    import torch

    torch.set_num_threads(1)
    if kind == "torch":
        def load(file):
            return torch.load(file, weights_only=True)
        pattern = "*.pt"
    else:
        from safetensors.torch import load_file as load
        pattern = "*.safetensors"
    start = time.perf_counter()
    files = sorted(glob.glob(os.path.join(path, pattern)))
    load(files[0])["features"].float()
    first_s = time.perf_counter() - start
    order = np.random.default_rng(seed).permutation(len(files))
    decoded_bytes = tokens = 0
    with Clock() as decoded:
        for i in order:
            features = load(files[i])["features"].float()  # [T, L, H] float32, as cache[i] gives
            decoded_bytes += features.numel() * 4
            tokens += features.shape[0]
    return read_result(first_s, tokens, decoded_bytes, decoded, None)


def worker_open_first(path: str) -> dict:
    from dflash.shards import open_cache

    start = time.perf_counter()
    cache = open_cache(path)
    open_s = time.perf_counter() - start
    sequence = cache[0]
    total_s = time.perf_counter() - start
    assert sequence.features.shape[0] == cache.lengths[0]
    return {"open_s": open_s, "open_and_first_read_s": total_s, "num_shards": len(cache.shards),
            "peak_rss_mb": peak_rss_mb()}


def run_worker(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", *args], check=True, capture_output=True, text=True,
        env=single_thread_env(),
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- writers


def spec_for(shape: str, feature_codec: str, topk_codec: str, max_length: int, **extra):
    from dflash.shards import CacheSpec

    return CacheSpec(top_k=TOP_K, max_length=max_length, feature_codec=feature_codec,
                     topk_codec=topk_codec, target={"name": shape}, **SHAPES[shape], **extra)


def write_cache(path: Path, spec, rows: list[dict]) -> dict:
    from dflash.shards import CacheWriter, finalize_cache
    from dflash.shards.report import bytes_per_token

    with Clock() as clock:
        writer = CacheWriter(path, spec)
        for index, row in enumerate(rows):
            writer.add(**row, source={"file": "synthetic.jsonl", "index": index})
        writer.close()
        cache = finalize_cache(path, spec, 1)
    total_bytes = sum(s["num_bytes"] for s in cache.manifest["shards"])
    return {"write_mb_per_s": total_bytes / clock.wall / 1e6, "write_mb_per_cpu_s": total_bytes / clock.cpu / 1e6,
            "write_tokens_per_s": cache.num_tokens / clock.wall, "bytes_per_token": bytes_per_token(cache)}


def baseline_sample(row: dict) -> dict:
    import torch

    from dflash.shards import codecs

    bf16 = codecs.f32_to_bf16(row["features"])
    return {
        "input_ids": torch.from_numpy(row["input_ids"].astype(np.int64)),
        "loss_mask": torch.from_numpy(row["loss_mask"]),
        "features": torch.from_numpy(bf16.view(np.int16)).view(torch.bfloat16),
        "topk_ids": torch.from_numpy(row["topk_ids"].astype(np.int32)),
        "topk_logprobs": torch.from_numpy(row["topk_logprobs"]).half(),
        "tail_mass": torch.from_numpy(codecs.tail_from_logprobs(row["topk_logprobs"])),
    }


def write_files(path: Path, rows: list[dict], kind: str) -> dict:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    samples = [baseline_sample(row) for row in rows]  # conversion is not part of the write time
    total_bytes = 0
    with Clock() as clock:
        for index, sample in enumerate(samples):
            file = path / (f"{index:06d}.pt" if kind == "torch" else f"{index:06d}.safetensors")
            if kind == "torch":
                torch.save(sample, file)
            else:
                save_file(sample, str(file))
            with open(file, "rb+") as f:
                os.fsync(f.fileno())  # as durable as the cache's shards
            total_bytes += file.stat().st_size
    tokens = sum(len(r["input_ids"]) for r in rows)
    return {"write_mb_per_s": total_bytes / clock.wall / 1e6, "write_mb_per_cpu_s": total_bytes / clock.cpu / 1e6,
            "write_tokens_per_s": tokens / clock.wall, "bytes_per_token": {"total": total_bytes / tokens}}


# ----------------------------------------------------------------------------- main


def bench_shape(shape: str, num_tokens: int, seq_len: int, root: Path, seed: int) -> tuple[list, dict]:
    from dflash.shards.synthetic import synthetic_row

    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq_len // 2, seq_len * 3 // 2 + 1, size=max(2, num_tokens // seq_len))
    spec = spec_for(shape, "bf16", "packed", int(lengths.max()))
    rows = [synthetic_row(rng, spec, int(n)) for n in lengths]
    results, sizes = [], {}
    for feature_codec, topk_codec in CODECS:  # warm-up: first-use costs stay out of the timings
        write_cache(root / "warm-up", spec_for(shape, feature_codec, topk_codec, int(lengths.max())), rows[:1])
        shutil.rmtree(root / "warm-up")
    for feature_codec, topk_codec in CODECS:
        name = f"{feature_codec}/{topk_codec}"
        path = root / f"{shape}-{feature_codec}-{topk_codec}"
        written = write_cache(path, spec_for(shape, feature_codec, topk_codec, int(lengths.max())), rows)
        sizes[name] = written.pop("bytes_per_token")
        read = run_worker("cache", str(path), str(seed))
        results.append({"shape": shape, "format": f"dflash {name}", **written, **read})
        shutil.rmtree(path)
    for kind in ("torch", "safetensors"):
        path = root / f"{shape}-{kind}"
        written = write_files(path, rows, kind)
        sizes[f"{kind} per sample"] = written.pop("bytes_per_token")
        results.append({"shape": shape, "format": f"{kind} per sample", **written,
                        **run_worker(kind, str(path), str(seed))})
        shutil.rmtree(path)
    return results, sizes


def bench_topk(kl_tokens: int, seed: int) -> list[dict]:
    from dflash.shards import codecs, topk_codec_kl
    from dflash.shards.synthetic import zipf_topk

    out = []
    for shape, dims in SHAPES.items():
        vocab = dims["vocab_size"]
        ids, logprobs = zipf_topk(np.random.default_rng(seed), kl_tokens, vocab, TOP_K)
        out.append({
            "shape": shape, "vocab_size": vocab, "top_k": TOP_K,
            "packed_bytes_per_token": codecs.packed_bytes_per_token(TOP_K, vocab),
            "raw_reference_bytes_per_token": RAW_TOPK_BYTES,
            "mean_kl_nats": topk_codec_kl(ids, logprobs, vocab_size=vocab),
            "num_tokens": kl_tokens,
        })
    return out


def bench_many_shards(root: Path, num_shards: int, seed: int) -> dict:
    """Build a cache of `num_shards` one-row shards under `root`, then time opening it and
    reading its first sequence in a fresh process."""
    from dflash.shards.synthetic import synthetic_row

    spec = spec_for("smollm2-135m", "bf16", "packed", 16, shard_max_rows=1)
    row = synthetic_row(np.random.default_rng(seed), spec, 16)
    path = root / "many-shards"
    from dflash.shards import CacheWriter, finalize_cache
    from dflash.shards.layout import MANIFEST

    start = time.perf_counter()
    writer = CacheWriter(path, spec)
    for index in range(num_shards):
        writer.add(**row, source={"file": "synthetic.jsonl", "index": index})
    writer.close()
    finalize_cache(path, spec, 1)
    build_s = time.perf_counter() - start
    result = {"num_shards": num_shards, "dir": str(root), "build_s": build_s,
              "manifest_bytes": (path / MANIFEST).stat().st_size, **run_worker("open", str(path))}
    shutil.rmtree(path)
    return result


def format_tables(report: dict) -> str:
    lines = [f"shard_io benchmark, {report['date']}, {report['machine']}, 1-minute load average "
             f"{report['load_average'][0]:.1f} at start, {report['load_average'][1]:.1f} at end", ""]
    lines.append("bytes per token (stored values; total = whole files / tokens)")
    lines.append(f"{'shape':<14} {'format':<24} {'features':>10} {'top-k':>8} {'ids+mask':>9} {'total':>10}")
    for shape, sizes in report["bytes_per_token"].items():
        for name, bpt in sizes.items():
            cols = bpt.get("columns", {})
            ids = cols.get("input_ids", 0) + cols.get("loss_mask", 0)
            features = f"{bpt['features']:.1f}" if "features" in bpt else "-"
            topk = f"{bpt['topk']:.1f}" if "topk" in bpt else "-"
            ids_text = f"{ids:.1f}" if cols else "-"
            lines.append(f"{shape:<14} {name:<24} {features:>10} {topk:>8} {ids_text:>9} {bpt['total']:>10.1f}")
    lines += ["", "write (with fsync) and random-access read (one thread, warm page cache; decoded = float32 features)"]
    lines.append("(per CPU-s: bytes over the reader's CPU time, i.e. one core's cost; wall: as this run saw it)")
    lines.append(f"{'shape':<14} {'format':<24} {'write MB/s':>10} {'MB/CPU-s':>8} {'1st sample s':>12} "
                 f"{'tok/CPU-s':>10} {'GB/CPU-s':>9} {'GB/s wall':>9} {'raw GB/CPU-s':>12} {'RSS MB':>7}")
    for r in report["io"]:
        raw = "-" if r["raw_gb_per_cpu_s"] is None else f"{r['raw_gb_per_cpu_s']:.2f}"
        lines.append(f"{r['shape']:<14} {r['format']:<24} {r['write_mb_per_s']:>10.0f} {r['write_mb_per_cpu_s']:>8.0f} "
                     f"{r['first_sample_s']:>12.4f} "
                     f"{r['tokens_per_cpu_s']:>10,.0f} {r['decoded_gb_per_cpu_s']:>9.2f} {r['decoded_gb_per_s']:>9.2f} "
                     f"{raw:>12} {r['peak_rss_mb']:>7.0f}")
    lines += ["", "scan of every sequence (fit's first start counts anchors): loss masks alone vs whole rows via raw()"]
    lines.append(f"{'shape':<14} {'format':<24} {'raw tok/CPU-s':>14} {'mask tok/CPU-s':>15} {'ratio':>7}")
    for r in report["io"]:
        if "mask_tokens_per_cpu_s" in r:
            lines.append(f"{r['shape']:<14} {r['format']:<24} {r['raw_tokens_per_cpu_s']:>14,.0f} "
                         f"{r['mask_tokens_per_cpu_s']:>15,.0f} "
                         f"{r['mask_tokens_per_cpu_s'] / r['raw_tokens_per_cpu_s']:>7.1f}")
    lines += ["", "top-k codec at k = 32 on Zipf-like logits (raw reference: int32 id + fp16 log-prob + fp32 tail)"]
    lines.append(f"{'shape':<14} {'V':>7} {'packed B/token':>14} {'raw B/token':>11} {'mean KL (nats)':>15}")
    for r in report["topk_codec"]:
        lines.append(f"{r['shape']:<14} {r['vocab_size']:>7} {r['packed_bytes_per_token']:>14} "
                     f"{r['raw_reference_bytes_per_token']:>11} {r['mean_kl_nats']:>15.2e}")
    m = report["many_shards"]
    lines += ["", f"{m['num_shards']:,}-shard cache ({m['dir']}): built in {m['build_s']:.1f} s, "
                  f"manifest {m['manifest_bytes'] / 1e6:.1f} MB, "
                  f"open {m['open_s']:.3f} s, open + first sequence {m['open_and_first_read_s']:.3f} s, "
                  f"reader RSS {m['peak_rss_mb']:.0f} MB"]
    lines += ["", "checks: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in report["checks"].items())]
    lines.append(f"bench process peak RSS (holds the generated rows): {report['bench_peak_rss_mb']:.0f} MB, "
                 f"total {report['seconds']:.0f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--dir", help="scratch directory (default: a temporary one under /tmp)")
    parser.add_argument("--smollm-tokens", type=int, default=32768)
    parser.add_argument("--qwen-tokens", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=512, help="mean sequence length")
    parser.add_argument("--many-shards", type=int, default=10_000)
    parser.add_argument("--many-shards-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where to build the many-shard cache (default: /dev/shm, a tmpfs)")
    parser.add_argument("--kl-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "cache":
            result = worker_read_cache(rest[0], int(rest[1]))
        elif kind == "open":
            result = worker_open_first(rest[0])
        else:
            result = worker_read_files(rest[0], int(rest[1]), kind)
        print(json.dumps(result))
        return

    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="shard_io-", dir=args.dir))
    try:
        io, sizes = [], {}
        for shape, tokens in (("smollm2-135m", args.smollm_tokens), ("qwen3-8b", args.qwen_tokens)):
            results, sizes[shape] = bench_shape(shape, tokens, args.seq_len, root, args.seed)
            io += results
        topk = bench_topk(args.kl_tokens, args.seed)
        # Building 10,000 shards costs 30,000 fsyncs, minutes on a slow disk; on tmpfs it is
        # CPU only. Opening reads the (page-cached) manifest and maps one shard either way.
        many_root = Path(tempfile.mkdtemp(prefix="shard_io-many-", dir=args.many_shards_dir))
        try:
            many = bench_many_shards(many_root, args.many_shards, args.seed)
        finally:
            shutil.rmtree(many_root, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fp8_ratio = {shape: s["fp8/packed"]["features"] / s["bf16/packed"]["features"] for shape, s in sizes.items()}
    dflash_bf16 = [r for r in io if r["format"] == "dflash bf16/packed"]
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "config": {"smollm_tokens": args.smollm_tokens, "qwen_tokens": args.qwen_tokens, "seq_len": args.seq_len,
                   "top_k": TOP_K, "many_shards": args.many_shards, "kl_tokens": args.kl_tokens},
        "bytes_per_token": sizes,
        "fp8_over_bf16_feature_bytes": fp8_ratio,
        "io": io,
        "topk_codec": topk,
        "many_shards": many,
        "checks": {
            "open_10k_shards_and_first_read<=1s": many["open_and_first_read_s"] <= 1.0,
            "decoded_feature_read>=1GB/CPU-s": all(r["decoded_gb_per_cpu_s"] >= 1.0 for r in dflash_bf16),
            "topk_k32<=98B/token": all(r["packed_bytes_per_token"] <= 98 for r in topk),
            "topk_mean_kl<=1e-3": all(r["mean_kl_nats"] <= 1e-3 for r in topk),
            "fp8_about_half_of_bf16": all(abs(r - 0.5) < 0.01 for r in fp8_ratio.values()),
        },
        "bench_peak_rss_mb": peak_rss_mb(),
        "load_average": [load_start, os.getloadavg()[0]],
        "seconds": time.perf_counter() - started,
    }
    print(format_tables(report))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
