"""The data plan (determinism, balance, held-out set) and labels on a hand-made cache."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash.train.data import (
    Corpus,
    DataPlan,
    Segment,
    decay_gamma,
    draw_anchors,
    eligible_anchors,
    held_out_mask,
    position_weights,
    read_batch,
)

# ---------------------------------------------------------------------------------------
# A hand-made in-memory cache with the reader's interface (raw rows, spec, lengths).
# ---------------------------------------------------------------------------------------

V, H, L, K = 100, 4, 2, 3


class HandCache:
    """Rows whose cached top-1 at position t is token 50+t (so a label names its position)."""

    def __init__(self, loss_masks: list[np.ndarray]):
        self.path = "hand"
        self.spec = SimpleNamespace(num_layers=L, hidden_size=H, feature_codec="bf16", feature_shape=(L, H),
                                    vocab_size=V, layer_ids=[0, 1], top_k=K, tokenizer_sha256="", target={},
                                    identity=lambda: {"hand": True})
        self.rows = []
        for i, mask in enumerate(loss_masks):
            T = mask.shape[0]
            features = (np.arange(T * L * H, dtype=np.float32).reshape(T, L, H) + 1000 * i)
            bits = torch.from_numpy(features).bfloat16().view(torch.uint16).numpy()
            topk_ids = np.stack([50 + np.arange(T), np.zeros(T, int), np.ones(T, int)], axis=1) % V
            self.rows.append(SimpleNamespace(
                input_ids=np.arange(T, dtype=np.int32) + 10 * i, loss_mask=mask, features=bits,
                topk_ids=topk_ids.astype(np.int32),
                topk_logprobs=np.log(np.tile([[0.7, 0.2, 0.05]], (T, 1))).astype(np.float32),
                tail_mass=np.full(T, 0.05, np.float32), topk_packed=None))
        self.lengths = np.array([m.shape[0] for m in loss_masks], dtype=np.int64)

    def __len__(self):
        return len(self.rows)

    def raw(self, i, decode_topk=True):
        return self.rows[i]

    def loss_mask(self, i):
        return self.rows[i].loss_mask

    def source(self, i):
        return {"file": "hand.jsonl", "index": i}


def mask_of(T: int, reply_from: int, gaps=()) -> np.ndarray:
    mask = np.zeros(T, dtype=bool)
    mask[reply_from:] = True
    for g in gaps:
        mask[g] = False
    return mask


# ---------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size,gamma", [(16, 7.0), (10, 5.0), (8, 4.0), (12, 5.0 + 2 / 3), (4, 2.0)])
def test_decay_gamma(block_size, gamma):
    assert decay_gamma(block_size) == pytest.approx(gamma)


def test_position_weights():
    np.testing.assert_allclose(position_weights(4, 2.0), [0.0, 1.0, np.exp(-0.5), np.exp(-1.0)], rtol=1e-6)


def test_eligible_anchors_need_a_reply_token_and_a_label():
    #         0  1  2  3  4  5  6  7
    mask = np.array([0, 0, 1, 1, 0, 1, 1, 1], dtype=bool)
    # 2 (3 labelled), 5, 6 (7 labelled); not 3 (4 unmasked), not 7 (last position).
    np.testing.assert_array_equal(eligible_anchors(mask), [2, 5, 6])
    assert eligible_anchors(np.ones(1, bool)).shape == (0,)


def test_labels_on_hand_made_cache():
    B, gamma = 4, 2.0
    T = 12
    mask = mask_of(T, 3, gaps=[7])  # reply from 3; position 7 masked out
    corpus = Corpus([HandCache([mask])])
    batch = read_batch(corpus, [Segment(0, 0, 1)], stream=0, plan_anchors=1, seed=0, block_size=B,
                       gamma=gamma, mask_token_id=99)
    (context_length, anchors), = batch.segments
    a = int(anchors[0])
    assert context_length == a
    # Block tokens: the anchor's token then mask tokens.
    np.testing.assert_array_equal(batch.block_ids.numpy(), [a, 99, 99, 99])
    # Expected labels, written out: position k predicts x[a+k] from the distribution cached
    # at a+k-1, whose top-1 is 50 + (a+k-1) in this cache; labelled when a+k < T and
    # loss_mask[a+k].
    expected = [(k, 50 + a + k - 1, np.exp(-(k - 1) / gamma)) for k in range(1, B)
                if a + k < T and mask[a + k]]
    got = list(zip(batch.label_positions.tolist(), batch.topk_ids[:, 0].tolist(), batch.weights.tolist()))
    assert [(k, t) for k, t, _ in got] == [(k, t) for k, t, _ in expected]
    np.testing.assert_allclose([w for *_, w in got], [w for *_, w in expected], rtol=1e-6)
    np.testing.assert_array_equal(batch.label_rows.numpy(), [k for k, *_ in expected])
    # Context: features of positions 0..a-1, in [L*H] order per position.
    features = batch.context_features.float().reshape(a, L, H)
    expected_features = torch.arange(a * L * H, dtype=torch.float32).reshape(a, L, H).bfloat16().float()
    torch.testing.assert_close(features, expected_features, rtol=0, atol=0)


@pytest.mark.parametrize("anchor", [3, 6, 8, 9, 10])
def test_labels_every_anchor(anchor, monkeypatch):
    """Each anchor position of the hand-made sequence, forced: labels point at a+k-1."""
    B, T = 4, 12
    mask = mask_of(T, 3, gaps=[7])
    corpus = Corpus([HandCache([mask])])
    monkeypatch.setattr("dflash.train.data.draw_anchors", lambda *args: np.array([anchor]))
    batch = read_batch(corpus, [Segment(0, 0, 1)], stream=0, plan_anchors=1, seed=0, block_size=B,
                       gamma=7.0, mask_token_id=99)
    ks = batch.label_positions.numpy()
    expected_ks = [k for k in range(1, B) if anchor + k < T and mask[anchor + k]]
    np.testing.assert_array_equal(ks, expected_ks)
    np.testing.assert_array_equal(batch.topk_ids[:, 0].numpy(), 50 + anchor + ks - 1)
    assert batch.context_features.shape == (anchor, L * H)


def test_training_on_all_tokens_anchors_and_labels_prompt_positions_too():
    """--train-on all: every position 1..T-2 may anchor, and every a+k < T is labelled."""
    B, T = 4, 12
    mask = mask_of(T, 3, gaps=[7])
    replies, everything = Corpus([HandCache([mask])]), Corpus([HandCache([mask])], all_tokens=True)
    assert replies.num_eligible.tolist() == [eligible_anchors(mask).shape[0]]
    assert everything.num_eligible.tolist() == [T - 2]
    assert replies.fingerprint() != everything.fingerprint()  # a stored anchor index is not reused across them
    batch = read_batch(everything, [Segment(0, 0, T - 2)], stream=0, plan_anchors=T - 2, seed=0, block_size=B,
                       gamma=7.0, mask_token_id=99)
    (_, anchors), = batch.segments
    np.testing.assert_array_equal(anchors, np.arange(1, T - 1))  # prompt positions 1, 2 included
    expected = [(a, k) for a in anchors for k in range(1, B) if a + k < T]  # position 7 (masked) too
    got = list(zip(anchors[batch.label_rows.numpy() // B], batch.label_positions.numpy()))
    assert got == expected
    np.testing.assert_array_equal(batch.topk_ids[:, 0].numpy(), [50 + a + k - 1 for a, k in expected])


def test_batch_rows_across_segments():
    B = 4
    masks = [mask_of(10, 2), mask_of(9, 4)]
    corpus = Corpus([HandCache(masks)])
    segments = [Segment(1, 0, 2), Segment(0, 1, 2)]
    batch = read_batch(corpus, segments, stream=3, plan_anchors=3, seed=5, block_size=B, gamma=7.0,
                       mask_token_id=99)
    anchors1 = draw_anchors(masks[1], 3, 5, 3, 1)[0:2]
    anchors0 = draw_anchors(masks[0], 3, 5, 3, 0)[1:3]
    np.testing.assert_array_equal(batch.block_ids.numpy()[::B], np.concatenate([anchors1 + 10, anchors0]))
    assert batch.context_features.shape[0] == anchors1[-1] + anchors0[-1]
    # Every label row's cached top-1 names position anchor + k - 1 of its own block.
    anchors = np.concatenate([anchors1, anchors0])
    rows, ks = batch.label_rows.numpy(), batch.label_positions.numpy()
    np.testing.assert_array_equal(rows % B, ks)
    np.testing.assert_array_equal(batch.topk_ids[:, 0].numpy(), 50 + anchors[rows // B] + ks - 1)


# ---------------------------------------------------------------------------------------
# Anchors and the plan
# ---------------------------------------------------------------------------------------


def test_anchors_are_stateless_and_keyed():
    mask = mask_of(200, 20)
    a = draw_anchors(mask, 16, seed=1, stream=2, sequence=3)
    assert np.array_equal(a, draw_anchors(mask, 16, seed=1, stream=2, sequence=3))
    assert np.all(np.diff(a) > 0) and np.isin(a, eligible_anchors(mask)).all()
    for other in [dict(seed=2, stream=2, sequence=3), dict(seed=1, stream=3, sequence=3),
                  dict(seed=1, stream=2, sequence=4)]:
        assert not np.array_equal(a, draw_anchors(mask, 16, **other))
    assert draw_anchors(mask, 10_000, seed=1, stream=2, sequence=3).shape[0] == eligible_anchors(mask).shape[0]


def make_plan(world_size: int, *, n: int = 200, seed: int = 0, tokens_per_step: int = 1024,
              anchors: int = 8, fraction: float = 0.1) -> DataPlan:
    eligible = np.random.default_rng(7).integers(0, 30, size=n)  # some sequences have none
    return DataPlan(num_eligible=eligible, held_out=held_out_mask(n, fraction, seed), block_size=16,
                    anchors_per_seq=anchors, tokens_per_step=tokens_per_step, seed=seed,
                    world_size=world_size)


def test_held_out_set_is_deterministic_and_sized():
    mask = held_out_mask(1000, 0.0125, seed=3)
    assert mask.sum() == 13  # ceil(12.5)
    np.testing.assert_array_equal(mask, held_out_mask(1000, 0.0125, seed=3))
    assert not np.array_equal(mask, held_out_mask(1000, 0.0125, seed=4))
    assert held_out_mask(10, 0.0, seed=3).sum() == 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_plan_covers_training_set_once_per_epoch_and_never_held_out(world_size):
    plan = make_plan(world_size)
    blocks = np.zeros(len(plan.num_eligible), dtype=np.int64)
    for step in range(plan.steps_per_epoch):
        for rank in range(world_size):
            for seg in plan.segments(epoch=2, step=step, rank=rank):
                blocks[seg.sequence] += seg.count
    assert not blocks[plan.held_out].any()
    # Every block of every training sequence, exactly once (up to a dropped tail < ranks).
    expected = np.where(plan.held_out, 0, np.minimum(plan.num_eligible, plan.anchors_per_seq))
    assert expected.sum() - blocks.sum() < world_size
    assert np.all(blocks <= expected)


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_plan_balances_ranks(world_size):
    plan = make_plan(world_size, tokens_per_step=16 * 16 * world_size)
    for step in range(plan.steps_per_epoch):
        counts = [sum(s.count for s in plan.segments(1, step, r)) for r in range(world_size)]
        assert max(counts) - min(counts) <= 1
        if step < plan.steps_per_epoch - 1:
            assert min(counts) >= 0.95 * max(counts)


def test_plan_is_pure_and_ranks_partition_the_step():
    a, b = make_plan(4), make_plan(4)
    for step in [0, 3, a.steps_per_epoch - 1]:
        assert a.segments(1, step, 2) == b.segments(1, step, 2)
        # Asking out of order (another epoch first) does not change the answer.
        b.segments(5, 0, 0)
        assert a.segments(1, step, 3) == b.segments(1, step, 3)
        ranks = [(s.sequence, s.first, s.count) for r in range(4) for s in a.segments(1, step, r)]
        whole = [(s.sequence, s.first, s.count) for s in a.step_segments(1, step)]
        assert sum(c for *_, c in ranks) == sum(c for *_, c in whole)


def test_plan_permutes_per_epoch():
    plan = make_plan(1)
    first = [s.sequence for s in plan.segments(0, 0, 0)]
    assert first != [s.sequence for s in plan.segments(1, 0, 0)]
    assert first == [s.sequence for s in make_plan(1).segments(0, 0, 0)]
    assert first != [s.sequence for s in make_plan(1, seed=1).segments(0, 0, 0)]


def test_plan_rejects_too_small_step():
    with pytest.raises(ValueError, match="at least one block"):
        make_plan(4, tokens_per_step=16)


# ---------------------------------------------------------------------------------------
# Reading from a real (synthetic) cache
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_read_batch_from_memory_mapped_cache_matches_decoded_rows(tmp_path, codec):
    from dflash.shards import open_cache
    from dflash.train.synthetic import write_synthetic_training_cache

    write_synthetic_training_cache(tmp_path / "c", lengths=[30, 41, 25], feature_codec=codec, seed=3)
    cache = open_cache(tmp_path / "c", check_rows=False)
    corpus = Corpus([cache])
    segments = [Segment(2, 0, 3), Segment(0, 1, 2)]
    batch = read_batch(corpus, segments, stream=1, plan_anchors=4, seed=0, block_size=4, gamma=7.0,
                       mask_token_id=0)
    offset = 0
    for seg, (context_length, anchors) in zip(segments, batch.segments):
        row = cache[seg.sequence]  # decoded by the reader: float32 features
        expected = row.features[:context_length].reshape(context_length, -1)
        got = batch.context_features[offset:offset + context_length].float().numpy()
        np.testing.assert_array_equal(got, expected)
        offset += context_length
        np.testing.assert_array_equal(anchors, draw_anchors(row.loss_mask, 4, 0, 1, seg.sequence)
                                      [seg.first:seg.first + seg.count])
    assert offset == batch.context_features.shape[0]


def test_anchor_count_split_over_ranks_equals_one_rank(tmp_path):
    """Each rank counts a stride of the sequences; the all-reduce (here: two threads summing
    at a barrier) gives every rank the one-rank counts, and only rank 0 stores the index."""
    import threading

    from dflash.shards import open_cache
    from dflash.train.synthetic import write_synthetic_training_cache

    write_synthetic_training_cache(tmp_path / "c", lengths=[30, 41, 25, 3, 17], seed=5)
    one = Corpus([open_cache(tmp_path / "c")]).num_eligible
    assert one.sum() > 0
    partial, barrier, results = {}, threading.Barrier(2), {}

    def combine(rank):
        def sum_over_ranks(counts):
            partial[rank] = counts.copy()
            barrier.wait()
            return partial[0] + partial[1]
        return sum_over_ranks

    def rank_main(rank):
        corpus = Corpus([open_cache(tmp_path / "c")], index_dir=tmp_path / "run", rank=rank, world_size=2,
                        combine=combine(rank))
        results[rank] = corpus.num_eligible

    (tmp_path / "run").mkdir()
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(partial[0][1::2], 0)  # rank 0 read only the even sequences
    np.testing.assert_array_equal(partial[1][0::2], 0)
    np.testing.assert_array_equal(results[0], one)
    np.testing.assert_array_equal(results[1], one)
    stored = Corpus([open_cache(tmp_path / "c")], index_dir=tmp_path / "run", rank=1, world_size=2)  # no combine:
    np.testing.assert_array_equal(stored.num_eligible, one)  # the stored index, no count
    with pytest.raises(ValueError, match="needs `combine`"):
        Corpus([open_cache(tmp_path / "c")], rank=1, world_size=2)


@pytest.mark.parametrize("order", [("bf16", "fp8"), ("fp8", "bf16")])
def test_a_batch_over_bf16_and_fp8_caches_decodes_each_with_its_own_codec(tmp_path, order):
    """Caches of the two raw codecs train together (e.g. new data added in fp8): each row is
    decoded by its own cache's codec, the batch in float32. (Rows were decoded with the first
    cache's codec: fp8 bytes read as bf16 bits.)"""
    from dflash.shards import open_cache
    from dflash.train.synthetic import write_synthetic_training_cache

    caches = []
    for i, codec in enumerate(order):
        write_synthetic_training_cache(tmp_path / codec, lengths=[30, 41], feature_codec=codec, seed=3 + i)
        caches.append(open_cache(tmp_path / codec, check_rows=False))
    corpus = Corpus(caches)
    segments = [Segment(1, 0, 2), Segment(2, 0, 2), Segment(3, 1, 1)]  # sequences of both caches
    batch = read_batch(corpus, segments, stream=1, plan_anchors=4, seed=0, block_size=4, gamma=7.0,
                       mask_token_id=0)
    assert batch.context_features.dtype == torch.float32
    offset = 0
    for seg, (context_length, _) in zip(segments, batch.segments):
        cache, index = corpus.locate(seg.sequence)
        expected = cache[index].features[:context_length].reshape(context_length, -1)
        np.testing.assert_array_equal(batch.context_features[offset:offset + context_length].numpy(), expected)
        offset += context_length


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_read_batch_labels_equal_the_whole_row_decode(tmp_path, codec):
    """The packed top-k is decoded at the labelled positions only: the same bits as the
    reader's whole-row decode at those positions (ids, log-probs, the tokens before them)."""
    from dflash.shards import open_cache
    from dflash.train.synthetic import write_synthetic_training_cache

    write_synthetic_training_cache(tmp_path / "c", lengths=[30, 41, 25], feature_codec=codec, seed=3, zipf=True)
    cache = open_cache(tmp_path / "c")
    corpus = Corpus([cache])
    segments = [Segment(2, 0, 3), Segment(0, 1, 2), Segment(1, 0, 4)]
    B = 4
    batch = read_batch(corpus, segments, stream=1, plan_anchors=4, seed=0, block_size=B, gamma=7.0,
                       mask_token_id=0)
    rows, ks = batch.label_rows.numpy(), batch.label_positions.numpy()
    anchors = np.concatenate([a for _, a in batch.segments])
    segment_of_block = np.repeat(np.arange(len(segments)), [len(a) for _, a in batch.segments])
    positions = anchors[rows // B] + ks - 1  # a+k-1 in each row's own sequence
    for i, seg in enumerate(segments):
        mine = segment_of_block[rows // B] == i
        whole = cache.raw(seg.sequence)  # the whole row decoded
        assert torch.equal(batch.topk_ids[mine], torch.from_numpy(whole.topk_ids[positions[mine]]).long())
        assert torch.equal(batch.topk_logprobs[mine], torch.from_numpy(whole.topk_logprobs[positions[mine]]))
        assert torch.equal(batch.label_tokens[mine], torch.from_numpy(whole.input_ids[positions[mine]]).long())


def test_check_once_checks_each_row_at_its_first_read_only(tmp_path, monkeypatch):
    from dflash.shards import open_cache, rows
    from dflash.train.synthetic import write_synthetic_training_cache

    write_synthetic_training_cache(tmp_path / "c", lengths=[30, 41, 25], seed=3)
    calls = []
    real = rows.row_checksum
    monkeypatch.setattr(rows, "row_checksum", lambda values: calls.append(1) or real(values))
    every, once = open_cache(tmp_path / "c"), open_cache(tmp_path / "c", check_once=True)
    for i in (0, 1, 0, 2, 1):
        every.raw(i)
    assert len(calls) == 5
    for i in (0, 1, 0, 2, 1):
        once.raw(i)
    assert len(calls) == 5 + 3
