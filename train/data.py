"""The data plan and the batch reader: which blocks each rank trains on, and reading them.

The plan is a pure function of (the caches' per-sequence anchor counts, seed, epoch, step,
world size): no state to save beyond (epoch, step), no queue, no worker, no thread.

- A fixed held-out set: the `ceil(fraction * N)` sequences with the smallest
  `splitmix64(seed, global index)` hash. Never trained on; the same for every world size.
- Anchors: a block starts at an eligible position a (`eligible_anchors`) and covers
  a..a+B-1. Per (seed, epoch, sequence) a stateless generator `np.random.default_rng([seed,
  epoch, sequence])` picks `min(anchors_per_seq, eligible)` of them without replacement;
  they are sorted. The count per sequence is known without drawing, so the plan only needs
  the counts (`Corpus.num_eligible`, computed once from the loss masks).
- An epoch is the stream of blocks (sequence, i-th anchor) over a per-epoch permutation of
  the training sequences (`np.random.default_rng([seed, epoch])`). Step s takes the next
  `tokens_per_step // B` blocks, and rank r the r-th of `world_size` contiguous, equal slices
  of them (lengths differ by at most one block). A sequence can straddle two ranks or two
  steps: each part reads its own context rows. That costs a few duplicated context reads per
  step and buys exactly equal work per rank with no dropped data. The last step of an epoch
  takes the remainder (dropped only if it has fewer blocks than ranks).
- Labels (the alignment peers got wrong): block position k (1..B-1) predicts x[a+k]; its
  label is the cached distribution at position a+k-1 (the target's prediction for token
  a+k); weight `loss_mask[a+k] * exp(-(k-1)/gamma)`, 0 when a+k >= T. The context of the
  block is the features at positions < a.

Reading (`read_batch`): for each of the rank's segments, the row is opened through the
memory-mapped shard (`cache.raw(i)`, its crc32 checked at the run's first read of it), and
the batch is laid out in one reusable host buffer (`Staging`): the context features [0, max
anchor) copied once out of the mapping as stored (bf16 bits, or fp8 codes and scales), the
label rows' top-k (a packed codec decoded at those positions only), the block ids and the
layout's index tensors. Cost: one copy of the context rows. `BatchFeed` runs it for the
training loop one step ahead, copies the buffer to the device on a side stream in one
transfer and decodes the features there (see its docstring): no thread, no queue.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash.common.files import write_npz_atomic
from dflash.shards import codecs
from dflash.train.run_folder import ANCHOR_INDEX_FILE

# Stream key for held-out evaluation anchors; training epochs use their own index.
EVAL_STREAM = 2**31 - 1


def decay_gamma(block_size: int) -> float:
    """The paper's gamma for w_k = exp(-(k-1)/gamma): 4 for B=8, 5 for B=10, 7 for B=16.

    Other block sizes: piecewise-linear through those three points, extended beyond them by
    the end segments' slopes (1/2 below 8, 1/3 above 16), floored at 1. So B=12 gives 5.67,
    B=32 gives 12.33, B=4 gives 2.
    """
    if block_size <= 10:
        gamma = 4.0 + (block_size - 8) / 2.0
    else:
        gamma = 5.0 + (block_size - 10) / 3.0
    return max(1.0, gamma)


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """[B] float32: 0 for the anchor (k=0), exp(-(k-1)/gamma) for k = 1..B-1."""
    k = np.arange(block_size, dtype=np.float64)
    weights = np.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights.astype(np.float32)


def eligible_anchors(loss_mask: np.ndarray) -> np.ndarray:
    """Positions a that may start a block: [n] int64.

    a >= 1 (at least one context position), loss_mask[a] (the anchor is a reply token, as the
    committed token at inference is), and a+1 < T with loss_mask[a+1] (at least one labelled
    position, else the block only costs compute).
    """
    mask = np.asarray(loss_mask, dtype=bool)
    ok = np.zeros(mask.shape[0], dtype=bool)
    if mask.shape[0] >= 3:
        ok[1:-1] = mask[1:-1] & mask[2:]
    return np.flatnonzero(ok).astype(np.int64)


def draw_anchors(loss_mask: np.ndarray, num_anchors: int, seed: int, stream: int, sequence: int) -> np.ndarray:
    """The sorted anchors of `sequence` for `stream` (an epoch, or EVAL_STREAM): [n] int64.

    n = min(num_anchors, eligible). Stateless: the same arguments give the same anchors in
    any process, in any order of calls.
    """
    candidates = eligible_anchors(loss_mask)
    n = min(num_anchors, candidates.shape[0])
    rng = np.random.default_rng([seed, stream, sequence])
    picked = rng.choice(candidates.shape[0], size=n, replace=False)
    return np.sort(candidates[picked])


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser over uint64: a well-mixed stateless hash."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def held_out_mask(num_sequences: int, fraction: float, seed: int) -> np.ndarray:
    """[N] bool: the ceil(fraction * N) sequences with the smallest hash of (seed, index)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {fraction}")
    mask = np.zeros(num_sequences, dtype=bool)
    count = math.ceil(fraction * num_sequences)
    if count == 0:
        return mask
    keys = _splitmix64(np.arange(num_sequences, dtype=np.uint64) ^ _splitmix64(np.array([seed], np.uint64)))
    mask[np.argsort(keys, kind="stable")[:count]] = True
    return mask


