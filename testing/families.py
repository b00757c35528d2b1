"""The target families dflash is checked on: one table of tiny random targets, one per model
family that users bring (tests/test_families.py takes each through the whole pipeline; the
README's "Supported targets" table lists the same rows).

Each family is a transformers config class with the tiny shared dimensions (hidden 32, 4 heads
of 8, 2 KV heads, 4 layers) and the fields that make it that family: tied embeddings, MoE
experts, the real window layout (gpt-oss alternates sliding and full layers), the hybrid
layouts of linear-attention and full-attention layers (Qwen3-Next, Qwen3.5 and its MoE,
Qwen3.6's architecture). Windows are small (WINDOW tokens) so that prompts pass them.

What vLLM serves is not kept here: `dflash.train.serving` holds the pinned vLLM's gaps (the
export's warning reads it), and `engine_status` reads it for a family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

WINDOW = 16
"""Sliding-window layers' window (tokens) in the tiny targets: shorter than the pipeline's prompts."""

TINY_DIMS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=512)

# Qwen3-Next and Qwen3.5: 3 Gated DeltaNet (linear-attention) layers then 1 full one, as the
# released models repeat; their linear heads at the tiny size.
_HYBRID = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True, kw_only=True)
class TargetFamily:
    """One model family: how to build its tiny random target."""

    name: str
    """The family's name in tests and tables."""
    config_class: str
    """The transformers config class (its model_type names the family to engines)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Config fields beyond TINY_DIMS that make the family what it is."""
    tie_word_embeddings: bool = False
    hybrid: bool = False
    """Linear-attention (recurrent) layers beside full ones."""
    sliding: bool = False
    """Sliding-window attention layers (WINDOW tokens)."""

    @property
    def model_type(self) -> str:
        import transformers

        return getattr(transformers, self.config_class).model_type


FAMILIES: dict[str, TargetFamily] = {f.name: f for f in [
    TargetFamily(name="llama", config_class="LlamaConfig", tie_word_embeddings=True),
    TargetFamily(name="qwen2", config_class="Qwen2Config"),
    TargetFamily(name="qwen3", config_class="Qwen3Config"),
    TargetFamily(name="qwen3-moe", config_class="Qwen3MoeConfig", fields=dict(_MOE, decoder_sparse_step=1)),
    TargetFamily(name="gpt-oss", config_class="GptOssConfig", sliding=True,
                 fields=dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                             layer_types=["sliding_attention", "full_attention"])),
    TargetFamily(name="phi3", config_class="Phi3Config"),
    TargetFamily(name="olmo", config_class="OlmoConfig"),
    TargetFamily(name="olmo2", config_class="Olmo2Config"),
    TargetFamily(name="granite", config_class="GraniteConfig"),
    TargetFamily(name="mistral", config_class="MistralConfig", fields=dict(sliding_window=None)),
    # Mistral v0.1: every layer slides (window 4096 in the release).
    TargetFamily(name="mistral-sliding", config_class="MistralConfig", sliding=True,
                 fields=dict(sliding_window=WINDOW)),
    TargetFamily(name="gemma2", config_class="Gemma2Config", tie_word_embeddings=True, sliding=True,
                 fields=dict(sliding_window=WINDOW)),
    TargetFamily(name="gemma3", config_class="Gemma3TextConfig", tie_word_embeddings=True, sliding=True,
                 fields=dict(sliding_window=WINDOW, sliding_window_pattern=2,
                             layer_types=["sliding_attention", "full_attention"])),
    TargetFamily(name="qwen3-next", config_class="Qwen3NextConfig", hybrid=True,
                 fields=dict(_HYBRID, **_MOE, shared_expert_intermediate_size=32, decoder_sparse_step=1)),
    TargetFamily(name="qwen3.5", config_class="Qwen3_5TextConfig", hybrid=True, fields=_HYBRID),
    # Qwen3.6's releases are the Qwen3.5 architectures (dense, and this MoE one).
    TargetFamily(name="qwen3.5-moe", config_class="Qwen3_5MoeTextConfig", hybrid=True,
                 fields=dict(_HYBRID, **_MOE, shared_expert_intermediate_size=32)),
]}


def family_config(family: TargetFamily, **overrides: Any):
    """The tiny config of `family`; `overrides` (token ids, dimensions) win."""
    import transformers

    fields = {**TINY_DIMS, "initializer_range": 0.2, "tie_word_embeddings": family.tie_word_embeddings,
              **family.fields, **overrides}
    if "layer_types" in fields:  # the family's pattern, repeated over the layers
        pattern, num_layers = fields["layer_types"], fields["num_hidden_layers"]
        fields["layer_types"] = (pattern * -(-num_layers // len(pattern)))[:num_layers]
    return getattr(transformers, family.config_class)(**fields)


def family_model(family: TargetFamily, **overrides: Any):
    """A random tiny causal LM of `family` in float32, eval mode (seed 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(family, **overrides), dtype=torch.float32).eval()
