"""Speculative decoding on targets with sliding-window attention layers, past their window:
the verify's rejected positions are cropped from the KV cache, which a sliding-window cache
layer can do only when it keeps its past (`activate_past_recording`); without it transformers
raises "crop was called, but the current layer does not track past states" once a sequence
passes the window. Lossless: the output equals the target's own greedy output."""

import pytest
import torch

from dflash.testing.builders import HalfRightProposer
from dflash.train.speculative import greedy_generate, speculative_generate

WINDOW = 6
PROMPT = [3, 9, 4, 1, 7, 2, 8, 5, 6, 3, 1, 4]  # longer than the window


def sliding_target(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
                  sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**common, use_sliding_window=True)).eval()
    if kind == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        return Gemma2ForCausalLM(Gemma2Config(**common)).eval()
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1)).eval()



@pytest.mark.parametrize("kind", ["qwen3", "gpt-oss", "gemma2"])
def test_speculative_decoding_is_lossless_past_the_window(kind):
    target = sliding_target(kind)
    greedy = greedy_generate(target, PROMPT, max_new_tokens=24, stop_token_ids=set())
    spec = speculative_generate(target, HalfRightProposer(target, PROMPT, 32), PROMPT, max_new_tokens=24, verify_size=3,
                                layer_ids=[0, 1], stop_token_ids=set())
    assert len(PROMPT) + len(spec.tokens) > 2 * WINDOW
    assert spec.tokens == greedy.tokens
    assert 1 < max(spec.acceptance_lengths) < 3  # some drafts accepted, one rejected: crops happened
