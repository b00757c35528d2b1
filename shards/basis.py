"""A learned feature basis: the cache stores r coefficients per token instead of L*H features.

The drafter reads cached features only through `fc: Linear(L*H -> H, bias=False)`, so any
fixed linear map applied in stage one folds into `fc` at export: stage one stores
`c = P^T (D x)` (x: the token's L*H concatenated target features, D: a fixed diagonal
scaling, P: [L*H, r] with orthonormal columns), the drafter trains `fc'` ([H, r]) on c, and
export writes `fc = fc' P^T D` ([H, L*H]), a drafter of the usual format that reads raw
target features. The map is uncentered because fc has no bias.

P holds the top-r eigenvectors of the (scaled) uncentered second-moment matrix
`sum_t (D x_t)(D x_t)^T`, accumulated in float64 over a sample of the run's own tokens.
The basis is stored next to the manifest in `feature_basis.safetensors` (tensors
`projection` [L*H, r] float32, `scale` [L*H] float32, `eigenvalues` [L*H] float64; metadata
`dflash` = JSON of how it was fitted), whose sha256 the manifest records. Pure numpy.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash.shards.layout import BASIS_FILE

METHODS = ("uncentered-pca",)


@dataclass(kw_only=True)
class FeatureBasis:
    """P, D and how they were fitted. `encode` maps raw features to coefficients."""

    projection: np.ndarray
    """[L*H, r] float32, orthonormal columns in descending eigenvalue order."""
    scale: np.ndarray
    """[L*H] float32, the diagonal D applied before projecting (ones: no scaling)."""
    eigenvalues: np.ndarray
    """[L*H] float64, descending: the second-moment spectrum per token (energy per direction)."""
    num_tokens: int
    """Tokens the second-moment matrix was accumulated over."""
    method: str = "uncentered-pca"
    """How P was chosen (see METHODS)."""

    def __post_init__(self) -> None:
        self.projection = np.ascontiguousarray(self.projection, dtype=np.float32)
        self.scale = np.ascontiguousarray(self.scale, dtype=np.float32)
        self.eigenvalues = np.ascontiguousarray(self.eigenvalues, dtype=np.float64)
        if self.projection.ndim != 2 or not 1 <= self.projection.shape[1] <= self.projection.shape[0]:
            raise ValueError(f"FeatureBasis.projection must be [L*H, r] with 1 <= r <= L*H, got "
                             f"{self.projection.shape}")
        width = self.projection.shape[0]
        if self.scale.shape != (width,) or self.eigenvalues.shape != (width,):
            raise ValueError(f"FeatureBasis.scale and eigenvalues must be [{width}], got "
                             f"{self.scale.shape} and {self.eigenvalues.shape}")
        if self.method not in METHODS:
            raise ValueError(f"FeatureBasis.method must be one of {METHODS}, got {self.method!r}")

    @property
    def input_width(self) -> int:
        """L*H, the raw feature width the basis reads."""
        return int(self.projection.shape[0])

    @property
    def rank(self) -> int:
        """r, coefficients per token."""
        return int(self.projection.shape[1])

    @property
    def energy_captured(self) -> float:
        """Share of the sample's (scaled) feature energy inside the basis's span."""
        total = float(np.clip(self.eigenvalues, 0, None).sum())
        return float(np.clip(self.eigenvalues[: self.rank], 0, None).sum()) / total if total > 0 else 1.0

    def encode(self, features: np.ndarray) -> np.ndarray:
        """Raw features [T, L, H] (or [T, L*H]) float -> coefficients [T, r] float32.

        Float32 matmul, one call per sequence: a sequence's coefficients depend on its own
        features only, so resumed and multi-rank runs encode it identically.
        """
        x = np.asarray(features, dtype=np.float32).reshape(len(features), -1)  # [T, L*H]
        if x.shape[1] != self.input_width:
            raise ValueError(f"features have {x.shape[1]} values per token, the basis reads {self.input_width}")
        if not np.all(self.scale == 1):
            x = x * self.scale
        return x @ self.projection  # [T, r]

    def info(self) -> dict[str, Any]:
        """How the basis was fitted (the safetensors metadata, also copied into the manifest)."""
        return {"method": self.method, "rank": self.rank, "input_width": self.input_width,
                "num_tokens": int(self.num_tokens), "energy_captured": self.energy_captured,
                "scaled": bool(not np.all(self.scale == 1))}

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        meta = json.dumps(self.info(), sort_keys=True, separators=(",", ":"))
        return save({"projection": self.projection, "scale": self.scale, "eigenvalues": self.eigenvalues},
                    metadata={"dflash": meta})

    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> FeatureBasis:
        from safetensors import SafetensorError
        from safetensors.numpy import load

        try:
            tensors = load(data)
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(json.loads(data[8:8 + header_len])["__metadata__"]["dflash"])
            return cls(projection=tensors["projection"], scale=tensors["scale"],
                       eigenvalues=tensors["eigenvalues"], num_tokens=int(meta["num_tokens"]),
                       method=meta["method"])
        except (SafetensorError, KeyError, TypeError, ValueError, json.JSONDecodeError) as error:
            raise ValueError(f"{where} is not a dflash feature basis ({type(error).__name__}: {error}); "
                             "the file is damaged: rebuild the cache with dflash-precompute --overwrite") from error

    @classmethod
    def load(cls, path: str | Path, expected_sha256: str | None = None) -> FeatureBasis:
        """Read a basis file; ValueError naming it when it is missing, damaged or not the
        file the manifest recorded (`expected_sha256`)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path} is missing: this cache stores basis coefficients and cannot be "
                             "decoded or exported without it; restore it or rebuild the cache")
        data = path.read_bytes()
        if expected_sha256 is not None:
            digest = hashlib.sha256(data).hexdigest()
            if digest != expected_sha256:
                raise ValueError(f"{path}: sha256 {digest} does not match the manifest's {expected_sha256}: "
                                 "the basis file is damaged or from another cache; restore it or rebuild the cache")
        return cls.from_bytes(data, str(path))


