"""The DSpark drafter kind: the DFlash backbone, a low-rank Markov head and an optional confidence head.

DSpark (deepseek-ai/DeepSpec) keeps the DFlash drafter (train/model.py) and makes each draft
see the one before it. The semantics are vLLM's `qwen3_dspark.py` and its DSpark speculator
(`vllm/v1/worker/gpu/spec_decode/dspark/`), with `sample_from_anchor` true, vLLM's default:

- A block of size N is the anchor x[a] (the last committed token) and N - 1 mask tokens at
  positions a..a+N-1; block position i predicts the *next* token, x[a+i+1], so one block
  drafts N tokens (DFlash's block of N drafts N - 1: its anchor predicts nothing). The context
  is the target's features at positions < a, as in DFlash.
- Markov head: `markov_w1` [V, r] embeds a target token id, `markov_w2` [V_draft, r] maps
  the embedding to a bias on the draft logits. Position i's logits are
  `lm_head(h_i) + markov_w2 @ markov_w1[t_i]`, t_i the token at position a+i: the anchor for
  i = 0, then the token drafted at i - 1. Drafting is left to right (`sequential_drafts`):
  position i's argmax needs t_i, which is position i-1's argmax (mapped to its target id when
  drafting from a draft vocabulary).
- Confidence head (optional): `proj` maps [h_i; markov_w1[t_i]] to a logit of the
  probability that draft i is accepted (vLLM's `confidence_head_with_markov`); vLLM reads it
  for adaptive verification only, never for the drafts themselves.

Training (train/fit.py, through `DSparkKind`): the previous token is teacher-forced, t_i = x[a+i], the cached
sequence's own token, as speculators' DSpark trains it. The Markov bias then enters the same
fused sparse-KL loss as the backbone's logits, through concatenation:
`[h; e] @ [W_head; markov_w2]^T = h W_head^T + markov_w2 e` with e = markov_w1[t] ([N, r]),
so the loss kernel sees hidden [N, H + r] and a head [V_draft, H + r] whose last r columns
need a gradient: `sparse_kl_loss(..., weight_grad_from=H)` forms dW for those columns only
(dz.T @ e, 2NrV flops, not 2N(H + r)V), and on CPU, where the demo's N x V_draft logits fit
one chunk, reads the forward's logits instead of recomputing them. The confidence head is
trained by binary cross-entropy towards the position's acceptance rate under rejection
sampling, sum_v min(p_v, q_v) = 1 - TV(p, q), as the paper and speculators do; from a cache
that holds only the target's top-k, the sum runs over the top-k ids (a lower bound, exact
when the target's tail mass is 0). It is detached: the confidence loss trains the
confidence head alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dflash.train.drafters.base import (
    DrafterKind,
    Drafts,
    LossOperands,
    sglang_serving,
    vllm_placeholders,
    vllm_serving,
)
from dflash.train.model import DFlashDrafter, DrafterConfig, TargetHead


@dataclass(kw_only=True)
class DSparkConfig(DrafterConfig):
    """A DSpark drafter's config: DFlash's and its heads'. A block is the anchor and
    num_drafts - 1 masks, and every position predicts the next token (num_drafts drafts)."""

    kind: ClassVar[str | None] = "dspark"
    markov_rank: int
    """Rank r of the Markov head (markov_w1 [V, r], markov_w2 [V_draft, r])."""
    confidence_head: bool = False
    """Also a confidence head (a linear map of [hidden; markov_w1[previous token]] to the logit
    of the position's acceptance probability)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"DSparkConfig.markov_rank must be >= 1, got {self.markov_rank}")


@dataclass(kw_only=True)
class DSparkOptions:
    """`dflash-train fit`'s options of `--drafter dspark`."""

    markov_rank: int = 256
    """dspark: rank of the Markov head (markov_w1 [vocab, rank], markov_w2 [draft vocab, rank])."""
    confidence_head: bool = False
    """dspark: also train a confidence head (each draft's acceptance probability, for vLLM's
    adaptive verification), by cross-entropy towards the drafter's overlap with the target's top-k."""


class MarkovHead(nn.Module):
    """markov_w1 [V, r] (an embedding of the previous token's target id), markov_w2
    [V_draft, r] (its bias on the draft logits), named as vLLM's DSparkMarkovHead."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[...] target ids -> [..., r]."""
        return self.markov_w1(token_ids)

    def bias(self, embed: torch.Tensor) -> torch.Tensor:
        """[..., r] -> [..., V_draft] in fp32."""
        return embed.float() @ self.markov_w2.weight.float().T


class ConfidenceHead(nn.Module):
    """proj: [H + r] -> 1 (with bias), vLLM's DSparkConfidenceHead with with_markov true."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """[N, H], [N, r] -> [N] fp32 logits."""
        x = torch.cat([hidden.float(), embed.float()], dim=-1)
        return (x @ self.proj.weight.float().T)[:, 0] + self.proj.bias.float()


class DSparkDrafter(DFlashDrafter):
    """DFlashDrafter plus `markov_head` (and `confidence_head` when config.confidence_head).

    The backbone's forward and inference calls are DFlashDrafter's; the heads act on its
    output rows (`sequential_drafts` at inference, train/fit.py's loss in training).
    """

    def __init__(self, config: DSparkConfig, **kwargs):
        super().__init__(config, **kwargs)
        r = config.markov_rank
        self.markov_head = MarkovHead(config.vocab_size, config.draft_vocab_size or config.vocab_size, r)
        self.confidence_head = ConfidenceHead(config.hidden_size + r) if config.confidence_head else None
        self.reset_heads()

    def reset_heads(self) -> None:
        """markov_w1 ~ N(0, 0.01) (speculators' choice), markov_w2 and proj ~ N(0,
        initializer_range), proj's bias 0. Drawn after the backbone's weights, so a DSpark
        and a DFlash drafter of one seed share their backbone's initial weights."""
        nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)
        nn.init.normal_(self.markov_head.markov_w2.weight, std=self.config.initializer_range)
        if self.confidence_head is not None:
            nn.init.normal_(self.confidence_head.proj.weight, std=self.config.initializer_range)
            nn.init.zeros_(self.confidence_head.proj.bias)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "markov_head"):  # (DFlashDrafter.__init__ calls this before the heads exist)
            self.reset_heads()


