"""bench/engine_venv.py: where the engine venv is looked for."""

from pathlib import Path

from bench.engine_venv import DEFAULT_ENGINE_VENV, ENGINE_VENV_ENV, engine_venv


def test_a_relative_engine_venv_is_made_absolute(tmp_path, monkeypatch):
    """The engine process runs in the check's work folder: `--engine-venv .venv-engine` must
    still name the folder beside the caller, not one inside the work folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENGINE_VENV_ENV, raising=False)
    assert engine_venv(".venv-engine") == tmp_path / ".venv-engine"
    monkeypatch.setenv(ENGINE_VENV_ENV, "elsewhere/venv")
    assert engine_venv() == tmp_path / "elsewhere" / "venv"
    monkeypatch.delenv(ENGINE_VENV_ENV)
    assert engine_venv() == Path(DEFAULT_ENGINE_VENV).absolute()
