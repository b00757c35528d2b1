"""Re-encode a cache's features with another feature codec, without the target.

`transcode_cache(src, dst, feature_codec=..., feature_rank=...)` reads every row of `src`
(decoded: float32 features, top-k ids, log-probs and tail mass), fits a basis for a basis
codec the way stage one does (the first records in input order, by (file, index), up to
`basis_sample_tokens`), and writes the same sequences, sources and loss masks to `dst` with
the new codec; CACHE/target/ is copied (the source's rejected records are not). The source's
features should be lossless (bf16): transcoding fp8 or basis features compounds their error.
The packed top-k is decoded and encoded again, so compare codecs on caches transcoded from one
source (bf16 -> bf16 too).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from dflash.shards.basis import SecondMoment, fit_basis, write_basis
from dflash.shards.layout import TARGET_DIR
from dflash.shards.reader import open_cache
from dflash.shards.writer import CacheWriter, finalize_cache


def sample_moment(source, sample_tokens: int) -> SecondMoment:
    """Second moment of the first records of `source` (an open cache) in input order, by
    (file, index), until they hold `sample_tokens` tokens."""
    order = sorted(range(len(source)), key=lambda i: (source.source(i)["file"], source.source(i)["index"]))
    moment = SecondMoment(source.spec.num_layers * source.spec.hidden_size)
    for i in order:
        if moment.num_tokens >= sample_tokens:
            break
        moment.add(source[i].features)
    return moment


def transcode_cache(src: str | Path, dst: str | Path, *, feature_codec: str, feature_rank: int | None = None,
                    basis_sample_tokens: int = 65536, moment: SecondMoment | None = None) -> dict[str, Any]:
    """Write `dst` from `src` with `feature_codec`; returns {"fit_s", "write_s", "num_tokens"}.

    moment: `sample_moment(src, basis_sample_tokens)` when already computed (several ranks
    from one sample).
    """
    source = open_cache(src)
    dst = Path(dst)
    if dst.exists():
        raise ValueError(f"{dst} exists: transcode into a new directory")
    spec = dataclasses.replace(source.spec, feature_codec=feature_codec, feature_rank=feature_rank,
                               options={**source.spec.options, "transcoded_from": str(src)})
    basis, fit_s = None, 0.0
    if spec.is_basis:
        began = time.perf_counter()
        moment = moment or sample_moment(source, basis_sample_tokens)
        basis = fit_basis(moment.matrix, moment.num_tokens, spec.feature_rank)
        write_basis(dst, basis)
        fit_s = time.perf_counter() - began
    writer = CacheWriter(dst, spec, basis=basis)
    write_s = 0.0  # validate, encode and write: what stage one spends per row after the forward
    for i in range(len(source)):
        seq = source[i]
        began = time.perf_counter()
        writer.add(source=seq.source, input_ids=seq.input_ids, loss_mask=seq.loss_mask,
                   features=seq.features, topk_ids=seq.topk_ids, topk_logprobs=seq.topk_logprobs,
                   tail_mass=seq.tail_mass)
        write_s += time.perf_counter() - began
    began = time.perf_counter()
    writer.close()
    write_s += time.perf_counter() - began
    finalize_cache(dst, spec, 1)
    if source.target_dir.is_dir():
        shutil.copytree(source.target_dir, dst / TARGET_DIR)
    return {"fit_s": fit_s, "write_s": write_s, "num_tokens": int(np.sum(source.lengths))}
