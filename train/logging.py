"""Run logging: metrics.jsonl (every step), events.jsonl, Weights & Biases, the console line.

Only rank 0 logs. `RUN/metrics.jsonl` gets one line per step with exactly `STEP_KEYS`;
`RUN/events.jsonl` gets the run's milestones: start (or resume), each checkpoint with its
durations, each held-out evaluation, and done. A skipped update is not an event: it is the
step line's `skipped` and a line of RUN/spikes.jsonl (written by fit); a stop on persistent
spikes is the error fit raises (SpikeStop). W&B gets the same step keys (per-position
accuracies as `accuracy/k`) and the events' numbers; it runs offline unless `WANDB_MODE`
says otherwise. Files are appended and flushed per line, so a crash loses at most the line
being written; at every start, step lines past the step the run starts from are dropped
(they are redone): past the checkpoint on resume, all of them on a fresh start over an earlier
attempt that left no checkpoint, so metrics.jsonl never holds a step twice. events.jsonl and
spikes.jsonl lose their lines past that step the same way (a redone checkpoint, evaluation or
skipped step logs itself again); the start and resume lines of every attempt stay.

The console line cannot be misread: the epoch is 1-based out of the total with the
fraction done inside it, the step is global out of the total:
`epoch 1/6 (41.2%) step 4700/68780 loss 0.53 acc 0.41 tau~3.2 26.2k tok/s ETA 4d13h`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from dflash.common.files import write_atomic
from dflash.train.run_folder import EVENTS_FILE, METRICS_FILE, SPIKES_FILE, WANDB_ID_FILE

STEP_KEYS = ("step", "epoch", "epoch_index", "epoch_fraction", "loss", "accuracy", "grad_norm",
             "lr", "skipped", "tokens", "tokens_per_s", "data_time_s", "gpu_data_wait_s", "step_time_s")


def tau_estimate(accuracy: list[float | None]) -> float:
    """Acceptance length implied by per-position accuracies: 1 + sum_k prod_{i<=k} acc_i
    (stopping at the first position without rows, None).

    Treats positions as independent (an approximation: errors are correlated), counts the
    target's bonus token as the 1.
    """
    tau, run = 1.0, 1.0
    for acc in accuracy:
        if acc is None or not math.isfinite(acc):
            break
        run *= acc
        tau += run
    return tau


def format_rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s:02d}s"
    return f"{s}s"


def console_line(record: dict, *, epochs: int, total_steps: int, eta_s: float) -> str:
    """`epoch 1/6 (41.2%) step 4700/68780 loss 0.53 acc 0.41 tau~3.2 26.2k tok/s ETA 4d13h`."""
    accuracy = [a for a in record["accuracy"] if a is not None]
    acc = sum(accuracy) / len(accuracy) if accuracy else float("nan")
    skipped = " SKIPPED" if record["skipped"] else ""
    return (f"epoch {record['epoch_index']}/{epochs} ({100 * record['epoch_fraction']:.1f}%) "
            f"step {record['step']}/{total_steps} loss {record['loss']:.3g} acc {acc:.2f} "
            f"tau~{tau_estimate(record['accuracy']):.1f} {format_rate(record['tokens_per_s'])} tok/s "
            f"ETA {format_duration(eta_s)}{skipped}")


class RunLogger:
    """metrics.jsonl + events.jsonl + optional W&B, on rank 0 (a no-op elsewhere)."""

    def __init__(self, run_dir: Path, *, enabled: bool, wandb_config: dict | None = None,
                 wandb_project: str = "dflash", resume_step: int = 0):
        """resume_step: the step training starts from (the checkpoint's, 0 for a fresh start);
        the lines past it that an earlier attempt left in metrics.jsonl, events.jsonl and
        spikes.jsonl are dropped: those steps run again and log themselves again."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._wandb = None
        self._wandb_step = resume_step  # W&B refuses (drops, with a warning) steps that go back
        if not enabled:
            return
        metrics = self.run_dir / METRICS_FILE
        for name in (METRICS_FILE, EVENTS_FILE, SPIKES_FILE):
            if (self.run_dir / name).exists():
                _truncate_after(self.run_dir / name, resume_step)
        self._metrics = open(metrics, "a", buffering=1)
        self._events = open(self.run_dir / EVENTS_FILE, "a", buffering=1)
        if wandb_config is not None:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=wandb_config,
                                     name=self.run_dir.name, resume="allow",
                                     id=_wandb_id(self.run_dir))

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        assert tuple(record) == STEP_KEYS, f"metrics keys {tuple(record)} != {STEP_KEYS}"
        self._metrics.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            flat = {k: v for k, v in record.items() if k != "accuracy" and v is not None}  # CPU: no GPU wait
            flat.update({f"accuracy/{k + 1}": a for k, a in enumerate(record["accuracy"])})
            self._wandb_step = max(self._wandb_step, record["step"])
            self._wandb.log(flat, step=self._wandb_step)

    def event(self, kind: str, **fields) -> None:
        if not self.enabled:
            return
        self._events.write(json.dumps({"event": kind, **fields}) + "\n")
        if self._wandb is not None:
            # A background checkpoint finishes steps after the one it saved: it is logged at
            # the current step, its own step as `checkpoint/step`.
            numbers = {f"{kind}/{k}": v for k, v in fields.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if numbers:
                self._wandb_step = max(self._wandb_step, fields.get("step") or 0)
                self._wandb.log(numbers, step=self._wandb_step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._metrics.close()
        self._events.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _truncate_after(path: Path, step: int) -> None:
    """Keep the step lines up to `step` (where the run starts); rewrite atomically."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError):
            continue  # a line torn by the crash
    write_atomic(path, "".join(line + "\n" for line in kept))


def _wandb_id(run_dir: Path) -> str:
    """A stable W&B run id per run folder, so a resume continues the same W&B run."""
    path = run_dir / WANDB_ID_FILE
    if not path.exists():
        import secrets

        path.write_text(secrets.token_hex(8))
    return path.read_text().strip()