class SecondMoment:
    """Accumulates `sum_t x_t x_t^T` (float64) of scaled raw features, to fit a basis from."""

    def __init__(self, input_width: int, scale: np.ndarray | None = None):
        self.scale = np.ones(input_width, np.float32) if scale is None else np.asarray(scale, np.float32)
        self.matrix = np.zeros((input_width, input_width), dtype=np.float64)  # [L*H, L*H]
        self.num_tokens = 0

    def add(self, features: np.ndarray) -> None:
        """Add one sequence's raw features [T, L, H] (or [T, L*H])."""
        from dflash.shards.codecs import bf16_to_f32

        features = np.asarray(features)
        if features.dtype == np.uint16:  # bf16 bit patterns, as the writer accepts them
            features = bf16_to_f32(features)
        x = np.asarray(features, dtype=np.float32).reshape(len(features), -1) * self.scale
        x = x.astype(np.float64)
        self.matrix += x.T @ x
        self.num_tokens += len(x)


def fit_basis(matrix: np.ndarray, num_tokens: int, rank: int, *, scale: np.ndarray | None = None) -> FeatureBasis:
    """Top-`rank` eigenvectors of a second-moment matrix [W, W] (float64, symmetric).

    Deterministic: numpy's eigh on the same matrix, then each eigenvector's sign fixed so
    that its largest-magnitude entry (first on ties) is positive.
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    width = matrix.shape[0]
    if matrix.shape != (width, width):
        raise ValueError(f"the second-moment matrix must be square, got {matrix.shape}")
    if not 1 <= rank <= width:
        raise ValueError(f"--feature-rank must be in [1, L*H = {width}], got {rank}")
    if num_tokens < 1:
        raise ValueError("no tokens to fit the feature basis from: the sample is empty")
    values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
    order = np.argsort(-values, kind="stable")
    values, vectors = values[order], vectors[:, order]
    top = vectors[:, :rank]
    signs = np.sign(top[np.argmax(np.abs(top), axis=0), np.arange(rank)])
    top = top * np.where(signs == 0, 1.0, signs)
    return FeatureBasis(projection=top.astype(np.float32),
                        scale=np.ones(width, np.float32) if scale is None else scale,
                        eigenvalues=values / num_tokens, num_tokens=num_tokens)


def write_basis(cache_dir: str | Path, basis: FeatureBasis) -> Path:
    """Write CACHE/feature_basis.safetensors atomically; returns its path."""
    from dflash.common.files import write_atomic

    path = Path(cache_dir) / BASIS_FILE
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(path, basis.to_bytes())
    return path
