"""Who computes what, in which batches: pure functions of the record lengths.

Every rank computes the same plan from the same lengths, so no coordinator is needed and a
resumed run (any rank) recomputes exactly the original plan; the batches it skips are the
ones whose records are already in complete shards, and a partly done batch is recomputed
whole, so every sequence's values come from the same batch as in the uninterrupted run.

Ranks are balanced by tokens with the longest-processing-time rule (longest record first,
to the rank with the fewest tokens so far), which keeps every rank within one record's
length of the mean. Batches group records of similar length (sorted, longest first) under a
padded-token budget, so padding is small and the largest batch runs first: an out-of-memory
shows up in the first minute, not after hours.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def assign_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Split record positions 0..n-1 over `world_size` ranks, balanced by length.

    Returns, per rank, its positions ordered longest first (ties by position). The result
    depends only on `lengths` and `world_size`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [(0, rank) for rank in range(world_size)]  # (tokens so far, rank): a min-heap
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        tokens, rank = heapq.heappop(loads)
        assigned[rank].append(i)
        heapq.heappush(loads, (tokens + lengths[i], rank))
    return assigned


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group positions 0..n-1 into batches whose padded size (count x longest) stays within
    `batch_tokens`; a record longer than the budget gets a batch of its own.

    Batches hold similar lengths: positions are sorted longest first (ties by position)
    and cut greedily, so the first batch holds the longest records.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # Sorted descending: the batch's first record is its longest, so the padded size of
        # the batch with i added is (count + 1) x that length.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
