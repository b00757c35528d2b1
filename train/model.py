"""The DFlash drafter: Qwen3-style decoder layers that draft a block of tokens in one pass.

Architecture (as z-lab/dflash's DFlashDraftModel, written from the paper and that file's
structure, with the same parameter names so that export is a rename-free save):

- The target's features of L layers at every context position are concatenated
  (`[C, L*H]`), fused by `fc: Linear(L*H -> H, bias=False)` and `hidden_norm` (RMSNorm).
- Every decoder layer takes its queries from the block tokens only. Its keys and values are
  `[k_proj(context); k_proj(block)]` and `[v_proj(context); v_proj(block)]`: the *same*
  fused context enters every layer (it is not transformed by earlier layers). `q_norm` /
  `k_norm` are per-head RMSNorms; RoPE runs over the absolute positions of context and block.
- Attention is bidirectional inside a block. A query of the block anchored at position `a`
  sees the context positions `j < a` (strictly: at inference the anchor is the token the
  target just produced, whose features do not exist yet) and its own block, nothing else.
- Layers may be sliding-window (`layer_types`, `sliding_window`) and causal inside the block
  (`is_causal`), as z-lab's reference and vLLM's DFlash read those config fields: a query at
  absolute position p sees a key at position k only when p - k < sliding_window (and, in a
  bidirectional layer, k - p < sliding_window); a causal layer adds k <= p. A
  `sliding_attention` layer is causal unless `is_causal` says otherwise (`layer_attention`).
- SwiGLU MLP, pre-norm residuals, a final `norm`. The embedding and the LM head are the
  target's, frozen, and are not parameters of this module (`TargetHead` holds them).

Two attention paths compute the same thing: Flex Attention over the whole packed batch with
a block-sparse mask (GPU: only the visible tiles are computed), and a dense path that runs
`scaled_dot_product_attention` per segment and per chunk of blocks with an explicit boolean
mask (CPU, where Flex Attention has no backward). `attention="auto"` picks Flex on CUDA.

Training layout (`BlockLayout`): a batch is a list of *segments*, each a sequence's context
rows (positions `0..context_length-1`) plus some blocks anchored in it. Queries are packed
block-major: block `b` occupies rows `b*B .. b*B+B-1`, in segment order.

Inference (`DrafterContextCache`, `append_context`, `forward_block`): the context keys and
values of every layer are cached for the committed positions; a block of B tokens starting
right after them is drafted in one call. The cache can be cropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash.shards import TargetInfo
from dflash.shards.layout import HEAD_FILE
from dflash.train.mask_token import choose_mask_token_id, read_target_json

AttentionImpl = Literal["auto", "flex", "dense"]
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # Hugging Face's layer_types


@dataclass(kw_only=True)
class DrafterConfig:
    """Shape of the drafter; the attention and MLP sizes default to the target's. A drafter
    kind with fields of its own subclasses it (train/drafters/)."""

    kind: ClassVar[str | None] = None
    """The registry name of the kind whose config this class is (train/drafters/); None: the
    default kind, and `to_dict` writes no `kind` (a config as written before kinds had names)."""

    hidden_size: int
    """Model width; must equal the target's hidden size (the embedding and LM head are shared)."""
    intermediate_size: int
    """SwiGLU inner width."""
    num_hidden_layers: int = 5
    """Drafter decoder layers (the paper's Qwen3 drafters use 5)."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention); divides num_attention_heads."""
    head_dim: int
    """Width of one attention head."""
    vocab_size: int
    """Rows of the target's embedding and LM head."""
    target_layer_ids: list[int]
    """Target decoder layers whose outputs feed the drafter, in cache order."""
    num_target_layers: int
    """Decoder layers of the target (recorded for export)."""
    num_drafts: int = 15
    """Tokens one block drafts per verify (vLLM's num_speculative_tokens); the verify checks
    num_drafts + 1 tokens, the drafts and the target's bonus token. The drafter rows a block
    takes are the kind's (train/drafters/: `block_rows`)."""
    mask_token_id: int
    """Token id whose (frozen) embedding fills the block positions after the anchor."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    max_position_embeddings: int = 32768
    """Longest position the drafter is meant for (recorded for export; RoPE has no table)."""
    initializer_range: float = 0.02
    """Standard deviation of the normal initialisation of linear weights."""
    feature_width: int | None = None
    """Width of the context features fc reads: None for raw target features (L*H); r when
    trained on a basis cache's coefficients (export folds the basis back into fc)."""
    feature_basis_sha256: str | None = None
    """The basis the coefficients are in (its file's sha256), when feature_width is set."""
    draft_vocab_size: int | None = None
    """Rows of the drafter's own head when it drafts from a draft vocabulary (the buffers
    `draft_head`, the target LM head's rows of those tokens, and `draft_ids`, their target
    ids; train/draft_vocab.py); None: it scores the target's whole head."""
    layer_types: list[str] | None = None
    """Attention of each layer, "full_attention" or "sliding_attention" (Hugging Face's names);
    None: every layer full_attention."""
    sliding_window: int | None = None
    """Positions a sliding_attention layer's query reaches back: it sees keys at positions
    k > p - sliding_window of its own position p; set exactly when a layer slides."""
    is_causal: bool | None = None
    """Causal attention inside the block in every layer (True), bidirectional in every layer
    (False), or None: causal in sliding_attention layers only (how z-lab's reference and vLLM
    read a config without is_causal)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"DrafterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"DrafterConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_drafts < 1:
            raise ValueError(f"DrafterConfig.num_drafts must be >= 1, got {self.num_drafts}")
        if not self.target_layer_ids:
            raise ValueError("DrafterConfig.target_layer_ids is empty: the drafter needs target features")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DrafterConfig.mask_token_id {self.mask_token_id} is not a row of the target's "
                f"embedding (vocab_size {self.vocab_size}): pick an id in [0, {self.vocab_size})"
            )
        if (self.feature_width is None) != (self.feature_basis_sha256 is None) or (
                self.feature_width is not None and self.feature_width < 1):
            raise ValueError("DrafterConfig.feature_width (>= 1) and feature_basis_sha256 go together: set "
                             f"both or neither, got {self.feature_width!r} and {self.feature_basis_sha256!r}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size < self.vocab_size:
            raise ValueError(f"draft_vocab_size must lie in [1, {self.vocab_size}) (the target's vocabulary), got "
                             f"{self.draft_vocab_size}: drop --draft-vocab to draft from the whole vocabulary")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is not None:
            self.layer_types = [str(t) for t in self.layer_types]
            unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
            if unknown or len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"DrafterConfig.layer_types {self.layer_types}: give one of {FULL_ATTENTION!r} or "
                                 f"{SLIDING_ATTENTION!r} per layer ({self.num_hidden_layers} layers)")
            if SLIDING_ATTENTION not in self.layer_types:
                self.layer_types = None  # all full: stored as the default, so such a config stays as it was
        if self.layer_types is None and self.is_causal is False:
            self.is_causal = None  # all full and bidirectional: the default, likewise
        sliding = self.layer_types is not None
        if sliding != (self.sliding_window is not None) or (sliding and self.sliding_window < 1):
            raise ValueError(f"DrafterConfig.sliding_window (>= 1) is set exactly when a layer is {SLIDING_ATTENTION}: "
                             f"got sliding_window {self.sliding_window!r} with layer_types {self.layer_types!r}")

    def layer_attention(self, layer: int) -> tuple[int | None, bool]:
        """(window, causal) of decoder layer `layer`: its sliding window (None: full attention)
        and whether its block attention is causal."""
        sliding = self.layer_types is not None and self.layer_types[layer] == SLIDING_ATTENTION
        return (self.sliding_window if sliding else None), (sliding if self.is_causal is None else self.is_causal)

    @property
    def context_width(self) -> int:
        """Input width of fc: feature_width, or L*H raw target features."""
        return self.feature_width or len(self.target_layer_ids) * self.hidden_size

    @property
    def num_target_features(self) -> int:
        """L: how many target layers are concatenated in the context features."""
        return len(self.target_layer_ids)

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["feature_width"] is None:  # raw-feature drafters keep their exact config
            del data["feature_width"], data["feature_basis_sha256"]
        if data["draft_vocab_size"] is None:  # so do whole-vocabulary drafters
            del data["draft_vocab_size"]
        for name in ("layer_types", "sliding_window", "is_causal"):  # and full bidirectional ones
            if data[name] is None:
                del data[name]
        if self.kind is not None:
            data["kind"] = self.kind
        return data

    @classmethod
    def from_dict(cls, data: dict) -> DrafterConfig:
        """This class's config from `to_dict`'s dict (its `kind` is the class's: train/drafters/
        picks the class, `config_from_dict`)."""
        return cls(**{name: value for name, value in data.items() if name != "kind"})

    @classmethod
    def from_target(
        cls,
        target_dir: str | Path,
        *,
        num_hidden_layers: int = 5,
        num_drafts: int = 15,
        mask_token_id: int | None = None,
    ) -> DrafterConfig:
        """Size a drafter for the target described by `CACHE/target/` (config.json, target.json).

        The mask token is `mask_token_id` if given, else `choose_mask_token_id`'s pick from
        target.json and the tokenizer files beside it.
        """
        target_dir = Path(target_dir)
        target = TargetInfo.load(target_dir)
        hf = read_target_json(target_dir / "config.json")
        hf_text = hf.get("text_config", hf)  # multimodal configs nest the language model's
        heads = int(hf_text["num_attention_heads"])
        hidden = target.hidden_size
        rope_theta = target.rope_theta or hf_text.get("rope_theta") or (
            (hf_text.get("rope_parameters") or {}).get("rope_theta")) or 10000.0
        return cls(
            hidden_size=hidden,
            intermediate_size=int(hf_text["intermediate_size"]),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(hf_text.get("num_key_value_heads") or heads),
            head_dim=int(hf_text.get("head_dim") or hidden // heads),
            vocab_size=target.vocab_size,
            target_layer_ids=list(target.layer_ids),
            num_target_layers=target.num_layers,
            num_drafts=num_drafts,
            mask_token_id=choose_mask_token_id(target, target_dir) if mask_token_id is None else mask_token_id,
            rms_norm_eps=float(target.rms_norm_eps or hf_text.get("rms_norm_eps") or 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(hf_text.get("max_position_embeddings") or 32768),
        )


# ---------------------------------------------------------------------------------------
# Frozen target pieces
# ---------------------------------------------------------------------------------------


@dataclass
class TargetHead:
    """The target's frozen input embedding and LM head (`CACHE/target/head.safetensors`)."""

    embed_tokens: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H] (a draft vocabulary's head: [V_d, H], see `for_drafter`)
    final_norm: torch.Tensor | None = None  # [H]: the target's final norm scale, when stored
    draft_ids: torch.Tensor | None = None  # [V_d] int64: the target id of each lm_head row; None: row i is id i
    target_to_draft: torch.Tensor | None = None  # [V] int64: the row of each target id, -1 outside

    @classmethod
    def load(cls, target_dir: str | Path, *, device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None) -> TargetHead:
        from safetensors.torch import load_file

        path = Path(target_dir) / HEAD_FILE
        if not path.exists():
            raise ValueError(f"{path} is missing: the cache's target/ folder is incomplete")
        try:
            tensors = load_file(str(path), device=str(device))
        except Exception as error:
            raise ValueError(f"{path}: cannot read the target's embedding and LM head: {error}; rebuild "
                             "the cache's target/ folder with dflash-precompute") from error
        missing = {"embed_tokens.weight", "lm_head.weight"} - tensors.keys()
        if missing:
            raise ValueError(f"{path} lacks {sorted(missing)}: rebuild the cache with dflash-precompute")
        embed, head = tensors["embed_tokens.weight"], tensors["lm_head.weight"]
        if dtype is not None:
            embed, head = embed.to(dtype), head.to(dtype)
        norm = tensors.get("norm.weight")
        if norm is not None and tuple(norm.shape) != (embed.shape[1],):
            raise ValueError(f"{path}: norm.weight has shape {tuple(norm.shape)}, expected ({embed.shape[1]},); "
                             "rebuild the cache's target/ folder with dflash-precompute")
        return cls(embed_tokens=embed.requires_grad_(False), lm_head=head.requires_grad_(False),
                   final_norm=None if norm is None else norm.float())

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[...] int -> [..., H] in the embedding's dtype."""
        return F.embedding(token_ids, self.embed_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] (materialises logits: for inference, not for the training loss);
        [..., V_d] over a draft vocabulary's rows (`to_target` maps an argmax to token ids)."""
        return hidden @ self.lm_head.to(hidden.dtype).T

    def for_drafter(self, drafter: DFlashDrafter) -> TargetHead:
        """The head `drafter` drafts through: this one, or its draft vocabulary's rows."""
        if getattr(drafter, "draft_ids", None) is None or self.draft_ids is not None:
            return self  # (a stand-in without the attribute drafts from the whole head)
        ids = drafter.draft_ids.to(self.lm_head.device)
        lookup = torch.full((self.lm_head.shape[0],), -1, dtype=torch.long, device=ids.device)
        lookup[ids] = torch.arange(ids.shape[0], device=ids.device)
        return dataclasses.replace(self, lm_head=drafter.draft_head.to(self.lm_head.device, self.lm_head.dtype),
                                   draft_ids=ids, target_to_draft=lookup)

    def to_target(self, rows: torch.Tensor) -> torch.Tensor:
        """lm_head row indices (an argmax) -> target token ids."""
        return rows if self.draft_ids is None else self.draft_ids[rows]


# ---------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and returned in the input's dtype (so that fp32
    master weights under bf16 autocast keep activations in bf16)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """RoPE tables for integer positions [N]: cos, sin [N, head_dim] (half-split layout, as
    Hugging Face Llama/Qwen: the two halves of a head rotate together)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))  # [hd/2]
    angles = positions.float()[:, None] * inv_freq[None, :]  # [N, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [N, hd]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., N, heads, hd] rotated by cos/sin [N, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rope_theta = c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def project_queries(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [..., N, H] -> queries [..., N, heads, hd], normed and rotated."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        return apply_rope(q, *rope)

    def project_keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x [..., N, H] -> keys, values [..., N, kv_heads, hd]; keys normed and rotated."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, *rope), v


class DrafterMLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, q_rope, c_rope, attend,
                block_rows: int) -> torch.Tensor:
        """One layer of the training forward (a module call, so that FSDP2 gathers this
        layer's parameters around it). hidden [Q, H] block rows (block-major, `block_rows` per
        block), context [C, H] fused target features; attend(q, k_ctx, v_ctx, k_blk, v_blk) ->
        [Q, h, hd] applies the block mask."""
        attn = self.self_attn
        x, state = self.attention_input(hidden, block_rows)
        q = attn.project_queries(x, q_rope)  # [Q, h, hd]
        k_blk, v_blk = attn.project_keys_values(x, q_rope)  # [Q, kvh, hd]
        k_ctx, v_ctx = attn.project_keys_values(context, c_rope)  # [C, kvh, hd]
        out = attend(q, k_ctx, v_ctx, k_blk, v_blk)
        hidden = hidden + self.attention_output(attn.o_proj(out.flatten(-2)), state, block_rows)
        return hidden + self.feed_forward(hidden, block_rows)

    # The sublayers' ends, shared by the training forward and `DFlashDrafter.forward_block`;
    # a kind's layer (train/drafters/) mixes the block's rows here. `block_rows`: rows per
    # block of the [..., rows, H] input (rows a multiple of it, block-major).

    def attention_input(self, hidden: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, object]:
        """(the attention's input rows, what `attention_output` needs of them): the input norm."""
        return self.input_layernorm(hidden), None

    def attention_output(self, out: torch.Tensor, state: object, block_rows: int) -> torch.Tensor:
        """The attention's output after o_proj -> the residual update."""
        return out

    def feed_forward(self, hidden: torch.Tensor, block_rows: int) -> torch.Tensor:
        """The MLP sublayer's residual update of `hidden`."""
        return self.mlp(self.post_attention_layernorm(hidden))


# ---------------------------------------------------------------------------------------
# Training layout and masks
# ---------------------------------------------------------------------------------------


@dataclass
class BlockLayout:
    """Where the context rows and blocks of a packed training batch live.

    Segment i contributes context rows for positions `0..context_lengths[i]-1` of its sequence
    (rows `context_offsets[i]..`) and `num_blocks[i]` blocks anchored at sorted positions
    `anchors[block_offsets[i]:...]`. Every anchor must be <= its segment's context length, so
    that all context positions j < a are present. All index tensors live on `device`.
    """

    block_size: int
    context_lengths: list[int]
    num_blocks: list[int]
    anchors: torch.Tensor  # [num_blocks_total] int64
    context_positions: torch.Tensor  # [C] int64, position of each context row in its sequence
    block_positions: torch.Tensor  # [Q] int64, anchor + 0..B-1 per block
    context_offsets: list[int] = field(default_factory=list)
    block_offsets: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, segments: list[tuple[int, np.ndarray]], block_size: int,
              device: torch.device | str = "cpu") -> BlockLayout:
        """segments: (context_length, anchors [n] int, sorted) per segment."""
        context_lengths = [int(length) for length, _ in segments]
        num_blocks = [len(anchors) for _, anchors in segments]
        for i, (length, anchors) in enumerate(segments):
            if len(anchors) and (int(np.max(anchors)) > length or int(np.min(anchors)) < 0):
                raise ValueError(
                    f"segment {i}: anchors must lie in [0, context_length={length}], got "
                    f"[{int(np.min(anchors))}, {int(np.max(anchors))}]"
                )
        anchors = torch.as_tensor(
            np.concatenate([np.asarray(a, dtype=np.int64) for _, a in segments]) if segments
            else np.zeros(0, np.int64), dtype=torch.int64)  # [n_blocks]
        context_positions = torch.cat(
            [torch.arange(length, dtype=torch.int64) for length in context_lengths]
        ) if segments else torch.zeros(0, dtype=torch.int64)  # [C]
        block_positions = (anchors[:, None] + torch.arange(block_size)[None, :]).reshape(-1)  # [Q]
        return cls(
            block_size=block_size,
            context_lengths=context_lengths,
            num_blocks=num_blocks,
            anchors=anchors.to(device),
            context_positions=context_positions.to(device),
            block_positions=block_positions.to(device),
            context_offsets=np.concatenate([[0], np.cumsum(context_lengths)[:-1]]).astype(int).tolist()
            if segments else [],
            block_offsets=np.concatenate([[0], np.cumsum(num_blocks)[:-1]]).astype(int).tolist()
            if segments else [],
        )

    @property
    def num_context(self) -> int:
        return int(sum(self.context_lengths))

    @property
    def num_queries(self) -> int:
        return int(sum(self.num_blocks)) * self.block_size

    def flex_index(self) -> dict[str, torch.Tensor]:
        """Per-row metadata for the packed mask over keys [context rows; block rows].

        q_block [Q]: the block of each query; kv_block [C+Q]: the block of each key (-1 for
        context rows); kv_segment / q_segment: the segment; kv_position: the position of each
        key in its sequence; q_anchor / q_position: each query's block anchor and position.
        """
        device = self.anchors.device
        seg_ids = torch.arange(len(self.num_blocks), device=device)
        block_segment = torch.repeat_interleave(seg_ids, torch.tensor(self.num_blocks, device=device))
        context_segment = torch.repeat_interleave(seg_ids, torch.tensor(self.context_lengths, device=device))
        q_block = torch.arange(len(self.anchors), device=device).repeat_interleave(self.block_size)
        minus_one = torch.full((self.num_context,), -1, dtype=torch.int64, device=device)
        return {
            "q_block": q_block,
            "q_segment": block_segment.repeat_interleave(self.block_size),
            "q_anchor": self.anchors.repeat_interleave(self.block_size),
            "q_position": self.block_positions,
            "kv_block": torch.cat([minus_one, q_block]),
            "kv_segment": torch.cat([context_segment, block_segment.repeat_interleave(self.block_size)]),
            "kv_position": torch.cat([self.context_positions, self.block_positions]),
        }

    def dense_mask(self, window: int | None = None, causal: bool = False) -> torch.Tensor:
        """The full [Q, C+Q] boolean visibility matrix of a layer with this window and
        causality (tests and small batches only)."""
        ix = self.flex_index()
        device = self.anchors.device
        q = torch.arange(self.num_queries, device=device)[:, None]
        kv = torch.arange(self.num_context + self.num_queries, device=device)[None, :]
        return _visible(ix, q, kv, window, causal)


