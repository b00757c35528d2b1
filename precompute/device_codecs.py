"""The feature codecs in torch, run on the target's device in the batch: only encoded bytes
cross to the host.

Bit for bit the numpy encoders of `dflash.shards.codecs` (`f32_to_bf16`, `f32_to_fp8`), so a
cache is the same bytes whichever side encoded it (tests/test_device_codecs.py compares them
on zeros, outliers, subnormals and rounding ties). fp8 mirrors the numpy bit manipulation
step by step in int32 instead of calling torch's float8 cast, so that no device's own fp8
conversion (saturation, hardware rounding paths) can change a code; its divisions are
tensor-by-tensor (a division by a Python scalar may become a multiplication by the
reciprocal on CUDA, which rounds differently). Every step is an exactly rounded IEEE
operation (max, divide, multiply, add) or integer arithmetic, so CPU and CUDA agree.

The basis codecs are not here: their projection is a float32 matmul whose reduction order
differs between numpy's BLAS and a device's GEMM, so its last bits cannot match the numpy
encoder; they keep encoding on the host (FORMAT.md says why).
"""

from __future__ import annotations

import torch

from dflash.shards.codecs import FP8_MAX, FP8_MIN_SCALE

DEVICE_CODECS = ("bf16", "fp8")
"""Feature codecs encoded on the target's device."""

_FP8_MIN_NORMAL_BITS = 0x3C800000  # float32 bits of 2**-6, e4m3's smallest normal
_FP8_SUBNORMAL_MAGIC = 2.0**14  # adding it rounds |y| < 2**-6 to a multiple of 2**-9 (e4m3's step)
_FP8_SUBNORMAL_MAGIC_BITS = 0x46800000


def encode_features(features: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """Encode [N, L, H] features (float, any device) for `codec` ("bf16" or "fp8"), on their
    device: {"features": [N, L, H] int16 (bf16 bits) or uint8 (e4m3 codes)} plus, for fp8,
    {"feature_scales": [N, L] float32}. The caller has checked that the features are finite."""
    if codec == "bf16":
        return {"features": features.to(torch.bfloat16).view(torch.int16)}
    if codec == "fp8":
        codes, scales = f32_to_fp8(features)
        return {"features": codes, "feature_scales": scales}
    raise ValueError(f"feature codec {codec!r} is not encoded on the device; those are {DEVICE_CODECS}")


def f32_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`dflash.shards.codecs.f32_to_fp8` in torch: (codes uint8 [..., H], scales float32 [...]),
    one scale per vector over the last dimension, mapping its max |x| to 448."""
    x = x.float()
    amax = x.abs().amax(dim=-1)  # [...]
    scales = torch.where(amax > 0, (amax / torch.full_like(amax, FP8_MAX)).clamp_min(FP8_MIN_SCALE),
                         torch.ones_like(amax))
    inverse = torch.ones_like(scales) / scales
    y = x * inverse.unsqueeze(-1)  # [..., H] float32, |y| <= 448 (+ 1 ulp)
    bits = y.view(torch.int32)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    subnormal = (y.abs() + _FP8_SUBNORMAL_MAGIC).view(torch.int32) - _FP8_SUBNORMAL_MAGIC_BITS
    # Round the float32 mantissa to 3 bits (to nearest even; a carry bumps the exponent, which
    # is right), then rebias the exponent from 127 to 7 (120 << 3 = 960).
    code = (((magnitude >> 20) & 1) + 0x7FFFF + magnitude) >> 20
    code = torch.where(magnitude < _FP8_MIN_NORMAL_BITS, subnormal, code - 960).clamp_max(0x7E)
    return (code | sign).to(torch.uint8), scales


__all__ = ["DEVICE_CODECS", "encode_features", "f32_to_fp8"]
