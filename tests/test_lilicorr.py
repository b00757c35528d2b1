"""LiLiCorr (train/drafters/lilicorr.py): the config's refusals, a fresh drafter's backbone, the
walk, ModelOpt's three terms against per-slot references, the loss's gradient against dense
logits, the penalty read from the cache against the exact one from a tiny target's full
logits, the export vLLM's lilicorr.py loader reads, and vLLM's own head on our tensors.
`fit --drafter lilicorr` end to end is in tests/test_lilicorr_fit.py."""

import json
import math
import re
import subprocess

import numpy as np
import pytest
import torch
from safetensors import safe_open

from bench.engine_venv import vllm_model_file
from dflash.testing.builders import drafter_config, tiny_causal_lm
from dflash.train import drafters
from dflash.train.drafters.lilicorr import (
    OBJECTIVES,
    LatticeRows,
    LiLiCorrDrafter,
    cached_log_probs,
    lattice,
    lattice_drafts,
    lattice_loss,
    lattice_rows,
    lattice_terms,
)
from dflash.train.export import hf_config, vllm_tensors, write_export
from dflash.train.loading import drafter_config_from_hf, load_exported
from dflash.train.model import BlockLayout, TargetHead

H, V = 32, 50  # H: dflash.testing.builders.drafter_config's hidden size
SHAPE = dict(num_hidden_layers=2, vocab_size=V, target_layer_ids=[1, 3], num_target_layers=5, num_drafts=3,
             mask_token_id=V - 1)
HEAD = dict(lilicorr_candidate_topk=4, lilicorr_hidden_size=16, lilicorr_num_layers=2, lilicorr_num_heads=2,
            lilicorr_mlp_ratio=1.5, lilicorr_factor_dim=8, lilicorr_vector_eps=1e-4, lilicorr_logit_scale=8.0)
CONVS = dict(conv_kernel_size=2, conv_group_size=8)


def make_lilicorr(seed: int = 0, randomise: bool = True, **fields) -> LiLiCorrDrafter:
    """A LiLiCorr drafter; `randomise`: the head's zero-initialised tensors (embeddings, biases)
    and the convolutions drawn away from their start, so that every tensor matters."""
    torch.manual_seed(seed)
    model = drafters.make(drafter_config("lilicorr", **{**SHAPE, **HEAD, **fields}), attention="dense")
    if randomise:
        with torch.no_grad():
            for name, param in model.lilicorr.named_parameters():
                if param.dim() != 2 or "embedding" in name:
                    param.normal_(std=0.3)
            for layer in model.layers if model.config.conv_kernel_size else ():
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.normal_()
                    conv.kernel_projection.weight.normal_(std=0.2)
    return model.eval()


def head(seed: int = 3) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(embed_tokens=torch.randn(V, H, generator=g), lm_head=torch.randn(V, H, generator=g))


# -- the config -----------------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    (dict(lilicorr_candidate_topk=6), "lilicorr_candidate_topk must be a power of two <= 16"),
    (dict(lilicorr_candidate_topk=32), "lilicorr_candidate_topk must be a power of two <= 16"),
    (dict(conv_kernel_size=2), r"conv_kernel_size \(2\) and conv_group_size \(0\) are both > 0"),
    (dict(lilicorr_num_heads=3), "lilicorr_num_heads 3 must divide the head's width 16"),
    (dict(lilicorr_objective="tv"), "lilicorr_objective 'tv': pick one of base, margin"),
    (dict(draft_vocab_size=20), "scores the whole vocabulary .*drop --draft-vocab"),
])
def test_the_config_refuses_what_vllm_cannot_serve(fields, message):
    with pytest.raises(ValueError, match=message):
        drafter_config("lilicorr", **{**SHAPE, **HEAD, **fields})