# ---------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """A rank's share of one sequence in one step: its anchors [first, first+count) (sorted)."""

    sequence: int
    first: int
    count: int


@dataclass
class DataPlan:
    """Which blocks every rank trains on at every step.

    num_eligible [N]: eligible anchors per sequence (global index over the caches);
    held_out [N] bool. Sequences with no eligible anchor are skipped.
    """

    num_eligible: np.ndarray
    held_out: np.ndarray
    block_size: int
    anchors_per_seq: int
    tokens_per_step: int
    seed: int
    world_size: int
    _epoch_cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.tokens_per_step < self.block_size * self.world_size:
            raise ValueError(
                f"tokens_per_step ({self.tokens_per_step}) must hold at least one block of "
                f"{self.block_size} tokens per rank ({self.world_size} ranks)"
            )
        blocks = np.minimum(self.num_eligible, self.anchors_per_seq).astype(np.int64)  # [N]
        self.blocks_per_sequence = np.where(self.held_out, 0, blocks)
        self.train_sequences = np.flatnonzero(self.blocks_per_sequence > 0)  # [N_train]
        self.blocks_per_step = self.tokens_per_step // self.block_size
        self.blocks_per_epoch = int(self.blocks_per_sequence.sum())
        full, rest = divmod(self.blocks_per_epoch, self.blocks_per_step)
        self.steps_per_epoch = full + (1 if rest >= self.world_size else 0)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training set holds {self.blocks_per_epoch} blocks, fewer than one per rank "
                f"({self.world_size}): add data, lower eval_fraction, or use fewer ranks"
            )

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order [N_train] sequence ids, end [N_train] cumulative blocks) of an epoch."""
        if epoch not in self._epoch_cache:
            self._epoch_cache.clear()  # one epoch at a time: O(N) memory
            order = np.random.default_rng([self.seed, epoch]).permutation(self.train_sequences)
            self._epoch_cache[epoch] = (order, np.cumsum(self.blocks_per_sequence[order]))
        return self._epoch_cache[epoch]

    def step_blocks(self, step: int) -> tuple[int, int]:
        """[start, stop) of step `step` in the epoch's block stream."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside the epoch's {self.steps_per_epoch} steps")
        start = step * self.blocks_per_step
        return start, min(start + self.blocks_per_step, self.blocks_per_epoch)

    def rank_blocks(self, step: int, rank: int) -> tuple[int, int]:
        """[start, stop) of rank `rank`'s equal share of the step's blocks."""
        start, stop = self.step_blocks(step)
        n = stop - start
        return start + n * rank // self.world_size, start + n * (rank + 1) // self.world_size

    def segments(self, epoch: int, step: int, rank: int) -> list[Segment]:
        """The rank's segments at (epoch, step), in stream order."""
        start, stop = self.rank_blocks(step, rank)
        return self._segments(epoch, start, stop)

    def step_segments(self, epoch: int, step: int) -> list[Segment]:
        """Every rank's segments at (epoch, step) (for spike logs: the whole global batch)."""
        return self._segments(epoch, *self.step_blocks(step))

    def _segments(self, epoch: int, start: int, stop: int) -> list[Segment]:
        order, end = self._epoch(epoch)
        segments = []
        i = int(np.searchsorted(end, start, side="right"))
        position = start
        while position < stop:
            first_block_of_seq = int(end[i] - self.blocks_per_sequence[order[i]])
            take = min(stop, int(end[i])) - position
            segments.append(Segment(int(order[i]), position - first_block_of_seq, take))
            position += take
            i += 1
        return segments


