"""Triton-specific checks of sparse_kl_loss under TRITON_INTERPRET=1 (set by conftest).

The shared numerical tests live in test_kernels.py (parametrised over every impl); here:
tile and split geometries, the order of the backward chunks, config validation, and the
error on CPU tensors without the interpreter.
"""

import os
import subprocess
import sys

import pytest
import torch

from dflash.kernels import sparse_kl_loss
from dflash.kernels.sparse_kl import INTERPRETED, TritonConfig
from test_kernels import FP32_TOL, SHAPES, loss_and_grads, make_problem, rel_err, truth


def test_runs_interpreted():
    assert INTERPRETED, "conftest sets TRITON_INTERPRET=1 before the kernels are imported"


@pytest.mark.parametrize(
    "config, workspace_rows",
    [
        (TritonConfig(block_n=16, block_v=16, block_h=16, num_splits=1), 37),  # many tiles, one split, one chunk
        (TritonConfig(block_n=64, block_v=256, block_h=64, num_splits=3), 64),  # one row tile, uneven splits
        (TritonConfig(block_n=16, block_v=64, block_h=16, num_splits=64, group_n=2), 5),  # splits capped by V tiles
    ],
)
def test_tile_geometries(config, workspace_rows):
    n, h, v, k = SHAPES["odd"]
    hidden, weight, ids, logprobs = make_problem(n, h, v, k, seed=11)
    ref, ref_dx, ref_dw = loss_and_grads(lambda x, w: truth(x, w, ids, logprobs), hidden, weight, grad_weight=True)
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out, argmax = sparse_kl_loss(x, w, ids, logprobs, impl="triton", triton_config=config,
                                 workspace_bytes=workspace_rows * v * 4, return_argmax=True)
    out.backward()
    assert abs(out.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert rel_err(x.grad, ref_dx) <= FP32_TOL
    assert rel_err(w.grad, ref_dw) <= FP32_TOL
    assert torch.equal(argmax, (hidden.double() @ weight.double().T).argmax(1))


@pytest.mark.parametrize("impl", ["naive", "torch", "triton"])
def test_argmax_ties_take_the_first_index(impl):
    """Exact ties within a tile, across tiles and across splits resolve to the smallest id,
    as torch.argmax does. Small integer inputs make every logit exact in any summation
    order (so ties are real ties) and make ties common."""
    n, h, v, k = SHAPES["odd"]
    g = torch.Generator().manual_seed(12)
    hidden = torch.randint(-2, 3, (n, h), generator=g).float()  # [N, H]
    weight = torch.randint(-1, 2, (v, h), generator=g).float()  # [V, H]
    ids = torch.rand(n, v, generator=g).argsort(1)[:, :k]
    logprobs = torch.full((n, k), -3.0)
    logits = hidden @ weight.T  # [N, V], integers
    assert ((logits == logits.max(1, keepdim=True).values).sum(1) > 1).float().mean() > 0.3
    config = TritonConfig(block_n=16, block_v=64, block_h=16, num_splits=4)
    kw = {"triton_config": config} if impl == "triton" else {}
    _, argmax = sparse_kl_loss(hidden, weight, ids, logprobs, impl=impl, return_argmax=True, **kw)
    assert torch.equal(argmax, logits.argmax(1))


@pytest.mark.parametrize(
    "field, value",
    [("block_n", 8), ("block_v", 100), ("block_h", 0), ("gather_block_n", 3), ("num_splits", 0), ("num_warps", 6),
     ("group_n", 0)],
)
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=f"TritonConfig.{field}"):
        TritonConfig(**{field: value})


def test_cpu_tensors_without_interpreter_raise():
    code = (
        "import torch\n"
        "from dflash.kernels import sparse_kl_loss\n"
        "x, w = torch.randn(4, 16), torch.randn(32, 16)\n"
        "ids, lq = torch.tensor([[1, 2]] * 4), torch.full((4, 2), -1.0)\n"
        "try:\n"
        "    sparse_kl_loss(x, w, ids, lq, impl='triton')\n"
        "except ValueError as err:\n"
        "    assert 'TRITON_INTERPRET=1' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('impl=triton ran on CPU tensors without the interpreter')\n"
        "assert sparse_kl_loss(x, w, ids, lq, impl='auto').isfinite()\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
