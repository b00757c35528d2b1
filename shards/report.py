"""What `dflash-shards` reports: plain functions returning JSON-ready dicts, and their text.

`info` and the length histogram come from the manifest alone; `show` reads one row; `stats`
reads the top-k columns of a deterministic sample of rows (no row checksum, so the feature
bytes are never touched). Tokens are decoded with the cache's own tokenizer when
CACHE/target holds one; transformers is imported only then, so the format itself never
depends on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dflash.shards.reader import Cache, open_cache

_FEATURE_COLUMNS = ("features", "feature_scales")
_TOPK_COLUMNS = ("topk", "topk_ids", "topk_logprobs", "tail_mass")


def bytes_per_token(cache: Cache) -> dict[str, Any]:
    """Stored bytes per token: total (whole shard files), features, topk, and each column."""
    manifest = cache.manifest
    num_tokens = max(1, manifest["num_tokens"])
    columns = {name: size / num_tokens for name, size in sorted(manifest["column_bytes"].items())}
    return {
        "total": sum(s["num_bytes"] for s in manifest["shards"]) / num_tokens,
        "features": sum(columns.get(name, 0.0) for name in _FEATURE_COLUMNS),
        "topk": sum(columns.get(name, 0.0) for name in _TOPK_COLUMNS),
        "columns": columns,
    }


def cache_info(path: str | Path) -> dict[str, Any]:
    cache = open_cache(path)
    manifest, spec = cache.manifest, cache.spec
    return {
        "path": str(cache.path),
        "format_version": manifest["format_version"],
        "created_utc": manifest["created_utc"],
        "num_shards": manifest["num_shards"],
        "num_sequences": manifest["num_sequences"],
        "num_tokens": manifest["num_tokens"],
        "num_loss_tokens": manifest["num_loss_tokens"],
        "num_rejected": manifest["num_rejected"],
        "world_size": manifest["world_size"],
        "top_k": spec.top_k,
        "feature_layers": spec.layer_ids,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "feature_codec": spec.feature_codec,
        "feature_rank": spec.feature_rank,
        "feature_basis": cache.feature_basis_entry,
        "topk_codec": spec.topk_codec,
        "max_length": spec.max_length,
        "logit_temperature": spec.logit_temperature,
        "regenerated": spec.replies[0],
        "generation_temperature": spec.replies[1],
        "target": spec.target,
        "tokenizer_sha256": spec.tokenizer_sha256,
        "inputs": spec.inputs,
        "has_target_dir": cache.target_dir.is_dir(),
        "total_bytes": sum(s["num_bytes"] for s in manifest["shards"]),
        "target_dir_bytes": _folder_bytes(cache.target_dir),
        "bytes_per_token": bytes_per_token(cache),
    }


def _folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (0 when it is absent)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def format_info(info: dict[str, Any]) -> str:
    target = info["target"]
    regen = "no"
    if info["regenerated"]:
        regen = f"yes, at temperature {info['generation_temperature']}"
    bpt = info["bytes_per_token"]
    lines = [
        f"cache        {info['path']} (format version {info['format_version']}, "
        f"finalized {info['created_utc']})",
        f"target       {target.get('name', '?')} ({target.get('model_type', target.get('architecture', '?'))}, "
        f"{target.get('num_layers', '?')} layers, {target.get('dtype', '?')}); "
        f"target/ {'present' if info['has_target_dir'] else 'absent'}",
        f"sequences    {info['num_sequences']:,} in {info['num_shards']:,} shards from "
        f"{info['world_size']} rank(s); {info['num_rejected']:,} rejected",
        f"tokens       {info['num_tokens']:,} ({info['num_loss_tokens']:,} in the loss mask), "
        f"max length {info['max_length']:,}",
        f"features     layers {info['feature_layers']} x hidden {info['hidden_size']}, "
        f"{info['feature_codec']}" + _basis_text(info),
        f"top-k        k={info['top_k']} of V={info['vocab_size']:,}, {info['topk_codec']} codec, "
        f"temperature {info['logit_temperature']}; regenerated: {regen}",
        f"size         {(info['total_bytes'] + info.get('target_dir_bytes', 0)) / 2**20:,.1f} MiB "
        f"(shards {info['total_bytes'] / 2**20:,.1f}, target/ {info.get('target_dir_bytes', 0) / 2**20:,.1f}); "
        f"bytes/token: total "
        f"{bpt['total']:,.1f}, features {bpt['features']:,.1f}, top-k {bpt['topk']:,.1f}",
    ]
    for item in info["inputs"]:
        lines.append(f"input        {item['path']} (sha256 {str(item.get('sha256', '?'))[:12]})")
    return "\n".join(lines)


def _basis_text(info: dict[str, Any]) -> str:
    basis = info.get("feature_basis")
    if not basis:
        return ""
    raw_bf16 = 2 * len(info["feature_layers"]) * info["hidden_size"]
    return (f" coefficients, rank {info['feature_rank']} ({basis['method']} basis "
            f"{basis['sha256'][:12]}, {basis['energy_captured']:.4%} of the energy of "
            f"{basis['num_tokens']:,} sample tokens; features at "
            f"{info['bytes_per_token']['features'] / raw_bf16:.3f}x bf16's {raw_bf16:,} B/token)")


def load_tokenizer(target_dir: Path):
    """The cache's tokenizer, or None when target/ holds none or transformers is missing."""
    if not any((target_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(target_dir))
    except (OSError, ValueError):
        return None


def parse_positions(text: str | None, num_tokens: int) -> tuple[int, int]:
    """"A:B" (Python slice bounds, either may be empty or negative) -> clamped (start, stop)."""
    if text is None:
        return 0, num_tokens
    try:
        start_text, stop_text = text.split(":")
        start = int(start_text) if start_text else 0
        stop = int(stop_text) if stop_text else num_tokens
    except ValueError as error:
        raise ValueError(f"--positions must look like A:B (e.g. 0:32), got {text!r}") from error
    start, stop, _ = slice(start, stop).indices(num_tokens)
    return start, max(start, stop)


def show_row(path: str | Path, row: int, *, positions: str | None = None, top: int = 5) -> dict[str, Any]:
    """One sequence, position by position: token, loss mask, the target's top-`top` candidates
    for the NEXT token as probabilities, and the tail mass."""
    cache = open_cache(path)
    seq = cache[row]
    num_tokens = len(seq.input_ids)
    start, stop = parse_positions(positions, num_tokens)
    tokenizer = load_tokenizer(cache.target_dir)

    def text(token_id: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([int(token_id)])

    top = min(top, cache.spec.top_k)
    out = []
    for t in range(start, stop):
        order = np.argsort(-seq.topk_logprobs[t], kind="stable")[:top]
        out.append({
            "position": t,
            "token_id": int(seq.input_ids[t]),
            "token": text(seq.input_ids[t]),
            "loss_mask": bool(seq.loss_mask[t]),
            "next_token_id": int(seq.input_ids[t + 1]) if t + 1 < num_tokens else None,
            "topk": [
                {"id": int(seq.topk_ids[t, j]), "token": text(seq.topk_ids[t, j]),
                 "prob": float(np.exp(seq.topk_logprobs[t, j]))}
                for j in order
            ],
            "tail_mass": float(seq.tail_mass[t]),
        })
    return {
        "path": str(cache.path),
        "row": cache._index(row),
        "num_sequences": len(cache),
        "source": seq.source,
        "num_tokens": num_tokens,
        "num_loss_tokens": int(seq.loss_mask.sum()),
        "tokenizer": tokenizer is not None,
        "positions": out,
    }


def format_show(shown: dict[str, Any]) -> str:
    def label(token_id: int, token: str | None) -> str:
        return str(token_id) if token is None else repr(token)

    source = shown["source"]
    lines = [
        f"row {shown['row']} of {shown['num_sequences']}: {source['file']} record {source['index']}, "
        f"{shown['num_tokens']} tokens, {shown['num_loss_tokens']} in the loss mask"
        + ("" if shown["tokenizer"] else " (no tokenizer in target/: ids shown)"),
        "the top-k at position t is the target's distribution for token t+1; "
        "* marks the token that follows",
        f"{'pos':>5} {'mask':>4}  {'token':<16} {'tail':>7}  next-token top-k (probability)",
    ]
    for p in shown["positions"]:
        candidates = "  ".join(
            f"{'*' if c['id'] == p['next_token_id'] else ''}{label(c['id'], c['token'])} {c['prob']:.3f}"
            for c in p["topk"]
        )
        lines.append(
            f"{p['position']:>5} {'x' if p['loss_mask'] else '.':>4}  "
            f"{label(p['token_id'], p['token']):<16.16} {p['tail_mass']:>7.4f}  {candidates}"
        )
    return "\n".join(lines)


def _summary(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"mean": float("nan"), "p10": float("nan"), "p50": float("nan"), "p90": float("nan")}
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return {"mean": float(values.mean()), "p10": float(p10), "p50": float(p50), "p90": float(p90)}


def cache_stats(path: str | Path, *, max_sequences: int = 1000, bins: int = 10) -> dict[str, Any]:
    """Length histogram (every sequence, from the manifest) and top-k statistics over up to
    `max_sequences` evenly spaced sequences: top-k mass coverage (1 - tail), entropy of the
    top-k-plus-tail distribution (the tail as one bucket: a lower bound on the target's
    entropy), top-1 probability; and bytes per token by column."""
    if max_sequences < 1:
        raise ValueError(f"--max-sequences must be >= 1, got {max_sequences}")
    cache = open_cache(path, check_rows=False)
    lengths = cache.lengths
    counts, edges = np.histogram(lengths, bins=bins, range=(0, max(1, int(lengths.max(initial=1)))))
    sample = np.unique(np.linspace(0, len(cache) - 1, min(len(cache), max_sequences)).round().astype(int))
    coverage, entropy, top1 = [], [], []
    for i in sample:
        raw = cache.raw(int(i))
        probs = np.exp(raw.topk_logprobs.astype(np.float64))  # [T, k]
        tail = raw.tail_mass.astype(np.float64)  # [T]
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -(probs * np.log(probs)).sum(1) - np.where(tail > 0, tail * np.log(tail), 0.0)
        coverage.append(1.0 - tail)
        entropy.append(h)
        top1.append(probs.max(1))

    def concat(parts):
        return np.concatenate(parts) if parts else np.zeros(0)

    return {
        "path": str(cache.path),
        "num_sequences": len(cache),
        "num_sampled_sequences": int(sample.size),
        "num_sampled_tokens": int(sum(len(c) for c in coverage)),
        "length": {
            **_summary(lengths.astype(np.float64)),
            "min": int(lengths.min()) if lengths.size else 0,
            "max": int(lengths.max()) if lengths.size else 0,
            "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        },
        "topk_mass": _summary(concat(coverage)),
        "entropy_nats": _summary(concat(entropy)),
        "top1_prob": _summary(concat(top1)),
        "bytes_per_token": bytes_per_token(cache),
        "_samples": {"topk_mass": concat(coverage), "entropy_nats": concat(entropy), "top1_prob": concat(top1)},
    }


def format_stats(stats: dict[str, Any]) -> str:
    length = stats["length"]
    lines = [
        f"{stats['num_sequences']:,} sequences; top-k statistics over {stats['num_sampled_tokens']:,} "
        f"positions of {stats['num_sampled_sequences']:,} sequences",
        f"length       mean {length['mean']:.1f}, min {length['min']}, p50 {length['p50']:.0f}, "
        f"p90 {length['p90']:.0f}, max {length['max']}",
    ]
    hist = length["histogram"]
    peak = max(1, max(hist["counts"]))
    last = len(hist["counts"]) - 1
    for i, (low, high, count) in enumerate(zip(hist["edges"], hist["edges"][1:], hist["counts"])):
        close = "]" if i == last else ")"  # numpy's last bin includes its upper edge (the maximum)
        lines.append(f"  [{low:>8.0f}, {high:>8.0f}{close}  {count:>8}  {'#' * round(40 * count / peak)}")
    for key, name in (("topk_mass", "top-k mass"), ("entropy_nats", "entropy"), ("top1_prob", "top-1 prob")):
        s = stats[key]
        lines.append(f"{name:<12} mean {s['mean']:.4f}, p10 {s['p10']:.4f}, p50 {s['p50']:.4f}, p90 {s['p90']:.4f}")
    bpt = stats["bytes_per_token"]
    lines.append(f"bytes/token  total {bpt['total']:,.1f}, features {bpt['features']:,.1f}, top-k {bpt['topk']:,.1f}")
    for name, size in bpt["columns"].items():
        lines.append(f"  {name:<16} {size:>12,.2f}")
    return "\n".join(lines)


def check_plot_path(out: str | Path) -> None:
    """Refuse a --plot path whose folder does not exist (before the statistics are computed)."""
    folder = Path(out).parent
    if not folder.is_dir():
        raise ValueError(f"--plot {out}: folder {folder} does not exist; create it or choose another path")


def plot_stats(stats: dict[str, Any], out: str | Path) -> None:
    """Draw the length histogram, the three top-k distributions and bytes per token as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError("--plot needs matplotlib: pip install 'dflash[plot]'") from error
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    hist = stats["length"]["histogram"]
    edges = np.asarray(hist["edges"])
    axes[0, 0].bar(edges[:-1], hist["counts"], width=np.diff(edges), align="edge")
    axes[0, 0].set(title="sequence length", xlabel="tokens", ylabel="sequences")
    for ax, key, title in (
        (axes[0, 1], "topk_mass", "top-k mass coverage (1 - tail)"),
        (axes[0, 2], "entropy_nats", "target entropy (top-k + tail bucket), nats"),
        (axes[1, 0], "top1_prob", "top-1 probability"),
    ):
        ax.hist(stats["_samples"][key], bins=50)
        ax.set(title=title, ylabel="positions")
    columns = stats["bytes_per_token"]["columns"]
    axes[1, 1].barh(list(columns), list(columns.values()))
    axes[1, 1].set(title="bytes per token by column", xscale="log")
    axes[1, 2].axis("off")
    summary = "\n".join(line for line in format_stats(stats).splitlines() if not line.startswith(" "))
    axes[1, 2].text(0, 1, summary, va="top", family="monospace", fontsize=8)
    fig.suptitle(stats["path"])
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def format_verify(report: dict[str, Any]) -> str:
    if report["ok"]:
        return f"ok: {report['num_shards']} shards, {report['num_sequences']} sequences verified"
    lines = [f"FAILED: {len(report['problems'])} problem(s)"]
    # Problems raised by the reader advise running verify; verify itself says what follows it.
    lines += [f"  {p['shard'] or '(cache)'}: "
              + p["problem"].replace("run `dflash-shards verify` on the cache and re-run", "re-run")
              .replace("`dflash-shards verify` on the cache and re-run", "re-run")
              .replace("run `dflash-shards verify` and re-run", "re-run")
              for p in report["problems"]]
    return "\n".join(lines)
