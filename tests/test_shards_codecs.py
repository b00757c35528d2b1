"""Codec tests: bf16 and fp8 against torch's own conversions, packed top-k against its bounds."""

import numpy as np
import pytest
import torch

from dflash.shards import codecs, topk_codec_kl
from dflash.shards.synthetic import zipf_topk


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_bf16_rounding_matches_torch(rng):
    x = np.concatenate([
        rng.standard_normal(10_000).astype(np.float32) * 100,
        # exact ties between two bf16 values, both parities, to test ties-to-even
        (np.arange(1, 2001, dtype=np.uint32) << 15 | np.uint32(0x3F800000)).view(np.float32),
        np.array([0.0, -0.0, 1e-40, -3e38, 3.38e38], dtype=np.float32),
    ])
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(codecs.f32_to_bf16(x), expected)


def test_bf16_widening_is_exact(rng):
    bits = rng.integers(0, 2**16, size=4096, dtype=np.uint16)
    bits = bits[(bits & 0x7F80) != 0x7F80]  # finite patterns only
    expected = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(codecs.bf16_to_f32(bits), expected)


def test_fp8_decode_matches_torch_for_every_code():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)  # all but NaN
    expected = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(codecs.fp8_to_f32(codes[None, :], np.ones(1, np.float32))[0], expected)


def test_fp8_encode_matches_torch_rounding(rng):
    x = rng.standard_normal((64, 3, 257)).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 4, (64, 3, 1))
    codes, scales = codecs.f32_to_fp8(x)
    scaled = torch.from_numpy(x / scales[..., None])
    expected = scaled.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(codes, expected)


def test_fp8_error_within_documented_bound(rng):
    x = rng.standard_normal((128, 5, 576)).astype(np.float32)
    x[..., ::64] *= 300.0  # outlier channels, as real hidden states have
    codes, scales = codecs.f32_to_fp8(x)
    decoded = codecs.fp8_to_f32(codes, scales)
    # FORMAT.md: |x - x'| <= max(2^-4 |x|, 2^-10 * scale) (half a step of 3 mantissa bits,
    # or of the subnormal grid 2^-9), plus float32 rounding of the scale.
    bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scales[..., None]) * (1 + 1e-6)
    assert (np.abs(decoded - x) <= bound).all()
    assert codes.nbytes == x.size  # one byte per value


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_fp8_vectors_of_tiny_values_keep_the_bound():
    # A max |x| under 448 x 2^-126 made 1 / scale overflow: every value, zeros included,
    # decoded as +-max|x|. The scale is floored at 2^-126; the documented bound holds.
    x = np.zeros((5, 16), np.float32)
    for row, amax in enumerate([1e-30, 1e-36, 1e-38, 1e-41, 1e-45]):
        x[row, :4] = np.float32(amax) * np.array([1.0, -0.5, 0.25, 0.0], np.float32)
    codes, scales = codecs.f32_to_fp8(x)
    decoded = codecs.fp8_to_f32(codes, scales)
    assert (scales >= codecs.FP8_MIN_SCALE).all() and np.isfinite(decoded).all()
    bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scales[..., None]) * (1 + 1e-6)
    assert (np.abs(decoded - x) <= bound).all()
    assert (decoded[x == 0] == 0).all()
    assert decoded[0, 0] == x[0, 0]  # 1e-30 is far above the floor: the scale is max|x| / 448


def test_fp8_all_zero_vector_decodes_to_zero():
    codes, scales = codecs.f32_to_fp8(np.zeros((2, 8), np.float32))
    np.testing.assert_array_equal(codecs.fp8_to_f32(codes, scales), 0.0)


@pytest.mark.parametrize(("vocab_size", "expected_bytes"), [(49152, 87), (151936, 95)])
def test_packed_topk_bytes_per_token(vocab_size, expected_bytes):
    assert codecs.packed_bytes_per_token(32, vocab_size) == expected_bytes
    assert expected_bytes <= 98  # half of int32 id + fp16 log-prob + fp32 tail at k = 32


@pytest.mark.parametrize("vocab_size", [49152, 151936])
@pytest.mark.parametrize("exponents", [(1.0, 3.0), (1.0, 1.2), (2.8, 3.0)])
def test_packed_topk_kl_bound_on_zipf(rng, vocab_size, exponents):
    ids, logprobs = zipf_topk(rng, 128, vocab_size, 32, exponent_range=exponents)
    kl = topk_codec_kl(ids, logprobs, vocab_size=vocab_size)
    assert 0 < kl <= 1e-3


