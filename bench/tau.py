"""Acceptance length (tau) of drafters trained with one budget: the runner the tau benches share.

A job is (label, cache, fit overrides, seed): `dflash-train fit` with the embedded default's
budget (`DEMO_FIT`, as `make demo` trains) plus the overrides, then `eval` offline over all
held-out anchors (with the replayed figure) and online (real speculative decoding with the
target on the first `online_prompts` held-out prompts; basis drafters are folded into fc
for it). Each finished job is appended to WORK/tau.jsonl, keyed by what determines it (cache
folder name, overrides, seed), so a rerun skips it and two benches sharing WORK share their
common runs (the kl baseline of bench/recipe.py is the bf16 row of bench/feature_codecs.py).

`--seed` also draws the held-out set: compare variants within a seed (`paired`), and quote
the spread over seeds beside any mean.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The embedded default's training budget (demo/run.py's settings on the day these benches
# were written, with the loss and norm init of that day spelled out; kept here so that
# records stay comparable when the demo or fit's defaults change).
DEMO_FIT: dict[str, Any] = dict(
    num_layers=1, num_drafts=7, anchors_per_seq=32, tokens_per_step=512, max_steps=400, lr=1e-3, loss="kl",
    norm_init="ones", eval_fraction=0.1, checkpoint_every=400, eval_every=0, spike_warmup_steps=20, device="cpu",
    dtype="float32", wandb=False, log_every=50)
METRICS = ("offline_tau", "replay_tau", "online_tau", "online_replay_tau", "speed_ratio")


@dataclass(frozen=True)
class Job:
    label: str  # the row the report shows (a codec, a recipe variant)
    cache: str
    seed: int
    overrides: dict = field(default_factory=dict, hash=False, compare=False)
    prompts: str | None = None  # the prompts file `cache` was built from, when not run_jobs' one

    @property
    def key(self) -> str:
        return json.dumps({"cache": Path(self.cache).name, "overrides": self.overrides, "seed": self.seed},
                          sort_keys=True)


def _run_job(job: Job, work: str, target: str, prompts: str, online_prompts: int, max_new_tokens: int,
             threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from dflash.train.config import FitConfig
    from dflash.train.evaluate import EvalConfig, run_eval
    from dflash.train.fit import fit

    name = Path(job.cache).name + "".join(f"-{k}={v}" for k, v in sorted(job.overrides.items()))
    run = Path(work) / "runs" / f"{name}-s{job.seed}".replace("/", "_")
    flat = {**DEMO_FIT, **job.overrides}
    if "block_size" in job.overrides:  # a row's rows per block (fit's old key): the kind's num_drafts, not 7
        flat.pop("num_drafts")
    flat["checkpoint_every"] = flat["max_steps"]
    # "extra_cache": a second cache trained on too (same feature basis); every figure stays on
    # the job's own cache (its held-out sequences under the run's split, and its prompts).
    extra = flat.pop("extra_cache", None)
    began = time.perf_counter()
    fit(FitConfig.from_dict({"cache": [job.cache, *([extra] if extra else [])], "out": str(run), "seed": job.seed,
                             **flat}))
    fit_s = time.perf_counter() - began
    torch.manual_seed(0)
    own = job.cache if extra else None
    offline = run_eval(EvalConfig(run=str(run), cache=own, device="cpu", save=False), show_progress=False)
    trained = run_eval(EvalConfig(run=str(run), cache=own, device="cpu", save=False, split="train"),
                       show_progress=False)
    online = run_eval(EvalConfig(run=str(run), cache=job.cache, online=True, target=target,
                                 prompts=job.prompts or prompts,
                                 limit=online_prompts, max_new_tokens=max_new_tokens, device="cpu", save=False),
                      show_progress=False)
    live = online["online"]
    start = start_figures(run)
    return {**start, "key": job.key, "label": job.label, "cache": Path(job.cache).name, "overrides": job.overrides,
            "seed": job.seed, "fit_s": fit_s, "threads": threads,
            "offline_tau": offline["acceptance_length"], "num_anchors": offline["num_anchors"],
            "replay_tau": offline["replay_acceptance_length"],
            "train_tau": trained["acceptance_length"],  # the same figure on the sequences it trained on
            "online_tau": live["acceptance_length"], "online_replay_tau": online["replay_acceptance_length"],
            "online_offline_tau": online["acceptance_length"], "lossless": live["lossless"],
            "num_prompts": live["num_prompts"],
            "speed_ratio": live["tokens_per_s"] / live["baseline_tokens_per_s"]}


PLATEAU_ACCURACY = 0.3  # first-position accuracy that marks the end of the first-steps plateau
PLATEAU_WINDOW = 10  # steps the accuracy is averaged over (one step's 128 blocks are noisy)


def start_figures(run: Path) -> dict:
    """From RUN/metrics.jsonl: the first step's loss (the untrained drafter's), and the first
    step at which the mean first-position accuracy of the last PLATEAU_WINDOW steps reaches
    PLATEAU_ACCURACY (None: never)."""
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = [s["accuracy"][0] or 0.0 for s in steps]
    plateau = next((steps[i]["step"] for i in range(PLATEAU_WINDOW - 1, len(steps))
                    if sum(first[i - PLATEAU_WINDOW + 1:i + 1]) / PLATEAU_WINDOW >= PLATEAU_ACCURACY), None)
    return {"initial_loss": steps[0]["loss"], "plateau_step": plateau}


def run_jobs(jobs: list[Job], work: Path, *, target: Path, prompts: Path, online_prompts: int = 20,
             max_new_tokens: int = 48, workers: int = 1, threads: int | None = None) -> dict[str, dict]:
    """Run the jobs not yet in WORK/tau.jsonl (`workers` at once, each with `threads` torch
    threads: by default the CPU's threads shared out among them); returns every job's record
    by key."""
    log = work / "tau.jsonl"
    done: dict[str, dict] = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                done[record["key"]] = record
    todo = list({job.key: job for job in jobs if job.key not in done}.values())
    threads = threads or max(1, (os.cpu_count() or 1) // max(1, workers))
    args = (str(work), str(target), str(prompts), online_prompts, max_new_tokens, threads)
    if todo:
        print(f"[tau] {len(todo)} runs to do ({len(jobs) - len(todo)} already in {log}), {workers} at once, "
              f"{threads} thread(s) each", file=sys.stderr, flush=True)
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(_run_job, job, *args): job for job in todo}
        for future in as_completed(futures):
            record = future.result()
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
            done[record["key"]] = record
            print(f"[tau] {record['label']} seed {record['seed']}: offline {record['offline_tau']:.3f}, replayed "
                  f"{record['replay_tau']:.3f}, online {record['online_tau']:.3f} ({record['fit_s']:.0f} s fit)",
                  file=sys.stderr, flush=True)
    return {job.key: done[job.key] for job in jobs}


def summarize(jobs: list[Job], records: dict[str, dict], baseline: str | None = None) -> list[dict]:
    """Per label: mean and spread (half the range) over seeds of every metric, and, against
    `baseline`'s label, the mean of the per-seed differences (same seed, same held-out set)."""
    by_label: dict[str, list[dict]] = {}
    for job in jobs:
        by_label.setdefault(job.label, []).append(records[job.key])
    out = []
    for label, rows in by_label.items():
        entry: dict[str, Any] = {"label": label, "seeds": [r["seed"] for r in rows],
                                 "lossless": all(r["lossless"] for r in rows),
                                 "fit_s": statistics.fmean(r["fit_s"] for r in rows),
                                 "initial_loss": [r.get("initial_loss") for r in rows],
                                 "plateau_step": [r.get("plateau_step") for r in rows]}
        for key in METRICS:
            values = [r[key] for r in rows]
            entry[key] = {"mean": statistics.fmean(values),
                          "spread": (max(values) - min(values)) / 2 if len(values) > 1 else 0.0,
                          "values": values}
        if baseline is not None and baseline in by_label:
            base = {r["seed"]: r for r in by_label[baseline]}
            for key in ("offline_tau", "replay_tau", "online_tau"):
                diffs = [r[key] / base[r["seed"]][key] - 1 for r in rows if r["seed"] in base]
                entry[f"{key}_vs_baseline"] = statistics.fmean(diffs) if diffs else None
        out.append(entry)
    return out


def format_table(summary: list[dict], title: str, baseline: str | None = None) -> list[str]:
    """The summary as a table; the percentages are against `baseline` (default: the first row)."""
    def cell(entry: dict, key: str) -> str:
        text = f"{entry[key]['mean']:.3f} +- {entry[key]['spread']:.3f}"
        paired = entry.get(f"{key}_vs_baseline")
        return text if paired is None else f"{text} ({paired:+.1%})"

    against = f"the {baseline} row" if baseline else "the first row"
    lines = [title + f" (mean +- half-range over seeds; (x%): mean per-seed change against {against})",
             f"{'':<24} {'seeds':<6} {'offline':>24} {'replayed':>24} {'online':>24} {'spec/greedy':>11} "
             f"{'lossless':>8} {'fit s':>6} {'loss@1':>7} {'acc>=0.3 at':>14}"]
    for entry in summary:
        lines.append(f"{entry['label']:<24} {','.join(map(str, entry['seeds'])):<6} {cell(entry, 'offline_tau'):>24} "
                     f"{cell(entry, 'replay_tau'):>24} {cell(entry, 'online_tau'):>24} "
                     f"{entry['speed_ratio']['mean']:>10.2f}x {'yes' if entry['lossless'] else 'NO':>8} "
                     f"{entry['fit_s']:>6.0f} {_mean_text(entry.get('initial_loss'), '.1f'):>7} "
                     f"{_steps_text(entry.get('plateau_step')):>14}")
    return lines


def _mean_text(values: list | None, spec: str) -> str:
    known = [v for v in values or [] if v is not None]
    return format(statistics.fmean(known), spec) if known else "-"


def _steps_text(values: list | None) -> str:
    """Per-seed plateau ends, e.g. "60/70/-" ("-": never reached)."""
    return "/".join("-" if v is None else str(v) for v in values) if values else "-"
