"""Column codecs: bf16 and fp8 features, raw and packed top-k. Pure numpy.

Features are the bulk of a cache (5 x 4096 x 2 B = 40 KB/token for Qwen3-8B in bf16), so both
feature codecs keep one fixed-width element per value and decode with a few vectorised
passes; the stored array is what training maps zero-copy. fp8 halves the bytes at a
documented error (FORMAT.md). Top-k is small beside features, so its codec favours size over
decode speed: ids bit-packed at ceil(log2 V) bits, probabilities quantised on a
square-root scale (the scale on which a quantisation step costs the same KL at every
probability), all in one fixed number of bytes per token.
"""

from __future__ import annotations

import functools
import math

import numpy as np

# Element-wise codecs run over chunks of this many values, so that their few temporaries
# stay in cache and are allocated once: about 3x faster than whole-array numpy passes.
_CHUNK_VALUES = 1 << 16

# ----------------------------------------------------------------------------- bf16

def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (round to nearest, ties to even); returns the uint16 bit patterns.

    The caller guarantees finite input; values beyond the bf16 range round to inf, which
    the writer's validation refuses beforehand.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.reshape(-1).view(np.uint32)
    out = np.empty(bits.size, dtype=np.uint16)
    work = np.empty(min(_CHUNK_VALUES, bits.size), dtype=np.uint32)
    for start in range(0, bits.size, _CHUNK_VALUES):
        chunk = bits[start:start + _CHUNK_VALUES]
        t = work[:chunk.size]
        # bits + 0x7FFF + lsb of the kept half, then keep the upper 16 bits
        np.right_shift(chunk, 16, out=t)
        t &= 1
        t += 0x7FFF
        t += chunk
        t >>= 16
        out[start:start + chunk.size] = t
    return out.reshape(x.shape)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32, exactly."""
    return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)


# ----------------------------------------------------------------------------- fp8 e4m3

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# The smallest fp8 scale, float32's smallest normal (2^-126): below it 1 / scale overflows to
# inf, and a vector whose max |x| is under 448 x 2^-126 (~5e-36) would encode as NaN.
FP8_MIN_SCALE = float(np.finfo(np.float32).tiny)
_FP8_MIN_NORMAL_BITS = 0x3C800000  # float32 bits of 2**-6, e4m3's smallest normal
# Adding 2**14 to a float32 below 2**-6 rounds it (to nearest even) to a multiple of 2**-9,
# e4m3's subnormal step, and leaves that multiple in the low mantissa bits.
_FP8_SUBNORMAL_MAGIC = np.float32(2.0**14)
_FP8_SUBNORMAL_MAGIC_BITS = 0x46800000
# A float32 whose bits are an e4m3 code shifted left by 20 has exponent field e4m3_exp and
# mantissa e4m3_mant << 20; multiplying by 2**120 rebiases 127 -> 7. The float32
# subnormal range lines up with e4m3's subnormals, so this is exact for all 254 finite codes.
_FP8_REBIAS = np.float32(2.0**120)


def f32_to_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode float32 [..., H] as float8_e4m3fn codes with one scale per leading index.

    Returns (codes uint8 [..., H], scales float32 [...]) with x ~= decode(codes) * scale;
    the scale maps each vector's max |x| to 448, so no code saturates (floored at
    FP8_MIN_SCALE, so that a vector of float32 subnormals still encodes). The bit layout is
    torch.float8_e4m3fn's (sign, 4 exponent bits with bias 7, 3 mantissa bits; 0x7F/0xFF are
    NaN and never produced), so `torch.from_numpy(codes).view(torch.float8_e4m3fn)` decodes it.
    Rounding is to nearest, ties to even.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    hidden = x.shape[-1]
    vectors = x.reshape(-1, hidden)  # [N, H]
    amax = np.maximum(vectors.max(axis=1), -vectors.min(axis=1))  # [N]
    scales = np.where(amax > 0, np.maximum(amax / np.float32(FP8_MAX), np.float32(FP8_MIN_SCALE)),
                      np.float32(1)).astype(np.float32)
    inverse = (np.float32(1) / scales).astype(np.float32)
    codes = np.empty(vectors.shape, dtype=np.uint8)
    rows = max(1, _CHUNK_VALUES // hidden)
    for start in range(0, vectors.shape[0], rows):
        chunk = vectors[start:start + rows]
        y = chunk * inverse[start:start + rows, None]  # [n, H] float32, |y| <= 448 (+ 1 ulp)
        bits = y.view(np.uint32)
        sign = (bits >> 24).astype(np.uint8)
        sign &= 0x80
        bits &= 0x7FFFFFFF  # y is now |y|
        small = bits < _FP8_MIN_NORMAL_BITS
        subnormal = (y + _FP8_SUBNORMAL_MAGIC).view(np.uint32)
        subnormal -= _FP8_SUBNORMAL_MAGIC_BITS
        # Round the float32 mantissa to 3 bits (to nearest even); a carry bumps the exponent,
        # which is the right result. Then rebias the exponent from 127 to 7 (120 << 3 = 960).
        code = bits >> 20
        code &= 1
        code += 0x7FFFF
        code += bits
        code >>= 20
        code -= 960
        np.copyto(code, subnormal, where=small)
        np.minimum(code, 0x7E, out=code)
        out = codes[start:start + rows]
        out[...] = code
        out |= sign
    return codes.reshape(x.shape), scales.reshape(x.shape[:-1])


def fp8_to_f32(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Decode float8_e4m3fn codes uint8 [..., H] with scales float32 [...] to float32 [..., H]."""
    hidden = codes.shape[-1]
    flat = codes.reshape(-1, hidden)  # [N, H]
    factors = (np.asarray(scales, dtype=np.float32).reshape(-1) * _FP8_REBIAS)  # [N]
    out = np.empty(flat.shape, dtype=np.float32)
    words = out.view(np.int32)
    rows = max(1, _CHUNK_VALUES // hidden)
    for start in range(0, flat.shape[0], rows):
        w = words[start:start + rows]
        # The code at the top of a 32-bit word; an arithmetic shift by 4 lands the 7
        # magnitude bits at bit 20 while smearing the sign over bits 27..31; the mask keeps
        # bit 31 (the float32 sign) and clears 27..30.
        np.left_shift(flat[start:start + rows], 24, out=w, dtype=np.int32, casting="unsafe")
        w >>= 4
        w &= np.int32(-0x78000001)  # 0x87FFFFFF
        out[start:start + rows] *= factors[start:start + rows, None]
    return out.reshape(codes.shape)


# ----------------------------------------------------------------------------- top-k

def id_bits(vocab_size: int) -> int:
    """Bits per packed token id: ceil(log2 V)."""
    return max(1, math.ceil(math.log2(vocab_size)))


# Packed top-k layout per token (bits, least significant first within each field):
#   tail code      MASS_BITS   logit of the tail share, log(t / M), uniform on [-48, 48]
#   p[0] code      FIRST_BITS  sqrt of the top candidate's share of the top-k mass M
#   p[1..k-1]      REST_BITS   each: sqrt of the share on the range left by the previous code
#   ids            k * ceil(log2 V), in descending probability order
MASS_BITS = 16
FIRST_BITS = 8
REST_BITS = 5
_MASS_RANGE = 48.0
_MASS_LEVELS = 2**MASS_BITS - 1  # codes 1..65535; 0 means "tail mass exactly 0"


def packed_bytes_per_token(top_k: int, vocab_size: int) -> int:
    bits = MASS_BITS + FIRST_BITS + REST_BITS * (top_k - 1) + top_k * id_bits(vocab_size)
    return (bits + 7) // 8


def _chain_bits(i: int) -> int:
    return FIRST_BITS if i == 0 else REST_BITS


def encode_topk_packed(
    topk_ids: np.ndarray, topk_logprobs: np.ndarray, tail_mass: np.ndarray, vocab_size: int
) -> np.ndarray:
    """Encode one sequence's top-k as packed bytes: returns uint8 [T, packed_bytes_per_token].

    topk_ids [T, k] int (< V, unique per row), topk_logprobs [T, k] float (full-vocabulary
    log-probs, any order: candidates are stored in descending probability), tail_mass [T]
    float in [0, 1].
    """
    num_tokens, top_k = topk_ids.shape
    order = np.argsort(-np.asarray(topk_logprobs, dtype=np.float64), axis=1, kind="stable")
    ids = np.take_along_axis(np.asarray(topk_ids, dtype=np.int64), order, axis=1)  # [T, k]
    probs = np.exp(np.take_along_axis(np.asarray(topk_logprobs, dtype=np.float64), order, axis=1))
    mass = probs.sum(axis=1)  # [T] top-k mass M
    tail = np.asarray(tail_mass, dtype=np.float64)

    # Tail: the logit log(t / M) on a uniform grid, which is precise for t and for 1 - t alike.
    with np.errstate(divide="ignore"):
        logit = np.log(tail) - np.log(mass)
    level = np.rint((np.clip(logit, -_MASS_RANGE, _MASS_RANGE) + _MASS_RANGE)
                    * ((_MASS_LEVELS - 1) / (2 * _MASS_RANGE)))
    mass_code = np.where(tail > 0, level + 1, 0).astype(np.int64)  # [T]

    # Shares p = q / M, quantised on sqrt(p), each on [0, u) where u is the upper edge of the
    # previous code's bin (which bounds the next share, as the shares are sorted). Closed
    # loop: the encoder tracks the decoder's u, so errors never accumulate along the chain.
    roots = np.sqrt(probs / mass[:, None])  # [T, k]
    upper = np.ones(num_tokens)
    share_codes = np.empty((num_tokens, top_k), dtype=np.int64)
    for i in range(top_k):
        levels = 2 ** _chain_bits(i)
        code = np.clip(np.floor(roots[:, i] / upper * levels), 0, levels - 1)
        share_codes[:, i] = code
        upper = (code + 1) * upper / levels

    fields = np.concatenate([mass_code[:, None], share_codes, ids], axis=1).astype(np.uint64)  # [T, F]
    return pack_fields(fields, _field_widths(top_k, vocab_size))


def _field_widths(top_k: int, vocab_size: int) -> np.ndarray:
    """[F] bits of each field of the packed layout: tail, shares, ids."""
    return np.array([MASS_BITS, FIRST_BITS] + [REST_BITS] * (top_k - 1) + [id_bits(vocab_size)] * top_k)


def pack_fields(fields: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Pack unsigned fields [T, F] (each < 2**widths[f], at most 64 bits) one after the other,
    least significant bit first, into uint8 [T, ceil(sum(widths) / 8)].

    Fields are ORed into 64-bit little-endian words: each field's low part into the word its
    first bit falls in, the part that crosses into the next word (at most one per word
    boundary) into that one; bits never overlap, so sums are ORs. The bytes are those of
    `np.packbits(bits, bitorder="little")` over the fields' bits.
    """
    widths = np.asarray(widths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(widths)[:-1]])  # [F]
    word, shift = offsets >> 6, (offsets & 63).astype(np.uint64)
    num_words = int((widths.sum() + 63) // 64)
    values = np.ascontiguousarray(fields, dtype=np.uint64)
    words = np.zeros((len(values), num_words), dtype=np.uint64)
    starts = np.flatnonzero(np.diff(word, prepend=-1))  # the first field of each word
    words[:, word[starts]] = np.add.reduceat(values << shift, starts, axis=1)
    cross = np.flatnonzero(offsets % 64 + widths > 64)  # fields that run into the next word
    words[:, word[cross] + 1] += values[:, cross] >> (np.uint64(64) - shift[cross])
    num_bytes = int((widths.sum() + 7) // 8)
    return np.ascontiguousarray(words.astype("<u8").view(np.uint8)[:, :num_bytes])


@functools.lru_cache(maxsize=16)
def _packed_fields(top_k: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per field of the packed layout: (byte index [F, 8] of the 8 bytes holding it,
    bit shift [F], mask [F]); F = 2 + 2k - 1 fields (tail, shares, ids)."""
    widths = np.array([MASS_BITS, FIRST_BITS] + [REST_BITS] * (top_k - 1) + [id_bits(vocab_size)] * top_k)
    offsets = np.concatenate([[0], np.cumsum(widths)[:-1]])
    byte_index = (offsets >> 3)[:, None] + np.arange(8)
    return byte_index, (offsets & 7).astype(np.uint64), ((1 << widths) - 1).astype(np.uint64)


def decode_topk_packed(
    packed: np.ndarray, top_k: int, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode uint8 [T, bytes] -> (topk_ids [T, k] int32, topk_logprobs [T, k] float32,
    tail_mass [T] float32), candidates in descending probability; exp(logprobs) sums with the
    tail to 1."""
    num_tokens, num_bytes = packed.shape
    byte_index, shifts, masks = _packed_fields(top_k, vocab_size)
    # Every field (at most 57 bits wide) lies within the 8 bytes from its first byte: gather
    # those as one little-endian uint64 per field, then shift and mask.
    padded = np.zeros((num_tokens, num_bytes + 8), dtype=np.uint8)
    padded[:, :num_bytes] = packed
    words = np.ascontiguousarray(padded[:, byte_index]).view("<u8")[..., 0]  # [T, F] uint64
    fields = ((words >> shifts) & masks).astype(np.int64)  # [T, F]
    mass_code = fields[:, 0]  # [T]
    share_codes = fields[:, 1:1 + top_k]  # [T, k]
    ids = fields[:, 1 + top_k:].astype(np.int32)  # [T, k]

    # The chain's ranges are a running product: u_0 = 1, u_{i+1} = u_i (c_i + 1) / 2^b_i,
    # the same roundings as the encoder's sequential loop (dividing by 2^b is exact).
    levels = np.array([2.0**_chain_bits(i) for i in range(top_k)])  # [k]
    upper = np.ones((num_tokens, top_k))
    np.cumprod((share_codes[:, :-1] + 1) / levels[:-1], axis=1, out=upper[:, 1:])
    roots = (share_codes + 0.5) * upper / levels  # bin centres, never 0
    shares = roots**2
    shares /= shares.sum(axis=1, keepdims=True)

    logit = (mass_code - 1) * (2 * _MASS_RANGE / (_MASS_LEVELS - 1)) - _MASS_RANGE
    tail = np.where(mass_code > 0, 1.0 / (1.0 + np.exp(-logit)), 0.0)  # [T] float64
    log_mass = np.where(mass_code > 0, -np.logaddexp(0.0, logit), 0.0)  # log(1 - t)
    logprobs = np.log(shares) + log_mass[:, None]
    return ids, logprobs.astype(np.float32), tail.astype(np.float32)


def tail_from_logprobs(topk_logprobs: np.ndarray) -> np.ndarray:
    """max(0, 1 - sum(exp(topk_logprobs))) per row, computed in float64: [T] float32."""
    mass = np.exp(np.asarray(topk_logprobs, dtype=np.float64)).sum(axis=-1)
    return np.maximum(0.0, 1.0 - mass).astype(np.float32)


def topk_kl(
    logprobs_a: np.ndarray, tail_a: np.ndarray, logprobs_b: np.ndarray, tail_b: np.ndarray
) -> np.ndarray:
    """KL(a || b) in nats per row between two top-k-plus-tail distributions on the same ids
    (same order): [T]. Each side is normalised over its k + 1 buckets first."""
    qa = np.exp(np.asarray(logprobs_a, dtype=np.float64))
    qb = np.exp(np.asarray(logprobs_b, dtype=np.float64))
    ta = np.asarray(tail_a, dtype=np.float64)[:, None]
    tb = np.asarray(tail_b, dtype=np.float64)[:, None]
    pa = np.concatenate([qa, ta], axis=1)
    pb = np.concatenate([qb, tb], axis=1)
    pa /= pa.sum(axis=1, keepdims=True)
    pb /= pb.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(pa > 0, pa * (np.log(pa) - np.log(pb)), 0.0)
    return terms.sum(axis=1)


def topk_codec_kl(
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    tail_mass: np.ndarray | None = None,
    *,
    vocab_size: int | None = None,
    codec: str = "packed",
) -> float:
    """Mean KL (nats per token) that storing this top-k with `codec` costs.

    The KL is from the exact top-k-plus-tail distribution to the decoded one, both
    normalised over k + 1 buckets. topk_ids [T, k] int, topk_logprobs [T, k] float
    (full-vocabulary log-probs, e.g. the target's real ones), tail_mass [T] (default
    1 - sum(exp(topk_logprobs))). Use it to check the codec on a real target's distributions.
    """
    topk_ids = np.asarray(topk_ids)
    topk_logprobs = np.asarray(topk_logprobs)
    if topk_ids.ndim != 2 or topk_ids.shape != topk_logprobs.shape:
        raise ValueError(
            f"topk_ids and topk_logprobs must both be [T, k], got {topk_ids.shape} and "
            f"{topk_logprobs.shape}"
        )
    if tail_mass is None:
        tail_mass = tail_from_logprobs(topk_logprobs)
    if codec == "raw":
        return 0.0
    if codec != "packed":
        raise ValueError(f"codec must be 'packed' or 'raw', got {codec!r}")
    vocab_size = int(topk_ids.max()) + 1 if vocab_size is None else vocab_size
    top_k = topk_ids.shape[1]
    packed = encode_topk_packed(topk_ids, topk_logprobs, tail_mass, vocab_size)
    ids, logprobs, tail = decode_topk_packed(packed, top_k, vocab_size)
    # Compare on the decoder's order (descending probability).
    order = np.argsort(-np.asarray(topk_logprobs, dtype=np.float64), axis=1, kind="stable")
    exact = np.take_along_axis(np.asarray(topk_logprobs, dtype=np.float64), order, axis=1)
    assert np.array_equal(ids, np.take_along_axis(topk_ids, order, axis=1))
    return float(topk_kl(exact, tail_mass, logprobs, tail).mean())
