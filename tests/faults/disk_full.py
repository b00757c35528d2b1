"""3. `disk-full`: a file-size limit during stage one and during a checkpoint write.

The limit is RLIMIT_FSIZE, with SIGXFSZ ignored so that write() fails with EFBIG: in stage
one a random limit from the start, or one that drops to a few KiB at a random instant (the
failure lands in a shard, the target folder, a record, the manifest...); in fit a limit
that is hit inside a checkpoint write. The command exits non-zero with its last line naming
the cause ("File too large" / "No space left"; a traceback above it is tallied, not
failed), no partial file sits under a final name, and a rerun without the limit completes
and equals the uninterrupted run.
"""

from __future__ import annotations

import resource
from pathlib import Path

import numpy as np

from tests.faults.workspace import (
    FILE_TOO_LARGE,
    Child,
    FinalNameWatcher,
    Outcome,
    Workspace,
    check_cache_file,
    compare_caches,
    is_temporary,
    left_checkpoints,
    random_instant,
    same_final_run,
)


def trial_disk_full(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    """Stage one under a file-size limit from the start, stage one whose limit drops to a few
    KiB at a random instant (any write may be the one that fails: a shard, a record, the
    manifest), and fit whose limit lands in a checkpoint write; each then rerun with space."""
    return [disk_full_precompute(ws, rng, trial), disk_full_precompute(ws, rng, trial, mid_run=True),
            disk_full_checkpoint(ws, rng, trial)]


def _clear_error(child: Child) -> str | None:
    """None when the failed command's last line names the cause, else the problem."""
    last = child.last_line()
    if FILE_TOO_LARGE not in last and "No space left" not in last:
        return f"the error does not name the cause: last line {last!r}"
    return None


def _error_notes(child: Child) -> list[str]:
    """How the failure was reported: the exception type of the last line, traceback or not."""
    last = child.last_line()
    kind = last.split(":")[0] if ":" in last else last[:60]
    notes = [f"error: {kind}", f"message: {last[:300]}"]
    if "Traceback" in child.output:
        notes.append("reported as a traceback")
    return notes


def disk_full_precompute(ws: Workspace, rng: np.random.Generator, trial: int,
                          mid_run: bool = False) -> Outcome:
    reference = ws.precompute_reference
    sizes = [p.stat().st_size for p in reference.cache.rglob("*") if p.is_file()]
    out = ws.trial_dir("disk-full-precompute" + "-mid-run" * mid_run, trial) / "cache"
    outcome = Outcome(case="stage one, disk fills mid-run" if mid_run else "stage one")
    watch = FinalNameWatcher(out, lambda rel: check_cache_file(out, rel, reference.cache))
    with watch:
        if mid_run:
            child = ws.launch("precompute", ws.precompute_args(out))
            random_instant(reference, rng, out, child)
            limit = int(rng.integers(0, 4096))
            try:  # from now on every file write past `limit` bytes fails
                resource.prlimit(child.process.pid, resource.RLIMIT_FSIZE, (limit, limit))
            except ProcessLookupError:
                pass
        else:
            # Any file of the cache may be the one that hits the limit; the child's own output
            # goes to a pipe, which the limit does not cover.
            limit = int(rng.integers(16 * 1024, max(sizes)))
            child = ws.launch("precompute", ws.precompute_args(out), fsize_limit=limit)
        code = child.wait()
        if code == 0 and mid_run:
            outcome.case = "stage one, finished before the disk filled"
        elif _judge_failure(outcome, child, code, limit):
            outcome.notes.append(f"limit hit in: {_where_it_failed(out)}")
        rerun = ws.launch("precompute", ws.precompute_args(out))
        if rerun.wait() != 0:
            outcome.problems.append(f"the rerun with space failed: {rerun.output[-2000:]}")
    outcome.problems += watch.problems
    outcome.counts["final-name files opened during the runs"] = watch.opened
    if not outcome.problems:
        outcome.problems += compare_caches(out, reference.cache)
    return outcome


def _where_it_failed(cache: Path) -> str:
    """Which write a failed stage one was in, from the temporaries it left."""
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if is_temporary(p.relative_to(cache)))
    if any(name.startswith((".target.tmp", ".target.stale")) for name in left):
        return "the target folder"
    if any(name.endswith(".arrow.tmp") for name in left):
        return "a shard"
    if any(name.endswith(".json.tmp") or name.endswith(".jsonl.tmp") for name in left):
        return "a record or the manifest"
    return "?"


def disk_full_checkpoint(ws: Workspace, rng: np.random.Generator, trial: int) -> Outcome:
    reference = ws.fit_reference
    files = [p for p in reference.run.rglob("*") if p.is_file()]
    in_checkpoints = [p.stat().st_size for p in files if "checkpoints" in p.parts]
    others = [p.stat().st_size for p in files if "checkpoints" not in p.parts]
    # Above every log and index the run writes, below its largest checkpoint file: the
    # limit is hit inside a checkpoint write and nowhere else.
    low, high = 2 * max(others), max(in_checkpoints)
    assert low < high, f"checkpoint files ({high} B) must exceed twice the other files ({low // 2} B)"
    limit = int(rng.integers(low, high))
    out = ws.trial_dir("disk-full-checkpoint", trial) / "run"
    outcome = Outcome(case="checkpoint write")
    child = ws.launch("fit", ws.fit_args(out), fsize_limit=limit)
    code = child.wait()
    _judge_failure(outcome, child, code, limit)
    outcome.problems += left_checkpoints(out, reference.run)
    rerun = ws.launch("fit", ws.fit_args(out))
    if rerun.wait() != 0:
        outcome.problems.append(f"the rerun with space failed: {rerun.output[-2000:]}")
    elif not outcome.problems:
        outcome.problems += same_final_run(out, reference)
    return outcome


def _judge_failure(outcome: Outcome, child, code: int, limit: int) -> bool:
    """Record how a run under a `limit`-byte file-size limit ended; True when it failed with
    an error of its own (the expected ending), False when it finished or died of a signal."""
    if code == 0:
        outcome.problems.append(f"a {limit}-byte file limit did not stop the run")
        return False
    if code < 0:
        outcome.problems.append(f"the run died of signal {-code} instead of failing with an error")
        return False
    problem = _clear_error(child)
    if problem:
        outcome.problems.append(problem)
    outcome.notes += _error_notes(child)
    return True
