"""The DFlash2 drafter kind: DFlash's block with grouped dynamic causal convolutions around each
layer's attention and MLP, and a candidate selector that reranks each draft's top-k.

The semantics are vLLM 0.32's `qwen3_dflash2.py` and its DFlash2 speculator
(`vllm/v1/worker/gpu/spec_decode/dflash2/`), which speculators 0.9.0 (`models/dflash2/`)
trains and z-lab's reference (`dflash/model.py`, `DFlash2DraftModel`) decodes:

- The block is DFlash's (train/drafters/dflash.py): the anchor and num_drafts masks, the
  anchor's row predicting nothing.
- Grouped dynamic causal convolution (`GroupedCausalConv`, vLLM's `DFlashGroupedConv`):
  `kernel_projection` [2*T*G, H] maps each block row x_p to per-group kernel deltas d_p
  [2, T, G] (T taps, G = H / conv_group_size groups); `base_kernel` [2, T, H] is a static
  kernel per channel. Side s (0 before, 1 after the sublayer) computes
  `y_p = sum_{t < T, t <= i(p)} (base[s, t] + d_p[s, t, group]) * x_{p-t}`, i(p) the row's
  position inside its block: causal, and never across blocks. Each decoder layer wraps its
  attention (`attention_conv`: side 0 on the normed input, side 1 on o_proj's output with the
  input's deltas) and its MLP (`mlp_conv`) so. The context rows' keys and values do not pass
  through it (vLLM and speculators feed the fused target features straight to k/v_proj).
  Initialised as the identity (base[:, 0] = 1, the rest and the projection 0), as speculators
  does: a fresh DFlash2 drafter computes what its DFlash backbone computes, and `--init-from`
  a DFlash drafter starts from that drafter exactly.
- Candidate selector (`CandidateSelector`): `predecessor_codebook` [V, r], `successor_codebook`
  [V, r], `hidden_projection` [r, H]. Draft position s takes the top-k (`selector_top_k`)
  tokens c of its unary logits u = lm_head(h_s) and scores each
  `u_c + <predecessor[t_s] * hidden_projection(h_s), successor[c]>`, t_s the token before it
  (the anchor for the first draft, then the draft before); the draft is the best-scoring
  candidate, left to right (vLLM's selector walk at temperature 0, `selector_drafts`). The
  whole vocabulary: the codebooks are indexed by token id, and vLLM's selector reads the
  target's head, so a draft vocabulary is refused.

Training (train/fit.py through `DFlash2Kind`), speculators 0.9.0's objective
(`models/dflash2/core.py` and `metrics.py`): the unary logits get fit's distillation loss as
any DFlash drafter's, and the selector adds `selector_loss_alpha` (1.0) times a K-way
cross-entropy (`selector_loss`): the candidates are the unary top-K, with the target's top-1
put in the last slot when the top-K misses it; the label is the target's top-1 among them;
the predecessor is teacher-forced (the sequence's own token before the label, x[a+k-1]); each
row weighs what it weighs in the distillation loss (the block position's decay), and the sum
is normalised with it. Its gradient reaches the selector and, through the candidates' unary
logits and the projection, the backbone's rows; the head stays frozen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dflash.train.drafters.base import (
    DrafterKind,
    Drafts,
    LossOperands,
    v2_runner_serving,
)
from dflash.train.model import DFlashDrafter, DrafterConfig, DrafterLayer, TargetHead

# The config.json fields (under dflash_config) vLLM's loader, speculators and z-lab read.
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SELECTOR_LOSS_ALPHA = 1.0  # speculators' default weight of the selector's cross-entropy


@dataclass(kw_only=True)
class DFlash2Config(DrafterConfig):
    """A DFlash2 drafter's config: DFlash's, its convolutions' and its candidate selector's."""

    kind: ClassVar[str | None] = "dflash2"
    conv_kernel_size: int = 2
    """Taps T of each causal convolution (the row itself and T - 1 rows before it in the block)."""
    conv_group_size: int = 16
    """Channels sharing one dynamic kernel delta; divides hidden_size."""
    selector_rank: int = 256
    """Rank r of the candidate selector's codebooks ([vocab, r] each)."""
    selector_top_k: int = 16
    """Candidates K the selector reranks per draft position (the unary top-K)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"DFlash2Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"DFlash2Config.conv_group_size {self.conv_group_size} must divide hidden_size "
                             f"{self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"DFlash2Config.selector_top_k {self.selector_top_k} exceeds vocab_size {self.vocab_size}")
        if self.draft_vocab_size is not None:
            raise ValueError("a DFlash2 drafter scores the whole vocabulary (its selector's codebooks are indexed "
                             "by token id): drop --draft-vocab")


@dataclass(kw_only=True)
class DFlash2Options:
    """`dflash-train fit`'s options of `--drafter dflash2`."""

    conv_kernel_size: int = 2
    """dflash2: taps of each causal convolution inside the block (z-lab's release: 2)."""
    conv_group_size: int = 16
    """dflash2: hidden channels sharing one dynamic kernel; divides the target's hidden size."""
    selector_rank: int = 256
    """dflash2: rank of the candidate selector's codebooks ([vocab, rank] each)."""
    selector_top_k: int = 16
    """dflash2: candidates the selector reranks per draft (the unary top-k)."""