# -- training ------------------------------------------------------------------------------


def anchor_batch(batch, num_drafts: int):
    """A batch read with blocks of num_drafts + 1 (labels x[a+1..a+N], train/data.py's
    alignment) -> the DSpark batch of blocks of N = num_drafts rows: ids [x[a], MASK x (N-1)],
    label row k of an (N+1)-block becomes row k-1 of the N-block (position i predicts
    x[a+i+1]), label_positions 0..N-1. Weights and labels are unchanged, so position i weighs
    exp(-i/gamma), as DFlash's first draft weighs 1."""
    N = num_drafts
    blocks = batch.block_ids.shape[0] // (N + 1)
    block_ids = batch.block_ids.view(blocks, N + 1)[:, :N].reshape(-1)  # [blocks*N]
    b, k = batch.label_rows // (N + 1), batch.label_rows % (N + 1)
    assert bool((k >= 1).all()), "a label on an anchor row"
    return dataclasses.replace(batch, block_ids=block_ids, label_rows=b * N + k - 1, label_positions=k - 1)


def loss_operands(drafter: DSparkDrafter, rows: torch.Tensor, head: TargetHead,
                  prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [N, H + r], head [V_draft, H + r], markov embedding [N, r]) such that
    hidden @ head.T = the DSpark logits: the backbone's rows through the frozen head plus the
    Markov bias of each row's previous token (prev_tokens [N] target ids). The head's last r
    columns are markov_w2, with its gradient."""
    embed = drafter.markov_head.embed(prev_tokens)  # [N, r] fp32
    dtype = head.lm_head.dtype
    return (torch.cat([rows.to(dtype), embed.to(dtype)], dim=1),
            torch.cat([head.lm_head, drafter.markov_head.markov_w2.weight.to(dtype)], dim=1), embed)


def confidence_loss(drafter: DSparkDrafter, rows: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor,
                    weight: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """Summed weighted BCE of the confidence logits towards the acceptance rate
    sum_{v in top-k} min(p_v, q_v) (p the drafter's softmax of hidden @ weight.T, q the
    target's cached top-k; ids [N, k] rows of `weight`, ids outside it marked by a -inf
    log-prob). The target is detached; only the confidence head gets this loss's gradient."""
    from dflash.kernels.reference import chunked_lse_gather, default_workspace_bytes

    with torch.no_grad():
        lse, z_sel, _ = chunked_lse_gather(hidden.detach(), weight.detach(), ids.long().clamp(min=0),
                                           vocab_pass=True, dense_grad=False,
                                           workspace_bytes=default_workspace_bytes(hidden.device))
        p = torch.exp(z_sel.float() - lse.float()[:, None])  # [N, k]
        q = torch.exp(logprobs.float())  # [N, k] (0 where -inf)
        target = torch.minimum(p, q).sum(1).clamp(0.0, 1.0)  # [N]
    logits = drafter.confidence_head(rows, embed)  # [N]
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    return (bce * weights).sum()


# -- inference -----------------------------------------------------------------------------