# ---------------------------------------------------------------------------------------
# The caches, as one corpus
# ---------------------------------------------------------------------------------------


PROGRESS_MIN_SEQUENCES = 50_000  # a first-start anchor count over fewer takes seconds: no bar


class Corpus:
    """One or more caches seen as one list of sequences (global index = concatenation order).

    `num_eligible` [N] counts each sequence's eligible anchors. It needs every loss mask
    once; it is computed at the first start and stored in `index_dir` (the run folder:
    RUN/anchor_index.npz, written atomically), keyed by the caches' identities, so a resume
    reads no row before its first step.

    Under several ranks the first count is split: rank r reads the masks of sequences
    r, r + world_size, ..., `combine` sums the per-rank arrays (an all-reduce) and rank 0
    writes the index. Every rank must construct the Corpus (the all-reduce is collective).
    """

    def __init__(self, caches: list, index_dir: Path | None = None, *, rank: int = 0, world_size: int = 1,
                 combine: Callable[[np.ndarray], np.ndarray] | None = None, progress: bool = False,
                 all_tokens: bool = False):
        if not caches:
            raise ValueError("no cache given: pass at least one --cache")
        self.caches = caches
        self.all_tokens = all_tokens  # anchors and labels at every token, not the loss mask's only
        self.spec = caches[0].spec
        for cache in caches[1:]:
            check_compatible(self.spec, cache.spec, cache)
            check_same_basis(caches[0], cache)
        sizes = np.array([len(c) for c in caches], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])  # [num_caches + 1]
        self.lengths = np.concatenate([np.asarray(c.lengths, dtype=np.int64) for c in caches])  # [N]
        self.num_eligible = self._eligible_counts(index_dir, rank, world_size, combine, progress)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, sequence: int) -> tuple[object, int]:
        """(cache, index in that cache) of a global sequence index."""
        c = int(np.searchsorted(self.offsets, sequence, side="right")) - 1
        return self.caches[c], sequence - int(self.offsets[c])

    def source(self, sequence: int) -> dict:
        cache, index = self.locate(sequence)
        return {"cache": str(cache.path), "sequence": index, **cache.source(index)}

    def fingerprint(self) -> str:
        """sha256 over the caches' spec identities and sizes (what num_eligible depends on)."""
        parts = [{"identity": c.spec.identity(), "num_sequences": len(c),
                  "lengths_sha256": hashlib.sha256(np.asarray(c.lengths, np.int64).tobytes()).hexdigest()}
                 for c in self.caches]
        if self.all_tokens:
            parts.append({"all_tokens": True})
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def training_mask(self, loss_mask: np.ndarray) -> np.ndarray:
        """The mask anchors and labels are drawn from: the loss mask, or every token."""
        mask = np.asarray(loss_mask, dtype=bool)
        return np.ones_like(mask) if self.all_tokens else mask

    def _eligible_counts(self, index_dir: Path | None, rank: int, world_size: int,
                         combine: Callable[[np.ndarray], np.ndarray] | None, progress: bool) -> np.ndarray:
        path = None if index_dir is None else Path(index_dir) / ANCHOR_INDEX_FILE
        fingerprint = self.fingerprint()
        if path is not None and path.exists():  # every rank sees the same file: no rank writes yet
            stored = np.load(path)
            if str(stored["fingerprint"]) == fingerprint:
                return stored["num_eligible"]
        if world_size > 1 and combine is None:
            raise ValueError("a Corpus split over several ranks needs `combine` (an all-reduce sum)")
        counts = np.zeros(len(self), dtype=np.int64)  # [N]
        mine = range(rank, len(self), world_size)
        if progress and len(mine) >= PROGRESS_MIN_SEQUENCES:
            from tqdm import tqdm

            mine = tqdm(mine, desc="counting anchors (first start)", unit="seq", unit_scale=True, mininterval=2)
        for s in mine:
            cache, index = self.locate(s)
            counts[s] = eligible_anchors(self.training_mask(cache.loss_mask(index))).shape[0]  # ~1 byte/token
        if world_size > 1:
            counts = np.asarray(combine(counts), dtype=np.int64)
        if path is not None and rank == 0:
            write_npz_atomic(path, fingerprint=np.array(fingerprint), num_eligible=counts)
        return counts


