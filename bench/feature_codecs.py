"""Feature codecs: bytes per token, write and read speed, and acceptance length (tau).

Three parts, each optional:

- caches: the embedded default's regenerated bf16 cache (`--source`, e.g. .demo/cache from
  `make demo`) is transcoded (`dflash.shards.transcode`) into every codec of the grid: bf16,
  fp8, and the basis codecs at r in {H/2, H, 2H} x {bf16, fp8 coefficients}. All caches,
  bf16 included, are written from the same decoded rows, so they hold the same sequences,
  loss masks and top-k; only the features differ. Reported: feature bytes per token (and
  against bf16), the basis's captured energy and fit time, and the write throughput (tokens
  per second validated, encoded and written; the target forward is not part of it).
- reads: random-access reads in a fresh one-thread process (bench/shard_io.py's workers):
  `raw` (the zero-copy views training maps, row checksum and top-k decode included) and
  `decoded` (float32 features, or coefficients), against safetensors files per sample (the
  speculators layout, bf16 features) of the same rows, at the two shard_io shapes
  (synthetic rows; the basis there is r columns of the identity: the read path does not
  depend on its values) and on the embedded default's own caches.
- tau: for each codec and seed, `dflash-train fit` with the demo's budget (1 layer, block 8,
  400 steps of 512 tokens, lr 1e-3), then `eval` offline over all held-out anchors (with the
  replayed figure) and online (real speculative decoding with the target on the first
  `--online-prompts` held-out prompts; basis drafters are folded into fc for it): the runner
  of bench/tau.py, which appends each run to WORK/tau.jsonl and skips what is there.

    python -m bench.feature_codecs --source .demo/cache --target .demo/smollm2-135m-instruct \\
        --prompts .demo/chitchat.jsonl --work /tmp/codecs [--parts caches,reads,tau] [--workers 2] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.tau import DEMO_FIT, Job, format_table, run_jobs, summarize

HERE = Path(__file__).resolve().parent
GRID = [("bf16", None), ("fp8", None), ("basis-bf16", 0.5), ("basis-bf16", 1), ("basis-bf16", 2),
        ("basis-fp8", 0.5), ("basis-fp8", 1), ("basis-fp8", 2)]
READ_GRID = [("bf16", None), ("fp8", None), ("basis-bf16", 1), ("basis-fp8", 1)]


def codec_name(codec: str, factor: float | None) -> str:
    if factor is None:
        return codec
    return f"{codec} r={'H/2' if factor == 0.5 else 'H' if factor == 1 else f'{factor:g}H'}"


def slug(name: str) -> str:
    return name.replace(" r=", "-r").replace("/", "_")


def shard_io():
    spec = importlib.util.spec_from_file_location("shard_io", HERE / "shard_io.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- caches

def build_caches(source: Path, work: Path, grid, sample_tokens: int) -> list[dict]:
    from dflash.shards import open_cache
    from dflash.shards.report import bytes_per_token
    from dflash.shards.transcode import sample_moment, transcode_cache

    hidden = open_cache(source).spec.hidden_size
    moment = None  # one sample's second moment for every rank (its fit time is counted once)
    out = []
    for codec, factor in grid:
        name = codec_name(codec, factor)
        path = work / "caches" / slug(name)
        timing_path = path.with_suffix(".timing.json")
        if not timing_path.is_file():
            shutil.rmtree(path, ignore_errors=True)
            moment_s = 0.0
            if factor is not None and moment is None:
                began = time.perf_counter()
                moment = sample_moment(open_cache(source), sample_tokens)
                moment_s = time.perf_counter() - began
            timing = transcode_cache(source, path, feature_codec=codec,
                                     feature_rank=None if factor is None else int(hidden * factor),
                                     basis_sample_tokens=sample_tokens, moment=moment)
            timing["fit_s"] += moment_s
            timing_path.write_text(json.dumps(timing))
        timing = json.loads(timing_path.read_text())
        cache = open_cache(path)
        bpt = bytes_per_token(cache)
        basis = cache.feature_basis_entry or {}
        out.append({"codec": name, "path": str(path), "feature_rank": cache.spec.feature_rank,
                    "features_bytes_per_token": bpt["features"], "total_bytes_per_token": bpt["total"],
                    "write_tokens_per_s": timing["num_tokens"] / timing["write_s"], "fit_s": timing["fit_s"],
                    "energy_captured": basis.get("energy_captured"), "basis_sample_tokens": basis.get("num_tokens")})
    bf16 = next(r["features_bytes_per_token"] for r in out if r["codec"] == "bf16")
    for r in out:
        r["features_vs_bf16"] = r["features_bytes_per_token"] / bf16
    return out


# ----------------------------------------------------------------------------- reads

def identity_basis(input_width: int, rank: int):
    """r columns of the identity, spread over the input: a valid orthonormal basis, cheap at
    any size (the read path and the encode matmul do not depend on the values)."""
    from dflash.shards.basis import FeatureBasis

    projection = np.zeros((input_width, rank), dtype=np.float32)
    projection[np.linspace(0, input_width - 1, rank).astype(np.int64), np.arange(rank)] = 1
    return FeatureBasis(projection=projection, scale=np.ones(input_width, np.float32),
                        eigenvalues=np.ones(input_width), num_tokens=1)


def write_rows(path: Path, spec, rows: list[dict], basis=None) -> None:
    from dflash.shards import CacheWriter, finalize_cache
    from dflash.shards.basis import write_basis

    if basis is not None:
        write_basis(path, basis)
    writer = CacheWriter(path, spec, basis=basis)
    for index, row in enumerate(rows):
        writer.add(**row, source={"file": "synthetic.jsonl", "index": index})
    writer.close()
    finalize_cache(path, spec, 1)


def read_bench_synthetic(sio, shape: str, num_tokens: int, seq_len: int, root: Path, seed: int) -> list[dict]:
    from dflash.shards.synthetic import synthetic_row

    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq_len // 2, seq_len * 3 // 2 + 1, size=max(2, num_tokens // seq_len))
    base = sio.spec_for(shape, "bf16", "packed", int(lengths.max()))
    rows = [synthetic_row(rng, base, int(n)) for n in lengths]
    results = []
    width = base.num_layers * base.hidden_size
    for codec, factor in READ_GRID:
        rank = None if factor is None else int(base.hidden_size * factor)
        spec = sio.spec_for(shape, codec, "packed", int(lengths.max()), feature_rank=rank)
        path = root / f"{shape}-{slug(codec_name(codec, factor))}"
        write_rows(path, spec, rows, identity_basis(width, rank) if rank else None)
        results.append({"shape": shape, "format": f"dflash {codec_name(codec, factor)}",
                        **sio.run_worker("cache", str(path), str(seed))})
        shutil.rmtree(path)
    path = root / f"{shape}-safetensors"
    sio.write_files(path, rows, "safetensors")
    results.append({"shape": shape, "format": "safetensors per sample",
                    **sio.run_worker("safetensors", str(path), str(seed))})
    shutil.rmtree(path)
    return results


def read_bench_demo(sio, caches: list[dict], source: Path, root: Path, seed: int) -> list[dict]:
    from dflash.shards import open_cache

    results = []
    for entry in caches:
        if entry["codec"] in [codec_name(c, f) for c, f in READ_GRID]:
            results.append({"shape": "demo cache", "format": f"dflash {entry['codec']}",
                            **sio.run_worker("cache", entry["path"], str(seed))})
    cache = open_cache(source)
    rows = []
    for i in range(len(cache)):
        seq = cache[i]
        rows.append({"input_ids": seq.input_ids, "loss_mask": seq.loss_mask, "features": seq.features,
                     "topk_ids": seq.topk_ids, "topk_logprobs": seq.topk_logprobs})
    path = root / "demo-safetensors"
    sio.write_files(path, rows, "safetensors")
    results.append({"shape": "demo cache", "format": "safetensors per sample",
                    **sio.run_worker("safetensors", str(path), str(seed))})
    shutil.rmtree(path)
    return results


# ----------------------------------------------------------------------------- tau

def tau_jobs(caches: list[dict], seeds: list[int], codecs: list[str], max_steps: int) -> list[Job]:
    by_name = {c["codec"]: c for c in caches}
    overrides = {} if max_steps == DEMO_FIT["max_steps"] else {"max_steps": max_steps}
    return [Job(label=name, cache=by_name[name]["path"], seed=seed, overrides=overrides)
            for seed in seeds for name in codecs]  # seed-major: a partial grid still compares every codec


# ----------------------------------------------------------------------------- report

def format_report(report: dict) -> str:
    lines = [f"feature_codecs benchmark, {report['date']}, {report['machine']}", ""]
    if report.get("caches"):
        lines.append("embedded default's cache (SmolLM2-135M, 5 x 576 features), every codec from one source")
        lines.append(f"{'codec':<18} {'feat B/tok':>10} {'x bf16':>7} {'total B/tok':>11} {'energy':>8} "
                     f"{'fit s':>6} {'write tok/s':>11}")
        for r in report["caches"]:
            energy = "-" if r["energy_captured"] is None else f"{r['energy_captured']:.4%}"
            lines.append(f"{r['codec']:<18} {r['features_bytes_per_token']:>10,.1f} {r['features_vs_bf16']:>7.3f} "
                         f"{r['total_bytes_per_token']:>11,.1f} {energy:>8} {r['fit_s']:>6.1f} "
                         f"{r['write_tokens_per_s']:>11,.0f}")
        lines.append("")
    if report.get("reads"):
        lines.append("random-access reads, one thread, warm page cache (tokens per CPU-second; raw = zero-copy views)")
        lines.append(f"{'shape':<14} {'format':<26} {'raw tok/CPU-s':>13} {'decoded tok/CPU-s':>17} "
                     f"{'vs safetensors':>14}")
        for shape in dict.fromkeys(r["shape"] for r in report["reads"]):
            rows = [r for r in report["reads"] if r["shape"] == shape]
            base = next(r["tokens_per_cpu_s"] for r in rows if r["format"] == "safetensors per sample")
            for r in rows:
                raw = r.get("raw_tokens_per_cpu_s")
                best = raw if raw is not None else r["tokens_per_cpu_s"]
                lines.append(f"{shape:<14} {r['format']:<26} {'-' if raw is None else f'{raw:,.0f}':>13} "
                             f"{r['tokens_per_cpu_s']:>17,.0f} {best / base:>13.2f}x")
        lines.append("")
    if report.get("tau"):
        lines += format_table(report["tau"], "tau on the embedded default, every codec with the same budget")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, help="the embedded default's bf16 cache (.demo/cache)")
    parser.add_argument("--target", type=Path, help="the target folder (online tau)")
    parser.add_argument("--prompts", type=Path, help="the prompts file the cache was built from (online tau)")
    parser.add_argument("--work", type=Path, required=True, help="where caches, runs and tau.jsonl go (reused)")
    parser.add_argument("--parts", default="caches,reads,tau")
    parser.add_argument("--codecs", default="bf16,fp8,basis-bf16 r=H,basis-fp8 r=H",
                        help="codecs trained for tau, comma-separated (names as in the table), or 'all'")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--workers", type=int, default=1, help="tau runs at once (the CPU's threads shared out)")
    parser.add_argument("--online-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--sample-tokens", type=int, default=65536, help="basis sample (stage one's default)")
    parser.add_argument("--smollm-tokens", type=int, default=32768)
    parser.add_argument("--qwen-tokens", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict = {"date": datetime.date.today().isoformat(),
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}, "
                               f"load average {os.getloadavg()[0]:.1f} at start"}
    caches = []
    if args.source is not None and ({"caches", "tau"} & parts or "reads" in parts):
        caches = build_caches(args.source, args.work, GRID, args.sample_tokens)
        report["caches"] = caches
    if "reads" in parts:
        sio = shard_io()
        root = Path(tempfile.mkdtemp(prefix="feature_codecs-", dir=args.work))
        try:
            reads = []
            for shape, tokens in (("smollm2-135m", args.smollm_tokens), ("qwen3-8b", args.qwen_tokens)):
                reads += read_bench_synthetic(sio, shape, tokens, args.seq_len, root, 0)
            if caches:
                reads += read_bench_demo(sio, caches, args.source, root, 0)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        report["reads"] = reads
    if "tau" in parts:
        codecs = [codec_name(c, f) for c, f in GRID] if args.codecs == "all" else args.codecs.split(",")
        jobs = tau_jobs(caches, [int(seed) for seed in args.seeds.split(",")], codecs, args.max_steps)
        records = run_jobs(jobs, args.work, target=args.target, prompts=args.prompts,
                           online_prompts=args.online_prompts, max_new_tokens=args.max_new_tokens,
                           workers=args.workers)
        report["tau_runs"] = [records[job.key] for job in jobs]
        report["tau"] = summarize(jobs, records, baseline="bf16" if "bf16" in codecs else None)
    report["seconds"] = time.perf_counter() - started
    print(format_report(report))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
