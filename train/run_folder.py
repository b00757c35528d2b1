"""The run folder (`dflash-train fit --out RUN`): its layout, and reading a drafter back from it.

Every file name of the folder is a constant here; the modules that write or read a file use
the constant, so this docstring is the one description of the layout:

```
RUN/
  .lock                 LOCK_FILE: fit's OS lock (fcntl.flock) while it runs, holding the
                        holder's pid, host and start time as JSON; the file stays and marks
                        the folder as a run (train/runlock.py)
  config.json           RUN_CONFIG_FILE: the resolved FitConfig, flat keys (FitConfig.to_dict);
                        a resume refuses a config that differs in a field that changes numbers
  drafter_config.json   DRAFTER_CONFIG_FILE: the DrafterConfig (sizes, layer ids, mask token)
  run.json              RUN_INFO_FILE: the target fingerprint of the run's caches (train/identity.py)
  anchor_index.npz      ANCHOR_INDEX_FILE: eligible anchors per sequence, with the caches'
                        fingerprint (computed at the first start; train/data.py)
  metrics.jsonl         METRICS_FILE: one line per step, keys logging.STEP_KEYS (`skipped` marks
                        a skipped update)
  events.jsonl          EVENTS_FILE: start or resume, checkpoint, eval (held-out), done
  spikes.jsonl          SPIKES_FILE: one line per skipped update, with its batch's sequences
  checkpoints/          CHECKPOINTS_DIR: step-XXXXXXXX/ folders (train/checkpoint.py), each
    step-00001000/        WEIGHTS_FILE model.safetensors, OPTIMIZER_FILE optimizer.pt,
                          STATE_FILE state.json; written as .step-XXXXXXXX.tmp/ and renamed
  eval/                 EVAL_DIR: <checkpoint name>.json, the figures of `dflash-train eval`
                        (read by `dflash-train export` for the model card)
  wandb_id.txt          WANDB_ID_FILE: the W&B run id, so a resume continues the same W&B run
  wandb/                Weights & Biases' own folder (offline runs), when enabled
```

The .json and .npz files and each checkpoint folder are written atomically (temporary name,
fsync, rename: dflash.shards.files); the .jsonl logs are appended and flushed per line, so a
crash loses at most the line being written (metrics.jsonl is rewritten atomically at a start,
without the step lines past the step the run starts from).

`load_drafter` reads a drafter back from a run's checkpoint (or from an exported folder, with
the run's config beside it): the one reader `eval` and `export` share. What this file trades
off: the layout is plain files a user can read with `cat` and `jq`, not one database, so
each reader checks the files it needs and names the missing one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dflash.train.model import DFlashDrafter

LOCK_FILE = ".lock"
RUN_CONFIG_FILE = "config.json"
DRAFTER_CONFIG_FILE = "drafter_config.json"
RUN_INFO_FILE = "run.json"
ANCHOR_INDEX_FILE = "anchor_index.npz"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
SPIKES_FILE = "spikes.jsonl"
WANDB_ID_FILE = "wandb_id.txt"
CHECKPOINTS_DIR = "checkpoints"
EVAL_DIR = "eval"
# The files of one checkpoint folder, RUN/checkpoints/step-XXXXXXXX/.
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.json"


@dataclass
class LoadedDrafter:
    """A drafter and where it came from."""

    drafter: DFlashDrafter
    checkpoint: Path
    """The checkpoint folder (RUN/checkpoints/step-N) or exported folder it was read from."""
    step: int | None
    """Training step of the checkpoint (None for an exported folder)."""
    fit_config: dict[str, Any] | None
    """RUN/config.json, when loaded from a run."""


def load_drafter(run: str | Path | None, checkpoint: str | Path | None = None, *,
                 device: torch.device | str = "cpu") -> LoadedDrafter:
    """The drafter of `checkpoint` (a RUN/checkpoints/step-N folder, or an exported folder),
    by default RUN's newest complete checkpoint. Weights stay float32."""
    from safetensors.torch import load_file

    # The exported format and the checkpoint list are read through their owners, which use
    # this module's names (imported here, at call time, to keep the import graph one-way).
    from dflash.train.checkpoint import latest_checkpoint
    from dflash.train.export import is_exported, load_exported, load_weights
    from dflash.train.model import DFlashDrafter, DrafterConfig

    if checkpoint is not None and is_exported(checkpoint):
        fit_config = _read_json(Path(run) / RUN_CONFIG_FILE) if run is not None else None
        return LoadedDrafter(load_exported(checkpoint, device=device), Path(checkpoint), None, fit_config)
    if run is None:
        raise ValueError("give --run (a folder written by dflash-train fit), or --checkpoint with an "
                         "exported drafter folder")
    run = Path(run)
    fit_config = _read_json(run / RUN_CONFIG_FILE)
    drafter_config = DrafterConfig.from_dict(_read_json(run / DRAFTER_CONFIG_FILE))
    if checkpoint is None:
        checkpoint = latest_checkpoint(run)
        if checkpoint is None:
            raise ValueError(f"{run}/{CHECKPOINTS_DIR} holds no complete checkpoint: train first, or pass "
                             "--checkpoint")
    checkpoint = Path(checkpoint)
    weights = checkpoint / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"{weights} does not exist: --checkpoint takes a RUN/{CHECKPOINTS_DIR}/step-N folder "
                         "or an exported drafter folder")
    drafter = DFlashDrafter(drafter_config)
    load_weights(drafter, load_file(str(weights)), weights)
    state = _read_json(checkpoint / STATE_FILE) if (checkpoint / STATE_FILE).is_file() else {}
    return LoadedDrafter(drafter.to(device), checkpoint, state.get("step"), fit_config)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: is this a run folder written by dflash-train fit?") from None


def eval_results_path(run: Path, checkpoint: Path) -> Path:
    """Where `dflash-train eval` keeps the figures of a checkpoint of a run."""
    return Path(run) / EVAL_DIR / f"{Path(checkpoint).name}.json"


def held_out_eval(run: Path, step: int | None) -> dict[str, Any] | None:
    """The held-out evaluation fit logged at `step` (RUN/events.jsonl), if any."""
    events = Path(run) / EVENTS_FILE
    if step is None or not events.is_file():
        return None
    found = None
    for line in events.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(event, dict) and event.get("event") == "eval" and event.get("step") == step:
            found = event
    return found


__all__ = [
    "ANCHOR_INDEX_FILE", "CHECKPOINTS_DIR", "DRAFTER_CONFIG_FILE", "EVAL_DIR", "EVENTS_FILE", "LOCK_FILE",
    "LoadedDrafter", "METRICS_FILE", "OPTIMIZER_FILE", "RUN_CONFIG_FILE", "RUN_INFO_FILE", "SPIKES_FILE",
    "STATE_FILE", "WANDB_ID_FILE", "WEIGHTS_FILE", "eval_results_path", "held_out_eval", "load_drafter",
]