def check_same_basis(first, cache) -> None:
    """Refuse to mix caches whose feature columns are in different bases (or one in none)."""
    ours, theirs = first.spec, cache.spec
    if (ours.is_basis or theirs.is_basis) and (
            (ours.feature_codec, ours.feature_rank, first.feature_basis_sha256)
            != (theirs.feature_codec, theirs.feature_rank, cache.feature_basis_sha256)):
        def describe(c) -> str:
            if not c.spec.is_basis:
                return f"{c.path} stores raw {c.spec.feature_codec} features"
            return (f"{c.path} stores {c.spec.feature_codec} coefficients of rank {c.spec.feature_rank} in "
                    f"basis {c.feature_basis_sha256[:12]}")
        raise ValueError(f"cannot train on these caches together: {describe(first)}, but {describe(cache)}; "
                         "a drafter's fc reads one feature space: rebuild them with one basis (or use one cache)")


def check_compatible(spec, other, cache) -> None:
    """Refuse to mix caches whose rows cannot train one drafter together."""
    for name in ("vocab_size", "hidden_size", "layer_ids", "top_k", "tokenizer_sha256"):
        if getattr(spec, name) != getattr(other, name):
            raise ValueError(
                f"cache {cache.path} differs from the first cache in {name} "
                f"({getattr(other, name)!r} vs {getattr(spec, name)!r}): caches trained together "
                "must come from the same target, layers, tokenizer and top-k"
            )
    if spec.target.get("config_sha256") != other.target.get("config_sha256"):
        raise ValueError(f"cache {cache.path} was built from a different target (config_sha256 differs)")


# ---------------------------------------------------------------------------------------
# Reading a batch
# ---------------------------------------------------------------------------------------

_ALIGN_BYTES = 64  # every part of a staging buffer starts on a cache line (any dtype's alignment too)


class Staging:
    """A host byte buffer that a batch is laid out in, reused from read to read; pinned when
    the batch goes to a GPU, so that its copy is one asynchronous transfer.

    Reuse matters even on a CPU: a fresh buffer of a step's size (170 MB at Qwen3-8B's
    widths) costs more in first-touch page faults than the copy into it.
    """

    def __init__(self, pin: bool = False):
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.uint8)  # [capacity] uint8
        self.used_bytes = 0

    def parts(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Contiguous views of the buffer, one per (shape, dtype), in order (grown when short:
        the batch laid out before keeps the old buffer alive through its views)."""
        offsets, end = [], 0
        for shape, dtype in shapes:
            offsets.append(end)
            end += -(-math.prod(shape) * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES
        if end > self.buffer.numel():  # a quarter more, so that steps of varying size settle
            self.buffer = torch.empty(max(end, self.buffer.numel() * 5 // 4), dtype=torch.uint8, pin_memory=self.pin)
        self.used_bytes = end
        return [self.buffer[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for o, (shape, dtype) in zip(offsets, shapes)]


@dataclass
class FeatureRun:
    """Context rows of consecutive segments stored in one codec, as the cache holds them."""

    codec: str
    codes: torch.Tensor  # [c, L, H] ([c, 1, r] basis codecs): int16 (bf16 bits) or uint8 (e4m3 codes)
    scales: torch.Tensor | None  # [c, L] ([c, 1]) float32 for fp8 codecs (value = e4m3 * scale); else None


def decode_features(runs: list[FeatureRun]) -> torch.Tensor:
    """[C, L*H] ([C, r] basis codecs) on the runs' device: bf16 when every run is bf16 (a view,
    no copy), else float32 (fp8 codes times their per-token scales; bf16 runs widened)."""
    if all(run.scales is None for run in runs):
        parts = [run.codes.view(torch.bfloat16) for run in runs]
    else:
        parts = [run.codes.view(torch.bfloat16).float() if run.scales is None
                 else run.codes.view(torch.float8_e4m3fn).float() * run.scales[..., None] for run in runs]
    context = parts[0] if len(parts) == 1 else torch.cat(parts)
    return context.reshape(context.shape[0], -1)


@dataclass
class Batch:
    """One rank's share of a step: on the host as `read_batch` lays it out in a `Staging`
    buffer, or on the device (`BatchFeed`).

    Rows of the drafter's output: block b's position k is row b*B+k. Label rows are the
    block positions with a nonzero weight. The context features travel as the cache stores
    them (`features`) and are decoded where they are used (`context_features`).
    """

    segments: list[tuple[int, np.ndarray]]  # (context length, anchors [n]) per segment
    block_ids: torch.Tensor  # [Q] int64: x[a] then mask ids, block-major
    anchors: torch.Tensor  # [n] int64: every block's anchor, segment after segment
    context_positions: torch.Tensor  # [C] int64: each context row's position in its sequence
    features: list[FeatureRun]  # the C context rows, as stored
    label_rows: torch.Tensor  # [N] int64, into the Q drafter rows
    label_positions: torch.Tensor  # [N] int64, block position k in 1..B-1
    topk_ids: torch.Tensor  # [N, k] int64
    topk_logprobs: torch.Tensor  # [N, k] float32
    weights: torch.Tensor  # [N] float32, exp(-(k-1)/gamma)
    label_tokens: torch.Tensor  # [N] int64: x[a+k-1], the token before the one each label row predicts
    sequences: list[int]  # global sequence index per segment
    decoded: torch.Tensor | None = field(default=None, repr=False)
    """The decoded features, once asked for (or set: feature noise)."""

    @property
    def context_features(self) -> torch.Tensor:
        """[C, L*H] ([C, r] basis codecs): bf16, or float32 when a run is fp8 (after scaling);
        decoded on the features' device at the first use."""
        if self.decoded is None:
            self.decoded = decode_features(self.features)
        return self.decoded

    @property
    def num_tokens(self) -> int:
        return int(self.block_ids.shape[0])


