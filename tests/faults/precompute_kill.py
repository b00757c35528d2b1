"""1. `precompute-kill`: SIGKILL of `dflash-precompute` at a random instant, then a rerun.

The killed run and the rerun write with the writer thread behind the forward
(`--writer-thread on`), the uninterrupted reference without it. The cache equals the
reference's (manifest shard checksums, sequences, rejects, target files, every decoded row),
`verify` passes, and no file was ever readable under a final name unless it was complete (a
watcher thread opens every final name it sees during both runs and compares it with the
uninterrupted run's bytes). Even trials kill after a random number of sealed shards plus up
to one shard's time; odd trials kill inside the writer: while it has a shard open (its
`*.arrow.tmp` exists), after a random part of one shard's time.
"""

from __future__ import annotations

import time

import numpy as np

from tests.faults.workspace import (
    FinalNameWatcher,
    Outcome,
    Workspace,
    check_cache_file,
    compare_caches,
    random_instant,
    wait_for,
)

WRITER_THREAD = ["--writer-thread", "on"]


def trial_precompute_kill(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    """SIGKILL dflash-precompute at a random instant of its writing, rerun, compare."""
    reference = ws.precompute_reference
    out = ws.trial_dir("precompute-kill", trial) / "cache"
    outcome = Outcome(case="kill")
    watch = FinalNameWatcher(out, lambda rel: check_cache_file(out, rel, reference.cache))
    with watch:
        child = ws.launch("precompute", ws.precompute_args(out) + WRITER_THREAD)
        if trial % 2:
            _inside_the_writer(reference, rng, out, child)
        else:
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
        rerun = ws.launch("precompute", ws.precompute_args(out) + WRITER_THREAD)
        if rerun.wait() != 0:
            outcome.problems.append(f"the rerun failed: {rerun.output[-2000:]}")
    outcome.problems += watch.problems
    outcome.counts["final-name files opened during the runs"] = watch.opened
    if not outcome.problems:
        outcome.problems += compare_caches(out, reference.cache)
    return [outcome]


def _inside_the_writer(reference, rng: np.random.Generator, out, child) -> None:
    """Return while the writer thread has a shard open (after 0 to all-but-one sealed shards),
    after a random part of one shard's time."""
    sealed = int(rng.integers(0, reference.num_shards))
    shards = out / "shards"
    wait_for(lambda: shards.is_dir() and len(list(shards.glob("*.arrow"))) >= sealed
             and any(shards.glob("*.arrow.tmp")), child)
    time.sleep(float(rng.uniform(0.0, reference.write_s / reference.num_shards)))
