"""DSpark (train/drafters/dspark.py): the export vLLM's qwen3_dspark loader reads, the Markov bias in the
fused loss against a dense reference, and the sequential drafting rule."""

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from bench.engine_venv import vllm_model_file
from dflash.kernels.loss import sparse_kl_loss
from dflash.testing.builders import drafter_config
from dflash.train.drafters import make as make_drafter
from dflash.train.drafters.dspark import DSparkDrafter, confidence_loss, loss_operands, sequential_drafts
from dflash.train.export import hf_config, vllm_tensors, write_export
from dflash.train.loading import drafter_config_from_hf, load_exported
from dflash.train.model import DFlashDrafter, DrafterContextCache, TargetHead

H, V, R = 32, 50, 6  # H: dflash.testing.builders.drafter_config's hidden size



def make_dspark(confidence: bool = True, draft_vocab: int | None = None, seed: int = 0) -> DSparkDrafter:
    torch.manual_seed(seed)
    config = drafter_config("dspark", num_hidden_layers=2, vocab_size=V, target_layer_ids=[1, 3], num_target_layers=5,
                            num_drafts=4, mask_token_id=V - 1, markov_rank=R, confidence_head=confidence,
                            draft_vocab_size=draft_vocab)
    model = make_drafter(config, attention="dense")
    if draft_vocab is not None:
        with torch.no_grad():
            model.draft_ids.copy_(torch.randperm(V)[:draft_vocab].sort().values)
            model.draft_head.normal_()
    return model.eval()


def test_make_drafter_picks_the_class():
    assert type(make_dspark()) is DSparkDrafter
    config = drafter_config(num_hidden_layers=1, vocab_size=V, target_layer_ids=[1], num_target_layers=3,
                            mask_token_id=0)
    assert type(make_drafter(config)) is DFlashDrafter
    assert "markov_rank" not in config.to_dict() and "kind" not in config.to_dict()  # as before kinds had names


# -- export ---------------------------------------------------------------------------------


@pytest.mark.parametrize("confidence,draft_vocab", [(True, None), (False, None), (True, 20)])
def test_export_holds_every_tensor_vllm_maps(tmp_path, confidence, draft_vocab):
    model = make_dspark(confidence, draft_vocab)
    out = write_export(model, tmp_path / "dspark", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert config["markov_rank"] == R and config["block_size"] == 4 and config["sample_from_anchor"] is True
    assert config["enable_confidence_head"] is confidence
    assert config["confidence_head_with_markov"] is confidence
    assert config["draft_vocab_size"] == (draft_vocab or V) and config["dspark_draft_topk"] is None
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes == vllm_tensors(config)
    assert ("confidence_head.proj.bias" in shapes) is confidence


@pytest.mark.parametrize("left_out", ["fc.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                                      "confidence_head.proj.weight", "layers.1.mlp.down_proj.weight"])
def test_a_tensor_left_out_fails_the_check(tmp_path, left_out):
    """What vLLM's loader would silently start from uninitialised memory, the table catches."""
    model = make_dspark()
    config = hf_config(model.config, dtype="float32")
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in ("draft_head", "draft_ids")}
    assert shapes == vllm_tensors(config)
    del shapes[left_out]
    assert shapes != vllm_tensors(config)


def test_swapped_markov_matrices_fail_the_check_with_a_draft_vocabulary():
    """(Over the whole vocabulary both are [V, r]: a swap shows only in acceptance, which the
    engine check covers.)"""
    model = make_dspark(draft_vocab=20)
    config = hf_config(model.config, dtype="float32")
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    shapes["markov_head.markov_w1.weight"], shapes["markov_head.markov_w2.weight"] = (
        shapes["markov_head.markov_w2.weight"], shapes["markov_head.markov_w1.weight"])
    assert {k: v for k, v in shapes.items() if k.startswith("markov")} != {
        k: v for k, v in vllm_tensors(config).items() if k.startswith("markov")}


def _vllm_source() -> Path | None:
    return vllm_model_file("qwen3_dspark.py")


@pytest.mark.skipif(_vllm_source() is None, reason="vLLM's engine venv (qwen3_dspark.py) is not installed")
def test_the_table_names_the_modules_of_the_installed_vllm():
    """The heads' names in `vllm_tensors` are the attributes vLLM's qwen3_dspark.py assigns (its
    source, read as text: nothing of vLLM is imported or started)."""
    source = _vllm_source().read_text()
    for attribute in ("markov_head", "markov_w1", "markov_w2", "confidence_head", "proj"):
        assert re.search(rf"self\.{attribute}\b[^=\n]*=", source), attribute
    assert '"d2t", "draft_id_to_target_id"' in source.replace("name.replace(", "").replace("'", '"') or "d2t" in source
    assert "class Qwen3DSparkModel(DFlashQwen3Model)" in source  # the backbone's names are DFlash's


def test_export_reads_back(tmp_path):
    model = make_dspark()
    out = write_export(model, tmp_path / "dspark", dtype=torch.float32)
    back = load_exported(out)
    assert type(back) is DSparkDrafter
    assert drafter_config_from_hf(json.loads((out / "config.json").read_text()), "x") == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, back.state_dict()[name]), name


# -- the loss -------------------------------------------------------------------------------


def _head(seed: int = 3) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(embed_tokens=torch.randn(V, H, generator=g), lm_head=torch.randn(V, H, generator=g) * 0.3)


@pytest.mark.parametrize("impl", ["naive", "torch", "triton"])
@pytest.mark.parametrize("weight_grad_from", [0, H], ids=["full-dW", "markov-columns"])
def test_markov_bias_in_the_fused_loss_equals_dense_logits(impl, weight_grad_from):
    """[h; e] @ [W; W2]^T is the DSpark logits: loss and gradients (rows, markov_w1, markov_w2)
    against a dense float64 reference of softmax(h W^T + W2 e) and the bucket KL, with dW over
    the whole head, or over markov_w2's columns only (fit's call)."""
    dtype = torch.float32 if impl == "triton" else torch.float64  # the Triton path takes fp32/bf16
    model = make_dspark(confidence=False).to(dtype)
    head = _head()
    head = TargetHead(embed_tokens=head.embed_tokens.to(dtype), lm_head=head.lm_head.to(dtype))
    g = torch.Generator().manual_seed(5)
    n, k = 13, 5
    rows = torch.randn(n, H, generator=g, dtype=dtype, requires_grad=True)
    prev = torch.randint(0, V, (n,), generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n)])
    logprobs = torch.log_softmax(torch.randn(n, k + 1, generator=g, dtype=torch.float64), -1)[:, :k].to(dtype)
    weights = torch.rand(n, generator=g, dtype=torch.float64).to(dtype)

    hidden, weight, _ = loss_operands(model, rows, head, prev)
    loss = sparse_kl_loss(hidden, weight, ids, logprobs, weights, impl=impl, reduction="sum",
                          weight_grad_from=weight_grad_from)
    loss.backward()
    got = [rows.grad.clone(), model.markov_head.markov_w1.weight.grad.clone(),
           model.markov_head.markov_w2.weight.grad.clone()]
    for t in (rows, model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight):
        t.grad = None

    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    logits = rows.double() @ head.lm_head.double().T + w1.double()[prev] @ w2.double().T
    lp = torch.log_softmax(logits, -1)
    logprobs = logprobs.double()
    weights = weights.double()
    q = logprobs.exp()
    lp_s = lp.gather(1, ids)
    tail_q = 1 - q.sum(1)
    tail_p = 1 - lp_s.exp().sum(1)
    row = (q * (logprobs - lp_s)).sum(1) + tail_q * (tail_q.log() - tail_p.log())
    ref = (weights * row).sum()
    ref.backward()
    # The kernel's rows and lse are float32 whatever the inputs (kernels/reference.py): 1e-5 is
    # float32's reach over these few terms, and a wrong or missing bias term is O(1) off.
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    want = [rows.grad, model.markov_head.markov_w1.weight.grad, model.markov_head.markov_w2.weight.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-6)
    assert want[1].abs().sum() > 0 and want[2].abs().sum() > 0