def test_packed_topk_round_trip(rng):
    vocab_size, top_k = 151936, 32
    ids, logprobs = zipf_topk(rng, 64, vocab_size, top_k)
    shuffle = rng.permuted(np.tile(np.arange(top_k), (64, 1)), axis=1)  # input order is free
    ids, logprobs = np.take_along_axis(ids, shuffle, 1), np.take_along_axis(logprobs, shuffle, 1)
    tail = codecs.tail_from_logprobs(logprobs)
    packed = codecs.encode_topk_packed(ids, logprobs, tail, vocab_size)
    assert packed.shape == (64, 95) and packed.dtype == np.uint8
    dec_ids, dec_logprobs, dec_tail = codecs.decode_topk_packed(packed, top_k, vocab_size)
    order = np.argsort(-logprobs, axis=1, kind="stable")
    np.testing.assert_array_equal(dec_ids, np.take_along_axis(ids, order, 1))  # ids are exact
    # the tail keeps ~0.1% relative precision (16-bit logit grid); distributions sum to 1
    np.testing.assert_allclose(dec_tail, tail, rtol=2e-3, atol=1e-12)
    np.testing.assert_allclose(np.exp(dec_logprobs.astype(np.float64)).sum(1) + dec_tail, 1.0, atol=1e-5)
    # the top candidate's probability is within a couple of percent
    np.testing.assert_allclose(np.exp(dec_logprobs[:, 0]), np.exp(np.sort(logprobs)[:, -1]), rtol=0.03)


# The tail's logit log(t / M) is clamped to [-48, 48]: a tail below e^-48 M ~ 1.4e-21 M
# decodes as that floor, an absolute error no loss can see.
@pytest.mark.parametrize(("tail", "expected"), [(0.0, 0.0), (1e-12, 1e-12), (1e-30, 1.4252e-21), (0.999, 0.999)])
def test_packed_topk_tail_extremes(tail, expected):
    top_k = 4
    shares = np.array([[0.7, 0.2, 0.08, 0.02]])
    logprobs = np.log(shares * (1 - tail)).astype(np.float32)
    packed = codecs.encode_topk_packed(np.array([[5, 1, 7, 3]]), logprobs, np.array([tail]), 10)
    _, dec_logprobs, dec_tail = codecs.decode_topk_packed(packed, top_k, 10)
    np.testing.assert_allclose(dec_tail, [expected], rtol=2e-3)
    assert np.isfinite(dec_logprobs).all()


def test_topk_codec_kl_raw_is_zero(rng):
    ids, logprobs = zipf_topk(rng, 8, 1000, 4)
    assert topk_codec_kl(ids, logprobs, codec="raw") == 0.0


def _packbits_reference(fields: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The fields' bits, least significant first, one after the other, through np.packbits."""
    bits = [((fields[:, f:f + 1].astype(np.uint64) >> np.arange(w, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
            for f, w in enumerate(widths)]
    return np.packbits(np.concatenate(bits, axis=1), axis=1, bitorder="little")


@pytest.mark.parametrize("top_k, vocab_size", [(32, 151_936), (1, 2), (8, 64), (5, 49_152), (64, 2**20)])
@pytest.mark.parametrize("values", ["random", "all ones", "zeros"])
def test_pack_fields_matches_packbits(top_k, vocab_size, values):
    widths = codecs._field_widths(top_k, vocab_size)
    limits = (np.uint64(1) << widths.astype(np.uint64)) - np.uint64(1)  # [F] largest value of each field
    rng = np.random.default_rng(top_k)
    if values == "random":
        fields = rng.integers(0, 2**63, (37, len(widths)), dtype=np.uint64) & limits
    elif values == "all ones":
        fields = np.broadcast_to(limits, (37, len(widths))).copy()
    else:
        fields = np.zeros((37, len(widths)), np.uint64)
    packed = codecs.pack_fields(fields, widths)
    assert packed.shape == (37, codecs.packed_bytes_per_token(top_k, vocab_size))
    np.testing.assert_array_equal(packed, _packbits_reference(fields, widths))
