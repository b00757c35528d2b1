"""1. `precompute-kill`: SIGKILL of `dflash-precompute` at a random instant, then a rerun.

The cache equals an uninterrupted run's (manifest shard checksums, sequences, rejects,
target files, every decoded row), `verify` passes, and no file was ever readable under a
final name unless it was complete (a watcher thread opens every final name it sees during
both runs and compares it with the uninterrupted run's bytes).
"""

from __future__ import annotations

import numpy as np

from tests.faults.workspace import (
    FinalNameWatcher,
    Outcome,
    Workspace,
    check_cache_file,
    compare_caches,
    random_instant,
)


def trial_precompute_kill(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    """SIGKILL dflash-precompute at a random instant of its writing, rerun, compare."""
    reference = ws.precompute_reference
    out = ws.trial_dir("precompute-kill", trial) / "cache"
    outcome = Outcome(case="kill")
    watch = FinalNameWatcher(out, lambda rel: check_cache_file(out, rel, reference.cache))
    with watch:
        child = ws.launch("precompute", ws.precompute_args(out))
        random_instant(reference, rng, out, child)
        killed = child.kill()
        code = child.wait()
        sealed = len(list((out / "shards").glob("*.arrow")))
        if not killed:
            outcome.case = "finished before the kill"
            if code != 0:
                outcome.problems.append(f"the run failed on its own ({code}): {child.last_line()}")
        elif (out / "manifest.json").exists():
            outcome.case = "killed after the manifest"
        else:
            outcome.case = "killed before any shard" if sealed == 0 else "killed mid-run"
        outcome.counts["shards sealed at the kills"] = sealed
        rerun = ws.launch("precompute", ws.precompute_args(out))
        if rerun.wait() != 0:
            outcome.problems.append(f"the rerun failed: {rerun.output[-2000:]}")
    outcome.problems += watch.problems
    outcome.counts["final-name files opened during the runs"] = watch.opened
    if not outcome.problems:
        outcome.problems += compare_caches(out, reference.cache)
    return [outcome]
