"""DFlash2 (train/drafters/dflash2.py): the convolutions and the candidate selector against
per-row references, the selector's loss against a dense one, the walk's drafts, the export
vLLM's qwen3_dflash2 loader reads, and `--init-from` a DFlash drafter and a z-lab DFlash2
folder. `fit --drafter dflash2` end to end is in tests/test_dflash2_fit.py."""

import json
import re
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from bench.engine_venv import vllm_model_file
from dflash.testing.builders import drafter_config
from dflash.train import drafters
from dflash.train.drafters.dflash2 import (
    DFlash2Drafter,
    grouped_causal_conv,
    selector_candidates,
    selector_drafts,
    selector_loss,
)
from dflash.train.export import hf_config, vllm_tensors, write_export
from dflash.train.loading import drafter_config_from_hf, load_exported
from dflash.train.model import BlockLayout, DrafterContextCache, TargetHead

H, V = 32, 50  # H: dflash.testing.builders.drafter_config's hidden size
SHAPE = dict(num_hidden_layers=2, vocab_size=V, target_layer_ids=[1, 3], num_target_layers=5, num_drafts=3,
             mask_token_id=V - 1)
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5)


def make_dflash2(seed: int = 0, randomise: bool = True, **fields) -> DFlash2Drafter:
    """A DFlash2 drafter; `randomise`: convolutions away from the identity."""
    torch.manual_seed(seed)
    model = drafters.make(drafter_config("dflash2", **{**SHAPE, **DFLASH2, **fields}), attention="dense")
    if randomise:
        with torch.no_grad():
            for layer in model.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.normal_()
                    conv.kernel_projection.weight.normal_(std=0.2)
    return model.eval()


def head(seed: int = 3) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(embed_tokens=torch.randn(V, H, generator=g), lm_head=torch.randn(V, H, generator=g))


# -- the convolution ------------------------------------------------------------------------