@torch.no_grad()
def sequential_drafts(drafter: DSparkDrafter, hidden: torch.Tensor, anchors: torch.Tensor, head: TargetHead,
                      linear=None) -> torch.Tensor:
    """Greedy DSpark drafts, left to right, as vLLM's DSpark speculator draws them at
    temperature 0 (greedy draft sampling).

    hidden [n, N, H] (the backbone's output for n blocks), anchors [n] target ids, head the
    drafter's head (`head.for_drafter`). Position i's logits are the backbone's plus
    markov_w2 @ markov_w1[t_i], t_0 the anchor and t_i the target id of draft i-1. `linear`
    (x [m, H], w [V, H]) -> [m, V] computes the backbone's logits (default: a float32 matmul).
    Returns [n, N] target ids.
    """
    return _sequential(drafter, hidden, anchors, head, linear, margins=False).tokens


def _sequential(drafter: DSparkDrafter, hidden: torch.Tensor, anchors: torch.Tensor, head: TargetHead,
                linear: Any, margins: bool) -> Drafts:
    n, N, H = hidden.shape
    weight = head.lm_head
    if linear is None:
        base = hidden.float().reshape(n * N, H) @ weight.float().T  # [n*N, V_draft]
    else:
        base = linear(hidden.reshape(n * N, H), weight.to(hidden.dtype)).float()
    base = base.view(n, N, -1)
    prev = anchors.long()
    drafts, gaps = [], []
    for i in range(N):
        logits = base[:, i] + drafter.markov_head.bias(drafter.markov_head.embed(prev))  # [n, V_draft]
        prev = head.to_target(logits.argmax(-1))  # [n] target ids
        drafts.append(prev)
        if margins:
            top = logits.topk(2, dim=-1).values  # [n, 2]
            gaps.append(top[:, 0] - top[:, 1])
    return Drafts(tokens=torch.stack(drafts, dim=1), margins=torch.stack(gaps, dim=1) if margins else None)


# -- the kind ------------------------------------------------------------------------------


