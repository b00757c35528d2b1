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

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def seed() -> int:
    """The seed for tests that draw random data; fixed so that failures reproduce."""
    torch.manual_seed(0)
    np.random.seed(0)
    return 0
