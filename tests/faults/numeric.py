"""6. `numeric`: NaN, Inf and huge-loss batches injected into training.

The batches are poisoned through `dflash.train.fit.read_batch`, the seam the trainer's own
tests use. No checkpoint ever holds a non-finite value, each poisoned step is skipped and
leaves weights and optimizer state untouched, each skip is logged with its batch's
sources, and persistent poisoning stops the run with a message naming spikes.jsonl.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.faults.workspace import FIT_OPTIONS, Outcome, Workspace, checkpoint_difference, describe, fit_in_process

POISONS = ["NaN feature", "Inf feature", "NaN log-prob", "Inf log-prob", "huge loss"]


def _poison(batch: Any, how: str, rng: np.random.Generator) -> None:
    """Damage one batch in place, the way a bad row or a broken label would."""
    import torch

    if how in ("NaN feature", "Inf feature"):
        value = float("nan") if how == "NaN feature" else float(rng.choice([np.inf, -np.inf]))
        flat = batch.context_features.view(-1)
        flat[int(rng.integers(0, flat.numel()))] = value
    elif how in ("NaN log-prob", "Inf log-prob"):
        value = float("nan") if how == "NaN log-prob" else float("inf")
        n, k = batch.topk_logprobs.shape
        batch.topk_logprobs[int(rng.integers(0, n)), int(rng.integers(0, k))] = value
    else:  # log-probs far above 0: the "distribution" has mass e^40.. e^60, the loss explodes
        batch.topk_logprobs += torch.tensor(float(rng.uniform(40.0, 60.0)))


def trial_numeric(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    """Isolated poisoned batches (each must be skipped), then persistent poisoning (must stop)."""
    return [numeric_isolated(ws, rng, trial), numeric_persistent(ws, rng, trial)]


@contextlib.contextmanager
def poisoned_batches(schedule: dict[int, str], rng: np.random.Generator, sequences: dict[int, list[int]]):
    """Poison the training batch read at each (1-based) step in `schedule`; record every
    step's batch sequences in `sequences`."""
    from dflash.train import fit as fit_module

    real = fit_module.read_batch
    step = {"n": 0}

    def read_batch(corpus, segments, **kwargs):
        batch = real(corpus, segments, **kwargs)
        if kwargs["stream"] != fit_module.EVAL_STREAM:
            step["n"] += 1
            sequences[step["n"]] = list(batch.sequences)
            if step["n"] in schedule:
                _poison(batch, schedule[step["n"]], rng)
        return batch

    fit_module.read_batch = read_batch
    try:
        yield
    finally:
        fit_module.read_batch = real


def _numeric_checks(run: Path, schedule: dict[int, str], sequences: dict[int, list[int]]) -> list[str]:
    """Every checkpoint finite; a poisoned step skipped, logged with its sources, and equal
    (weights, optimizer moments) to the step before it."""
    import torch

    from dflash.train.checkpoint import list_checkpoints, load_checkpoint

    problems = []
    checkpoints = {int(p.name[5:]): p for p in list_checkpoints(run)}
    if not checkpoints:
        problems.append("no checkpoint to check")
    loaded = {}
    for step, path in sorted(checkpoints.items()):
        loaded[step] = load_checkpoint(path)
        model, optimizer, _ = loaded[step]
        tensors = list(model.values()) + [v for s in optimizer["state"].values() for v in s.values()
                                          if isinstance(v, torch.Tensor)]
        if not all(torch.isfinite(t).all() for t in tensors):
            problems.append(f"checkpoint step {step} holds a non-finite value")
    metrics = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    spikes_path = run / "spikes.jsonl"
    spikes = {r["step"]: r for r in map(json.loads, spikes_path.read_text().splitlines())} \
        if spikes_path.exists() else {}
    for step, how in sorted(schedule.items()):
        if step not in metrics:
            continue  # the run stopped before it
        if not metrics[step]["skipped"]:
            problems.append(f"step {step} ({how}) was not skipped (loss {metrics[step]['loss']})")
            continue
        logged = spikes.get(step)
        if logged is None:
            problems.append(f"step {step} ({how}) was skipped but not logged in spikes.jsonl")
        elif [s["sequence"] for s in logged["sources"]] != sequences[step] or not all(
                "file" in s and "index" in s for s in logged["sources"]):
            problems.append(f"step {step}'s spikes.jsonl sources do not name its batch's sequences")
        if step in loaded and step - 1 in loaded:
            difference = checkpoint_difference(loaded[step], loaded[step - 1], skip_lr=True)
            if difference:
                problems.append(f"skipped step {step} changed the {difference}")
    extra = sorted(s for s, r in metrics.items() if r["skipped"] and s not in schedule)
    if extra:
        problems.append(f"steps {extra} were skipped without being poisoned")
    return problems


def numeric_isolated(ws: Workspace, rng: np.random.Generator, trial: int) -> Outcome:
    total, warmup = 16, FIT_OPTIONS["spike_warmup_steps"]
    # Poisoned steps are apart (never max_consecutive_skips in a row); a huge loss is only
    # recognised once the running mean exists, after the warm-up steps.
    steps = sorted(rng.choice(np.arange(warmup + 2, total + 1, 2), size=int(rng.integers(2, 5)), replace=False))
    schedule = {int(s): str(rng.choice(POISONS)) for s in steps}
    outcome = Outcome(case="isolated", notes=[f"poisoned {schedule}"])
    run = ws.trial_dir("numeric-isolated", trial) / "run"
    sequences: dict[int, list[int]] = {}
    try:
        with poisoned_batches(schedule, rng, sequences):
            fit_in_process(ws.fit_config(ws.training_cache, run, max_steps=total, checkpoint_every=1,
                                         keep_checkpoints=1000))
    except Exception as error:  # noqa: BLE001
        outcome.problems.append(f"the run did not complete: {describe(error)}")
    outcome.problems += _numeric_checks(run, schedule, sequences)
    outcome.counts["poisoned steps"] = len(schedule)
    return outcome


def numeric_persistent(ws: Workspace, rng: np.random.Generator, trial: int) -> Outcome:
    from dflash.train.fit import SpikeStop

    max_skips = int(rng.integers(2, 6))
    start = int(rng.integers(FIT_OPTIONS["spike_warmup_steps"] + 2, 10))
    schedule = {s: str(rng.choice(POISONS)) for s in range(start, 200)}
    outcome = Outcome(case="persistent", notes=[f"poisoned from step {start}, stop after {max_skips}"])
    run = ws.trial_dir("numeric-persistent", trial) / "run"
    sequences: dict[int, list[int]] = {}
    try:
        with poisoned_batches(schedule, rng, sequences):
            fit_in_process(ws.fit_config(ws.training_cache, run, checkpoint_every=1, keep_checkpoints=1000,
                                         max_consecutive_skips=max_skips, epochs=50))
        outcome.problems.append("persistent poisoning did not stop the run")
    except SpikeStop as stop:
        expected = f"stopped at step {start + max_skips - 1}: {max_skips} steps in a row"
        if expected not in str(stop) or str(run / "spikes.jsonl") not in str(stop):
            outcome.problems.append(f"the stop message does not say where and why: {str(stop)[:300]}")
    except Exception as error:  # noqa: BLE001
        outcome.problems.append(f"the run failed otherwise: {describe(error)}")
    outcome.problems += _numeric_checks(run, schedule, sequences)
    outcome.counts["poisoned steps"] = len(sequences) - start + 1
    return outcome
