"""Synthetic cache contents for tests, benchmarks and demos: no model needed.

`zipf_topk` draws next-token distributions shaped like a language model's (Zipf-like logits:
a few likely tokens, a long tail), from which the top-k codec's error is measured;
`write_synthetic_cache` builds a whole cache with the real writer, so consumers (training,
evaluation, the CLI) can be tested without running a target.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash.shards.spec import CacheSpec


def zipf_topk(
    rng: np.random.Generator,
    num_tokens: int,
    vocab_size: int,
    top_k: int,
    *,
    exponent_range: tuple[float, float] = (1.0, 3.0),
    noise: float = 0.5,
    chunk_tokens: int = 256,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of Zipf-like distributions over the full vocabulary.

    Per token, logits are -s * log(rank) + N(0, noise^2) over a random ranking of the
    vocabulary with s ~ U(exponent_range): s = 1 is flat (top-1 ~ 0.1 at V = 49152), s = 3 is
    peaked (top-1 ~ 0.8). Returns (topk_ids [T, k] int32, topk_logprobs [T, k] float32),
    log-probs normalised over the whole vocabulary in float64, candidates in descending order.
    """
    log_rank = np.log(np.arange(1, vocab_size + 1, dtype=np.float64))  # [V]
    ids = np.empty((num_tokens, top_k), dtype=np.int32)
    logprobs = np.empty((num_tokens, top_k), dtype=np.float32)
    for start in range(0, num_tokens, chunk_tokens):
        n = min(chunk_tokens, num_tokens - start)
        exponents = rng.uniform(*exponent_range, size=(n, 1))
        logits = -exponents * log_rank + rng.normal(0.0, noise, size=(n, vocab_size))  # [n, V]
        logz = np.logaddexp.reduce(logits, axis=1, keepdims=True)
        best = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]  # [n, k] by rank
        best_logits = np.take_along_axis(logits, best, axis=1)
        order = np.argsort(-best_logits, axis=1)
        ranks = np.take_along_axis(best, order, axis=1)
        # A random permutation of the vocabulary, rotated per token, maps ranks to token ids.
        shifts = rng.integers(0, vocab_size, size=(n, 1))
        ids[start:start + n] = rng.permutation(vocab_size)[(ranks + shifts) % vocab_size]
        logprobs[start:start + n] = np.take_along_axis(best_logits, order, axis=1) - logz
    return ids, logprobs


def synthetic_row(
    rng: np.random.Generator, spec: CacheSpec, num_tokens: int, *, zipf: bool = False
) -> dict[str, np.ndarray]:
    """One random row for `spec`: the keyword arguments of `CacheWriter.add` minus `source`.

    Features are N(0, 1) with a few large channels (as real hidden states have); with
    zipf=False the top-k is drawn cheaply (random distinct ids, random sorted log-probs)
    instead of from full-vocabulary Zipf logits.
    """
    shape = (num_tokens, spec.num_layers, spec.hidden_size)
    features = rng.standard_normal(shape, dtype=np.float32)  # [T, L, H] float32
    features[..., :: max(1, spec.hidden_size // 8)] *= 20.0
    if zipf:
        topk_ids, topk_logprobs = zipf_topk(rng, num_tokens, spec.vocab_size, spec.top_k)
    else:
        topk_ids = np.stack(
            [rng.choice(spec.vocab_size, spec.top_k, replace=False) for _ in range(num_tokens)]
        ).astype(np.int32)  # [T, k] int32
        raw = -np.sort(rng.exponential(2.0, size=(num_tokens, spec.top_k)), axis=1)
        raw += np.log(rng.uniform(0.5, 1.0, size=(num_tokens, 1)))
        topk_logprobs = (raw - np.logaddexp.reduce(raw, axis=1, keepdims=True)
                         + np.log(rng.uniform(0.5, 1.0, size=(num_tokens, 1)))).astype(np.float32)
    # Each next token is drawn from the cached distribution of the position before it (one of
    # the top-k, or a random id for the tail), as in text the target generated itself.
    input_ids = rng.integers(0, spec.vocab_size, size=num_tokens, dtype=np.int64)  # [T]
    probs = np.exp(topk_logprobs[:-1].astype(np.float64))  # [T-1, k]
    pick = (rng.uniform(size=(num_tokens - 1, 1)) < np.cumsum(probs, axis=1)).argmax(axis=1)
    in_topk = rng.uniform(size=num_tokens - 1) < probs.sum(axis=1)
    input_ids[1:] = np.where(in_topk, topk_ids[np.arange(num_tokens - 1), pick], input_ids[1:])
    loss_mask = np.zeros(num_tokens, dtype=bool)  # [T]: a prompt, then the reply
    loss_mask[num_tokens // 3:] = True
    return dict(input_ids=input_ids, loss_mask=loss_mask, features=features, topk_ids=topk_ids,
                topk_logprobs=topk_logprobs)


def write_synthetic_cache(
    cache_dir: str | Path,
    spec: CacheSpec,
    lengths: list[int],
    *,
    seed: int = 0,
    world_size: int = 1,
    zipf: bool = False,
    source_file: str = "synthetic.jsonl",
):
    """Write and finalize a cache of len(lengths) random sequences; returns the open Cache.

    Record i goes to rank i % world_size (all ranks written from this process, in turn).
    """
    from dflash.shards.writer import CacheWriter, finalize_cache

    rng = np.random.default_rng(seed)
    rows = [synthetic_row(rng, spec, n, zipf=zipf) for n in lengths]
    basis = None
    if spec.is_basis:  # fitted on every row, as stage one fits on its sample
        from dflash.shards.basis import SecondMoment, fit_basis, write_basis

        moment = SecondMoment(spec.num_layers * spec.hidden_size)
        for row in rows:
            moment.add(row["features"])
        basis = fit_basis(moment.matrix, moment.num_tokens, spec.feature_rank)
        write_basis(cache_dir, basis)
    for rank in range(world_size):
        writer = CacheWriter(cache_dir, spec, rank=rank, world_size=world_size, basis=basis)
        for index in range(rank, len(rows), world_size):
            writer.add(**rows[index], source={"file": source_file, "index": index})
        writer.close()
    return finalize_cache(cache_dir, spec, world_size)
