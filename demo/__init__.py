"""The embedded default: SmolLM2-135M-Instruct on chitchat data (see demo/run.py)."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_work_dir() -> Path:
    """Where the demo's target, prompts, cache and run live: $DFLASH_DEMO_DIR, else .demo in the
    repository (demo/run.py and demo/out_of_domain.py share it)."""
    return Path(os.environ.get("DFLASH_DEMO_DIR", REPO / ".demo"))
