"""Training recipe: which loss, start, learning rate, block size and budget make the best drafter.

Every variant trains on the same cache with the embedded default's budget (bench/tau.py's
`DEMO_FIT`: 1 layer, block 8, 400 steps of 512 block tokens, lr 1e-3, float32 on CPU) changed
in one place, for each seed; then offline tau over all held-out anchors, the replayed tau and
online tau (real speculative decoding with the target, lossless checked) on the first
held-out prompts, and the speculative / plain greedy speed ratio. The seed also draws the held-out
set, so each variant is compared with the baseline within a seed (the percentage) as well as
by mean and spread.

    python -m bench.recipe --cache .demo/cache --target .demo/smollm2-135m-instruct \\
        --prompts .demo/chitchat.jsonl --work /tmp/recipe [--variants kl,ce] [--workers 2] [--json]

Shares WORK/tau.jsonl with bench/feature_codecs.py: point both at one WORK (and the bf16
cache of that bench) and the kl baseline runs once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

from bench.tau import Job, format_table, run_jobs, summarize

# label -> fit overrides (flat FitConfig keys) over DEMO_FIT (whose loss is kl). The loss and
# norm-init rows change one thing against kl; the rows after them change one thing against
# kl+ce, fit's default since the loss rows chose it (read them with --baseline kl+ce).
KL_CE = {"loss": "kl+ce"}
VARIANTS: dict[str, dict] = {
    "kl (top-32 KL)": {},
    "ce (target top-1)": {"loss": "ce"},
    "kl+ce": KL_CE,
    "norm from target (kl)": {"norm_init": "target"},
    "lr 2e-3 (kl+ce)": {**KL_CE, "lr": 2e-3},
    "block 4 (kl+ce)": {**KL_CE, "block_size": 4},
    "block 16 (kl+ce)": {**KL_CE, "block_size": 16},
    "more data (kl+ce)": KL_CE,  # on --more-data's cache: more regenerated conversations, the same steps
}
MORE_DATA = "more data (kl+ce)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="the embedded default's cache (.demo/cache)")
    parser.add_argument("--target", type=Path, required=True, help="the target folder (online tau)")
    parser.add_argument("--prompts", type=Path, required=True, help="the prompts file the cache was built from")
    parser.add_argument("--work", type=Path, required=True, help="where runs and tau.jsonl go (reused)")
    parser.add_argument("--variants", default="all",
                        help=f"comma-separated labels (or their first words), or all: {', '.join(VARIANTS)}")
    parser.add_argument("--baseline", default="kl+ce",
                        help="the row every other is compared with, seed by seed (fit's default loss)")
    parser.add_argument("--more-data", type=Path,
                        help=f"for '{MORE_DATA}': a cache built like --cache from more conversations")
    parser.add_argument("--more-data-prompts", type=Path, help="the prompts file --more-data was built from")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=1, help="runs at once (the CPU's threads shared out)")
    parser.add_argument("--threads", type=int,
                        help="torch threads per run (default: the CPU's shared out among the workers)")
    parser.add_argument("--online-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.variants == "all":
        chosen = list(VARIANTS)
    else:
        wanted = args.variants.split(",")

        def matches(label: str, word: str) -> bool:
            return label == word or label.startswith(word + " ")

        chosen = [label for label in VARIANTS if any(matches(label, w) for w in wanted)]
        unknown = [w for w in wanted if not any(matches(label, w) for label in VARIANTS)]
        if unknown:
            parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    baseline = args.baseline
    if baseline not in VARIANTS:
        parser.error(f"--baseline: unknown {baseline!r}; choose from {list(VARIANTS)}")
    if baseline not in chosen:
        chosen.insert(0, baseline)  # every variant is read against it
    if MORE_DATA in chosen and args.more_data is None:
        if args.variants != "all":
            parser.error(f"--variants '{MORE_DATA}' needs --more-data CACHE")
        chosen.remove(MORE_DATA)
    if args.more_data is not None and args.more_data_prompts is None:
        parser.error("--more-data needs --more-data-prompts (the prompts file it was built from)")
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}, "
                         f"load average {os.getloadavg()[0]:.1f} at start"}

    def job(label: str, seed: int) -> Job:
        if label == MORE_DATA:
            return Job(label, str(args.more_data), seed, VARIANTS[label], prompts=str(args.more_data_prompts))
        return Job(label, str(args.cache), seed, VARIANTS[label])

    jobs = [job(label, int(seed))
            for seed in args.seeds.split(",") for label in chosen]
    records = run_jobs(jobs, args.work, target=args.target, prompts=args.prompts,
                       online_prompts=args.online_prompts, max_new_tokens=args.max_new_tokens, workers=args.workers,
                       threads=args.threads)
    report["runs"] = [records[job.key] for job in jobs]
    report["summary"] = summarize(jobs, records, baseline=baseline)
    report["seconds"] = time.perf_counter() - started
    print(f"recipe benchmark, {report['date']}, {report['machine']}\n")
    print("\n".join(format_table(report["summary"], f"tau on {args.cache.name}, one change per row",
                                        baseline=baseline)))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
