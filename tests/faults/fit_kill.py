"""2. `fit-kill`: SIGKILL of `dflash-train fit` at a random instant, or at a planned point of
a step or of a checkpoint, then a resume.

The planned points, across a step and its checkpoint: inside the step (after its optimizer
update, before or after the gate's record), inside the snapshot's copy (after a fraction of
the tensors are copied), with the background write finished before the step's metrics line
(the main thread descheduled while the writer runs: "before-step-line"), a half-written
model.safetensors or optimizer.pt, before the fsync, before or after the rename, while
deleting old checkpoints. Every checkpoint left under a final name, and the final one after
the resume, is bitwise equal (weights, optimizer state, gate, step) to the uninterrupted
run's at that step, and the logged loss trace equals it too (every step once, none missing).
`python -m tests.faults --load N` runs the trials beside N busy processes.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np

from tests.faults.workspace import (
    FIT_OPTIONS,
    FinalNameWatcher,
    Outcome,
    Workspace,
    check_checkpoint,
    left_checkpoints,
    same_final_run,
    wait_for,
)

KILL_POINTS = ["model.safetensors", "optimizer.pt", "before-fsync", "before-rename", "after-rename",
               "deleting-old", "in-step", "snapshot", "before-step-line"]


def trial_fit_kill(ws: Workspace, rng: np.random.Generator, trial: int,
                   kill_point: dict | None = None) -> list[Outcome]:
    """SIGKILL dflash-train fit at a random instant or at a planned point, resume.

    kill_point ({"step", "point", "fraction"}, see `install_kill_point`) forces a kill at
    that point of that step or its checkpoint; by default half the trials draw one, half a
    random instant.
    """
    reference = ws.fit_reference
    out = ws.trial_dir("fit-kill", trial) / "run"
    every, keep = FIT_OPTIONS["checkpoint_every"], FIT_OPTIONS["keep_checkpoints"]
    if kill_point is not None:
        outcome = Outcome(case=_case(kill_point["point"]))
    elif rng.uniform() < 0.5:
        delay_s = float(rng.uniform(0.0, reference.train_s))
        outcome = Outcome(case="random instant")
    else:
        point = str(rng.choice(KILL_POINTS))
        # Old checkpoints are deleted from the (keep+1)-th one on; a step can be any.
        first, stride = (every * (keep + 1), every) if point == "deleting-old" else (
            (1, 1) if point == "in-step" else (every, every))
        step = int(rng.choice(np.arange(first, reference.total_steps + 1, stride)))
        kill_point = {"step": step, "point": point, "fraction": float(rng.uniform(0.0, 1.0))}
        outcome = Outcome(case=_case(point))
        outcome.notes.append(f"kill at {point} of step {step}")
    watch = FinalNameWatcher(out, lambda rel: check_checkpoint(out, rel.name, reference.run), checkpoints=True)
    with watch:
        prepare = None if kill_point is None else functools.partial(install_kill_point, **kill_point)
        child = ws.launch("fit", ws.fit_args(out), prepare=prepare)
        if kill_point is None:
            wait_for(lambda: (out / "metrics.jsonl").exists(), child)
            time.sleep(delay_s)
            child.kill()
        code = child.wait()
        if code != -signal.SIGKILL:
            if kill_point is not None:
                outcome.problems.append(f"the planned kill did not happen (exit {code}): {child.last_line()}")
            elif code != 0:
                outcome.problems.append(f"the run failed on its own ({code}): {child.last_line()}")
            else:
                outcome.case = "finished before the kill"
        outcome.problems += left_checkpoints(out, reference.run)
        resumed = ws.launch("fit", ws.fit_args(out))
        if resumed.wait() != 0:
            outcome.problems.append(f"the resume failed: {resumed.output[-2000:]}")
    outcome.problems += watch.problems
    outcome.counts["final-name checkpoints opened during the runs"] = watch.opened
    if not outcome.problems:
        outcome.problems += same_final_run(out, reference)
    return [outcome]


def _case(point: str) -> str:
    return "inside a step" if point == "in-step" else f"inside checkpoint: {point}"


def install_kill_point(step: int, point: str, fraction: float) -> None:
    """Make this process SIGKILL itself at `point` of step `step` or of its checkpoint.

    Points: "in-step" (after the step's optimizer update: before the gate records it when
    `fraction` < 0.5, after otherwise), "snapshot" (after `fraction` of the snapshot's
    tensors are copied into its buffers), "before-step-line" (the checkpoint's background write is let finish,
    then the kill, before the step's metrics line: the main thread descheduled while the writer
    runs, as on a loaded machine), "model.safetensors" / "optimizer.pt" (that file is cut to `fraction` of its size,
    then the kill: a half-written file in the temporary folder), "before-fsync" (every file
    written, none fsynced), "before-rename", "after-rename" (the folder has its final name,
    its parent is not fsynced, old checkpoints not deleted), "deleting-old" (after the first
    old checkpoint is deleted). The hooks sit on the writer's fsync, rename and delete calls;
    a hook that is never reached shows as "the planned kill did not happen".
    """
    from dflash.train import checkpoint, gating, logging

    tmp_name = f".step-{step:08d}.tmp"

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "in-step":
        real_record = gating.SpikeGate.record
        calls = itertools.count(1)

        def record(self, *args, **kwargs):  # called once per step, after the update
            call = next(calls)
            if call == step and fraction < 0.5:
                die()
            real_record(self, *args, **kwargs)
            if call == step:
                die()

        gating.SpikeGate.record = record
    elif point == "snapshot":
        real_snapshot, real_copy = checkpoint.CheckpointWriter.snapshot, checkpoint.CheckpointWriter._copy
        copies = {"left": None}

        def snapshot(self, at_step, model_state, optimizer_state, state):
            if at_step == step:
                num_optimizer = sum(len(entry) for entry in optimizer_state["state"].values())
                copies["left"] = int(fraction * (len(model_state) + num_optimizer))
            return real_snapshot(self, at_step, model_state, optimizer_state, state)

        def copy(self, key, tensor, where):  # each tensor's copy into its snapshot buffer
            if copies["left"] is not None:
                if copies["left"] == 0:
                    die()
                copies["left"] -= 1
            return real_copy(self, key, tensor, where)

        checkpoint.CheckpointWriter.snapshot, checkpoint.CheckpointWriter._copy = snapshot, copy
    elif point == "before-step-line":
        real_step = logging.RunLogger.step

        def log_step(self, record):
            if record["step"] == step:
                for thread in threading.enumerate():
                    if thread.name == f"checkpoint-{step}":
                        thread.join()
                die()
            real_step(self, record)

        logging.RunLogger.step = log_step
    elif point in ("model.safetensors", "optimizer.pt", "before-fsync"):
        real_fsync_file = checkpoint._fsync_file

        def fsync_file(path):
            if tmp_name in str(path) and point == "before-fsync":
                die()
            if tmp_name in str(path) and Path(path).name == point:
                os.truncate(path, int(os.path.getsize(path) * fraction))
                die()
            real_fsync_file(path)

        checkpoint._fsync_file = fsync_file
    elif point in ("before-rename", "after-rename"):
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if tmp_name in str(src) and point == "before-rename":
                die()
            real_replace(src, dst, *args, **kwargs)
            if tmp_name in str(src):
                die()

        checkpoint.os.replace = replace
    elif point == "deleting-old":
        real_rmtree = shutil.rmtree
        final_name = re.compile(r"step-\d{8}$")

        def rmtree(path, *args, **kwargs):
            real_rmtree(path, *args, **kwargs)
            if final_name.search(str(path)) and _writing_step(step):
                die()

        checkpoint.shutil.rmtree = rmtree
    else:
        raise ValueError(f"unknown kill point {point!r}")


def _writing_step(step: int) -> bool:
    """True inside the writer thread of checkpoint `step` (its thread is named after it)."""
    return threading.current_thread().name == f"checkpoint-{step}"
