"""Fault-tolerance trials: kill, starve, corrupt and poison dflash, and count what survives.

Ten fault classes in eight modules (refusals.py holds the last three), each class run as N
randomised trials (`--trials`, seeded by `--seed`); each module's docstring says what its
trials check:

1. `precompute-kill` (precompute_kill.py)  SIGKILL of `dflash-precompute`, then a rerun.
2. `fit-kill` (fit_kill.py)  SIGKILL of `dflash-train fit` at a random instant or at a
   planned point of a step or its checkpoint (snapshot, write, rename), then a resume.
3. `disk-full` (disk_full.py)  a file-size limit in stage one and in a checkpoint write.
4. `corruption` (corruption.py)  damaged shards and manifests, missing and foreign shards.
5. `bad-input` (bad_input.py)  malformed records among good ones.
6. `numeric` (numeric.py)  NaN, Inf and huge-loss batches, isolated and persistent.
7. `untrusted` (untrusted.py)  pickle payloads and paths that leave the cache.
8. `wrong-target` (refusals.py)  a cache, a resume or an eval of another target.
9. `second-writer` (refusals.py)  a second fit on a run folder that another fit holds.
10. `empty-input` (refusals.py)  stage one with nothing to write.

workspace.py holds what they share (the forkserver that runs the commands, the tiny target,
caches and reference runs, the final-name watcher); harness.py runs the trials, prints the
table and is the command line (`python -m tests.faults --help`, from the repository root).
tests/test_faults.py runs one seeded trial of each sub-case in the test suite. `--load N`
runs the trials beside N busy processes, as on a loaded machine.

The trade-off: tiny models (a 6-layer, 32-wide random Qwen3 target; a 1-layer drafter) and
short runs, so that 20 trials of every class fit in minutes on two cores. They exercise the
same code paths, file formats and write sequences as full-size runs.
"""
