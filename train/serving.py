"""What the pinned vLLM (0.32, the engine venv's, bench/engine_venv.sh) serves of dflash's
drafters, by the target's Hugging Face `model_type`: the gaps, each with its reason, read from
vLLM's source and its CPU build's runs. `export` warns with `VLLM_REFUSES`; the README's
"Supported targets" table and tests/test_families.py state both tables' reasons.

- `VLLM_REFUSES`: vLLM serves no DFlash drafter for these targets on any device. A DFlash
  drafter reads the target's intermediate layers through vLLM's EAGLE3 interface
  (`SupportsEagle3`: `use_aux_hidden_state_outputs` in its model runner), which vLLM's
  Gemma 2 and Gemma 3 models lack.
- `VLLM_CPU_CANNOT`: vLLM's GPU build serves them, its CPU build cannot (so dflash's CPU
  engine check does not run them).
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


def vllm_refusal(model_type: str | None) -> str | None:
    """Why the pinned vLLM serves no DFlash drafter for a target of `model_type`, or None."""
    return VLLM_REFUSES.get(model_type or "")


__all__ = ["VLLM_CPU_CANNOT", "VLLM_REFUSES", "VLLM_VERSION", "vllm_refusal"]