_TENSORS = ("block_ids", "anchors", "context_positions", "label_rows", "label_positions", "topk_ids",
            "topk_logprobs", "weights", "label_tokens")


def read_batch(corpus: Corpus, segments: list[Segment], *, stream: int, plan_anchors: int, seed: int,
               block_size: int, gamma: float, mask_token_id: int, staging: Staging | None = None) -> Batch:
    """Read the rows of `segments` from the memory-mapped shards into `staging` (a fresh
    buffer when None) and lay out a batch there.

    stream: the epoch (or EVAL_STREAM) the anchors are drawn for; plan_anchors: the cap on
    anchors per sequence (anchors_per_seq). Every row is first opened (checked, when the
    cache checks rows) and its anchors and labels found, which sizes the buffer; then each
    part is copied once from the mapping into its place. Features stay encoded; a packed
    top-k is decoded at the label positions only (the same values as a whole-row decode).
    """
    B = block_size
    weights_k = position_weights(B, gamma)  # [B]
    rows = []
    for seg in segments:
        cache, index = corpus.locate(seg.sequence)
        raw = cache.raw(index, decode_topk=False)
        loss_mask = corpus.training_mask(raw.loss_mask)  # [T]
        T = loss_mask.shape[0]
        anchors = draw_anchors(loss_mask, plan_anchors, seed, stream, seg.sequence)[seg.first:seg.first + seg.count]
        assert anchors.shape[0] == seg.count, "the plan's anchor count disagrees with the row"
        # Labels: block position k predicts x[a+k] from the distribution cached at a+k-1.
        target = anchors[:, None] + np.arange(B)[None, :]  # [n, B] positions a+k
        valid = target < T
        valid[valid] = loss_mask[target[valid]]
        valid[:, 0] = False
        blocks, ks = np.nonzero(valid)  # [N_seg] each
        rows.append((cache.spec, raw, anchors, blocks, ks, int(anchors[-1])))  # context: positions < the last anchor
    # Context rows go to one array per run of consecutive rows in one codec (a single run
    # unless caches of both codecs train together).
    runs: list[list] = []  # [codec, feature shape, rows]
    places = []  # (run, first row in it) per segment
    for spec, *_, context_length in rows:
        if not runs or runs[-1][0] != spec.feature_codec:
            runs.append([spec.feature_codec, tuple(spec.feature_shape), 0])
        places.append((len(runs) - 1, runs[-1][2]))
        runs[-1][2] += context_length
    num_blocks = sum(r[2].shape[0] for r in rows)
    num_labels = sum(r[3].shape[0] for r in rows)
    num_context = sum(r[5] for r in rows)
    k = corpus.spec.top_k
    shapes = [((num_blocks * B,), torch.int64), ((num_blocks,), torch.int64), ((num_context,), torch.int64),
              ((num_labels,), torch.int64), ((num_labels,), torch.int64), ((num_labels, k), torch.int64),
              ((num_labels, k), torch.float32), ((num_labels,), torch.float32), ((num_labels,), torch.int64)]
    for codec, shape, c in runs:
        fp8 = codec in ("fp8", "basis-fp8")
        shapes.append(((c, *shape), torch.uint8 if fp8 else torch.int16))
        shapes.append(((c, shape[0]) if fp8 else (0,), torch.float32))
    staging = staging or Staging()
    parts = staging.parts(shapes)
    tensors = dict(zip(_TENSORS, parts))
    out = {name: t.numpy() for name, t in tensors.items()}
    features = []
    for j, (codec, _, _) in enumerate(runs):
        codes, scales = parts[len(_TENSORS) + 2 * j], parts[len(_TENSORS) + 2 * j + 1]
        features.append(FeatureRun(codec, codes, scales if codec in ("fp8", "basis-fp8") else None))
    q0 = b0 = c0 = n0 = 0
    layout_segments = []
    for i, (spec, raw, anchors, blocks, ks, context_length) in enumerate(rows):
        n, m = anchors.shape[0], blocks.shape[0]
        ids = out["block_ids"][q0:q0 + n * B].reshape(n, B)
        ids[:] = mask_token_id
        input_ids = np.asarray(raw.input_ids)
        ids[:, 0] = input_ids[anchors]
        out["anchors"][b0:b0 + n] = anchors
        out["context_positions"][c0:c0 + context_length] = np.arange(context_length)
        label_at = anchors[blocks] + ks - 1  # [m] positions a+k-1
        out["label_rows"][n0:n0 + m] = q0 + blocks * B + ks
        out["label_positions"][n0:n0 + m] = ks
        if raw.topk_packed is not None:  # decode each labelled position once (blocks overlap)
            positions, inverse = np.unique(label_at, return_inverse=True)
            topk_ids, topk_logprobs, _ = codecs.decode_topk_packed(raw.topk_packed[positions], k, spec.vocab_size)
            topk_ids, topk_logprobs = topk_ids[inverse], topk_logprobs[inverse]
        else:
            topk_ids, topk_logprobs = np.asarray(raw.topk_ids)[label_at], np.asarray(raw.topk_logprobs)[label_at]
        out["topk_ids"][n0:n0 + m] = topk_ids
        out["topk_logprobs"][n0:n0 + m] = topk_logprobs
        out["weights"][n0:n0 + m] = weights_k[ks]
        out["label_tokens"][n0:n0 + m] = input_ids[label_at]
        j, r0 = places[i]
        codes = features[j].codes[r0:r0 + context_length].numpy()  # one copy out of the mapping
        codes[:] = raw.features[:context_length].view(codes.dtype)
        if features[j].scales is not None:
            features[j].scales[r0:r0 + context_length].numpy()[:] = raw.feature_scales[:context_length]
        layout_segments.append((context_length, anchors))
        q0, b0, c0, n0 = q0 + n * B, b0 + n, c0 + context_length, n0 + m
    return Batch(segments=layout_segments, features=features, sequences=[seg.sequence for seg in segments],
                 **tensors)


