"""Fault-tolerance trials: kill, starve, corrupt and poison dflash, and count what survives.

The trial runner, the table and the command line; the fault classes are the modules beside
this one (see the package docstring, `tests/faults/__init__.py`). Run from the repository
root:

    python -m tests.faults                  # 3 trials of every class
    python -m tests.faults --trials 20      # the Done-when run
    python -m tests.faults --classes bad-input --seed 0 --trial 7    # one trial again
    python -m tests.faults --json           # ... and one JSON object as the last line
    python -m tests.faults --classes fit-kill --trials 50 --load 4    # beside 4 busy processes
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.faults.bad_input import trial_bad_input
from tests.faults.corruption import trial_corruption
from tests.faults.disk_full import trial_disk_full
from tests.faults.fit_kill import trial_fit_kill
from tests.faults.numeric import trial_numeric
from tests.faults.precompute_kill import trial_precompute_kill
from tests.faults.refusals import trial_empty_input, trial_second_writer, trial_wrong_target
from tests.faults.untrusted import trial_untrusted
from tests.faults.workspace import CHILD_ENV, COUNTED_NOTES, Outcome, Workspace

# The order is part of the seeding: trial t of class c draws from default_rng([seed, c, t]).
CLASSES: dict[str, tuple[Callable, str]] = {
    "precompute-kill": (trial_precompute_kill, "SIGKILL of dflash-precompute, rerun"),
    "fit-kill": (trial_fit_kill, "SIGKILL of dflash-train fit (random instant, step, snapshot, write, rename), resume"),
    "disk-full": (trial_disk_full, "file-size limit in stage one and in a checkpoint write, rerun"),
    "corruption": (trial_corruption, "truncation, bit flips, footer/manifest damage, missing/foreign shard"),
    "bad-input": (trial_bad_input, "malformed records (JSON, types, roles, empty, huge, UTF-8, surrogates)"),
    "numeric": (trial_numeric, "NaN/Inf/huge-loss batches, isolated and persistent"),
    "untrusted": (trial_untrusted, "pickle payloads in checkpoints/index/head, paths escaping the cache"),
    "wrong-target": (trial_wrong_target, "caches, a resume or an eval of another target's cache"),
    "second-writer": (trial_second_writer, "a second fit on a held run folder; the holder killed"),
    "empty-input": (trial_empty_input, "empty, blank, all-malformed or all-cut input to stage one"),
}



@dataclass(kw_only=True)
class FaultsConfig:
    """What `run_faults` runs."""

    trials: int = 3
    """Trials per fault class."""
    seed: int = 0
    """Base seed: trial t of class c draws from default_rng([seed, c, t])."""
    classes: list[str] = field(default_factory=lambda: list(CLASSES))
    """Fault classes to run, by name."""
    first_trial: int = 0
    """Index of the first trial (to rerun one failing trial: --trial T)."""
    workdir: Path | None = None
    """Where targets, caches and runs go; None: a temporary folder deleted at the end."""
    load: int = 0
    """Busy-loop processes running beside the trials (and the reference runs), killed at the
    end: kills and writes land at other instants on a loaded machine."""
    engine: str = "transformers"
    """Stage one's engine in the precompute trials (`--engine`): vllm runs them on a target
    vLLM's CPU backend serves (run from the engine venv)."""

    def __post_init__(self) -> None:
        if self.load < 0:
            raise ValueError(f"--load must be >= 0, got {self.load}")
        if self.trials < 1:
            raise ValueError(f"--trials must be >= 1, got {self.trials}")
        if self.first_trial < 0:
            raise ValueError(f"--trial must be >= 0, got {self.first_trial}")
        unknown = [c for c in self.classes if c not in CLASSES]
        if unknown:
            raise ValueError(f"unknown fault class(es) {unknown}; choose from {list(CLASSES)}")



# A busy process spins until it is killed, its parent is gone, or this many seconds passed.
LOAD_MAX_S = 4 * 3600
SPIN = f"""
import os, time
parent, end = os.getppid(), time.monotonic() + {LOAD_MAX_S}
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(1_000_000):
        pass
"""


@contextlib.contextmanager
def cpu_load(num_processes: int):
    """`num_processes` processes that spin on a CPU each while the block runs."""
    processes = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(num_processes)]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


def run_trial(ws: Workspace, name: str, seed: int, trial: int) -> list[Outcome]:
    """One trial of class `name`; an exception in the harness itself is a failed trial."""
    rng = np.random.default_rng([seed, list(CLASSES).index(name), trial])
    try:
        return CLASSES[name][0](ws, rng, trial)
    except Exception:  # noqa: BLE001 - reported, the other trials go on
        return [Outcome(case="harness error", problems=["".join(traceback.format_exc().splitlines(True)[-8:])])]