@pytest.mark.parametrize("convs", [{}, CONVS], ids=["plain", "convolutions"])
def test_a_fresh_lilicorr_drafter_computes_what_its_dflash_backbone_does(convs):
    """The backbone's draws are DFlash's for one seed, the convolutions the identity: the same rows."""
    lilicorr = make_lilicorr(randomise=False, **convs)
    torch.manual_seed(0)
    dflash = drafters.make(drafter_config(**SHAPE), attention="dense").eval()
    assert all(torch.equal(lilicorr.state_dict()[k], v) for k, v in dflash.state_dict().items())
    assert all(drafters.get("lilicorr").owns(k) for k in lilicorr.state_dict().keys() - dflash.state_dict().keys())
    g = torch.Generator().manual_seed(1)
    context, embeds = torch.randn(10, 2 * H, generator=g), torch.randn(3 * 4, H, generator=g)
    layout = BlockLayout.build([(10, np.array([2, 5, 9]))], 4)
    assert torch.equal(lilicorr(embeds, context, layout), dflash(embeds, context, layout))


# -- the walk -------------------------------------------------------------------------------


@torch.no_grad()
def walk_by_hand(candidates, start, pairs):
    """vLLM's walk at temperature 0 spelled out: per block, the best start, then the best transition."""
    out = []
    for b in range(candidates.shape[0]):
        index = int(start[b].argmax())
        drafts = [int(candidates[b, 0, index])]
        for s in range(1, candidates.shape[1]):
            index = int(pairs[b, s - 1, index].argmax())
            drafts.append(int(candidates[b, s, index]))
        out.append(drafts)
    return out


@pytest.mark.parametrize("convs", [{}, CONVS], ids=["plain", "convolutions"])
def test_the_walk_takes_the_best_transition_from_the_draft_before(convs):
    model = make_lilicorr(**convs)
    g = torch.Generator().manual_seed(4)
    rows, anchor, target = torch.randn(6, 3, H, generator=g), torch.randn(6, H, generator=g), head()
    with torch.no_grad():
        candidates, start, pairs = lattice(model, rows, anchor, target)
    assert torch.equal(candidates, (rows @ target.lm_head.T).topk(4).indices)
    drafts = lattice_drafts(model, rows, anchor, target, margins=True)
    assert drafts.tokens.tolist() == walk_by_hand(candidates, start, pairs)
    assert not torch.equal(drafts.tokens, candidates[..., 0])  # the head moved some drafts
    assert bool((drafts.margins >= 0).all())
    assert float(start.abs().max()) <= 8.0 + 1e-4  # cosines times the logit scale
    # the kind drafts from the masks' rows, its anchor state from the context features before the anchor
    features = torch.randn(6, 2 * H, generator=g)
    block = torch.cat([torch.randn(6, 1, H, generator=g), rows], dim=1)
    kind_drafts = drafters.of(model).draft(model, block, torch.zeros(6, dtype=torch.long), target, context=features)
    assert torch.equal(kind_drafts.tokens, lattice_drafts(model, rows, model.fuse_context(features), target).tokens)


def test_fewer_drafts_use_the_lattices_prefix():
    """vLLM serves 1 <= num_speculative_tokens < block_size: a shorter walk scores the first slots."""
    model = make_lilicorr()
    g = torch.Generator().manual_seed(5)
    rows, anchor, target = torch.randn(4, 2, H, generator=g), torch.randn(4, H, generator=g), head()
    with torch.no_grad():
        candidates, start, pairs = lattice(model, rows, anchor, target)
    assert pairs.shape == (4, 1, 4, 4)
    assert lattice_drafts(model, rows, anchor, target).tokens.tolist() == walk_by_hand(candidates, start, pairs)


# -- the objective --------------------------------------------------------------------------


