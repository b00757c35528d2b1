"""What the pinned vLLM (0.32, the engine venv's, bench/engine_venv.sh) serves of dflash's
drafters, by the target's Hugging Face `model_type`: the gaps, each with its reason, read from
vLLM's source and its CPU build's runs. `export` warns with `VLLM_REFUSES`; the README's
"Supported targets" table and tests/test_families.py state both tables' reasons.

- `VLLM_REFUSES`: vLLM serves no DFlash drafter for these targets on any device. A DFlash
  drafter reads the target's intermediate layers through vLLM's EAGLE3 interface
  (`SupportsEagle3`: `use_aux_hidden_state_outputs` in its model runner), which vLLM's
  Gemma 2 and Gemma 3 models lack.
- `VLLM_CPU_CANNOT`: its CPU build cannot run them (so dflash's CPU engine check does not);
  vLLM's models for them have the EAGLE3 interface, and its GPU build serves them (z-lab's
  Qwen3.5 drafters are served so); not run here.
"""

from __future__ import annotations

VLLM_VERSION = "0.32"

_NO_EAGLE3 = ("vLLM's {} model lacks the EAGLE3 interface that DFlash drafters read the target through "
              "(\"Model does not support EAGLE3 interface\")")

VLLM_REFUSES: dict[str, str] = {
    "gemma2": _NO_EAGLE3.format("Gemma 2"),
    "gemma3": _NO_EAGLE3.format("Gemma 3"),
    "gemma3_text": _NO_EAGLE3.format("Gemma 3"),
}

# Gated DeltaNet layers on vLLM's CPU build: its CPU kernel asserts bfloat16 ("CPU GDN attention
# requires BF16"), its chunked kernel wants head dims that are multiples of 32 and equal for keys
# and values, and speculative decoding copies the recurrent state with a Triton kernel, which the
# CPU build cannot run.
_GDN_ON_CPU = ("vLLM's CPU build runs no Gated DeltaNet layer under speculative decoding (bfloat16 only, head "
               "dims multiples of 32, a Triton-only state copy)")

VLLM_CPU_CANNOT: dict[str, str] = {
    "qwen3_next": _GDN_ON_CPU,
    # vllm/model_executor/models/qwen3_5.py imports transformers' Qwen2-VL image processor, which
    # needs torchvision; the registry's torchvision is a CUDA build that does not load beside torch's CPU build.
    "qwen3_5_text": _GDN_ON_CPU + "; its module imports torchvision, which the CPU engine venv lacks",
    "qwen3_5_moe_text": _GDN_ON_CPU + "; its module imports torchvision, which the CPU engine venv lacks",
}


# Served, but not as trained: vLLM 0.32 sets CacheConfig.sliding_window from the target's
# `sliding_window` when every target layer slides (Mistral v0.1; engine/arg_utils.py), and its
# Attention layers without a window of their own fall back to it (layers/attention/attention.py),
# the DFlash drafter's full-attention layers included. Past the window the drafter then sees only
# the window's context, not what dflash trained and evaluated it with: the output stays the
# target's, the accepted counts differ (fewer, when the drafter uses the far context).
VLLM_ALL_SLIDING_WINDOWS_THE_DRAFTER = (
    "vLLM gives an all-sliding-window target's window to the drafter's attention too: past the window the "
    "drafter sees less context than it was trained with (lossless, fewer drafts accepted)")


def vllm_refusal(model_type: str | None) -> str | None:
    """Why the pinned vLLM serves no DFlash drafter for a target of `model_type`, or None."""
    return VLLM_REFUSES.get(model_type or "")


__all__ = ["VLLM_ALL_SLIDING_WINDOWS_THE_DRAFTER", "VLLM_CPU_CANNOT", "VLLM_REFUSES", "VLLM_VERSION",
           "vllm_refusal"]
