"""Stage one's feature-basis fit (basis codecs), run after the input scan and before any row.

The sample is the first records in input order (by position, bad records skipped) whose
token counts reach `basis_sample_tokens`: the same records whatever the world size. Each
rank runs the sample records assigned to it through the pipeline (`pipeline.compute_sample`:
regeneration, then the target forward, in batches planned over the sample alone) and
accumulates `sum_t x_t x_t^T` over all their positions, prompts and replies, in float64 on
its device; an all-reduce sums the ranks' matrices, rank 0 takes the eigendecomposition and
writes CACHE/feature_basis.safetensors, and every rank reads that file back, so all ranks
encode with the same bytes. The forward results are kept (in memory, bounded by the sample
size: see pipeline.py) and written as the sample's rows: each sample record goes through
the target once.

Tolerance across world sizes: the per-rank sums add the same per-token products in another
grouping, and a sequence's features depend (at float rounding) on its forward batch; the
matrices therefore agree to float64 rounding of those sums plus the batch-dependent feature
rounding stage one already has (one bf16 step at most, FORMAT.md), and the basis to what
that moves the eigenvectors (tests: 1e-4 on the projector P P^T for the test target).

A resumed run finds the basis file and reuses it (no refit); it still runs the sample's
batches that hold a record not yet written, in the same batches, so it writes the rows an
uninterrupted run writes.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from dflash.common.files import write_atomic
from dflash.precompute.pipeline import Computed, Item, Key, RankRun, compute_sample
from dflash.shards.basis import FeatureBasis, fit_basis, write_basis
from dflash.shards.layout import BASIS_FILE


def sample_positions(lengths: list[tuple[int, int]], sample_tokens: int) -> set[int]:
    """Positions of the first records (ascending position) holding >= sample_tokens tokens."""
    chosen, total = set(), 0
    for position, num_tokens in sorted(lengths):
        if total >= sample_tokens:
            break
        chosen.add(position)
        total += num_tokens
    return chosen


class _Moment:
    """sum_t x_t x_t^T over the sample's tokens, [L*H, L*H] float64 on the target's device."""

    def __init__(self, width: int, device) -> None:
        import torch

        self.width, self.device = width, device
        self.matrix = torch.zeros(width, width, dtype=torch.float64, device=device)
        self.num_tokens = 0

    def add(self, result: Computed) -> None:
        import torch

        features = np.asarray(result.output.features)  # [T, L, H]
        if features.dtype == np.uint16:  # bf16 bits
            x = torch.from_numpy((features.astype(np.uint32) << 16).view(np.float32))
        else:
            x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        x = x.reshape(len(features), self.width).to(device=self.device, dtype=torch.float64)  # [T, L*H]
        self.matrix.addmm_(x.T, x)
        self.num_tokens += len(features)


def fit_or_load_basis(run: RankRun, items: list[Item]) -> dict[Key, Computed | None]:
    """Set the cache's basis on the writer (reused when CACHE/feature_basis.safetensors exists,
    else fitted on the sample) and return the sample records' results, for the main pass to
    write ({key: result}; None for a record rejected or already done)."""
    config, group, writer = run.config, run.group, run.writer
    path = config.out / BASIS_FILE
    chosen = sample_positions(run.lengths, config.basis_sample_tokens) & run.mine
    sample = [item for item in items if item.position in chosen]
    present = all(group.step("looking for a feature basis", path.is_file))
    if not present and config.feature_basis is not None:
        # --feature-basis: the given basis, byte for byte (its sha256 is the cache's basis identity)
        group.step("copying the feature basis", lambda: group.rank == 0 and _copy_basis(config.feature_basis, path))
        present = True
    if present:
        basis = FeatureBasis.load(path)
        run.log(f"reusing {path} (rank {basis.rank}, {basis.energy_captured:.4%} of the sample's energy)")
        group.step("reading the feature basis", lambda: writer.use_basis(basis))
        return group.local("computing the basis sample", lambda: compute_sample(run, sample))

    began = time.perf_counter()
    moment = _Moment(len(run.target.layer_ids) * run.target.hidden_size, run.target.device)
    kept = group.local("sampling features for the basis", lambda: compute_sample(run, sample, on_result=moment.add))
    basis = _fit(run, moment)
    run.log(f"fitted the feature basis on {basis.num_tokens:,} tokens in {time.perf_counter() - began:.1f} s: "
            f"rank {basis.rank} of {basis.input_width}, {basis.energy_captured:.4%} of the energy")
    return kept


def _copy_basis(source: Path, path: Path) -> None:
    """Write `source` (a FeatureBasis file, checked by loading it) to `path` atomically."""
    FeatureBasis.load(source)
    write_atomic(path, Path(source).read_bytes())


def _fit(run: RankRun, moment: _Moment) -> FeatureBasis:
    """Sum the ranks' moments, fit and write the basis on rank 0, set it on every writer."""
    import torch

    group, writer = run.group, run.writer
    matrix = moment.matrix.cpu()
    counts = torch.tensor([moment.num_tokens], dtype=torch.int64)
    if group.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(matrix)
        dist.all_reduce(counts)

    def fit() -> None:
        if group.rank == 0:
            write_basis(run.config.out, fit_basis(matrix.numpy(), int(counts.item()), writer.spec.feature_rank))

    group.step("fitting the feature basis", fit)
    basis = FeatureBasis.load(run.config.out / BASIS_FILE)
    group.step("reading the feature basis", lambda: writer.use_basis(basis))
    return basis


__all__ = ["fit_or_load_basis", "sample_positions"]
