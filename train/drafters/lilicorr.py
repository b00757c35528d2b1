"""The LiLiCorr drafter kind: DFlash's block and backbone (optionally with DFlash2's
convolutions) and a reranker over the candidate lattice the backbone already produces.

LiLiCorr (NVIDIA, "Lightweight Likelihood Correlation of Parallel Drafts", arXiv 2608.20530).
The semantics are vLLM 0.32's `lilicorr.py` (`LiLiCorrHead`) and its V2 speculator
(`vllm/v1/worker/gpu/spec_decode/lilicorr/`, whose walk is DFlash2's); the objective is
NVIDIA ModelOpt's (`modelopt/torch/speculative/plugins/hf_lilicorr.py`, `modeling_lilicorr.py`,
recipe `modelopt_recipes/general/speculative_decoding/lilicorr.yaml`):

- The block is DFlash's: the anchor and D = num_drafts masks; the masks' rows are the lattice's
  D slots. With `conv_kernel_size` > 0 every layer is DFlash2's (`DFlash2Layer`, its grouped
  causal convolutions, the identity at initialisation).
- The lattice: each slot's K = `lilicorr_candidate_topk` candidates are the top-K of the
  drafter's logits through the target's head, with their log-probs over the whole vocabulary.
  Each candidate's state is token_proj(target embedding) + pass_hidden_proj(the slot's row) +
  feature_mlp(feature_norm(5 features: log-prob, prob, gap to the slot's best, rank / (K-1),
  is-top-1)) + slot and rank embeddings. `lilicorr_num_layers` bidirectional pre-norm layers
  attend over the D*K lattice with a per-head bias by slot distance plus a same-slot bias.
  The anchor's state is context_proj(the fused context row before the anchor: the drafter's
  `fuse_context` of the target features at a - 1). Per candidate, factor = silu(
  factor_input_proj([x, a, x*a])); `out_head`, `in_head` and `anchor_out_head` give vectors
  normalised to unit length (eps `lilicorr_vector_eps`); start[j] = <anchor_out, in[0, j]>,
  pair[s, i, j] = <out[s, i], in[s+1, j]>, both times `lilicorr_logit_scale`.
- Drafting (vLLM's walk at temperature 0): slot 0 takes argmax_j start[j], slot s takes
  argmax_j pair[s-1, i, j] for the candidate i taken before. The unary logits only enter
  through the features. The whole vocabulary: candidates are target ids (no draft vocabulary).

Training (train/fit.py through `LiLiCorrKind`): the labelled rows get fit's distillation loss
as any DFlash drafter's, and the lattice adds ModelOpt's three terms over the blocks whose
every slot is labelled. The ground truth of slot s is the target's greedy token at it (the
cache's top-1; ModelOpt reads the data's next token, the same on target-regenerated data).
The chain is teacher-forced: slot s's potentials are pair[s-1, g_{s-1}, :] (start for slot
0), g the ground truth's candidate index; a slot is supervised while the ground truth is among
the candidates at it and at every slot before. Per supervised slot with potentials z:

- CE: -log softmax(z)[g];
- hinge: relu(margin - (z_g - max_{j != g} z_j));
- penalty: sum_j softmax(z)_j w_j, w_j = relu(l(g) - l(c_j)), l the target's log-probs (the
  normaliser cancels: ModelOpt's logit gap).

loss = distillation + w_ce CE + w_margin hinge + w_pen penalty, each term ModelOpt's mean over
the supervised slots (here times the batch's summed row weight, so that fit's division by it
leaves the mean). Variants (`lilicorr_objective`): base 0.25 / 0 / 0.25; margin 0.125 /
0.125 / 0.25 with margin 2.0. The gradient reaches the head, and through the candidates'
log-probs and the rows, the backbone; the target's head and embedding stay frozen.

The penalty from the cache: ModelOpt reads the target's full logits; the cache holds the
target's top-k log-probs l_1 >= ... >= l_k and its tail mass t = 1 - sum exp(l_i). A
candidate inside the top-k gets its exact l. One outside it is no likelier than the k-th
cached token nor than the whole tail, so its log-prob is at most b = min(l_k, log t) (b = l_k
where t is under 1e-5, the float32 rounding of 1 - sum exp(l_i) and the loss kernel's floor),
and we use b: its weight l(g) - b is a lower bound of the exact
weight, so the penalty read from the cache is a lower bound of ModelOpt's, equal to it when
every candidate with head mass is in the target's top-k (tests/test_lilicorr.py checks both
against full logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash.kernels.reference import TAIL_EPS, teacher_tail
from dflash.train.drafters.base import (
    DrafterKind,
    Drafts,
    LossOperands,
    v2_runner_serving,
)
from dflash.train.drafters.dflash2 import DFlash2Layer, _CandidateLogits, unary_top_k
from dflash.train.model import DFlashDrafter, DrafterConfig, DrafterLayer, RMSNorm, TargetHead

# The dflash_config fields of vLLM's lilicorr.py (`lilicorr_enabled` is written as true).
HEAD_FIELDS = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers", "lilicorr_num_heads",
               "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale")
CONV_FIELDS = ("conv_kernel_size", "conv_group_size")
NUM_FEATURES = 5  # log-prob, prob, gap to the slot's best, rank fraction, is-top-1
# ModelOpt's two shipped compositions: (w_ce, w_margin, w_pen, margin).
OBJECTIVES = {"base": (0.25, 0.0, 0.25, 2.0), "margin": (0.125, 0.125, 0.25, 2.0)}
FACTOR_INIT_STD = 0.02  # ModelOpt's factor heads: small, non-zero (a zero product has no gradient)


@dataclass(kw_only=True)
class LiLiCorrConfig(DrafterConfig):
    """A LiLiCorr drafter's config: DFlash's, the lattice head's and the optional convolutions'."""

    kind: ClassVar[str | None] = "lilicorr"
    lilicorr_candidate_topk: int = 8
    """Candidates K per slot (a power of two, at most 16: vLLM's walk)."""
    lilicorr_hidden_size: int = 0
    """Width of the lattice head; 0: the drafter's hidden size."""
    lilicorr_num_layers: int = 2
    """Bidirectional attention layers over the lattice."""
    lilicorr_num_heads: int = 8
    """Attention heads of the lattice layers (divides the head's width)."""
    lilicorr_mlp_ratio: float = 2.0
    """The lattice MLP's inner width over the head's width."""
    lilicorr_factor_dim: int = 128
    """Width of the out/in/anchor transition vectors."""
    lilicorr_vector_eps: float = 1e-4
    """Norm floor of the transition vectors' normalisation."""
    lilicorr_logit_scale: float = 8.0
    """Scale of the cosine transition scores (fixed, not trained)."""
    conv_kernel_size: int = 0
    """Taps of DFlash2's convolutions in every layer; 0: none."""
    conv_group_size: int = 0
    """Channels sharing one dynamic kernel delta (with conv_kernel_size); 0: none."""
    lilicorr_objective: str = "base"
    """ModelOpt's composition of the lattice terms (OBJECTIVES); training only, not exported."""

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.lilicorr_candidate_topk
        if not 1 <= k <= 16 or k & (k - 1):
            raise ValueError(f"LiLiCorrConfig.lilicorr_candidate_topk must be a power of two <= 16 (vLLM's walk), "
                             f"got {k}")
        if k > self.vocab_size:
            raise ValueError(f"LiLiCorrConfig.lilicorr_candidate_topk {k} exceeds vocab_size {self.vocab_size}")
        for name in ("lilicorr_num_layers", "lilicorr_num_heads", "lilicorr_factor_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"LiLiCorrConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.lilicorr_hidden_size < 0 or self.head_width % self.lilicorr_num_heads:
            raise ValueError(f"LiLiCorrConfig.lilicorr_num_heads {self.lilicorr_num_heads} must divide the head's "
                             f"width {self.head_width} (lilicorr_hidden_size, 0: hidden_size)")
        if not self.lilicorr_mlp_ratio > 0 or not self.lilicorr_logit_scale > 0 or \
                not 0 < self.lilicorr_vector_eps < 0.5:
            raise ValueError("LiLiCorrConfig: lilicorr_mlp_ratio and lilicorr_logit_scale must be > 0 and "
                             f"lilicorr_vector_eps in (0, 0.5), got {self.lilicorr_mlp_ratio}, "
                             f"{self.lilicorr_logit_scale}, {self.lilicorr_vector_eps}")
        if self.conv_kernel_size < 0 or self.conv_group_size < 0 or \
                bool(self.conv_kernel_size) != bool(self.conv_group_size):
            raise ValueError(f"LiLiCorrConfig: conv_kernel_size ({self.conv_kernel_size}) and conv_group_size "
                             f"({self.conv_group_size}) are both > 0 (convolutions) or both 0 (none)")
        if self.conv_group_size and self.hidden_size % self.conv_group_size:
            raise ValueError(f"LiLiCorrConfig.conv_group_size {self.conv_group_size} must divide hidden_size "
                             f"{self.hidden_size}")
        if self.lilicorr_objective not in OBJECTIVES:
            raise ValueError(f"LiLiCorrConfig.lilicorr_objective {self.lilicorr_objective!r}: pick one of "
                             f"{', '.join(OBJECTIVES)}")
        if self.draft_vocab_size is not None:
            raise ValueError("a LiLiCorr drafter scores the whole vocabulary (its candidates are target ids): "
                             "drop --draft-vocab")

    @property
    def head_width(self) -> int:
        """The lattice head's width."""
        return self.lilicorr_hidden_size or self.hidden_size


@dataclass(kw_only=True)
class LiLiCorrOptions:
    """`dflash-train fit`'s options of `--drafter lilicorr`."""

    lilicorr_candidate_topk: int = 8
    """lilicorr: candidates per slot of the lattice (a power of two, at most 16)."""
    lilicorr_hidden_size: int = 0
    """lilicorr: width of the lattice head; 0: the drafter's (ModelOpt's Qwen3-8B recipe: 1024)."""
    lilicorr_num_layers: int = 2
    """lilicorr: attention layers over the lattice."""
    lilicorr_num_heads: int = 8
    """lilicorr: attention heads of the lattice layers (divides the head's width)."""
    lilicorr_mlp_ratio: float = 2.0
    """lilicorr: the lattice MLP's inner width over the head's width."""
    lilicorr_factor_dim: int = 128
    """lilicorr: width of the transition vectors (ModelOpt's Qwen3-8B recipe: 1024)."""
    lilicorr_vector_eps: float = 1e-4
    """lilicorr: norm floor of the transition vectors."""
    lilicorr_logit_scale: float = 8.0
    """lilicorr: scale of the cosine transition scores."""
    lilicorr_convolutions: bool = False
    """lilicorr: DFlash2's convolutions in every layer, of --conv-kernel-size taps and --conv-group-size."""
    lilicorr_objective: str = "base"
    """lilicorr: the lattice terms' weights (CE / hinge / penalty): base 0.25/0/0.25, margin 0.125/0.125/0.25."""


# -- the head ------------------------------------------------------------------------------


class LatticeMLP(nn.Module):
    """vLLM's NemotronHMLP with biases: down_proj(silu(up_proj(x)))."""

    def __init__(self, width: int, inner: int, out: int):
        super().__init__()
        self.up_proj = nn.Linear(width, inner)
        self.down_proj = nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """vLLM's LiLiCorrLatticeAttention: fused `in_proj_weight` [3h, h] and `in_proj_bias` [3h]
    (nn.MultiheadAttention's names), `out_proj`; a per-head additive bias, no mask."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [n, S, h], bias [heads, S, S] -> [n, S, h]."""
        n, S, h = x.shape
        q, k, v = (t.view(n, S, self.num_heads, -1).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(x.dtype)[None])  # [n, heads, S, hd]
        return self.out_proj(out.transpose(1, 2).reshape(n, S, h))


class LatticeLayer(nn.Module):
    """Pre-norm attention over the lattice, then the MLP (vLLM's LiLiCorrLayer)."""

    def __init__(self, width: int, num_heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(width, eps)
        self.attn = LatticeAttention(width, num_heads)
        self.mlp_norm = RMSNorm(width, eps)
        self.mlp = LatticeMLP(width, int(width * mlp_ratio), width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LatticeHead(nn.Module):
    """vLLM's LiLiCorrHead (the drafter's `lilicorr`): scores the transitions of a block's
    candidate lattice (module docstring)."""

    initialises_itself = True  # drawn after the backbone (LiLiCorrDrafter.reset_heads)

    def __init__(self, config: LiLiCorrConfig):
        super().__init__()
        H, h, heads = config.hidden_size, config.head_width, config.lilicorr_num_heads
        D, K, f = config.num_drafts, config.lilicorr_candidate_topk, config.lilicorr_factor_dim
        self.num_heads, self.num_slots, self.top_k = heads, D, K
        self.vector_eps, self.logit_scale = config.lilicorr_vector_eps, config.lilicorr_logit_scale
        self.token_proj = nn.Identity() if h == H else nn.Linear(H, h)
        self.pass_hidden_proj = nn.Linear(H, h)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = LatticeMLP(NUM_FEATURES, h, h)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, D, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, K, h))
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * (D + 1) - 1))  # vLLM: 2 * block_size - 1
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.context_proj = nn.Linear(H, h)
        self.layers = nn.ModuleList([LatticeLayer(h, heads, config.lilicorr_mlp_ratio, config.rms_norm_eps)
                                     for _ in range(config.lilicorr_num_layers)])
        self.output_norm = RMSNorm(h, config.rms_norm_eps)
        self.anchor_norm = RMSNorm(h, config.rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head, self.in_head, self.anchor_out_head = (nn.Linear(h, f) for _ in range(3))

    def reset_parameters(self, std: float) -> None:
        """ModelOpt's initialisation: linear weights ~ N(0, std) and biases 0, the lattice
        attention's fused projection Xavier-uniform (nn.MultiheadAttention's), embeddings and
        biases by slot 0, norms 1, the factor heads ~ N(0, 0.02)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, LatticeAttention):
                nn.init.xavier_uniform_(module.in_proj_weight)
                nn.init.zeros_(module.in_proj_bias)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.reset_parameters() if isinstance(module, nn.LayerNorm) else nn.init.ones_(module.weight)
        for tensor in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias):
            nn.init.zeros_(tensor)
        for head in (self.out_head, self.in_head, self.anchor_out_head):
            nn.init.normal_(head.weight, std=FACTOR_INIT_STD)

    def attention_bias(self, num_slots: int) -> torch.Tensor:
        """[heads, S, S] (S = num_slots * K): the bias by slot distance plus the same-slot bias."""
        slot = torch.arange(num_slots, device=self.same_slot_bias.device).repeat_interleave(self.top_k)  # [S]
        distance = slot[:, None] - slot[None, :]
        bias = self.relative_slot_bias[:, distance + self.num_slots]  # column block_size - 1 is distance 0
        return bias + (distance == 0).to(bias.dtype) * self.same_slot_bias[:, None, None]

    def factors(self, embeddings: torch.Tensor, log_probs: torch.Tensor, rows: torch.Tensor,
                anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain's log-potentials (float32): start [n, K] and pairs [n, d-1, K, K].

        embeddings [n, d, K, H] the candidates' target embeddings, log_probs [n, d, K] their
        log-probs under the drafter (descending), rows [n, d, H] the slots' rows, anchor [n, H]
        the fused context row before the anchor; d <= num_drafts slots."""
        n, d, K = log_probs.shape
        dtype = self.slot_embedding.dtype
        lp = log_probs.float()
        rank = torch.arange(K, device=lp.device, dtype=torch.float32) / max(K - 1, 1)
        features = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values, rank.expand_as(lp),
                                (rank == 0).float().expand_as(lp)], dim=-1)  # [n, d, K, 5]
        x = self.token_proj(embeddings.to(dtype)) + self.pass_hidden_proj(rows.to(dtype))[:, :, None]
        x = x + self.feature_mlp(self.feature_norm(features.to(dtype)))
        x = (x + self.slot_embedding[0, :, :d] + self.rank_embedding[0]).reshape(n, d * K, -1)  # [n, S, h]
        bias = self.attention_bias(d)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(n, d, K, -1)
        a = self.anchor_norm(self.context_proj(anchor.to(dtype)))[:, None, None]  # [n, 1, 1, h]
        factor = F.silu(self.factor_input_proj(torch.cat([x, a.expand_as(x), x * a], dim=-1)))
        out_vec = F.normalize(self.out_head(factor), dim=-1, eps=self.vector_eps)  # [n, d, K, f]
        in_vec = F.normalize(self.in_head(factor), dim=-1, eps=self.vector_eps)
        anchor_out = F.normalize(self.anchor_out_head(a[:, 0, 0]), dim=-1, eps=self.vector_eps)  # [n, f]
        start = torch.einsum("nf,nkf->nk", anchor_out, in_vec[:, 0])
        pairs = out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)  # [n, d-1, K, K]
        return self.logit_scale * start.float(), self.logit_scale * pairs.float()