class DSparkKind(DrafterKind):
    """DSpark: a block of the anchor and num_drafts - 1 masks, every row drafting (the anchor's
    too), left to right through the Markov head; vLLM's `dspark` method on its V2 runner."""

    name = "dspark"
    title = "DSpark"
    architecture = "Qwen3DSparkModel"  # vLLM's qwen3_dspark loader
    vllm_method = "dspark"
    vllm_runner = "V2"
    config_class = DSparkConfig
    options = DSparkOptions
    head_prefixes = ("markov_head.", "confidence_head.")
    default_num_drafts = 16  # a block of 16 rows, every one drafting
    fsdp = False  # its heads act in the loss, outside FSDP2's forward

    def check_options(self, options: Any, selected: bool) -> None:
        if options.markov_rank < 1:
            raise ValueError(f"fit config: markov_rank must be >= 1, got {options.markov_rank}")
        if options.confidence_head and not selected:
            raise ValueError("fit config: confidence_head is a DSpark head: add --drafter dspark or drop it")

    def config_fields(self, options: Any) -> dict[str, Any]:
        return {"markov_rank": options.markov_rank, "confidence_head": options.confidence_head}

    def claims_legacy(self, data: dict[str, Any]) -> bool:
        return data.get("markov_rank") is not None

    def block_rows(self, num_drafts: int) -> int:
        return num_drafts  # the anchor's row drafts too

    def num_drafts(self, block_rows: int) -> int:
        return block_rows

    def make(self, config: DrafterConfig, **kwargs: Any) -> DFlashDrafter:
        return DSparkDrafter(config, **kwargs)

    def training_batch(self, batch: Any, config: DrafterConfig) -> Any:
        return anchor_batch(batch, config.num_drafts)

    def loss_operands(self, model: DFlashDrafter, rows: torch.Tensor, head: TargetHead, batch: Any) -> LossOperands:
        """[rows; markov_w1[prev]] and [head; markov_w2]: the frozen head's columns get no gradient."""
        frozen_columns = rows.shape[1]
        rows, weight, embed = loss_operands(model, rows, head, batch.label_tokens)
        return LossOperands(rows=rows, head=dataclasses.replace(head, lm_head=weight),
                            frozen_columns=frozen_columns, extra=embed)

    def extra_loss(self, model: DFlashDrafter, operands: LossOperands, backbone_rows: torch.Tensor,
                   ids: torch.Tensor, logprobs: torch.Tensor, top1: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor | None:
        if model.confidence_head is None:
            return None
        return confidence_loss(model, backbone_rows, operands.extra, operands.rows, operands.head.lm_head,
                               ids, logprobs, weights)

    def draft(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, head: TargetHead, *,
              linear: Any = None, margins: bool = False, rows_per_chunk: int = 1024,
              context: torch.Tensor | None = None) -> Drafts:
        """Left to right, each draft's Markov bias from the one before (`sequential_drafts`)."""
        return _sequential(drafter, hidden, anchors, head, linear, margins)

    def hf_fields(self, config: DrafterConfig) -> dict[str, Any]:
        """What vLLM's qwen3_dspark loader and DSpark speculator read beyond the DFlash fields:
        the architecture, the Markov rank, the anchor-predicts layout, the confidence head, and
        no top-k restriction of the Markov bias (dspark_draft_topk null: the bias over the whole
        draft vocabulary, as trained); SGLang's `dspark.py` also needs the Markov head's type
        (it refuses a markov_rank without one)."""
        return {
            "markov_rank": config.markov_rank,
            "markov_head_type": "vanilla",  # two low-rank matrices, SGLang's VanillaMarkov
            "sample_from_anchor": True,
            "enable_confidence_head": config.confidence_head,
            "confidence_head_with_markov": config.confidence_head,
            "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
            "dspark_draft_topk": None,
        }

    def head_tensors(self, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        h, r, vocab = config["hidden_size"], config["markov_rank"], config["vocab_size"]
        draft = config.get("draft_vocab_size") or vocab
        shapes = {"markov_head.markov_w1.weight": (vocab, r), "markov_head.markov_w2.weight": (draft, r)}
        if config.get("enable_confidence_head"):
            extra = r if config.get("confidence_head_with_markov") else 0
            shapes.update({"confidence_head.proj.weight": (1, h + extra), "confidence_head.proj.bias": (1,)})
        return shapes

    def check_hf(self, data: dict[str, Any], where: str) -> None:
        if (data.get("sample_from_anchor", True) is not True or data.get("markov_rank") is None
                or data.get("markov_head_type", "vanilla") != "vanilla"
                or (data.get("enable_confidence_head") and not data.get("confidence_head_with_markov"))):
            raise ValueError(f"{where}: this DSpark drafter implements sample_from_anchor true, a markov_rank of "
                             "markov_head_type vanilla, and a confidence head with the Markov embedding; the "
                             "checkpoint sets otherwise")

    def config_from_hf(self, fields: dict[str, Any], data: dict[str, Any]) -> DrafterConfig:
        return DSparkConfig(**fields, markov_rank=int(data["markov_rank"]),
                            confidence_head=bool(data.get("enable_confidence_head")))

    def card_lines(self, config: DrafterConfig) -> list[str]:
        c = config
        return [f"DSpark (method `dspark`): this drafter adds a Markov head of rank {c.markov_rank} to the "
                "DFlash backbone (`markov_head.markov_w1` [vocab, rank] embeds the previous token, "
                "`markov_head.markov_w2` [draft vocab, rank] biases the draft logits), drafting left to right; its "
                f"block is the anchor and {c.num_drafts - 1} masks, and every position predicts the next token: "
                f"{c.num_drafts} drafts per verify of {c.num_drafts + 1}"
                + (", with a confidence head (`confidence_head.proj`)." if c.confidence_head else ".")]

    def serving_lines(self, config: DrafterConfig, target: str | None) -> list[str]:
        """vLLM's `dspark` method, which runs on its V2 model runner."""
        c = config
        target, spec = vllm_placeholders(target, self.speculative_config(c))
        return vllm_serving(
            target, spec,
            f"Serve next to the target it was trained for (its folder: `{target}`) with vLLM's `dspark` "
            f"speculative method; greedy output is the target's own. `num_speculative_tokens` is the drafts per "
            f"verify, {c.num_drafts} (vLLM's default from `block_size`). DSpark runs on vLLM's V2 model runner only, "
            "which on a GPU needs nothing special (on a CPU it needs Triton, which PyPI's build lacks):",
            "z-lab/dflash's code does not load the Markov head. SGLang uses the confidence head only with "
            "`SGLANG_RAGGED_VERIFY_MODE` other than its default `static`, and then needs one (`fit "
            "--confidence-head`); it loads no draft vocabulary (train without `--draft-vocab` for it).",
            sglang_serving(target, "DSPARK", "--speculative-dspark-block-size", c.num_drafts,
                           f"gamma, the drafts; SGLang verifies {c.num_drafts + 1} tokens"))

    def export_warning(self, folder_name: str) -> str | None:
        return None  # the exported config's architecture names the method


__all__ = ["ConfidenceHead", "DSparkConfig", "DSparkDrafter", "DSparkKind", "DSparkOptions", "MarkovHead",
           "anchor_batch", "confidence_loss", "loss_operands", "sequential_drafts"]