def run_faults(config: FaultsConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    """Run the trials; returns {"classes": {name: counts and failures}, ...} (see main)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # in-process runs compared bit for bit share one summation order
    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-faults-")) if config.workdir is None else config.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    ws = Workspace(workdir, config.seed, engine=config.engine)
    results: dict[str, Any] = {}
    try:
        with cpu_load(config.load):
            _run_classes(ws, config, results, log)
            load_average = os.getloadavg()[0]
    finally:
        torch.set_num_threads(threads)
        if config.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "seed": config.seed,
        "trials": config.trials,
        "load": config.load,
        "engine": config.engine,
        "load_average": round(load_average, 1),
        "classes": results,
        "failures": sum(r["failures"] for r in results.values()),
        "wall_s": round(time.perf_counter() - began, 1),
    }


def _run_classes(ws: Workspace, config: FaultsConfig, results: dict[str, Any], log: Callable[[str], None]) -> None:
    """Every trial of every class of `config`, into `results` by class."""
    for name in config.classes:
        class_began = time.perf_counter()
        entry = {"trials": 0, "failures": 0, "cases": {}, "notes": {}, "counts": {}, "failed": [],
                 "undetected": []}
        for trial in range(config.first_trial, config.first_trial + config.trials):
            outcomes = run_trial(ws, name, config.seed, trial)
            entry["trials"] += 1
            failed = [o for o in outcomes if o.problems]
            entry["failures"] += bool(failed)
            for outcome in outcomes:
                runs, fails = entry["cases"].get(outcome.case, (0, 0))
                entry["cases"][outcome.case] = (runs + 1, fails + bool(outcome.problems))
                for note in outcome.notes:
                    if note.startswith(COUNTED_NOTES):
                        entry["notes"][note] = entry["notes"].get(note, 0) + 1
                if any(note.startswith("undetected") for note in outcome.notes):
                    entry["undetected"].append({"trial": trial, "case": outcome.case, "notes": outcome.notes})
                for quantity, value in outcome.counts.items():
                    entry["counts"][quantity] = entry["counts"].get(quantity, 0) + value
            for outcome in failed:
                entry["failed"].append({"trial": trial, "case": outcome.case,
                                        "problems": outcome.problems, "notes": outcome.notes})
            log(f"{name} trial {trial}: " + ("ok" if not failed else
                                              "FAILED " + "; ".join(o.problems[0][:200] for o in failed)))
        entry["wall_s"] = round(time.perf_counter() - class_began, 1)
        results[name] = entry


def format_table(result: dict) -> str:
    lines = [f"{'fault class':<18} {'trials':>6} {'failures':>8} {'time':>7}  sub-cases (run/failed)",
             "-" * 100]
    for name, entry in result["classes"].items():
        cases = ", ".join(f"{case} {runs}/{fails}" for case, (runs, fails) in sorted(entry["cases"].items()))
        lines.append(f"{name:<18} {entry['trials']:>6} {entry['failures']:>8} {entry['wall_s']:>6.0f}s  {cases}")
        if entry["counts"]:
            lines.append(f"{'':<44}" + ", ".join(f"{k} {v}" for k, v in entry["counts"].items()))
        for note, count in sorted(entry["notes"].items()):
            lines.append(f"{'':<44}{count} x {note}")
    lines.append("-" * 100)
    beside = f", beside {result['load']} busy processes" if result["load"] else ""
    lines.append(f"seed {result['seed']}{beside} (load average {result['load_average']}), "
                 f"{result['failures']} failed trials, {result['wall_s']:.0f} s")
    for name, entry in result["classes"].items():
        for harmless in entry["undetected"]:
            lines.append(f"undetected {name} trial {harmless['trial']} ({harmless['case']}): {harmless['notes'][0]}")
        for failure in entry["failed"]:
            lines.append(f"FAILED {name} trial {failure['trial']} ({failure['case']}): "
                         + " | ".join(p[:400] for p in failure["problems"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per fault class (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    parser.add_argument("--classes", default=",".join(CLASSES), help="comma-separated fault classes")
    parser.add_argument("--trial", type=int, default=None, help="run only this trial index")
    parser.add_argument("--workdir", type=Path, default=None, help="keep targets, caches and runs here")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--verbose", action="store_true", help="a line per trial on stderr")
    parser.add_argument("--load", type=int, default=0,
                        help="busy-loop processes beside the trials, killed at the end (default 0)")
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                        help="stage one's engine in the precompute trials (vllm: run from the engine venv)")
    args = parser.parse_args()
    os.environ.update(CHILD_ENV)
    config = FaultsConfig(trials=1 if args.trial is not None else args.trials, seed=args.seed,
                          classes=[c for c in args.classes.split(",") if c],
                          first_trial=args.trial or 0, workdir=args.workdir, load=args.load, engine=args.engine)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
    result = run_faults(config, log)
    print(format_table(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