# ---------------------------------------------------------------------------------------
# Feeding the device
# ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Slot:
    """One batch in flight: its host buffer and, on a GPU, its device buffer and events."""

    host: Staging
    device_buffer: torch.Tensor | None = None  # [capacity] uint8 on the device
    copied: object = None  # torch.cuda.Event: the copy from `host` has finished
    released: object = None  # torch.cuda.Event: the device is done with the batch in `device_buffer`


@dataclass(eq=False)
class Sent:
    """A batch read and on its way to the device (`BatchFeed.read`), until `BatchFeed.receive`."""

    batch: Batch
    slot: _Slot
    read_s: float
    """Host seconds: opening the rows, laying them out, starting the copy."""
    read_events: tuple | None = None
    """(before, after) the read, on the compute stream: the device's idle time while it ran."""
    wait_events: tuple | None = None
    """(before, after) the compute stream waited for the copy (set by `receive`)."""


class BatchFeed:
    """Reads batches into reused host buffers and moves them to the device, in the caller's
    thread: no worker, no queue.

    Two slots: while the device computes with one slot's batch, the caller reads the next
    batch into the other slot's host buffer (pinned) and starts its copy on a side stream;
    the compute stream waits for that copy (on the device, not the host) only when it takes
    the batch, and decodes the features there. A slot is refilled only after the copy out of
    its host buffer has finished (an event the host waits for, normally long past) and,
    on the device, after the compute stream released the batch it held (`release`). On a CPU
    the same code runs with the host buffers as the device's: no copy, no events.

    Timing (CUDA): events around each read and each wait measure how long the compute stream
    sat idle for data (`device_wait_s`); on a CPU there is no such figure (None).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._slots = [_Slot(Staging(pin=self.cuda)) for _ in range(2)]
        self._next = 0
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    def read(self, read: Callable[[Staging], Batch]) -> Sent:
        """`read(staging)` (a `read_batch` into the next slot's host buffer), then start the
        batch's copy to the device."""
        slot = self._slots[self._next]
        self._next = 1 - self._next
        before = self._event()
        t0 = time.perf_counter()
        if slot.copied is not None:
            slot.copied.synchronize()  # the slot's previous copy has left the host buffer
        batch = read(slot.host)
        if self.cuda:
            batch = self._copy(batch, slot)
        return Sent(batch, slot, time.perf_counter() - t0, None if before is None else (before, self._event()))

    def receive(self, sent: Sent) -> Batch:
        """The batch for the current stream: it waits (on the device) for the copy, then the
        features are decoded there."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            before = self._event()
            stream.wait_event(sent.slot.copied)
            sent.wait_events = (before, self._event())
            runs = sent.batch.features
            for tensor in [*(getattr(sent.batch, name) for name in _TENSORS), *(run.codes for run in runs),
                           *(run.scales for run in runs if run.scales is not None)]:
                tensor.record_stream(stream)  # allocated on the side stream, used on this one
        sent.batch.decoded = decode_features(sent.batch.features)
        return sent.batch

    def release(self, sent: Sent) -> None:
        """The current stream has queued its last use of the batch: its slot may be refilled."""
        if self.cuda:
            sent.slot.released = self._event()

    @staticmethod
    def device_wait_s(reads: list[Sent], received: Sent) -> float | None:
        """Seconds the compute stream sat idle for data in a step: during the host reads of
        `reads` (launched work finished before the read did) and waiting for the copy of
        `received`. None on a CPU. Call after a synchronisation that covers the events."""
        if received.wait_events is None:
            return None
        pairs = [s.read_events for s in reads if s.read_events is not None] + [received.wait_events]
        return sum(max(0.0, a.elapsed_time(b)) for a, b in pairs) / 1000.0

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _copy(self, batch: Batch, slot: _Slot) -> Batch:
        """The batch re-viewed on the slot's device buffer, filled by one copy on the side stream."""
        host, used = slot.host.buffer, slot.host.used_bytes
        with torch.cuda.stream(self._stream):
            if slot.released is not None:
                self._stream.wait_event(slot.released)  # the device is done with the slot's last batch
            if slot.device_buffer is None or slot.device_buffer.numel() < host.numel():
                slot.device_buffer = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            device = slot.device_buffer
            device[:used].copy_(host[:used], non_blocking=True)

            def move(tensor: torch.Tensor) -> torch.Tensor:
                if tensor.untyped_storage().data_ptr() != host.untyped_storage().data_ptr() \
                        or not tensor.is_contiguous():  # made after the read (a kind's relabelling)
                    return tensor.to(self.device, non_blocking=True)
                offset = tensor.data_ptr() - host.data_ptr()
                size = tensor.numel() * tensor.element_size()
                return device[offset:offset + size].view(tensor.dtype).view(tensor.shape)

            moved = dataclasses.replace(
                batch, decoded=None, **{name: move(getattr(batch, name)) for name in _TENSORS},
                features=[FeatureRun(run.codec, move(run.codes), None if run.scales is None else move(run.scales))
                          for run in batch.features])
            slot.copied = torch.cuda.Event()
            slot.copied.record(self._stream)
        return moved
