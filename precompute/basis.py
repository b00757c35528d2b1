"""Stage one's feature-basis fit (basis codecs), run after the input scan and before any row.

The sample is the first records in input order (by position, bad records skipped) whose
token counts reach `basis_sample_tokens`: the same records whatever the world size. Each
rank runs the sample records assigned to it through the same path as its rows
(regeneration, then the target forward) and accumulates `sum_t x_t x_t^T` over all their
positions, prompts and replies, in float64 on its device; an all-reduce sums the ranks'
matrices, rank 0 takes the eigendecomposition and writes CACHE/feature_basis.safetensors,
and every rank reads that file back, so all ranks encode with the same bytes.

Tolerance across world sizes: the per-rank sums add the same per-token products in another
grouping, and a sequence's features depend (at float rounding) on its forward batch; the
matrices therefore agree to float64 rounding of those sums plus the batch-dependent feature
rounding stage one already has (one bf16 step at most, FORMAT.md), and the basis to what
that moves the eigenvectors (tests: 1e-4 on the projector P P^T for the test target).

A resumed run finds the basis file and reuses it (no refit); regenerated sample records are
kept (token ids only) and written without regenerating them again.
"""

from __future__ import annotations

import time

import numpy as np

from dflash.shards.basis import BASIS_FILE, FeatureBasis, fit_basis, write_basis


def sample_positions(lengths: list[tuple[int, int]], sample_tokens: int) -> set[int]:
    """Positions of the first records (ascending position) holding >= sample_tokens tokens."""
    chosen, total = set(), 0
    for position, num_tokens in sorted(lengths):
        if total >= sample_tokens:
            break
        chosen.add(position)
        total += num_tokens
    return chosen


def fit_or_load_basis(config, group, target, encoder, writer, done, mine, lengths, stats, sampled: dict,
                      log) -> FeatureBasis:
    """The cache's basis (reused when CACHE/feature_basis.safetensors exists, else fitted), set
    on `writer`. Fills `sampled` with the sample records this rank regenerated."""
    import torch

    from dflash.precompute import run as stage

    path = config.out / BASIS_FILE

    def exists() -> bool:
        return path.is_file()

    if all(group.step("looking for a feature basis", exists)):
        basis = FeatureBasis.load(path)
        log(f"reusing {path} (rank {basis.rank}, {basis.energy_captured:.4%} of the sample's energy)")
        group.step("reading the feature basis", lambda: writer.use_basis(basis))
        return basis

    began = time.perf_counter()
    width = len(target.layer_ids) * target.hidden_size
    device = target.device
    moment = {"matrix": torch.zeros(width, width, dtype=torch.float64, device=device), "num_tokens": 0}

    def accumulate() -> None:
        positions = sample_positions(lengths, config.basis_sample_tokens) & mine
        items = []
        for position, record in enumerate(stage.iter_records(config.data, config.limit)):
            if position in positions:
                conversation, encoded = stage._prepare(encoder, record.data)
                items.append(stage._Item(source=record.source, conversation=conversation, encoded=encoded))
        if config.regenerate:
            regenerated: list = []
            for batch in stage.plan_batches([len(m.encoded.input_ids) for m in items], config.batch_tokens):
                regenerated += stage._regenerate(config, target, encoder, writer, done,
                                                 [items[i] for i in batch], stats)
            kept = {m.key: m for m in regenerated}
            sampled.update({m.key: kept.get(m.key) for m in items})
            items = regenerated
        for batch in stage.plan_batches([len(m.encoded.input_ids) for m in items], config.batch_tokens):
            part = [items[i] for i in batch]
            outputs = target.forward([m.encoded.input_ids for m in part], [m.name for m in part])
            for output in outputs:
                features = np.asarray(output.features)
                if features.dtype == np.uint16:  # bf16 bits
                    x = torch.from_numpy((features.astype(np.uint32) << 16).view(np.float32))
                else:
                    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
                x = x.reshape(len(features), width).to(device=device, dtype=torch.float64)  # [T, L*H]
                moment["matrix"].addmm_(x.T, x)
                moment["num_tokens"] += len(features)

    group.step("sampling features for the basis", accumulate)
    matrix = moment["matrix"].cpu()
    counts = torch.tensor([moment["num_tokens"]], dtype=torch.int64)
    if group.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(matrix)
        dist.all_reduce(counts)
    rank = writer.spec.feature_rank

    def fit() -> None:
        if group.rank == 0:
            write_basis(config.out, fit_basis(matrix.numpy(), int(counts.item()), rank))

    group.step("fitting the feature basis", fit)
    basis = FeatureBasis.load(path)
    group.step("reading the feature basis", lambda: writer.use_basis(basis))
    log(f"fitted the feature basis on {basis.num_tokens:,} tokens in {time.perf_counter() - began:.1f} s: "
        f"rank {basis.rank} of {basis.input_width}, {basis.energy_captured:.4%} of the energy")
    return basis


__all__ = ["fit_or_load_basis", "sample_positions"]
