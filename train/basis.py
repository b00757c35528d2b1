"""Folding a cache's feature basis into a drafter trained on its coefficients.

A drafter trained on a basis cache has `fc'` of shape [H, r] reading c = P^T (D x). Since
fc is linear and bias-free, `fc = fc' P^T D` ([H, L*H]) reads the raw features x and computes
the same fused context: the folded drafter is an ordinary drafter (config without
feature_width), exported and served like any other, and fed raw target features online.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dflash.train import drafters
from dflash.train.model import DFlashDrafter


def fold_basis(drafter: DFlashDrafter, basis) -> DFlashDrafter:
    """A raw-feature drafter equal to `drafter` (trained on `basis` coefficients); the product
    fc' P^T D is formed in float32. The input drafter is left as it is."""
    c = drafter.config
    if c.feature_width is None:
        raise ValueError("the drafter reads raw target features already; there is no basis to fold")
    if basis.rank != c.feature_width or basis.input_width != c.num_target_features * c.hidden_size:
        raise ValueError(f"the basis maps {basis.input_width} -> {basis.rank} values; the drafter's fc reads "
                         f"{c.feature_width} coefficients of {c.num_target_features} x {c.hidden_size} features")
    sha = basis.sha256()
    if sha != c.feature_basis_sha256:
        raise ValueError(f"the drafter was trained on coefficients of basis {c.feature_basis_sha256}, this basis "
                         f"is {sha}: fold with the basis of the cache it was trained on")
    weight = drafter.fc.weight.detach().to("cpu", torch.float32)  # [H, r]
    projection = torch.from_numpy(np.ascontiguousarray(basis.projection.T))  # [r, L*H] float32
    scale = torch.from_numpy(basis.scale)  # [L*H]
    folded_fc = (weight @ projection) * scale  # [H, L*H]
    config = dataclasses.replace(c, feature_width=None, feature_basis_sha256=None)
    folded = drafters.make(config, attention=drafter.attention, max_dense_queries=drafter.max_dense_queries)
    state = {name: t.detach().to("cpu") for name, t in drafter.state_dict().items()}
    state["fc.weight"] = folded_fc.to(drafter.fc.weight.dtype)
    folded.load_state_dict(state)
    return folded.to(drafter.fc.weight.device)


def basis_of_caches(paths, sha256: str):
    """The FeatureBasis with file sha256 `sha256` from the first of `paths` (cache folders)
    that has it; ValueError when none does."""
    from dflash.shards import open_cache

    seen = []
    for path in paths:
        try:
            cache = open_cache(path, check_rows=False)
        except (ValueError, OSError) as error:
            seen.append(f"{path} ({error})")
            continue
        if cache.feature_basis_sha256 == sha256:
            return cache.load_feature_basis()
        seen.append(f"{path} (basis {cache.feature_basis_sha256})")
    raise ValueError(f"no cache holds the feature basis {sha256} this drafter was trained on (looked at "
                     f"{'; '.join(map(str, seen)) or 'none'}): pass the cache it was trained on")


def match_features(drafter: DFlashDrafter, cache, fit_caches) -> DFlashDrafter:
    """`drafter` ready to read `cache`'s features (cache None: raw target features, online).

    A basis-trained drafter meets raw features folded (its basis found among `fit_caches`,
    the run's caches); it reads a basis cache only if it is its own basis. A raw drafter
    cannot read coefficients.
    """
    c = drafter.config
    if cache is not None and cache.spec.is_basis:
        if c.feature_basis_sha256 != cache.feature_basis_sha256:
            raise ValueError(
                f"{cache.path} stores {cache.spec.feature_codec} coefficients in basis "
                f"{cache.feature_basis_sha256[:12]}; the drafter reads "
                + (f"coefficients of basis {c.feature_basis_sha256[:12]}" if c.feature_basis_sha256
                   else "raw target features")
                + ": evaluate it on a cache of its own basis, or on a raw-feature (bf16/fp8) cache")
        return drafter
    if c.feature_width is None:
        return drafter
    return fold_basis(drafter, basis_of_caches(list(fit_caches or []), c.feature_basis_sha256))