def _in_reach(q_position: torch.Tensor, kv_position: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor:
    """Whether a query at absolute position q_position may see a key at kv_position under a
    layer's window and causality (z-lab's reference and vLLM: p - k < window; a bidirectional
    window also k - p < window; causal k <= p). Broadcasting tensors; all True when neither."""
    reach = torch.ones_like(q_position - kv_position, dtype=torch.bool)
    if causal:
        reach = reach & (kv_position <= q_position)
    if window is not None:
        reach = reach & (q_position - kv_position < window)
        if not causal:
            reach = reach & (kv_position - q_position < window)
    return reach


def _visible(ix: dict[str, torch.Tensor], q: torch.Tensor, kv: torch.Tensor, window: int | None = None,
             causal: bool = False) -> torch.Tensor:
    """The DFlash visibility rule for query rows q and key rows kv (broadcasting index tensors).

    A query sees a key of its own block, or a context key of its own segment at a position
    strictly before its block's anchor; and, in a sliding or causal layer, only keys in reach
    of its position (`_in_reach`).
    """
    q_block = ix["q_block"][q]
    kv_block = ix["kv_block"][kv]
    same_block = kv_block == q_block
    earlier_context = (kv_block < 0) & (ix["kv_segment"][kv] == ix["q_segment"][q]) & (
        ix["kv_position"][kv] < ix["q_anchor"][q])
    visible = same_block | earlier_context
    if window is None and not causal:
        return visible
    return visible & _in_reach(ix["q_position"][q], ix["kv_position"][kv], window, causal)


def _dense_block_mask(anchors: torch.Tensor, context_length: int, block_size: int, *, context_start: int = 0,
                      window: int | None = None, causal: bool = False) -> torch.Tensor:
    """Visibility of one segment chunk: queries [n*B] over keys [context_length - context_start + n*B]
    (context positions context_start .. context_length-1, then the blocks).

    anchors [n] int64. Context key j is visible to the blocks with anchor > j; block keys are
    visible within their own block only; a window or causality narrows both (`_in_reach`).
    """
    n = anchors.shape[0]
    device = anchors.device
    q_anchor = anchors.repeat_interleave(block_size)  # [n*B]
    context_position = torch.arange(context_start, context_length, device=device)  # [ctx]
    context_visible = context_position[None, :] < q_anchor[:, None]  # [nB, ctx]
    block_id = torch.arange(n, device=device).repeat_interleave(block_size)  # [nB]
    block_visible = block_id[:, None] == block_id[None, :]  # [nB, nB]
    mask = torch.cat([context_visible, block_visible], dim=1)
    if window is None and not causal:
        return mask
    q_position = q_anchor + torch.arange(block_size, device=device).repeat(n)  # [nB]
    kv_position = torch.cat([context_position, q_position])  # [ctx + nB]
    return mask & _in_reach(q_position[:, None], kv_position[None, :], window, causal)


_compiled_flex = None


def _flex_attention(q, k, v, block_mask):
    """Compiled Flex Attention (compiled once per process; eager on CPU, which is forward-only
    and used by the parity test)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


# ---------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------


@dataclass
class DrafterContextCache:
    """Per-layer keys and values of the committed context positions (inference).

    keys[l], values[l]: [batch, T, kv_heads, hd] for layer l; `length` = T, and the next block
    is anchored at position T.
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (drop speculative context past them)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a context cache of length {self.length} to {length}")
        self.keys = [k[:, :length] for k in self.keys]
        self.values = [v[:, :length] for v in self.values]


DRAFT_BUFFERS = ("draft_head", "draft_ids")  # a draft vocabulary's frozen head and id map


class DFlashDrafter(nn.Module):
    """The DFlash drafter (parameters named as z-lab's DFlashDraftModel).

    Training: `forward(block_embeds, context_features, layout)`.
    Inference: `append_context(cache, features)`, then `forward_block(block_embeds, cache)`.
    Both return final-normed hidden states; logits are `TargetHead.logits(hidden)` (or the
    sparse loss kernel, which never materialises them).
    """

    layer_class: ClassVar[type[DrafterLayer]] = DrafterLayer
    """The decoder layer (a kind's drafter may use a subclass, train/drafters/)."""

    def __init__(self, config: DrafterConfig, *, attention: AttentionImpl = "auto",
                 max_dense_queries: int = 4096):
        super().__init__()
        self.config = config
        self.attention = attention
        self.max_dense_queries = max_dense_queries  # dense path: queries per SDPA call (memory bound)
        c = config
        self.layers = nn.ModuleList([self.layer_class(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(c.context_width, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # A draft vocabulary's head: frozen buffers (saved with the weights, never trained),
        # filled by train/draft_vocab.install at the start of training.
        rows = c.draft_vocab_size
        self.register_buffer("draft_head", None if rows is None else torch.zeros(rows, c.hidden_size))
        self.register_buffer("draft_ids", None if rows is None else torch.zeros(rows, dtype=torch.long))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) linear weights, unit norms (as Hugging Face inits Qwen3).
        A submodule with `initialises_itself` is left to its owner (a kind's drafter inits it
        after the backbone, so the backbone's draws are DFlash's for one seed)."""
        own = {id(m) for owner in self.modules() if getattr(owner, "initialises_itself", False)
               for m in owner.modules()}
        for module in self.modules():
            if id(module) in own:
                continue
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def fuse_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """[..., L*H] target features -> [..., H] fused context (fc, then hidden_norm)."""
        return self.hidden_norm(self.fc(context_features))

    # -- training ----------------------------------------------------------------------

    def forward(self, block_embeds: torch.Tensor, context_features: torch.Tensor,
                layout: BlockLayout) -> torch.Tensor:
        """Draft every block of a packed batch.

        block_embeds [Q, H]: embeddings of [x[a], MASK, ..., MASK] per block, block-major.
        context_features [C, L*H]: the target features of every segment's context rows.
        layout: where rows live. Returns hidden [Q, H] after the final norm; row b*B+k is
        block b's position k (which predicts x[a+k]).
        """
        assert block_embeds.shape[0] == layout.num_queries, (block_embeds.shape, layout.num_queries)
        assert context_features.shape[0] == layout.num_context, (context_features.shape, layout.num_context)
        impl = self._attention_impl(block_embeds.device)
        dtype = block_embeds.dtype
        hd, theta = self.config.head_dim, self.config.rope_theta
        context = self.fuse_context(context_features.to(self.fc.weight.dtype)).to(dtype)  # [C, H]
        q_rope = rope_cos_sin(layout.block_positions, hd, theta, dtype)
        c_rope = rope_cos_sin(layout.context_positions, hd, theta, dtype)
        kinds = [self.config.layer_attention(i) for i in range(len(self.layers))]  # (window, causal) per layer
        attends = {kind: self._attend_fn(impl, layout, *kind) for kind in dict.fromkeys(kinds)}  # one mask per kind
        hidden = block_embeds
        for layer, kind in zip(self.layers, kinds, strict=True):
            hidden = layer(hidden, context, q_rope, c_rope, attends[kind], layout.block_size)
        return self.norm(hidden)

    def _attend_fn(self, impl: str, layout: BlockLayout, window: int | None, causal: bool):
        """attend(q, k_ctx, v_ctx, k_blk, v_blk) -> [Q, h, hd] for layers of this window and causality."""
        if impl == "flex":
            block_mask = self._flex_block_mask(layout, window, causal)

            def attend(q, k_ctx, v_ctx, k_blk, v_blk):
                return self._attend_flex(q, k_ctx, v_ctx, k_blk, v_blk, block_mask)
        else:
            def attend(q, k_ctx, v_ctx, k_blk, v_blk):
                return self._attend_dense(q, k_ctx, v_ctx, k_blk, v_blk, layout, window, causal)
        return attend

    def _attention_impl(self, device: torch.device) -> str:
        if self.attention == "auto":
            return "flex" if device.type == "cuda" else "dense"
        return self.attention

    def _flex_block_mask(self, layout: BlockLayout, window: int | None = None, causal: bool = False):
        from torch.nn.attention.flex_attention import create_block_mask

        ix = layout.flex_index()

        def mask_mod(b, h, q, kv):
            return _visible(ix, q, kv, window, causal)

        device = layout.anchors.device
        # Eager: evaluates the rule over [Q, C+Q] on the device once per step (a few
        # elementwise passes), shared by every layer; compiling it would recompile per shape.
        return create_block_mask(mask_mod, None, None, layout.num_queries,
                                 layout.num_context + layout.num_queries, device=device)

    @staticmethod
    def _attend_flex(q, k_ctx, v_ctx, k_blk, v_blk, block_mask) -> torch.Tensor:
        # [1, heads, rows, hd] layout for flex; keys are [context rows; block rows].
        k = torch.cat([k_ctx, k_blk]).transpose(0, 1)[None]
        v = torch.cat([v_ctx, v_blk]).transpose(0, 1)[None]
        out = _flex_attention(q.transpose(0, 1)[None], k, v, block_mask)  # [1, h, Q, hd]
        return out[0].transpose(0, 1)  # [Q, h, hd]

    def _attend_dense(self, q, k_ctx, v_ctx, k_blk, v_blk, layout: BlockLayout, window: int | None = None,
                      causal: bool = False) -> torch.Tensor:
        B = layout.block_size
        blocks_per_call = max(1, self.max_dense_queries // B)
        outputs = []
        for seg, n_blocks in enumerate(layout.num_blocks):
            c0, b0 = layout.context_offsets[seg], layout.block_offsets[seg]
            for first in range(0, n_blocks, blocks_per_call):
                blocks = slice(b0 + first, b0 + min(n_blocks, first + blocks_per_call))
                anchors = layout.anchors[blocks]  # [n] sorted
                # Only context positions < the chunk's last anchor can be visible to it, and
                # under a window only those > its first anchor - window.
                ctx_len = min(int(anchors.max()), layout.context_lengths[seg])
                ctx_start = 0 if window is None else min(ctx_len, max(0, int(anchors.min()) - window + 1))
                rows = slice(blocks.start * B, blocks.stop * B)
                k = torch.cat([k_ctx[c0 + ctx_start:c0 + ctx_len], k_blk[rows]])  # [ctx + nB, kvh, hd]
                v = torch.cat([v_ctx[c0 + ctx_start:c0 + ctx_len], v_blk[rows]])
                mask = _dense_block_mask(anchors, ctx_len, B, context_start=ctx_start, window=window,
                                         causal=causal)  # [nB, ctx + nB]
                out = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                    attn_mask=mask, enable_gqa=True)  # [h, nB, hd]
                outputs.append(out.transpose(0, 1))
        if not outputs:
            return q.new_zeros(q.shape)
        return torch.cat(outputs)

    # -- inference ---------------------------------------------------------------------

    @torch.no_grad()
    def append_context(self, cache: DrafterContextCache, context_features: torch.Tensor) -> None:
        """Add the target features of the next committed positions to the cache.

        context_features [batch, n, L*H] for positions cache.length .. cache.length+n-1.
        """
        start = cache.length
        dtype = self.fc.weight.dtype
        positions = torch.arange(start, start + context_features.shape[1], device=context_features.device)
        rope = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
        context = self.fuse_context(context_features.to(dtype))  # [batch, n, H]
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_keys_values(context, rope)  # [batch, n, kvh, hd]
            keys.append(torch.cat([cache.keys[i], k], dim=1) if cache.keys else k)
            values.append(torch.cat([cache.values[i], v], dim=1) if cache.values else v)
        cache.keys, cache.values = keys, values

    @torch.no_grad()
    def forward_block(self, block_embeds: torch.Tensor, cache: DrafterContextCache) -> torch.Tensor:
        """Draft one block anchored right after the cached context.

        block_embeds [batch, B, H]: embeddings of [last committed token, MASK x (B-1)], at
        positions cache.length .. cache.length+B-1. The block sees every cached context
        position and itself (bidirectionally), narrowed in sliding or causal layers as in
        training (`DrafterConfig.layer_attention`). Returns hidden [batch, B, H]; position k
        predicts the token at cache.length + k. The cache is not modified.
        """
        start = cache.length
        dtype = self.fc.weight.dtype
        x_in = block_embeds.to(dtype)
        positions = torch.arange(start, start + x_in.shape[1], device=x_in.device)
        rope = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
        hidden = x_in
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            window, causal = self.config.layer_attention(i)
            # A window reaches back to position start - window + 1 at most (the block's first query).
            first = 0 if window is None else max(0, start - window + 1)
            x, state = layer.attention_input(hidden, x_in.shape[1])
            q = attn.project_queries(x, rope)  # [batch, B, h, hd]
            k_blk, v_blk = attn.project_keys_values(x, rope)
            k = torch.cat([cache.keys[i][:, first:], k_blk], dim=1) if cache.keys else k_blk
            v = torch.cat([cache.values[i][:, first:], v_blk], dim=1) if cache.values else v_blk
            mask = None
            if window is not None or causal:
                kv_position = torch.arange(first, start + x_in.shape[1], device=x_in.device)  # [K]
                mask = _in_reach(positions[:, None], kv_position[None, :], window, causal)  # [B, K]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                enable_gqa=True)  # [batch, h, B, hd]
            hidden = hidden + layer.attention_output(attn.o_proj(out.transpose(1, 2).flatten(-2)), state,
                                                     x_in.shape[1])
            hidden = hidden + layer.feed_forward(hidden, x_in.shape[1])
        return self.norm(hidden)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_flops_per_token(config: DrafterConfig, mean_context_per_query: float, block_rows: int | None = None) -> float:
    """Training FLOPs (forward + backward, 3x forward) per block token, for MFU; a block of
    `block_rows` rows (the kind's, train/drafters/; default the verify size, num_drafts + 1).

    Counts the layers' matmuls on block tokens and attention over `mean_context_per_query`
    visible keys (a sliding layer's at most its window's); context projections (fc and
    per-layer k/v of context rows) are per context row and left out, as is the frozen LM head
    inside the loss (counted by the caller).
    """
    c = config
    rows = c.num_drafts + 1 if block_rows is None else block_rows
    h, hd = c.hidden_size, c.head_dim
    per_layer = 2 * h * (c.num_attention_heads * hd) * 2 + 2 * h * (c.num_key_value_heads * hd) * 2 \
        + 3 * 2 * h * c.intermediate_size
    kinds = c.layer_types or [FULL_ATTENTION] * c.num_hidden_layers
    keys = sum(min(mean_context_per_query + rows, c.sliding_window) if kind == SLIDING_ATTENTION
               else mean_context_per_query + rows for kind in kinds)
    return 3.0 * (c.num_hidden_layers * per_layer + 2 * 2 * c.num_attention_heads * hd * keys)


__all__ = [
    "BlockLayout",
    "DFlashDrafter",
    "DrafterConfig",
    "DrafterContextCache",
    "DRAFT_BUFFERS",
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "TargetHead",
    "count_parameters",
    "model_flops_per_token",
]