# -- the modules ---------------------------------------------------------------------------


def grouped_causal_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """x [n, B, H] (n blocks of B rows), delta [n, B, T, G] per-row kernel deltas of G channel
    groups, base [T, H] -> [n, B, H]: y_p = sum_{t <= i(p)} (base[t] + delta_p[t, group]) x_{p-t}."""
    n, B, H = x.shape
    T, G = base.shape[0], delta.shape[-1]
    blocks = x.unflatten(-1, (G, H // G))  # [n, B, G, g]
    base = base.to(x.dtype).view(T, G, H // G)
    out = (base[0] + delta[:, :, 0, :, None]) * blocks
    for tap in range(1, min(T, B)):
        coefficient = base[tap] + delta[:, tap:, tap, :, None]  # [n, B - tap, G, g]
        shifted = coefficient * blocks[:, :-tap]  # row p takes row p - tap
        out = out + F.pad(shifted, (0, 0, 0, 0, tap, 0))  # rows before `tap` have no such row
    return out.flatten(-2)


class GroupedCausalConv(nn.Module):
    """vLLM's DFlashGroupedConv: `base_kernel` [2, T, H] and `kernel_projection` [2*T*G, H];
    `prepare` convolves a sublayer's input (side 0) and returns the output side's deltas,
    `finish` convolves its output with them (side 1)."""

    initialises_itself = True  # the identity, after the backbone's draws (DFlash2Drafter.reset_heads)

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        # skip_init: built inside the backbone's layers, it must not draw from the generator
        self.kernel_projection = torch.nn.utils.skip_init(nn.Linear, hidden_size, 2 * taps * self.groups, bias=False)

    def reset_parameters(self) -> None:
        """The identity: base[:, 0] = 1, the other taps and the projection 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., rows, H] (blocks of `block_rows`) -> (side 0's output, side 1's deltas)."""
        blocks = x.reshape(-1, block_rows, x.shape[-1])  # [n, B, H]
        delta = self.kernel_projection(blocks).unflatten(-1, (2, self.taps, self.groups))  # [n, B, 2, T, G]
        return grouped_causal_conv(blocks, delta[:, :, 0], self.base_kernel[0]).view_as(x), delta[:, :, 1]

    def finish(self, x: torch.Tensor, delta: torch.Tensor, block_rows: int) -> torch.Tensor:
        blocks = x.reshape(-1, block_rows, x.shape[-1])
        return grouped_causal_conv(blocks, delta, self.base_kernel[1]).view_as(x)


class DFlash2Layer(DrafterLayer):
    """A decoder layer with `attention_conv` and `mlp_conv` around its sublayers."""

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        args = (config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.attention_conv = GroupedCausalConv(*args)
        self.mlp_conv = GroupedCausalConv(*args)

    def attention_input(self, hidden: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, object]:
        return self.attention_conv.prepare(self.input_layernorm(hidden), block_rows)

    def attention_output(self, out: torch.Tensor, state: object, block_rows: int) -> torch.Tensor:
        return self.attention_conv.finish(out, state, block_rows)

    def feed_forward(self, hidden: torch.Tensor, block_rows: int) -> torch.Tensor:
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(hidden), block_rows)
        return self.mlp_conv.finish(self.mlp(x), delta, block_rows)


class CandidateSelector(nn.Module):
    """vLLM's CandidateSelector: `predecessor_codebook`, `successor_codebook` [V, r] and
    `hidden_projection` [r, H]."""

    initialises_itself = True  # drawn after the backbone (DFlash2Drafter.reset_heads)

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def context(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """[..., H] rows and [...] previous token ids -> [..., r]: predecessor[t] * projection(h)."""
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        return self.predecessor_codebook[previous].to(projected.dtype) * projected

    def transitions(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[N, H], [N], candidates [N, K] -> [N, K] float32 pairwise scores."""
        context = self.context(hidden, previous).float()  # [N, r]
        return torch.einsum("nr,nkr->nk", context, self.successor_codebook[candidates].float())


class DFlash2Drafter(DFlashDrafter):
    """DFlashDrafter whose layers carry the convolutions, plus `candidate_selector`."""

    layer_class = DFlash2Layer

    def __init__(self, config: DFlash2Config, **kwargs):
        super().__init__(config, **kwargs)
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, config.selector_rank)
        self.reset_heads()

    def reset_heads(self) -> None:
        """Convolutions the identity; the selector's codebooks and projection ~ N(0,
        initializer_range) (speculators' init), drawn after the backbone's weights, so a DFlash
        and a DFlash2 drafter of one seed start from the same backbone."""
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        std = self.config.initializer_range
        selector = self.candidate_selector
        for weight in (selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight):
            nn.init.normal_(weight, std=std)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "candidate_selector"):  # (DFlashDrafter.__init__ calls this before the selector exists)
            self.reset_heads()


# -- training ------------------------------------------------------------------------------


class _CandidateLogits(torch.autograd.Function):
    """[N, H] rows, frozen head [V, H], candidates [N, K] -> [N, K] float32 logits rows @ head[c].T,
    `chunk` rows at a time, saving no [N, K, H] gather for the backward."""

    @staticmethod
    def forward(ctx, rows, head, candidates, chunk):
        out = torch.empty(candidates.shape, dtype=torch.float32, device=rows.device)
        for s in range(0, rows.shape[0], chunk):
            picked = head[candidates[s:s + chunk]].float()  # [n, K, H]
            out[s:s + chunk] = torch.einsum("nh,nkh->nk", rows[s:s + chunk].float(), picked)
        ctx.save_for_backward(head, candidates)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        head, candidates = ctx.saved_tensors
        grad_rows = torch.empty(candidates.shape[0], head.shape[1], dtype=torch.float32, device=grad.device)
        for s in range(0, grad.shape[0], ctx.chunk):
            grad_rows[s:s + ctx.chunk] = torch.einsum("nk,nkh->nh", grad[s:s + ctx.chunk].float(),
                                                      head[candidates[s:s + ctx.chunk]].float())
        return grad_rows, None, None, None


def unary_top_k(rows: torch.Tensor, head: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """[N, k] ids of the k largest logits rows @ head.T, `chunk` rows at a time (no gradient)."""
    out = torch.empty(rows.shape[0], k, dtype=torch.long, device=rows.device)
    with torch.no_grad():
        for s in range(0, rows.shape[0], chunk):
            out[s:s + chunk] = (rows[s:s + chunk].to(head.dtype) @ head.T).topk(k, dim=-1).indices
    return out


def selector_candidates(top: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unary top-K [N, K] and the target's top-1 [N] -> (candidates [N, K], the target's slot
    [N]): the top-K, its last slot replaced by the target where the top-K misses it
    (speculators' `selector_training_candidates`)."""
    hit = top == target[:, None]  # [N, K]
    found = hit.any(1)
    candidates = top.clone()
    candidates[:, -1] = torch.where(found, top[:, -1], target)
    slot = torch.where(found, hit.long().argmax(1), top.shape[1] - 1)
    return candidates, slot


def selector_loss(drafter: DFlash2Drafter, rows: torch.Tensor, head: torch.Tensor, previous: torch.Tensor,
                  target: torch.Tensor, weights: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Summed weighted K-way cross-entropy of the selector's scores (unary + transition) over
    the candidates towards the target's top-1 (module docstring). rows [N, H] the backbone's
    labelled rows, head [V, H] the frozen target head, previous [N] teacher-forced predecessor
    ids, target [N] the target's top-1 ids, weights [N]."""
    candidates, slot = selector_candidates(
        unary_top_k(rows.detach(), head, drafter.config.selector_top_k, chunk), target)
    scores = _CandidateLogits.apply(rows, head, candidates, chunk) \
        + drafter.candidate_selector.transitions(rows, previous, candidates)  # [N, K]
    return (F.cross_entropy(scores, slot, reduction="none") * weights).sum()


# -- inference -----------------------------------------------------------------------------


@torch.no_grad()
def selector_drafts(drafter: DFlash2Drafter, hidden: torch.Tensor, anchors: torch.Tensor, head: TargetHead,
                    linear: Any = None, margins: bool = False, rows_per_chunk: int = 1024) -> Drafts:
    """Greedy DFlash2 drafts, vLLM's selector walk at temperature 0: each draft position's
    unary top-K, scored with the transition from the token before it (the anchor, then the
    draft before), the best taken, left to right.

    hidden [n, D, H] the drafting rows, anchors [n] target ids, head the target's; `linear`
    (x [m, H], w [V, H]) -> [m, V] computes the unary logits (default: float32 matmuls).
    Drafts.margins: the best minus the second-best score.
    """
    n, D, H = hidden.shape
    K = drafter.config.selector_top_k
    rows = hidden.reshape(n * D, H)
    weight = head.lm_head
    values, candidates = [], []
    for s in range(0, n * D, rows_per_chunk):
        part = rows[s:s + rows_per_chunk]
        logits = part.float() @ weight.float().T if linear is None else linear(part, weight.to(part.dtype)).float()
        top = logits.topk(K, dim=-1)
        values.append(top.values)
        candidates.append(top.indices)
    unary = torch.cat(values).view(n, D, K)
    candidates = torch.cat(candidates).view(n, D, K)
    context_rows = hidden.to(drafter.candidate_selector.hidden_projection.weight.dtype)
    previous = anchors.long()
    drafts, gaps = [], []
    for step in range(D):
        scores = unary[:, step] + drafter.candidate_selector.transitions(context_rows[:, step], previous,
                                                                          candidates[:, step])  # [n, K]
        best = scores.topk(min(2, K), dim=-1)
        previous = candidates[:, step].gather(1, best.indices[:, :1])[:, 0]
        drafts.append(previous)
        if margins:
            gaps.append(best.values[:, 0] - best.values[:, -1] if K > 1 else torch.full_like(best.values[:, 0],
                                                                                             float("inf")))
    return Drafts(tokens=torch.stack(drafts, dim=1), margins=torch.stack(gaps, dim=1) if margins else None)


# -- the kind ------------------------------------------------------------------------------


class DFlash2Kind(DrafterKind):
    """DFlash2: DFlash's block and backbone with convolutions in every layer, drafting through
    the candidate selector; vLLM's `dflash` method, which serves it on its V2 runner."""

    name = "dflash2"
    title = "DFlash2"
    architecture = "DFlash2DraftModel"  # vLLM's qwen3_dflash2 loader, z-lab's DFlash2DraftModel
    vllm_method = "dflash"
    vllm_runner = "V2"
    config_class = DFlash2Config
    options = DFlash2Options
    head_prefixes = ("candidate_selector.",)
    dflash_config_keys = FIELDS
    fsdp = False  # its selector acts in the loss, outside FSDP2's forward

    def check_options(self, options: Any, selected: bool) -> None:
        for name in FIELDS:
            if getattr(options, name) < 1:
                raise ValueError(f"fit config: {name} must be >= 1, got {getattr(options, name)}")

    def check_fit(self, config: Any) -> None:
        if config.model.draft_vocab is not None:
            raise ValueError("fit config: --drafter dflash2 scores the whole vocabulary (vLLM's candidate selector "
                             "indexes its codebooks by token id): drop --draft-vocab")
        taps, rows = config.drafter_options.conv_kernel_size, config.block_rows
        if taps > rows:
            raise ValueError(f"fit config: conv_kernel_size {taps} exceeds the block's {rows} rows: pass "
                             f"--conv-kernel-size {rows} or less, or more --num-drafts")

    def config_fields(self, options: Any) -> dict[str, Any]:
        return {name: getattr(options, name) for name in FIELDS}

    def check_init(self, source: DrafterConfig, config: DrafterConfig, where: str) -> None:
        """A DFlash2 source's convolution and codebook shapes must be the run's (a DFlash
        source has none: the run's start as the identity and fresh)."""
        if not isinstance(source, DFlash2Config):
            return
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank"):
            theirs, ours = getattr(source, name), getattr(config, name)
            if theirs != ours:
                raise ValueError(f"{where}: {name} is {theirs} in the source, {ours} for this run: pass "
                                 f"--{name.replace('_', '-')} {theirs}")

    def owns(self, name: str) -> bool:
        return name.startswith(self.head_prefixes) or ".attention_conv." in name or ".mlp_conv." in name

    def make(self, config: DrafterConfig, **kwargs: Any) -> DFlashDrafter:
        return DFlash2Drafter(config, **kwargs)

    def loss_operands(self, model: DFlashDrafter, rows: torch.Tensor, head: TargetHead, batch: Any) -> LossOperands:
        """DFlash's operands; the predecessor of each labelled row (x[a+k-1]) kept for the selector."""
        return LossOperands(rows=rows, head=head, extra=batch.label_tokens)

    def extra_loss(self, model: DFlashDrafter, operands: LossOperands, backbone_rows: torch.Tensor,
                   ids: torch.Tensor, logprobs: torch.Tensor, top1: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor | None:
        return SELECTOR_LOSS_ALPHA * selector_loss(model, backbone_rows, operands.head.lm_head, operands.extra,
                                                   top1.long(), weights)

    def draft(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, head: TargetHead, *,
              linear: Any = None, margins: bool = False, rows_per_chunk: int = 1024,
              context: torch.Tensor | None = None) -> Drafts:
        """The selector walk over the masks' rows (the anchor's row predicts nothing)."""
        return selector_drafts(drafter, hidden[:, 1:], anchors, head, linear, margins, rows_per_chunk)

    def dflash_config_fields(self, config: DrafterConfig) -> dict[str, Any]:
        return {name: getattr(config, name) for name in FIELDS}

    def head_tensors(self, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        fields = config["dflash_config"]
        h, vocab, r = config["hidden_size"], config["vocab_size"], fields["selector_rank"]
        convs = (2 * fields["conv_kernel_size"] * (h // fields["conv_group_size"]), h)
        shapes = {"candidate_selector.predecessor_codebook": (vocab, r),
                  "candidate_selector.successor_codebook": (vocab, r),
                  "candidate_selector.hidden_projection.weight": (r, h)}
        for i in range(config["num_hidden_layers"]):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, fields["conv_kernel_size"], h)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = convs
        return shapes

    def check_hf(self, data: dict[str, Any], where: str) -> None:
        super().check_hf(data, where)
        fields = data.get("dflash_config") or {}
        missing = [f"dflash_config.{name}" for name in FIELDS if fields.get(name, data.get(name)) is None]
        if missing:
            raise ValueError(f"{where}: a DFlash2 drafter's config needs {missing} (vLLM's loader reads them)")
        if data.get("draft_vocab_size") not in (None, data.get("vocab_size")):
            raise ValueError(f"{where}: draft_vocab_size {data['draft_vocab_size']}: a DFlash2 drafter scores the "
                             f"whole vocabulary ({data.get('vocab_size')})")

    def config_from_hf(self, fields: dict[str, Any], data: dict[str, Any]) -> DrafterConfig:
        dflash = data.get("dflash_config") or {}
        return DFlash2Config(**fields, **{name: int(dflash.get(name, data.get(name))) for name in FIELDS})

    def card_lines(self, config: DrafterConfig) -> list[str]:
        c = config
        return [f"DFlash2 (architecture `DFlash2DraftModel`, vLLM method `dflash`): DFlash's block and backbone "
                f"with a grouped dynamic causal convolution of {c.conv_kernel_size} taps (groups of "
                f"{c.conv_group_size} channels) around every layer's attention and MLP (`layers.N.attention_conv`, "
                f"`layers.N.mlp_conv`), and a candidate selector of rank {c.selector_rank} "
                f"(`candidate_selector`) that reranks each draft's top {c.selector_top_k} with the token before it, "
                "drafting left to right."]

    def serving_lines(self, config: DrafterConfig, target: str | None) -> list[str]:
        """vLLM's `dflash` method, which serves the DFlash2 architecture on its V2 model runner."""
        return v2_runner_serving(
            self, config, target,
            drafts_note=f", which also sets the convolutions' block of {config.num_drafts + 1} rows as trained",
            closing="Transformers: z-lab/dflash's `DFlash2DraftModel.from_pretrained(folder)` and its "
                    "`dflash_generate` loop.",
            block_meaning="the verify window and the convolutions' block, as trained: the drafts and the anchor")


__all__ = ["CandidateSelector", "DFlash2Config", "DFlash2Drafter", "DFlash2Kind", "DFlash2Layer", "DFlash2Options",
           "FIELDS", "GroupedCausalConv", "grouped_causal_conv", "selector_candidates", "selector_drafts",
           "selector_loss", "unary_top_k"]
