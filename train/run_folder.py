"""The run folder (`dflash-train fit --out RUN`): its layout, the names of its files.

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
  run.json              RUN_INFO_FILE: the target fingerprint of the run's caches and their paths
                        (train/identity.py); with --init-from, the source's record (train/init_from.py)
  anchor_index.npz      ANCHOR_INDEX_FILE: eligible anchors per sequence, with the caches'
                        fingerprint (computed at the first start; train/data.py)
  draft_vocab.npz       DRAFT_VOCAB_FILE: with --draft-vocab, the draft ids (most frequent
                        first), their counts and the tokens counted (chosen at the first
                        start, read back on resume; train/draft_vocab.py)
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
                        (train/logging.py)
  wandb/                Weights & Biases' own folder (offline runs), when enabled
```

The .json and .npz files and each checkpoint folder are written atomically (temporary name,
fsync, rename: dflash.common.files); the .jsonl logs are appended and flushed per line, so a
crash loses at most the line being written (metrics.jsonl is rewritten atomically at a start,
without the step lines past the step the run starts from).

Names and paths only, with the small reads of the logs (`held_out_eval`): no loader, so that
every module that writes or reads one of these files can import it. A drafter is read back
from a checkpoint by train/loading.py (`load_drafter`), which sits above checkpoint.py and
below export.py. What the layout trades off: plain files a user can read with `cat` and
`jq`, not one database, so each reader checks the files it needs and names the missing one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LOCK_FILE = ".lock"
RUN_CONFIG_FILE = "config.json"
DRAFTER_CONFIG_FILE = "drafter_config.json"
RUN_INFO_FILE = "run.json"
ANCHOR_INDEX_FILE = "anchor_index.npz"
DRAFT_VOCAB_FILE = "draft_vocab.npz"
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
    "ANCHOR_INDEX_FILE", "CHECKPOINTS_DIR", "DRAFTER_CONFIG_FILE", "DRAFT_VOCAB_FILE", "EVAL_DIR", "EVENTS_FILE",
    "LOCK_FILE", "METRICS_FILE", "OPTIMIZER_FILE", "RUN_CONFIG_FILE", "RUN_INFO_FILE", "SPIKES_FILE",
    "STATE_FILE", "WANDB_ID_FILE", "WEIGHTS_FILE", "eval_results_path", "held_out_eval",
]