def test_confidence_target_is_the_top_k_overlap():
    model = make_dspark().double()
    g = torch.Generator().manual_seed(2)
    n, k = 7, 4
    hidden = torch.randn(n, H + R, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H + R, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n)])
    logprobs = torch.log_softmax(torch.randn(n, k, generator=g, dtype=torch.float64), -1)
    rows, embed = hidden[:, :H], hidden[:, H:]
    loss = confidence_loss(model, rows, embed, hidden, weight, ids, logprobs, torch.ones(n, dtype=torch.float64))
    p = torch.softmax(hidden @ weight.T, -1).gather(1, ids)
    target = torch.minimum(p, logprobs.exp()).sum(1)
    logit = model.confidence_head.proj(torch.cat([rows, embed], -1))[:, 0]
    ref = F.binary_cross_entropy_with_logits(logit, target, reduction="sum")
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)


# -- drafting -------------------------------------------------------------------------------


def test_sequential_drafts_follow_the_drafted_token():
    """Position i's argmax is over base logits + markov_w2 markov_w1[t_i], t_i the previous draft."""
    model = make_dspark()
    head = _head()
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(3, 4, H, generator=g)
    anchors = torch.tensor([1, 7, 30])
    drafts = sequential_drafts(model, hidden, anchors, head)
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    for b in range(3):
        prev = int(anchors[b])
        for i in range(4):
            logits = hidden[b, i] @ head.lm_head.T + w2 @ w1[prev]
            prev = int(logits.argmax())
            assert int(drafts[b, i]) == prev


def test_a_strong_markov_bias_decides_the_drafts():
    """With a bias that maps each token to (token + 1) mod V far above the backbone's logits,
    the drafts are the anchor's successors: the bias is read from the drafted token, in order."""
    model = make_dspark()
    with torch.no_grad():
        model.markov_head.markov_w1.weight.copy_(torch.nn.functional.one_hot(torch.arange(V) % R, R).float())
        model.markov_head.markov_w2.weight.zero_()
    # rank R < V: use tokens 0..R-1 only, token t -> t+1 (mod R)
    with torch.no_grad():
        for t in range(R):
            model.markov_head.markov_w2.weight[(t + 1) % R, t] = 1e4
    head = _head()
    cache = DrafterContextCache()
    model.append_context(cache, torch.randn(1, 5, 2 * H))
    block = torch.tensor([[2] + [V - 1] * 3])
    hidden = model.forward_block(head.embed(block), cache)
    assert sequential_drafts(model, hidden, block[:, 0], head)[0].tolist() == [3, 4, 5, 0]


def test_the_model_card_serves_it_with_the_dspark_method():
    from dflash.train.export import model_card
    from dflash.train.loading import LoadedDrafter

    card = model_card(LoadedDrafter(make_dspark(), Path("step-1"), 1, None), evaluation=None)
    assert '"method": "dspark"' in card and card.startswith("---") and "# DSpark drafter" in card
    assert '"num_speculative_tokens": 4' in card and "V2 model runner" in card and '"dflash"' not in card