def terms_by_hand(start, pairs, truth, target_lp, margin):
    """ModelOpt's three terms slot by slot (hf_lilicorr.py's loop)."""
    n, D, K = target_lp.shape
    out = {name: torch.zeros(n, D) for name in ("ce", "hinge", "penalty", "supervised")}
    for b in range(n):
        z = start[b]
        for s in range(D):
            if s:
                if truth[b, s - 1] < 0:
                    break
                z = pairs[b, s - 1, truth[b, s - 1]]
            g = int(truth[b, s])
            if g < 0:
                break
            p = torch.softmax(z, -1)
            others = [float(z[j]) for j in range(K) if j != g]
            out["ce"][b, s] = -math.log(float(p[g]))
            out["hinge"][b, s] = max(0.0, margin - (float(z[g]) - max(others)))
            out["penalty"][b, s] = sum(float(p[j]) * max(0.0, float(target_lp[b, s, g] - target_lp[b, s, j]))
                                       for j in range(K))
            out["supervised"][b, s] = 1.0
    return out


def test_the_terms_are_modelopts_slot_by_slot():
    g = torch.Generator().manual_seed(6)
    start, pairs = torch.randn(5, 4, generator=g) * 3, torch.randn(5, 2, 4, 4, generator=g) * 3
    truth = torch.tensor([[0, 1, 2], [3, -1, 0], [-1, 2, 2], [1, 1, 1], [2, 0, -1]])
    target_lp = torch.randn(5, 3, 4, generator=g)
    got = lattice_terms(start, pairs, truth, target_lp, margin=2.0)
    want = terms_by_hand(start, pairs, truth, target_lp, 2.0)
    assert got["supervised"].tolist() == want["supervised"].tolist()
    for name in ("ce", "hinge", "penalty"):
        torch.testing.assert_close(got[name] * got["supervised"], want[name])


def dense_lattice_loss(model, rows, target, blocks, ids, logprobs, top1, weights):
    """lattice_loss through dense logits and a full log_softmax (the chunked paths' reference)."""
    w_ce, w_margin, w_pen, margin = OBJECTIVES[model.config.lilicorr_objective]
    slot_rows = rows[blocks.slots]  # [n, D, H]
    log_p = (slot_rows @ target.lm_head.T).log_softmax(-1)  # [n, D, V]
    top = log_p.detach().topk(4, dim=-1).indices
    embeddings = target.embed_tokens[top]
    start, pairs = model.lilicorr.factors(embeddings, log_p.gather(2, top), slot_rows,
                                          model.fuse_context(blocks.context))
    truth = top1[blocks.slots]
    hits = top == truth[..., None]
    index = torch.where(hits.any(-1), hits.long().argmax(-1), -1)
    terms = lattice_terms(start, pairs, index, cached_log_probs(top, ids[blocks.slots], logprobs[blocks.slots]),
                          margin)
    mask = terms["supervised"]
    total = w_ce * (terms["ce"] * mask).sum() + w_margin * (terms["hinge"] * mask).sum() \
        + w_pen * (terms["penalty"] * mask).sum()
    return total / mask.sum().clamp_min(1.0) * weights.sum()


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_the_lattice_loss_and_its_gradient_match_dense_logits(objective):
    model = make_lilicorr(lilicorr_objective=objective).train()
    target = head()
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(12, H, generator=g)
    with torch.no_grad():  # the target's top-1: the rows' own top-2 candidates, so most slots are supervised
        top1 = (rows @ target.lm_head.T).topk(2).indices[:, int(objective == "margin")]
    ids = torch.stack([top1, *torch.randint(0, V, (5, 12), generator=g)], 1)  # [N, 6], top-1 first
    logprobs = torch.sort(torch.rand(12, 6, generator=g) * -4, descending=True).values - 0.5
    blocks = LatticeRows(slots=torch.arange(12).view(4, 3), context=torch.randn(4, 2 * H, generator=g))
    weights = torch.rand(12, generator=g)
    params = [rows.requires_grad_(True), *model.parameters()]
    loss = lattice_loss(model, rows, target, blocks, ids, logprobs, top1, weights, chunk=5)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    dense = dense_lattice_loss(model, rows, target, blocks, ids, logprobs, top1, weights)
    dense_grads = torch.autograd.grad(dense, params, allow_unused=True)
    torch.testing.assert_close(loss, dense)
    assert float(loss) > 0
    for got, want in zip(grads, dense_grads, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert float(grads[0].abs().sum()) > 0  # the backbone's rows learn from the lattice
    by_name = dict(zip([name for name, _ in model.named_parameters()], grads[1:], strict=True))
    assert all(float(by_name[f"lilicorr.{name}.weight"].abs().sum()) > 0 for name in ("out_head", "in_head",
                                                                                     "anchor_out_head"))
    assert float(by_name["fc.weight"].abs().sum()) > 0  # the anchor state: the fused context row


def test_a_batch_without_a_complete_block_gives_zero_through_every_head_tensor():
    """DDP reduces every parameter's gradient each step: the head's must exist (zero) then too."""
    model = make_lilicorr().train()
    rows = torch.randn(4, H, requires_grad=True)
    empty = LatticeRows(slots=torch.zeros(0, 3, dtype=torch.long), context=torch.zeros(0, 2 * H))
    loss = lattice_loss(model, rows, head(), empty, torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2),
                        torch.zeros(4, dtype=torch.long), torch.ones(4))
    grads = torch.autograd.grad(loss, list(model.lilicorr.parameters()))
    assert float(loss) == 0.0 and all(float(g.abs().sum()) == 0.0 for g in grads)


