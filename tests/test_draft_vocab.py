"""`fit --draft-vocab N` (train/draft_vocab.py): the choice of the N tokens, the teacher's
top-k remapped to the draft head's rows (against a row-by-row reference), the loss against a
materialised float64 reference, drafts that stay inside the vocabulary (offline and online),
and the export's `lm_head.weight` and `d2t` read back as the run's drafter."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash.shards import open_cache
from dflash.testing.builders import tiny_fit_config
from dflash.train import draft_vocab
from dflash.train.acceptance import sequence_acceptance, target_top1
from dflash.train.checkpoint import latest_checkpoint
from dflash.train.config import LossConfig
from dflash.train.data import held_out_mask
from dflash.train.drafters import LossOperands
from dflash.train.drafters.base import greedy_tokens
from dflash.train.export import export_run
from dflash.train.fit import _distill, _teacher, fit
from dflash.train.loading import load_drafter, load_exported
from dflash.train.model import DFlashDrafter, DrafterConfig, TargetHead
from dflash.train.synthetic import write_synthetic_training_cache


def test_choose_orders_by_count_then_id():
    counts = np.array([0, 5, 2, 5, 0, 9, 2])
    assert draft_vocab.choose(counts, 5).tolist() == [5, 1, 3, 2, 6]
    assert draft_vocab.choose(counts, 7).tolist() == [5, 1, 3, 2, 6, 0, 4]  # never-seen ids by id
    with pytest.raises(ValueError, match="--draft-vocab 8"):
        draft_vocab.choose(counts, 8)


def draft_head(V: int, H: int, ids: list[int], generator) -> TargetHead:
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64)
    drafter = SimpleNamespace(draft_ids=torch.tensor(ids), draft_head=weight[ids])
    return TargetHead(embed_tokens=weight, lm_head=weight).for_drafter(drafter)


def test_remap_matches_a_row_by_row_reference():
    generator = torch.Generator().manual_seed(0)
    V, k, N = 40, 3, 64
    ids = torch.randperm(V, generator=generator)[:12].tolist()  # 12 >= 2k + 1 rows
    head = draft_head(V, 4, ids, generator)
    topk = torch.stack([torch.randperm(V, generator=generator)[:k] for _ in range(N)])
    topk[0] = torch.tensor([ids[-1], 39 if 39 not in ids else 38, ids[-2]])  # a row holding the rarest rows
    logprobs = torch.log_softmax(torch.randn(N, k + 1, generator=generator), -1)[:, :k]
    rows, lp, ce, live = draft_vocab.remap_teacher(topk, logprobs, head)
    size = len(ids)
    for n in range(N):
        inside = [ids.index(t) if t in ids else None for t in topk[n].tolist()]
        taken = {r for r in inside if r is not None}
        free = [r for r in range(size - 2 * k - 1, size) if r not in taken]
        expected = []
        for r in inside:
            expected.append(r if r is not None else free.pop(0))
        assert rows[n].tolist() == expected
        assert len(set(expected)) == k  # distinct, as the kernel wants
        for j, r in enumerate(inside):
            if r is None:
                assert lp[n, j] == -torch.inf
            else:
                assert lp[n, j] == logprobs[n, j]
        assert bool(live[n]) == bool(taken)
        if taken:  # the best in-vocabulary teacher token
            best = max((j for j in range(k) if inside[j] is not None), key=lambda j: logprobs[n, j])
            assert ce[n] == inside[best]


def distill(hidden, head, batch, config):
    """fit's loss of plain rows through `head` (no kind's operands)."""
    return _distill(LossOperands(rows=hidden, head=head), _teacher(batch, head), config)


@pytest.mark.parametrize("kind", ["kl", "ce", "kl+ce", "tv", "tv+ce", "0.9tv+0.1ce"])
def test_draft_vocab_loss_matches_a_materialised_reference(kind):
    generator = torch.Generator().manual_seed(1)
    V, H, k, N = 30, 5, 3, 40
    ids = torch.randperm(V, generator=generator)[:14].tolist()
    head = draft_head(V, H, ids, generator)
    hidden = torch.randn(N, H, generator=generator, dtype=torch.float64)
    topk = torch.stack([torch.randperm(V, generator=generator)[:k] for _ in range(N)])
    q = torch.softmax(torch.randn(N, k + 1, generator=generator, dtype=torch.float64), -1)[:, :k]
    batch = SimpleNamespace(topk_ids=topk, topk_logprobs=q.log().float(), weights=torch.rand(N, generator=generator))
    loss, argmax = distill(hidden, head, batch, LossConfig(loss=kind, ce_weight=0.5))

    logp = torch.log_softmax(hidden @ head.lm_head.T, -1)  # [N, V_d] float64 over the draft rows
    rows, _, _, _ = draft_vocab.remap_teacher(topk, batch.topk_logprobs, head)
    expected = torch.zeros(N, dtype=torch.float64)
    for n in range(N):
        inside = [(ids.index(t), float(q[n, j])) for j, t in enumerate(topk[n].tolist()) if t in ids]
        if not inside:
            continue  # no slot in the vocabulary: weight 0
        fillers = [int(r) for r, t in zip(rows[n], topk[n].tolist()) if t not in ids]
        p_in = sum(float(logp[n, r].exp()) for r in [r for r, _ in inside] + fillers)
        tail_q = 1 - sum(qq for _, qq in inside)
        kl = sum(qq * (np.log(qq) - float(logp[n, r])) for r, qq in inside)
        kl += tail_q * (np.log(tail_q) - np.log(1 - p_in))
        # TV: the fillers are classes of teacher mass 0 of their own, the rest is the tail.
        tv = 0.5 * (sum(abs(float(logp[n, r].exp()) - qq) for r, qq in inside)
                    + sum(float(logp[n, r].exp()) for r in fillers) + abs(1 - p_in - tail_q))
        best = max(inside, key=lambda item: item[1])[0]
        ce = -float(logp[n, best])
        expected[n] = batch.weights[n] * {"kl": kl, "ce": ce, "kl+ce": kl + 0.5 * ce, "tv": tv, "tv+ce": tv + 0.5 * ce,
                                          "0.9tv+0.1ce": 0.9 * tv + 0.1 * ce}[kind]
    torch.testing.assert_close(loss.double(), expected.sum(), rtol=1e-4, atol=1e-5)
    assert argmax.tolist() == [ids[r] for r in logp.argmax(1).tolist()]  # in token ids


def test_a_vocabulary_of_every_token_is_the_whole_head():
    """A draft vocabulary holding every id, in another order: the same loss and argmax."""
    generator = torch.Generator().manual_seed(2)
    V, H, k, N = 24, 6, 4, 32
    head = draft_head(V, H, torch.randperm(V, generator=generator).tolist(), generator)
    whole = TargetHead(embed_tokens=head.embed_tokens, lm_head=head.embed_tokens)
    hidden = torch.randn(N, H, generator=generator, dtype=torch.float64)
    topk = torch.stack([torch.randperm(V, generator=generator)[:k] for _ in range(N)])
    q = torch.softmax(torch.randn(N, k + 1, generator=generator), -1)[:, :k]
    batch = SimpleNamespace(topk_ids=topk, topk_logprobs=q.log(), weights=torch.rand(N, generator=generator))
    config = LossConfig(loss="kl+ce", ce_weight=0.5)
    (a, argmax_a), (b, argmax_b) = distill(hidden, head, batch, config), distill(hidden, whole, batch, config)
    torch.testing.assert_close(a, b)
    assert torch.equal(argmax_a, argmax_b)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache") / "cache"
    write_synthetic_training_cache(path, lengths=[40, 56, 33, 71, 48, 64, 29, 52], seed=1)
    return path


@pytest.fixture(scope="module")
def run(cache_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    fit(tiny_fit_config(cache_dir, out, draft_vocab=20, anchors_per_seq=6, max_steps=6, checkpoint_every=3))
    return out


@pytest.mark.e2e  # a fit
def test_the_run_drafts_from_the_most_frequent_training_tokens(cache_dir, run):
    cache = open_cache(cache_dir)
    held_out = held_out_mask(len(cache), 0.1, 0)  # the tiny fit's eval_fraction and seed
    assert held_out.any() and not held_out.all()
    counts = np.zeros(cache.spec.vocab_size, dtype=np.int64)
    for i in np.flatnonzero(~held_out):
        seq = cache[int(i)]
        for token in seq.input_ids[seq.loss_mask].tolist():
            counts[token] += 1
    expected = sorted(range(cache.spec.vocab_size), key=lambda t: (-counts[t], t))[:20]
    stored = np.load(run / draft_vocab.DRAFT_VOCAB_FILE)
    assert stored["ids"].tolist() == expected
    assert int(stored["total"]) == int(counts.sum())
    loaded = load_drafter(run)
    assert loaded.drafter.draft_ids.tolist() == expected
    head = TargetHead.load(cache.target_dir)
    assert torch.equal(loaded.drafter.draft_head, head.lm_head[torch.tensor(expected)].float())  # the target's rows


@pytest.mark.e2e  # a fit
def test_offline_drafts_are_the_best_in_vocabulary_tokens(cache_dir, run):
    cache = open_cache(cache_dir)
    drafter = load_drafter(run).drafter.eval()
    head = TargetHead.load(cache.target_dir, dtype=torch.float32)
    seq = cache[0]
    got = sequence_acceptance(drafter, head, seq.input_ids, seq.loss_mask, seq.features,
                              target_top1(seq.topk_ids, seq.topk_logprobs), verify_size=drafter.config.num_drafts + 1)
    ids = drafter.draft_ids
    assert set(np.unique(got.drafts).tolist()) <= set(ids.tolist())
    # the same drafts from the whole head with every other token's logit at -inf
    restricted = head.lm_head.clone()
    outside = torch.ones(head.lm_head.shape[0], dtype=torch.bool)
    outside[ids] = False
    whole = TargetHead(embed_tokens=head.embed_tokens, lm_head=head.lm_head)
    hidden = torch.randn(16, head.lm_head.shape[1])
    logits = hidden @ restricted.T
    logits[:, outside] = -torch.inf
    assert torch.equal(whole.for_drafter(drafter).to_target(greedy_tokens(hidden, drafter.draft_head)),
                       logits.argmax(1))


@pytest.mark.e2e  # a fit and an export
def test_the_export_carries_lm_head_and_d2t_and_loads_back(run, tmp_path):
    out = export_run(run, tmp_path / "dflash-export", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 20
    tensors = load_file(str(out / "model.safetensors"))
    ids = load_drafter(run).drafter.draft_ids
    assert tensors["d2t"].dtype == torch.int64
    assert torch.equal(tensors["d2t"] + torch.arange(20), ids)  # target id = row + d2t[row], as vLLM reads it
    assert tensors["lm_head.weight"].shape == (20, config["hidden_size"])
    loaded = load_exported(out)
    run_state = load_drafter(run).drafter.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, run_state[name]), name
    assert "draft_vocab" in (out / "README.md").read_text().replace("Draft vocabulary", "draft_vocab")


def test_config_refuses_a_vocabulary_of_the_whole_size():
    base = dict(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                vocab_size=32, target_layer_ids=[0], num_target_layers=2, mask_token_id=31)
    assert DFlashDrafter(DrafterConfig(**base, draft_vocab_size=12)).draft_head.shape == (12, 8)
    with pytest.raises(ValueError, match="drop --draft-vocab"):
        DrafterConfig(**base, draft_vocab_size=32)
    assert DFlashDrafter(DrafterConfig(**base)).draft_ids is None
    assert "draft_head" not in DFlashDrafter(DrafterConfig(**base)).state_dict()


def test_checkpoint_holds_the_draft_buffers(run):
    weights = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    assert weights["draft_ids"].shape == (20,) and weights["draft_head"].shape[0] == 20


def test_bench_coverage_matches_a_direct_count(cache_dir):
    from bench.draft_vocab import measure

    result = measure(str(cache_dir), [10, 40], eval_fraction=0.25, seed=3)
    cache = open_cache(cache_dir)
    held_out = held_out_mask(len(cache), 0.25, 3)
    counts = np.zeros(cache.spec.vocab_size, dtype=np.int64)
    wanted = []
    for i in range(len(cache)):
        seq = cache[i]
        if not held_out[i]:
            np.add.at(counts, seq.input_ids[seq.loss_mask], 1)
            continue
        top1 = target_top1(seq.topk_ids, seq.topk_logprobs)
        wanted += [int(top1[p - 1]) for p in np.flatnonzero(seq.loss_mask) if p > 0]
    for row in result["rows"]:
        vocab = set(sorted(range(cache.spec.vocab_size), key=lambda t: (-counts[t], t))[:row["size"]])
        assert row["top1_covered"] == pytest.approx(np.mean([t in vocab for t in wanted]))
    assert result["held_out_positions"] == len(wanted)
