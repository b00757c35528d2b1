"""train/fit.py's pieces: the learning-rate schedule and the loss against a materialised
float64 reference."""

import pytest
import torch

from dflash.train.config import LossConfig
from dflash.train.fit import lr_at
from dflash.train.model import TargetHead


@pytest.mark.parametrize("step,expected", [
    (0, 1.5e-4), (3, 6e-4),  # warm-up: 4 steps of 100
    (4, 6e-4), (52, 3e-4), (100, 0.0),  # cosine from step 4 to 100
])
def test_lr_schedule(step, expected):
    assert lr_at(step, 100, 0.04, 6e-4) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("kind", ["kl", "ce", "kl+ce", "tv", "tv+ce", "0.9tv+0.1ce"])
def test_loss_matches_materialised_reference(kind, seed):
    from types import SimpleNamespace

    from dflash.train.drafters import LossOperands
    from dflash.train.fit import _distill, _teacher

    N, H, V, k = 7, 5, 11, 3
    hidden, weight = torch.randn(N, H), torch.randn(V, H)
    topk_ids = torch.stack([torch.randperm(V)[:k] for _ in range(N)])  # [N, k]
    q = torch.softmax(torch.randn(N, k + 1), -1)[:, :k]  # a tail of mass q[:, k] left out
    batch = SimpleNamespace(topk_ids=topk_ids, topk_logprobs=q.log(), weights=torch.rand(N))
    config = LossConfig(loss=kind, ce_weight=0.5)
    head = TargetHead(embed_tokens=weight, lm_head=weight)
    loss, argmax = _distill(LossOperands(rows=hidden, head=head), _teacher(batch, head), config)  # a DFlash kind's loss

    logp = torch.log_softmax(hidden.double() @ weight.double().T, -1)  # [N, V]
    qd = q.double()
    p_sel = logp.gather(1, topk_ids).exp()
    tail_q = 1 - qd.sum(1)
    kl = (qd * (qd.log() - logp.gather(1, topk_ids))).sum(1) + tail_q * (tail_q.log() - (1 - p_sel.sum(1)).log())
    top1 = topk_ids.gather(1, q.argmax(1, keepdim=True))[:, 0]
    ce = -logp.gather(1, top1[:, None])[:, 0]
    tv = 0.5 * ((p_sel - qd).abs().sum(1) + ((1 - p_sel.sum(1)) - tail_q).abs())
    rows = {"kl": kl, "ce": ce, "kl+ce": kl + 0.5 * ce, "tv": tv, "tv+ce": tv + 0.5 * ce,
            "0.9tv+0.1ce": 0.9 * tv + 0.1 * ce}[kind]
    torch.testing.assert_close(loss.double(), (batch.weights.double() * rows).sum(), rtol=1e-4, atol=1e-5)
    assert torch.equal(argmax, logp.argmax(1))