def test_lattice_rows_are_the_complete_blocks_and_the_rows_before_their_anchors():
    class Batch:  # train/data.py's Batch, the fields lattice_rows reads: 2 segments, blocks of 4 rows
        segments = [(6, np.array([2, 6])), (5, np.array([5]))]
        anchors = torch.tensor([2, 6, 5])
        label_rows = torch.tensor([1, 2, 3, 5, 6, 9, 10, 11])  # block 1 lacks its slot 3
        label_positions = torch.tensor([1, 2, 3, 1, 2, 1, 2, 3])
        context_features = torch.arange(11.0)[:, None]
    blocks = lattice_rows(Batch(), num_drafts=3)
    assert blocks.slots.tolist() == [[0, 1, 2], [5, 6, 7]]
    assert blocks.context[:, 0].tolist() == [1.0, 6.0 + 4]  # rows a - 1 of each segment's context


# -- the penalty from the cache -------------------------------------------------------------


@pytest.mark.parametrize("k", [3, 8, 64])
def test_the_cached_penalty_bounds_the_exact_one_from_full_logits(k):
    """A tiny target's full logits give ModelOpt's exact weights; the cache's top-k and tail give
    ours: equal inside the top-k, a lower bound outside it, so the penalty is a lower bound,
    exact when the top-k is the whole vocabulary."""
    target = tiny_causal_lm("qwen3")
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        logits = target(torch.randint(0, 64, (1, 20), generator=g)).logits[0].double()  # [T, 64]
    log_p = logits.log_softmax(-1)
    cached = log_p.topk(k, dim=-1)
    candidates = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(20)])  # [T, 8] drafter's
    truth = cached.indices[:, 0]  # the target's greedy token
    candidates[:, 3] = truth
    exact = (logits.gather(1, truth[:, None]) - logits.gather(1, candidates)).clamp_min(0)  # ModelOpt's w
    lp = cached_log_probs(candidates, cached.indices, cached.values.float()).double()
    ours = (lp[:, 3:4] - lp).clamp_min(0)
    inside = (candidates[..., None] == cached.indices[:, None, :]).any(-1)
    torch.testing.assert_close(ours[inside], exact[inside], rtol=1e-5, atol=1e-5)
    assert bool((ours <= exact + 1e-5).all())
    head_probs = torch.softmax(torch.randn(20, 8, generator=g, dtype=torch.float64), -1)
    penalty, exact_penalty = (head_probs * ours).sum(), (head_probs * exact).sum()
    assert float(penalty) <= float(exact_penalty) + 1e-6
    if k == 64:
        torch.testing.assert_close(penalty, exact_penalty)
    shorter = cached_log_probs(candidates, cached.indices[:, :k - 1], cached.values[:, :k - 1].float()).double()
    looser = (head_probs * (shorter[:, 3:4] - shorter).clamp_min(0)).sum()
    assert float(penalty) >= float(looser) - 1e-4  # a larger k tightens the bound (1e-4: the fp32 cache)