class LiLiCorrDrafter(DFlashDrafter):
    """DFlashDrafter (DFlash2's layers when the config has convolutions) plus `lilicorr`."""

    def __init__(self, config: LiLiCorrConfig, **kwargs):
        super().__init__(config, **kwargs)
        self.lilicorr = LatticeHead(config)
        self.reset_heads()

    @property
    def layer_class(self) -> type[DrafterLayer]:
        return DFlash2Layer if self.config.conv_kernel_size else DrafterLayer

    def reset_heads(self) -> None:
        """The convolutions the identity, then the head's draws, after the backbone's: a DFlash
        and a LiLiCorr drafter of one seed start from the same backbone."""
        if self.config.conv_kernel_size:
            for layer in self.layers:
                layer.attention_conv.reset_parameters()
                layer.mlp_conv.reset_parameters()
        self.lilicorr.reset_parameters(self.config.initializer_range)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "lilicorr"):  # (DFlashDrafter.__init__ calls this before the head exists)
            self.reset_heads()


# -- the lattice from rows -----------------------------------------------------------------


class _LogSumExp(torch.autograd.Function):
    """[N, H] rows, frozen head [V, H] -> [N] float32 logsumexp(rows @ head.T), `chunk` rows at
    a time, no [N, V] logits kept for the backward (recomputed there)."""

    @staticmethod
    def forward(ctx, rows, head, chunk):
        out = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        for s in range(0, rows.shape[0], chunk):
            out[s:s + chunk] = torch.logsumexp(rows[s:s + chunk].float() @ head.float().T, dim=-1)
        ctx.save_for_backward(rows, head, out)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, head, lse = ctx.saved_tensors
        grad_rows = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
        for s in range(0, rows.shape[0], ctx.chunk):
            p = torch.exp(rows[s:s + ctx.chunk].float() @ head.float().T - lse[s:s + ctx.chunk, None])  # [n, V]
            grad_rows[s:s + ctx.chunk] = (grad[s:s + ctx.chunk, None].float() * p) @ head.float()
        return grad_rows.to(rows.dtype), None, None