def conv_by_rows(x, delta, base):
    """y[b, p] = sum over taps t <= p of (base[t] + delta[b, p, t, group]) * x[b, p - t], row by row."""
    n, B, _ = x.shape
    T, G = base.shape[0], delta.shape[-1]
    out = torch.zeros_like(x)
    for b in range(n):
        for p in range(B):
            for t in range(min(T, p + 1)):
                out[b, p] += (base[t] + delta[b, p, t].repeat_interleave(H // G)) * x[b, p - t]
    return out


@pytest.mark.parametrize("taps,rows", [(1, 4), (2, 4), (3, 4), (3, 2)])
def test_the_convolution_is_causal_inside_each_block(taps, rows):
    g = torch.Generator().manual_seed(taps)
    x, base = torch.randn(3, rows, H, generator=g), torch.randn(taps, H, generator=g)
    delta = torch.randn(3, rows, taps, 4, generator=g)
    torch.testing.assert_close(grouped_causal_conv(x, delta, base), conv_by_rows(x, delta, base))


def test_a_fresh_dflash2_drafter_computes_what_its_dflash_backbone_does():
    """The convolutions start as the identity and the backbone's draws are DFlash's: one seed,
    the same rows and the same unary drafts."""
    dflash2 = make_dflash2(randomise=False)
    torch.manual_seed(0)
    dflash = drafters.make(drafter_config(**SHAPE), attention="dense").eval()
    assert {k: v for k, v in dflash2.state_dict().items() if k in dflash.state_dict()}.keys() == \
        dflash.state_dict().keys()
    assert all(torch.equal(dflash2.state_dict()[k], v) for k, v in dflash.state_dict().items())
    g = torch.Generator().manual_seed(1)
    context, embeds = torch.randn(10, 2 * H, generator=g), torch.randn(3 * 4, H, generator=g)
    layout = BlockLayout.build([(10, np.array([2, 5, 9]))], 4)
    assert torch.equal(dflash2(embeds, context, layout), dflash(embeds, context, layout))


def test_training_rows_are_the_inference_blocks():
    """The packed training forward and `forward_block` (the online loop's) agree block by block,
    with convolutions away from the identity: the convolution restarts at every block."""
    model = make_dflash2()
    g = torch.Generator().manual_seed(2)
    context, anchors = torch.randn(12, 2 * H, generator=g), np.array([1, 4, 8, 12])
    embeds = torch.randn(len(anchors) * 4, H, generator=g)
    packed = model(embeds, context, BlockLayout.build([(12, anchors)], 4))
    for i, a in enumerate(anchors):
        cache = DrafterContextCache()
        model.append_context(cache, context[None, :a])
        block = model.forward_block(embeds[None, 4 * i:4 * i + 4], cache)[0]
        torch.testing.assert_close(block, packed[4 * i:4 * i + 4], rtol=1e-5, atol=1e-5)


# -- the selector ---------------------------------------------------------------------------


@torch.no_grad()
def walk_by_hand(model, rows, anchors, lm_head):
    """The selector walk spelled out: per block, per position, score every top-K candidate."""
    selector, K = model.candidate_selector, model.config.selector_top_k
    out = []
    for b in range(rows.shape[0]):
        previous, drafts = int(anchors[b]), []
        for s in range(rows.shape[1]):
            unary = rows[b, s] @ lm_head.T
            top = unary.topk(K)
            context = selector.predecessor_codebook[previous] * selector.hidden_projection(rows[b, s])
            scores = [float(top.values[j] + context @ selector.successor_codebook[top.indices[j]]) for j in range(K)]
            previous = int(top.indices[int(np.argmax(scores))])
            drafts.append(previous)
        out.append(drafts)
    return out


def test_the_walk_takes_each_draft_as_the_next_ones_predecessor():
    model = make_dflash2()
    with torch.no_grad():  # transitions as large as the unary logits, so the predecessor matters
        model.candidate_selector.predecessor_codebook.normal_(std=3.0)
        model.candidate_selector.successor_codebook.normal_(std=3.0)
    g = torch.Generator().manual_seed(4)
    rows, anchors, target = torch.randn(6, 3, H, generator=g), torch.randint(0, V, (6,), generator=g), head()
    drafts = selector_drafts(model, rows, anchors, target, margins=True)
    assert drafts.tokens.tolist() == walk_by_hand(model, rows, anchors, target.lm_head)
    unary_only = (rows @ target.lm_head.T).argmax(-1)
    assert not torch.equal(drafts.tokens, unary_only)  # the selector moved some drafts
    assert bool((drafts.margins >= 0).all())
    # the kind drafts from the masks' rows (the anchor's row predicts nothing)
    block = torch.cat([torch.randn(6, 1, H, generator=g), rows], dim=1)
    assert torch.equal(drafters.of(model).draft(model, block, anchors, target).tokens, drafts.tokens)


def test_a_missing_target_takes_the_last_candidate_slot():
    top = torch.tensor([[4, 7, 9], [4, 7, 9], [1, 2, 3]])
    candidates, slot = selector_candidates(top, torch.tensor([7, 5, 3]))
    assert candidates.tolist() == [[4, 7, 9], [4, 7, 5], [1, 2, 3]]
    assert slot.tolist() == [1, 2, 2]


def test_the_selector_loss_is_a_dense_k_way_cross_entropy():
    """Against logits formed densely: the same value and the same gradients (rows, selector)."""
    model = make_dflash2()
    g = torch.Generator().manual_seed(5)
    target = head()
    rows = torch.randn(9, H, generator=g, requires_grad=True)
    previous, labels = torch.randint(0, V, (9,), generator=g), torch.randint(0, V, (9,), generator=g)
    weights = torch.rand(9, generator=g)
    loss = selector_loss(model, rows, target.lm_head, previous, labels, weights, chunk=4)
    grads = torch.autograd.grad(loss, [rows, *model.candidate_selector.parameters()])

    dense_rows = rows.detach().clone().requires_grad_(True)
    unary = dense_rows @ target.lm_head.T  # [9, V]
    candidates, slot = selector_candidates(unary.detach().topk(DFLASH2["selector_top_k"]).indices, labels)
    s = model.candidate_selector
    context = s.predecessor_codebook[previous] * s.hidden_projection(dense_rows)
    scores = unary.gather(1, candidates) + (context[:, None, :] * s.successor_codebook[candidates]).sum(-1)
    dense = (F.cross_entropy(scores, slot, reduction="none") * weights).sum()
    dense_grads = torch.autograd.grad(dense, [dense_rows, *s.parameters()])
    torch.testing.assert_close(loss, dense)
    for got, want in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- export and loading ---------------------------------------------------------------------


def test_export_holds_every_tensor_vllm_maps_and_reads_back(tmp_path):
    model = make_dflash2()
    out = write_export(model, tmp_path / "dflash2", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["block_size"] == 4
    assert {k: config["dflash_config"][k] for k in DFLASH2} == DFLASH2  # where vLLM's loader reads them
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes == vllm_tensors(config)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 2 * (H // 8), H)
    assert shapes["candidate_selector.predecessor_codebook"] == (V, 6)
    back = load_exported(out)
    assert type(back) is DFlash2Drafter and back.config == model.config
    assert drafter_config_from_hf(config, "x") == model.config
    assert all(torch.equal(t, back.state_dict()[k]) for k, t in model.state_dict().items())


@pytest.mark.parametrize("left_out", ["candidate_selector.successor_codebook", "layers.0.attention_conv.base_kernel",
                                      "layers.1.mlp_conv.kernel_projection.weight"])
def test_a_tensor_left_out_fails_the_check(left_out):
    model = make_dflash2()
    config = hf_config(model.config, dtype="float32")
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes == vllm_tensors(config)
    del shapes[left_out]
    assert shapes != vllm_tensors(config)


@pytest.mark.skipif(vllm_model_file("qwen3_dflash2.py") is None,
                    reason="vLLM's engine venv (qwen3_dflash2.py) is not installed")
def test_the_table_names_the_modules_of_the_installed_vllm():
    """The names in `vllm_tensors` are the attributes vLLM's qwen3_dflash2.py assigns and the
    dflash_config keys it reads (its source, read as text)."""
    source = vllm_model_file("qwen3_dflash2.py").read_text()
    for attribute in ("attention_conv", "mlp_conv", "base_kernel", "kernel_projection", "candidate_selector",
                      "predecessor_codebook", "successor_codebook", "hidden_projection"):
        assert re.search(rf"self\.{attribute}\b[^=\n]*=", source), attribute
    for key in DFLASH2:
        assert f'draft_config["{key}"]' in source, key
    assert "torch.empty(2, taps, hidden_size" in source and "2 * taps * self.num_groups" in source


def test_a_draft_vocabulary_is_refused():
    with pytest.raises(ValueError, match="scores the whole vocabulary .*drop --draft-vocab"):
        drafter_config("dflash2", **{**SHAPE, **DFLASH2}, draft_vocab_size=20)


# -- against vLLM's own functions -----------------------------------------------------------

VLLM_SIDE = """
import sys
import torch
import vllm.model_executor.models.qwen3_dflash2 as q
case = torch.load(sys.argv[1])
n, B, _ = case["x"].shape
conv = q._grouped_conv(case["x"].reshape(n * B, -1), case["delta"].reshape(n * B, *case["delta"].shape[2:]),
                       case["base"], B, case["groups"], case["x"].shape[-1] // case["groups"], case["base"].shape[0])
edges = q._score_edges(case["predecessor"], case["successor"], case["candidates"], case["unary"], case["hidden"],
                       case["anchors"], case["candidates"].shape[-1])
torch.save({"conv": conv.reshape(n, B, -1), "edges": edges}, sys.argv[2])
"""


@pytest.mark.engine
@pytest.mark.e2e
def test_the_convolution_and_the_scores_are_vllms(tmp_path, engine_venv):
    """vLLM 0.32's `_grouped_conv` (its CPU path; the GPU's Triton kernel computes the same sum)
    and `_score_edges` (the selector's scores for every predecessor candidate, which its walk
    reads) on our tensors: the convolution equals ours, and the walk over vLLM's scores drafts
    what `selector_drafts` drafts."""
    model = make_dflash2()
    with torch.no_grad():
        model.candidate_selector.predecessor_codebook.normal_(std=3.0)
    g = torch.Generator().manual_seed(8)
    x, base, delta = torch.randn(3, 4, H, generator=g), torch.randn(2, H, generator=g), torch.randn(3, 4, 2, 4,
                                                                                                    generator=g)
    rows, anchors, target = torch.randn(5, 3, H, generator=g), torch.randint(0, V, (5,), generator=g), head()
    with torch.no_grad():
        top = (rows @ target.lm_head.T).topk(DFLASH2["selector_top_k"])
        s = model.candidate_selector
        case = {"x": x, "delta": delta, "base": base, "groups": 4, "predecessor": s.predecessor_codebook.detach(),
                "successor": s.successor_codebook.detach(), "candidates": top.indices, "unary": top.values,
                "hidden": s.hidden_projection(rows), "anchors": anchors}
    torch.save(case, tmp_path / "case.pt")
    (tmp_path / "vllm_side.py").write_text(VLLM_SIDE)
    done = subprocess.run([str(engine_venv / "bin" / "python"), *(str(tmp_path / name) for name in (
        "vllm_side.py", "case.pt", "out.pt"))], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["conv"], grouped_causal_conv(x, delta, base))
    edges = out["edges"]  # [n, D, K predecessors, K candidates]; step 0's predecessors are the anchor
    previous, walked = torch.zeros(5, dtype=torch.long), []
    for step in range(3):  # vLLM's walk at temperature 0 (its Triton kernel, spelled out)
        index = edges[torch.arange(5), step, previous].argmax(-1)
        walked.append(top.indices[torch.arange(5), step, index])
        previous = index
    assert torch.equal(torch.stack(walked, 1), selector_drafts(model, rows, anchors, target).tokens)
