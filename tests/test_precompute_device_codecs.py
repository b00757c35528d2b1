"""precompute/device_codecs.py: the torch feature encoders give the numpy codecs' bytes, bit for
bit, on adversarial values (zeros, huge outliers, float32 subnormals, rounding ties, signs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.precompute.device_codecs import encode_features, f32_to_fp8
from dflash.shards import codecs

H = 48


def _ties() -> np.ndarray:
    """[4, H] vectors whose max |x| is 448 (scale exactly 1), holding e4m3 rounding ties:
    midpoints between normal codes, between subnormal codes, and half the smallest subnormal."""
    step = 2.0**-9  # e4m3's subnormal step
    values = [448.0, 1.0625, 1.1875, -1.0625, 2.0**-7 + 2.0**-11, 0.5 * step, 1.5 * step, 2.5 * step,
              -0.5 * step, 7.5 * step, 2.0**-6 - 0.5 * step, 240.0 + 8.0, 1.0 + 2.0**-4 + 2.0**-20]
    row = np.zeros(H, np.float32)
    row[:len(values)] = values
    return np.stack([row, -row, row * np.float32(0.5) + np.float32(448) * (np.arange(H) == H - 1), row[::-1]])


def _adversarial(seed: int) -> np.ndarray:
    """[N, H] float32 rows: normal values, all zeros, negative zeros, a huge outlier, values
    around float32's subnormals, bf16 ties, and the e4m3 ties."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((6, H)).astype(np.float32)
    normal[1, 3] = 3.0e38  # an outlier that sends the rest of its row to e4m3 subnormals or 0
    normal[2, :] *= np.float32(1e-39)  # float32 subnormals
    normal[3, ::2] = np.float32(1.0 + 2.0**-8)  # bf16 ties (round to even: down)
    normal[3, 1::2] = np.float32(1.0 + 3 * 2.0**-8)  # bf16 ties (round to even: up)
    normal[4, :] = np.float32(1e-45) * np.arange(H)  # the smallest float32 subnormals
    zeros = np.zeros((1, H), np.float32)
    negative_zeros = np.full((1, H), -0.0, np.float32)
    return np.concatenate([normal, zeros, negative_zeros, _ties()])


# The row of the smallest float32 subnormals once overflowed 1 / scale (a RuntimeWarning, NaN
# codes); with the scale floored at float32's smallest normal it encodes like any other.
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_matches_numpy_bit_for_bit(seed, dtype):
    x = torch.from_numpy(_adversarial(seed)).to(dtype)
    codes, scales = f32_to_fp8(x)
    expected_codes, expected_scales = codecs.f32_to_fp8(x.float().numpy())
    np.testing.assert_array_equal(codes.numpy(), expected_codes)
    np.testing.assert_array_equal(scales.numpy().view(np.uint32), expected_scales.view(np.uint32))


def test_fp8_ties_are_exercised():
    # The tie rows really sit on midpoints: a round-half-up encoder would differ from the numpy one.
    x = _ties()
    up = np.floor(x[0, 1] * 8 + 0.5) / 8  # 1.0625 -> 1.125 under half-up; to even it is 1.0
    codes, _ = codecs.f32_to_fp8(x)
    decoded = codecs.fp8_to_f32(codes, np.ones(len(x), np.float32))
    assert decoded[0, 1] == 1.0 and up == 1.125
    assert decoded[0, 5] == 0.0 and decoded[0, 6] == 2 * 2.0**-9  # subnormal ties to even


@pytest.mark.parametrize("shape", [(7, 3, H), (1, 1, H)])
def test_encode_features_layout(shape):
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 5)
    fp8 = encode_features(x, "fp8")
    expected_codes, expected_scales = codecs.f32_to_fp8(x.numpy())
    assert fp8["features"].shape == shape and fp8["feature_scales"].shape == shape[:2]
    np.testing.assert_array_equal(fp8["features"].numpy(), expected_codes)
    np.testing.assert_array_equal(fp8["feature_scales"].numpy(), expected_scales)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_matches_numpy_bit_for_bit(seed):
    x = _adversarial(seed)
    x = x[np.abs(x).max(axis=1) < 3.3e38]  # beyond bf16's range the writer refuses the row
    bits = encode_features(torch.from_numpy(x), "bf16")["features"].numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, codecs.f32_to_bf16(x))


def test_basis_codecs_are_refused():
    with pytest.raises(ValueError, match="basis-fp8"):
        encode_features(torch.zeros(1, 1, H), "basis-fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_on_cuda_matches_numpy_bit_for_bit(seed):
    x = torch.from_numpy(_adversarial(seed)).cuda()
    codes, scales = f32_to_fp8(x)
    expected_codes, expected_scales = codecs.f32_to_fp8(x.cpu().numpy())
    np.testing.assert_array_equal(codes.cpu().numpy(), expected_codes)
    np.testing.assert_array_equal(scales.cpu().numpy(), expected_scales)
    finite = x.cpu().numpy()
    finite = finite[np.abs(finite).max(axis=1) < 3.3e38]  # beyond bf16's range the writer refuses the row
    bits = encode_features(torch.from_numpy(finite).cuda(), "bf16")["features"]
    np.testing.assert_array_equal(bits.cpu().numpy().view(np.uint16), codecs.f32_to_bf16(finite))