def lattice(drafter: LiLiCorrDrafter, rows: torch.Tensor, anchor: torch.Tensor, head: TargetHead, *,
            linear: Any = None, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(candidates [n, d, K] target ids, start [n, K], pairs [n, d-1, K, K]) of n blocks.

    rows [n, d, H] the slots' rows, anchor [n, H] the fused context rows before the anchors.
    Under autograd the candidates' log-probs carry the gradient to the rows (ModelOpt's soft
    channel); `linear` (x [m, H], w [V, H]) -> [m, V], when given, computes the logits
    (inference: the decoding loop's product), else float32 matmuls."""
    n, d, H = rows.shape
    K = drafter.config.lilicorr_candidate_topk
    flat = rows.reshape(n * d, H)
    weight = head.lm_head
    if linear is None:
        candidates = unary_top_k(flat.detach(), weight, K, chunk)  # [n*d, K], descending
        log_probs = _CandidateLogits.apply(flat, weight, candidates, chunk) \
            - _LogSumExp.apply(flat, weight, chunk)[:, None]  # [n*d, K]
    else:
        logits = linear(flat, weight.to(flat.dtype)).float()  # [n*d, V]
        top = logits.topk(K, dim=-1)
        candidates, log_probs = top.indices, top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
    embeddings = head.embed_tokens[candidates].view(n, d, K, -1)
    start, pairs = drafter.lilicorr.factors(embeddings, log_probs.view(n, d, K), rows, anchor)
    return candidates.view(n, d, K), start, pairs


@torch.no_grad()
def lattice_drafts(drafter: LiLiCorrDrafter, rows: torch.Tensor, anchor: torch.Tensor, head: TargetHead, *,
                   linear: Any = None, margins: bool = False, chunk: int = 1024) -> Drafts:
    """Greedy drafts, vLLM's walk at temperature 0: slot 0 the best start, each next slot the
    best transition from the candidate taken before. rows [n, d, H], anchor [n, H].
    Drafts.margins: the best minus the second-best score of each step."""
    candidates, start, pairs = lattice(drafter, rows, anchor, head, linear=linear, chunk=chunk)
    n, d, K = candidates.shape
    scores, drafts, gaps = start, [], []  # scores [n, K]: the step's, from the candidate taken before
    for step in range(d):
        best = scores.topk(min(2, K), dim=-1)
        index = best.indices[:, 0]
        if step + 1 < d:
            scores = pairs[torch.arange(n), step, index]
        drafts.append(candidates[torch.arange(n), step, index])
        gaps.append(best.values[:, 0] - best.values[:, -1] if K > 1 else torch.full_like(best.values[:, 0], math.inf))
    return Drafts(tokens=torch.stack(drafts, 1), margins=torch.stack(gaps, 1) if margins else None)


# -- training ------------------------------------------------------------------------------


@dataclass
class LatticeRows:
    """The blocks a batch's lattice trains on (every slot labelled): `slots` [n, D] indices into
    the labelled rows, `context` [n, L*H] the target features before each block's anchor."""

    slots: torch.Tensor
    context: torch.Tensor


def lattice_rows(batch: Any, num_drafts: int) -> LatticeRows:
    """The batch's complete blocks (train/data.py's Batch: label row b*B+k is block b's slot k)."""
    B = num_drafts + 1
    device = batch.label_rows.device
    num_blocks = int(batch.anchors.shape[0])
    slots = torch.full((num_blocks, num_drafts), -1, dtype=torch.long, device=device)
    slots[batch.label_rows // B, batch.label_positions - 1] = torch.arange(batch.label_rows.shape[0], device=device)
    complete = (slots >= 0).all(1)
    # context row of block b: its segment's first context row + a - 1 (contexts are positions 0..)
    offsets = np.concatenate([[0], np.cumsum([length for length, _ in batch.segments])[:-1]]).astype(np.int64)
    first_row = np.repeat(offsets, [len(anchors) for _, anchors in batch.segments])  # [num_blocks]
    context_rows = torch.as_tensor(first_row, device=device) + batch.anchors - 1
    return LatticeRows(slots=slots[complete], context=batch.context_features[context_rows[complete]])


def cached_log_probs(candidates: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """[..., K] the target's log-probs of the candidates from its cached top-k (ids, logprobs
    [..., k]): exact inside the top-k, the bound b = min(l_k, log tail) outside it (module
    docstring; l_k alone where the tail rounds to 0)."""
    match = candidates[..., :, None] == ids[..., None, :]  # [..., K, k]
    tail = teacher_tail(logprobs.reshape(-1, logprobs.shape[-1]), None).view(logprobs.shape[:-1])
    last = logprobs.min(-1).values
    # a tail under TAIL_EPS is the rounding of 1 - sum exp(l_i) (the loss kernel's floor): unknown, not small
    bound = torch.where(tail > TAIL_EPS, torch.minimum(last, tail.clamp_min(TAIL_EPS).log()), last)  # [...]
    exact = (match * logprobs[..., None, :].float()).sum(-1)
    return torch.where(match.any(-1), exact, bound[..., None].float())


def lattice_terms(start: torch.Tensor, pairs: torch.Tensor, truth: torch.Tensor, target_log_probs: torch.Tensor,
                  margin: float) -> dict[str, torch.Tensor]:
    """ModelOpt's per-slot terms on the teacher-forced chain (module docstring).

    start [n, K], pairs [n, D-1, K, K], truth [n, D] the ground truth's candidate index (-1:
    not a candidate), target_log_probs [n, D, K] the target's log-probs of the candidates.
    Returns [n, D] "ce", "hinge", "penalty" and "supervised" (float 0/1)."""
    n, D, K = target_log_probs.shape
    hit = truth >= 0
    index = truth.clamp_min(0)
    supervised = hit.long().cumprod(-1).float()  # the ground truth in every slot so far
    forced = pairs.gather(2, index[:, :-1, None, None].expand(-1, -1, 1, K))[:, :, 0]  # [n, D-1, K]
    z = torch.cat([start[:, None], forced], dim=1)  # [n, D, K]
    log_p = z.log_softmax(-1)
    z_truth = z.gather(2, index[..., None])[..., 0]
    # K = 1: no competing candidate, no hinge (ModelOpt's rule)
    hinge = F.relu(margin - (z_truth - z.scatter(2, index[..., None], -math.inf).max(-1).values)) if K > 1 \
        else torch.zeros_like(z_truth)
    truth_lp = target_log_probs.gather(2, index[..., None])  # [n, D, 1]
    weight = (truth_lp - target_log_probs).clamp_min(0.0)  # [n, D, K], 0 at the ground truth
    return {"ce": -log_p.gather(2, index[..., None])[..., 0], "hinge": hinge,
            "penalty": (log_p.exp() * weight).sum(-1), "supervised": supervised}


def lattice_loss(drafter: LiLiCorrDrafter, rows: torch.Tensor, head: TargetHead, blocks: LatticeRows,
                 ids: torch.Tensor, logprobs: torch.Tensor, top1: torch.Tensor, weights: torch.Tensor,
                 chunk: int = 1024) -> torch.Tensor:
    """w_ce CE + w_margin hinge + w_pen penalty, each the mean over the supervised slots,
    times the rows' summed weight (fit divides the summed loss by it). rows [N, H] the
    labelled rows, ids, logprobs [N, k] the teacher, top1 [N], weights [N]."""
    w_ce, w_margin, w_pen, margin = OBJECTIVES[drafter.config.lilicorr_objective]
    if blocks.slots.shape[0] == 0:  # a zero that reaches every head tensor (DDP reduces each one every step)
        return sum(p.sum() for p in drafter.lilicorr.parameters()) * 0.0 + rows.sum() * 0.0
    anchor = drafter.fuse_context(blocks.context.to(drafter.fc.weight.dtype))  # [n, H]
    candidates, start, pairs = lattice(drafter, rows[blocks.slots], anchor, head, chunk=chunk)
    truth = top1[blocks.slots]  # [n, D]
    hits = candidates == truth[..., None]
    index = torch.where(hits.any(-1), hits.long().argmax(-1), -1)
    terms = lattice_terms(start, pairs, index, cached_log_probs(candidates, ids[blocks.slots],
                                                                logprobs[blocks.slots]), margin)
    mask = terms["supervised"]
    total = sum(w * (terms[name] * mask).sum() for name, w in (("ce", w_ce), ("hinge", w_margin),
                                                              ("penalty", w_pen)) if w)
    return total / mask.sum().clamp_min(1.0) * weights.sum()


# -- the kind ------------------------------------------------------------------------------


class LiLiCorrKind(DrafterKind):
    """LiLiCorr: DFlash's block and backbone (with DFlash2's convolutions when configured),
    drafting through the lattice head's walk; vLLM's `dflash` method on its V2 runner."""

    name = "lilicorr"
    title = "LiLiCorr"
    architecture = "LiLiCorrDraftModel"  # vLLM's lilicorr.py loader
    vllm_method = "dflash"
    vllm_runner = "V2"
    config_class = LiLiCorrConfig
    options = LiLiCorrOptions
    head_prefixes = ("lilicorr.",)
    dflash_config_keys = ("lilicorr_enabled", *HEAD_FIELDS, *CONV_FIELDS)
    fsdp = False  # its head acts in the loss, outside FSDP2's forward

    def option_names(self) -> frozenset[str]:
        """Its own options and DFlash2's convolution flags, which `--lilicorr-convolutions` reads."""
        return super().option_names() | frozenset(CONV_FIELDS)

    def check_options(self, options: Any, selected: bool) -> None:
        if options.lilicorr_objective not in OBJECTIVES:
            raise ValueError(f"fit config: lilicorr_objective {options.lilicorr_objective!r}: pick one of "
                             f"{', '.join(OBJECTIVES)}")
        k = options.lilicorr_candidate_topk
        if not 1 <= k <= 16 or k & (k - 1):
            raise ValueError(f"fit config: lilicorr_candidate_topk must be a power of two <= 16, got {k}")

    def check_fit(self, config: Any) -> None:
        if config.model.draft_vocab is not None:
            raise ValueError("fit config: --drafter lilicorr scores the whole vocabulary (its candidates are target "
                             "ids): drop --draft-vocab")
        options, rows = config.drafter_options, config.block_rows
        if options.lilicorr_convolutions and options.conv_kernel_size > rows:
            raise ValueError(f"fit config: conv_kernel_size {options.conv_kernel_size} exceeds the block's {rows} "
                             f"rows: pass --conv-kernel-size {rows} or less, or more --num-drafts")

    def config_fields(self, options: Any) -> dict[str, Any]:
        convs = options.lilicorr_convolutions
        return {**{name: getattr(options, name) for name in HEAD_FIELDS},
                **{name: getattr(options, name) if convs else 0 for name in CONV_FIELDS},
                "lilicorr_objective": options.lilicorr_objective}

    def check_init(self, source: DrafterConfig, config: DrafterConfig, where: str) -> None:
        """Convolutions in both the source and the run must have one shape (a source without
        them starts the run's as the identity)."""
        if not getattr(source, "conv_kernel_size", 0) or not config.conv_kernel_size:
            return
        for name in CONV_FIELDS:
            theirs, ours = getattr(source, name), getattr(config, name)
            if theirs != ours:
                raise ValueError(f"{where}: {name} is {theirs} in the source, {ours} for this run: pass "
                                 f"--{name.replace('_', '-')} {theirs}")

    def owns(self, name: str) -> bool:
        return name.startswith(self.head_prefixes) or ".attention_conv." in name or ".mlp_conv." in name

    def make(self, config: DrafterConfig, **kwargs: Any) -> DFlashDrafter:
        return LiLiCorrDrafter(config, **kwargs)

    def loss_operands(self, model: DFlashDrafter, rows: torch.Tensor, head: TargetHead, batch: Any) -> LossOperands:
        """DFlash's operands; the batch's complete blocks and their anchors' context kept for the lattice."""
        return LossOperands(rows=rows, head=head, extra=lattice_rows(batch, model.config.num_drafts))

    def extra_loss(self, model: DFlashDrafter, operands: LossOperands, backbone_rows: torch.Tensor,
                   ids: torch.Tensor, logprobs: torch.Tensor, top1: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor | None:
        return lattice_loss(model, backbone_rows, operands.head, operands.extra, ids, logprobs, top1.long(), weights)

    def draft(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, head: TargetHead, *,
              linear: Any = None, margins: bool = False, rows_per_chunk: int = 1024,
              context: torch.Tensor | None = None) -> Drafts:
        """The walk over the masks' rows (the anchor's row predicts nothing); `context` [n, L*H]:
        the target features before each anchor, which the head's anchor state reads."""
        if context is None:
            raise ValueError("a LiLiCorr drafter drafts from the target features before the anchor: pass context")
        anchor = drafter.fuse_context(context.to(drafter.fc.weight.dtype))
        return lattice_drafts(drafter, hidden[:, 1:], anchor, head, linear=linear, margins=margins,
                              chunk=rows_per_chunk)

    def dflash_config_fields(self, config: DrafterConfig) -> dict[str, Any]:
        fields = {"lilicorr_enabled": True, **{name: getattr(config, name) for name in HEAD_FIELDS}}
        if config.conv_kernel_size:
            fields.update({name: getattr(config, name) for name in CONV_FIELDS})
        return fields

    def head_tensors(self, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        fields = config["dflash_config"]
        H, D = config["hidden_size"], config["block_size"] - 1
        h = fields["lilicorr_hidden_size"] or H
        K, f, heads = fields["lilicorr_candidate_topk"], fields["lilicorr_factor_dim"], fields["lilicorr_num_heads"]
        inner = int(h * fields["lilicorr_mlp_ratio"])
        p = "lilicorr."
        shapes: dict[str, tuple[int, ...]] = {}

        def linear(name: str, out: int, width: int) -> None:
            shapes.update({f"{p}{name}.weight": (out, width), f"{p}{name}.bias": (out,)})

        if h != H:
            linear("token_proj", h, H)
        for name, out, width in (("pass_hidden_proj", h, H), ("feature_mlp.up_proj", h, NUM_FEATURES),
                                 ("feature_mlp.down_proj", h, h), ("context_proj", h, H),
                                 ("factor_input_proj", h, 3 * h), ("out_head", f, h), ("in_head", f, h),
                                 ("anchor_out_head", f, h)):
            linear(name, out, width)
        shapes.update({p + "feature_norm.weight": (NUM_FEATURES,), p + "feature_norm.bias": (NUM_FEATURES,),
                       p + "slot_embedding": (1, 1, D, 1, h), p + "rank_embedding": (1, 1, 1, K, h),
                       p + "relative_slot_bias": (heads, 2 * D + 1), p + "same_slot_bias": (heads,),
                       p + "output_norm.weight": (h,), p + "anchor_norm.weight": (h,)})
        for i in range(fields["lilicorr_num_layers"]):
            q = f"layers.{i}."
            shapes.update({f"{p}{q}attn_norm.weight": (h,), f"{p}{q}mlp_norm.weight": (h,),
                           f"{p}{q}attn.in_proj_weight": (3 * h, h), f"{p}{q}attn.in_proj_bias": (3 * h,)})
            for name, out, width in (("attn.out_proj", h, h), ("mlp.up_proj", inner, h), ("mlp.down_proj", h, inner)):
                linear(q + name, out, width)
        taps = fields.get("conv_kernel_size") or 0
        for i in range(config["num_hidden_layers"] if taps else 0):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, H)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * (H // fields["conv_group_size"]), H)
        return shapes

    def check_hf(self, data: dict[str, Any], where: str) -> None:
        super().check_hf(data, where)
        fields = data.get("dflash_config") or {}
        missing = [f"dflash_config.{name}" for name in HEAD_FIELDS if fields.get(name) is None]
        if missing:
            raise ValueError(f"{where}: a LiLiCorr drafter's config needs {missing} (vLLM's loader reads them)")
        if not fields.get("lilicorr_enabled", True):
            raise ValueError(f"{where}: dflash_config.lilicorr_enabled is false; vLLM refuses it: set it true")
        if data.get("draft_vocab_size") not in (None, data.get("vocab_size")):
            raise ValueError(f"{where}: draft_vocab_size {data['draft_vocab_size']}: a LiLiCorr drafter scores the "
                             f"whole vocabulary ({data.get('vocab_size')})")

    def config_from_hf(self, fields: dict[str, Any], data: dict[str, Any]) -> DrafterConfig:
        dflash = data.get("dflash_config") or {}
        head = {name: type(getattr(LiLiCorrConfig, name))(dflash[name]) for name in HEAD_FIELDS}
        convs = {name: int(dflash.get(name) or 0) for name in CONV_FIELDS}
        return LiLiCorrConfig(**fields, **head, **convs)

    def card_lines(self, config: DrafterConfig) -> list[str]:
        c = config
        convs = (f" with DFlash2's grouped dynamic causal convolution of {c.conv_kernel_size} taps (groups of "
                 f"{c.conv_group_size} channels) around every layer's attention and MLP" if c.conv_kernel_size else "")
        return [f"LiLiCorr (architecture `LiLiCorrDraftModel`, vLLM method `dflash`): DFlash's block and backbone"
                f"{convs}, and a lattice reranker (`lilicorr`, {c.lilicorr_num_layers} layers of width "
                f"{c.head_width}) over each draft's top {c.lilicorr_candidate_topk} candidates that scores the "
                "transitions between adjacent drafts' candidates; drafting walks the best transition left to right."]

    def serving_lines(self, config: DrafterConfig, target: str | None) -> list[str]:
        """vLLM's `dflash` method, which serves the LiLiCorr architecture on its V2 model runner."""
        return v2_runner_serving(
            self, config, target, drafts_note=f" (vLLM takes 1 to {config.num_drafts})",
            closing="The lattice reads the target's embedding and LM head, so vLLM serves it with the whole "
                    "vocabulary.",
            block_meaning="the verify window, as trained: the drafts and the anchor")


__all__ = ["CONV_FIELDS", "HEAD_FIELDS", "LatticeHead", "LatticeRows", "LiLiCorrConfig", "LiLiCorrDrafter",
           "LiLiCorrKind", "LiLiCorrOptions", "OBJECTIVES", "cached_log_probs", "lattice", "lattice_drafts",
           "lattice_loss", "lattice_rows", "lattice_terms"]