def test_the_tail_tightens_the_bound_when_it_is_smaller_than_the_kth():
    ids = torch.tensor([[0, 1, 2]])
    logprobs = torch.log(torch.tensor([[0.6, 0.3, 0.09]]))  # tail 0.01 < the 3rd's 0.09
    lp = cached_log_probs(torch.tensor([[0, 5]]), ids, logprobs)
    torch.testing.assert_close(lp, torch.log(torch.tensor([[0.6, 0.01]])), rtol=1e-4, atol=1e-4)
    full = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))  # no tail left: the 3rd alone bounds
    torch.testing.assert_close(cached_log_probs(torch.tensor([[5]]), ids, full), full[:, 2:])


# -- export and loading ---------------------------------------------------------------------


@pytest.mark.parametrize("fields", [{}, CONVS, dict(lilicorr_hidden_size=0, lilicorr_num_heads=4)],
                         ids=["plain", "convolutions", "full-width"])
def test_export_holds_every_tensor_vllm_maps_and_reads_back(tmp_path, fields):
    model = make_lilicorr(**fields)
    out = write_export(model, tmp_path / "lilicorr", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LiLiCorrDraftModel"] and config["block_size"] == 4
    dflash = config["dflash_config"]
    assert dflash["lilicorr_enabled"] is True
    assert {k: dflash[k] for k in HEAD} == {**HEAD, **{k: v for k, v in fields.items() if k in HEAD}}
    assert ("conv_kernel_size" in dflash) == bool(fields.get("conv_kernel_size"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes == vllm_tensors(config)
    assert shapes["lilicorr.relative_slot_bias"] == (model.config.lilicorr_num_heads, 7)
    assert ("lilicorr.token_proj.weight" in shapes) == (model.config.head_width != H)
    back = load_exported(out)
    assert type(back) is LiLiCorrDrafter and back.config == model.config
    assert drafter_config_from_hf(config, "x") == model.config
    assert all(torch.equal(t, back.state_dict()[k]) for k, t in model.state_dict().items())


@pytest.mark.parametrize("left_out", ["lilicorr.in_head.bias", "lilicorr.layers.1.attn.in_proj_weight",
                                      "lilicorr.feature_norm.weight", "layers.1.mlp_conv.kernel_projection.weight"])
def test_a_tensor_left_out_fails_the_check(left_out):
    model = make_lilicorr(**CONVS)
    config = hf_config(model.config, dtype="float32")
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes == vllm_tensors(config)
    del shapes[left_out]
    assert shapes != vllm_tensors(config)


def test_a_config_without_the_heads_fields_is_refused():
    config = hf_config(make_lilicorr().config, dtype="float32")
    del config["dflash_config"]["lilicorr_factor_dim"]
    with pytest.raises(ValueError, match=r"needs \['dflash_config.lilicorr_factor_dim'\]"):
        drafter_config_from_hf(config, "x")


@pytest.mark.skipif(vllm_model_file("lilicorr.py") is None, reason="vLLM's engine venv (lilicorr.py) is not installed")
def test_the_table_names_the_modules_of_the_installed_vllm():
    """The names in `vllm_tensors` are the attributes vLLM's lilicorr.py assigns and the
    dflash_config keys it reads (its source, read as text)."""
    source = vllm_model_file("lilicorr.py").read_text()
    names = {part for name in vllm_tensors(hf_config(make_lilicorr().config, dtype="float32"))
             if name.startswith("lilicorr.") for part in name.split(".")[1:] if not part.isdigit()} - {"weight", "bias"}
    for attribute in names - {"up_proj", "down_proj"}:  # those two: NemotronHMLP's
        assert re.search(rf"self\.{attribute}\b[^=\n]*=", source), attribute
    for key in HEAD:
        assert f'config["{key}"]' in source, key
    assert '"lilicorr_enabled"' in source and "self.num_candidate_slots = block_size - 1" in source


# -- against vLLM's own head ----------------------------------------------------------------

VLLM_SIDE = """
import sys
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.lilicorr import LiLiCorrHead
from vllm.model_executor.models.utils import AutoWeightsLoader

case = torch.load(sys.argv[1])
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(1, 0, "tcp://127.0.0.1:" + sys.argv[3], 0, "gloo")
    initialize_model_parallel(1)
    head = LiLiCorrHead(model_hidden_size=case["hidden_size"], block_size=case["block_size"],
                        rms_norm_eps=case["eps"], config=case["fields"], prefix="lilicorr")
AutoWeightsLoader(head).load_weights(case["tensors"].items())
head.materialize_inference_buffers(torch.device("cpu"), torch.float32)  # what its load_weights ends with
for module in head.modules():  # then vLLM's model loader (its CPU linear kernels)
    if getattr(module, "quant_method", None) is not None:
        module.quant_method.process_weights_after_loading(module)
with torch.no_grad():
    scores = head.forward(case["embeddings"], case["log_probs"], case["rows"], case["anchor"],
                          torch.ones(case["rows"].shape[0], dtype=torch.bool))
torch.save({"scores": scores}, sys.argv[2])
"""


@pytest.mark.engine
@pytest.mark.e2e
@pytest.mark.parametrize("slots", [3, 2], ids=["whole-block", "fewer-drafts"])
def test_the_scores_are_vllms(tmp_path, engine_venv, slots):
    """vLLM 0.32's LiLiCorrHead (loaded by its own AutoWeightsLoader from our exported names)
    on our lattice: its scores [n, d, K, K] (step 0's rows: the start scores for every
    predecessor) are our start and pairs, and its walk drafts what `lattice_drafts` drafts."""
    model = make_lilicorr()
    g = torch.Generator().manual_seed(8)
    rows, anchor, target = torch.randn(5, slots, H, generator=g), torch.randn(5, H, generator=g), head()
    with torch.no_grad():
        logits = (rows @ target.lm_head.T).log_softmax(-1)
        top = logits.topk(4, dim=-1)
        candidates, start, pairs = lattice(model, rows, anchor, target)
    config = hf_config(model.config, dtype="float32")
    state = model.state_dict()
    case = {"hidden_size": H, "block_size": config["block_size"], "eps": model.config.rms_norm_eps,
            "fields": config["dflash_config"], "embeddings": target.embed_tokens[top.indices],
            "log_probs": top.values, "rows": rows, "anchor": anchor,
            "tensors": {name.removeprefix("lilicorr."): state[name] for name in vllm_tensors(config)
                        if name.startswith("lilicorr.")}}
    torch.save(case, tmp_path / "case.pt")
    (tmp_path / "vllm_side.py").write_text(VLLM_SIDE)
    done = subprocess.run([str(engine_venv / "bin" / "python"), *(str(tmp_path / name) for name in (
        "vllm_side.py", "case.pt", "out.pt")), str(29500 + slots)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    scores = torch.load(tmp_path / "out.pt")["scores"]  # [n, d, K predecessors, K candidates]
    torch.testing.assert_close(candidates, top.indices, rtol=0, atol=0)
    torch.testing.assert_close(scores[:, 0], start[:, None].expand(-1, 4, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores[:, 1:], pairs, rtol=1e-5, atol=1e-5)
    previous, walked = torch.zeros(5, dtype=torch.long), []
    for step in range(slots):  # vLLM's walk at temperature 0 (its Triton kernel, spelled out)
        previous = scores[torch.arange(5), step, previous].argmax(-1)
        walked.append(top.indices[torch.arange(5), step, previous])
    assert torch.equal(torch.stack(walked, 1), lattice_drafts(model, rows, anchor, target).tokens)
