"""Warm start: what `fit --init-from` buys over training from scratch, at the same budget.

For each seed, on a new cache (a target derived from the source's, with its own replies):
(a) fit from scratch; (b) fit --init-from the given drafter; (c) fit --init-from onto a basis
cache of the same rows (optional); and the unchanged source on the new cache, what the
fine-tune is measured against. Offline tau over the run's held-out anchors (the source is
scored on run (a)'s held-out sequences, the same set for a seed), and online tau when
--target and --prompts are given. Every fit uses the same flat FitConfig overrides (--fit).

    python -m bench.warm_start --cache NEW_CACHE --init-from DRAFTER [--basis-cache BASIS_CACHE] \\
        [--target NEW_TARGET --prompts PROMPTS] --work /tmp/warm [--seeds 0,1,2] [--json]
    python -m bench.warm_start --tiny --work /tmp/warm   # synthetic caches and source, seconds

The last line with --json is one JSON object: {"rows": [...], "summary": {...}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

# The budget of every fit, over fit's defaults (flat FitConfig keys); --fit adds to it.
BUDGET: dict[str, Any] = {"max_steps": 200, "tokens_per_step": 512, "lr": 1e-3, "num_drafts": 7,
                          "eval_every": 0, "eval_fraction": 0.1, "wandb": False, "log_every": 1000,
                          "checkpoint_every": 100000, "device": "cpu", "dtype": "float32"}
TINY_BUDGET: dict[str, Any] = {"max_steps": 12, "tokens_per_step": 96, "num_drafts": 3, "num_layers": 1}
ROWS = ("source, unchanged", "(a) from scratch", "(b) warm start", "(c) warm start onto basis")


def fit_run(cache: Path, out: Path, seed: int, budget: dict[str, Any], init_from: Path | None) -> Path:
    """A finished run in `out` (an existing one is resumed, i.e. reused)."""
    from dflash.train.config import FitConfig
    from dflash.train.fit import fit

    values = {"cache": [str(cache)], "out": str(out), "seed": seed, **budget}
    if init_from is not None:
        values.update(init_from=str(init_from), num_layers=None)  # the source's depth
    fit(FitConfig.from_dict(values))
    return out


def tau(run: Path, cache: Path, *, checkpoint: Path | None = None, target: Path | None = None,
        prompts: Path | None = None, limit: int | None = None) -> dict[str, float | None]:
    """Offline (held-out) and, with a target, online tau of the run's checkpoint (or `checkpoint`)."""
    from dflash.train.evaluate import EvalConfig, run_eval

    online = target is not None and prompts is not None
    result = run_eval(EvalConfig(run=str(run), checkpoint=str(checkpoint) if checkpoint else None,
                                 cache=str(cache), online=online, target=str(target) if online else None,
                                 prompts=str(prompts) if online else None, limit=limit, save=False,
                                 device="cpu", dtype="float32"), show_progress=False)
    return {"offline_tau": result.get("acceptance_length"),
            "online_tau": (result.get("online") or {}).get("acceptance_length")}


def measure(args: argparse.Namespace, budget: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        extra = dict(target=args.target, prompts=args.prompts, limit=args.limit)
        scratch = fit_run(args.cache, args.work / f"scratch-{seed}", seed, budget, None)
        warm = fit_run(args.cache, args.work / f"warm-{seed}", seed, budget, args.init_from)
        found = {ROWS[0]: tau(scratch, args.cache, checkpoint=args.init_from, **extra),
                 ROWS[1]: tau(scratch, args.cache, **extra), ROWS[2]: tau(warm, args.cache, **extra)}
        if args.basis_cache is not None:
            basis = fit_run(args.basis_cache, args.work / f"warm-basis-{seed}", seed, budget, args.init_from)
            found[ROWS[3]] = tau(basis, args.basis_cache, **extra)
        rows += [{"variant": name, "seed": seed, **figures} for name, figures in found.items()]
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Mean and spread per variant and measure (None where not measured)."""
    summary = {}
    for name in dict.fromkeys(row["variant"] for row in rows):
        mine = [row for row in rows if row["variant"] == name]
        summary[name] = {}
        for key in ("offline_tau", "online_tau"):
            values = [row[key] for row in mine if row[key] is not None]
            summary[name][key] = ({"mean": statistics.fmean(values), "stdev": statistics.stdev(values)
                                   if len(values) > 1 else 0.0, "n": len(values)} if values else None)
    return summary


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    def cell(entry):
        return "-" if entry is None else f"{entry['mean']:.3f} ± {entry['stdev']:.3f} (n={entry['n']})"

    lines = ["| variant | offline tau | online tau |", "|---|---|---|"]
    lines += [f"| {name} | {cell(s['offline_tau'])} | {cell(s['online_tau'])} |" for name, s in summary.items()]
    return "\n".join(lines)


def make_tiny(work: Path, budget: dict[str, Any]) -> tuple[Path, Path, Path]:
    """Synthetic stand-ins: a source drafter trained on one cache, a new cache of other rows of
    the same target shape, and that cache as basis-bf16 coefficients. (new, source, basis)."""
    from dflash.train.export import export_run
    from dflash.train.synthetic import write_synthetic_training_cache

    lengths = [40, 56, 33, 71, 48, 64, 29, 52, 45, 60, 38, 66, 50, 35, 58, 44]
    paths = {name: work / name for name in ("source-cache", "new-cache", "basis-cache")}
    if not paths["source-cache"].exists():
        write_synthetic_training_cache(paths["source-cache"], lengths=lengths, seed=1)
        write_synthetic_training_cache(paths["new-cache"], lengths=lengths, seed=2)
        write_synthetic_training_cache(paths["basis-cache"], lengths=lengths, seed=2, feature_codec="basis-bf16",
                                       feature_rank=48)
    source = work / "source-export"
    if not source.exists():
        run = fit_run(paths["source-cache"], work / "source-run", 0, budget, None)
        export_run(run, source, dtype="float32")
    return paths["new-cache"], source, paths["basis-cache"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, help="the new cache (the derived target's own replies)")
    parser.add_argument("--init-from", type=Path, help="the drafter to warm-start from (export, run or checkpoint)")
    parser.add_argument("--basis-cache", type=Path, help="the new cache's rows as basis coefficients (row c)")
    parser.add_argument("--target", type=Path, help="the derived target's folder (online tau)")
    parser.add_argument("--prompts", type=Path, help="the prompts file the new cache was built from (online tau)")
    parser.add_argument("--limit", type=int, help="online: at most this many prompts")
    parser.add_argument("--work", type=Path, required=True, help="where runs go (finished runs are reused)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--fit", default="{}", help="JSON object of fit overrides over the budget")
    parser.add_argument("--tiny", action="store_true", help="synthetic caches and source under WORK (seconds)")
    parser.add_argument("--json", action="store_true", help="print the rows and summary as JSON, last line")
    args = parser.parse_args()
    budget = {**BUDGET, **(TINY_BUDGET if args.tiny else {}), **json.loads(args.fit)}
    args.work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.cache, args.init_from, args.basis_cache = make_tiny(args.work, budget)
    elif args.cache is None or args.init_from is None:
        parser.error("give --cache and --init-from (or --tiny)")
    from dflash.train.init_from import read_source

    # From scratch at the source's depth: the same drafter, only the start differs.
    budget["num_layers"] = read_source(args.init_from).config.num_hidden_layers
    rows = measure(args, budget)
    summary = summarize(rows)
    print(format_table(summary))
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary, "budget": budget}))


if __name__ == "__main__":
    main()
