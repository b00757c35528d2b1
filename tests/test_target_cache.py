"""The target's cache under each transformers form of `activate_past_recording`
(train/target_cache.py): 5.25 takes `recurrent_states_to_keep`, 5.17 and 5.19 (the one vLLM 0.32
pins) take no argument. Full-attention layers record nothing, sliding layers record in the form
their version has, and decoding dense and sliding targets is exact either way; a hybrid target
on a version without per-token recurrent states is refused by name and version.

The older form is simulated on a newer transformers by replacing the methods with 5.19's (no
argument) and the version with "5.19.0"; on an installed older transformers (the engine venv)
the same tests run against the real one. The real 5.17 and 5.19 runs of the online-eval tests
are recorded in bench/RESULTS.md ("transformers").
"""

import inspect
import re

import pytest
import torch

from dflash.testing.builders import HalfRightProposer, tiny_causal_lm, tiny_hybrid_lm
from dflash.train.speculative import greedy_generate, speculative_generate
from dflash.train.target_cache import cache_kwarg, record_past, rollback_refusal

WINDOW = 6
PROMPT = [3, 9, 4, 1, 7, 2, 8, 5, 6, 3, 1, 4]  # longer than the window
V = 32


def _installed_takes_the_keyword() -> bool:
    from transformers import cache_utils

    method = cache_utils.LinearAttentionCacheLayerMixin.activate_past_recording
    return "recurrent_states_to_keep" in inspect.signature(method).parameters


@pytest.fixture(params=["installed", "no-argument"])
def form(request, monkeypatch) -> str:
    """The transformers version the refusals name. "installed": as it is. "no-argument": the
    form before 5.25, where `activate_past_recording` takes no argument on the cache and on
    each layer; simulated (as version 5.19.0) when the installed one takes the keyword."""
    import transformers
    from transformers import cache_utils

    if request.param == "installed" or not _installed_takes_the_keyword():
        return transformers.__version__

    def record(self):
        self.record_past = True

    def record_linear(self):  # 5.25's modeling code extends the history, empty here (no state kept per token)
        self.record_past = True
        self.recurrent_states_history = {state: [] for state in range(self.number_of_states)}

    def record_every_layer(self):
        for layer in self.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    monkeypatch.setattr(cache_utils.DynamicSlidingWindowLayer, "activate_past_recording", record)
    monkeypatch.setattr(cache_utils.LinearAttentionCacheLayerMixin, "activate_past_recording", record_linear)
    monkeypatch.setattr(cache_utils.Cache, "activate_past_recording", record_every_layer)
    monkeypatch.setattr(transformers, "__version__", "5.19.0")
    return "5.19.0"


def target_of(kind: str) -> torch.nn.Module:
    """A dense Llama, or a Qwen3 / Gemma2 with a sliding layer (window WINDOW) and a full one."""
    if kind == "llama":
        return tiny_causal_lm("llama", vocab_size=V, num_layers=2)
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
                  sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    if kind == "qwen3-sliding":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**common, use_sliding_window=True)).eval()
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**common)).eval()



@pytest.mark.parametrize("kind, recording", [("llama", [False, False]), ("qwen3-sliding", [True, False]),
                                             ("gemma2", [True, False])])
@torch.inference_mode()
def test_full_attention_layers_record_nothing_and_sliding_layers_keep_their_past(form, kind, recording):
    from transformers import DynamicCache

    target = target_of(kind)
    cache = DynamicCache(config=target.config)
    target(torch.tensor([PROMPT]), **{cache_kwarg(target): cache}, use_cache=True)
    record_past(cache, 4)
    assert [getattr(layer, "record_past", False) for layer in cache.layers] == recording
    assert [hasattr(layer, "activate_past_recording") for layer in cache.layers] == recording


@pytest.mark.parametrize("kind", ["llama", "qwen3-sliding", "gemma2"])
def test_dense_and_sliding_decoding_is_exact(form, kind):
    target = target_of(kind)
    assert rollback_refusal(target) is None
    greedy = greedy_generate(target, PROMPT, max_new_tokens=24, stop_token_ids=set())
    spec = speculative_generate(target, HalfRightProposer(target, PROMPT, V), PROMPT, max_new_tokens=24, verify_size=3,
                                layer_ids=[0, 1], stop_token_ids=set())
    assert len(PROMPT) + len(spec.tokens) > 2 * WINDOW  # past the window: crops act on the sliding layer
    assert spec.tokens == greedy.tokens
    assert 1 < max(spec.acceptance_lengths) < 3  # some drafts accepted, one rejected: crops happened


@pytest.mark.parametrize("form", ["no-argument"], indirect=True)
def test_a_hybrid_without_per_token_recurrent_states_is_refused_by_name_and_version(form):
    """Before 5.25 a linear-attention layer cannot record its recurrent state per token: the
    probe refuses the target before decoding, and the loop at the first verify."""
    target = tiny_hybrid_lm("qwen3_next")
    line = (f"speculative decoding cannot be made exact on qwen3_next targets: needs transformers >= 5.25 for "
            f"qwen3_next's recurrent state; this is {form}")
    assert rollback_refusal(target) == line
    with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
        speculative_generate(target, HalfRightProposer(target, PROMPT, V), PROMPT, max_new_tokens=8, verify_size=4,
                             layer_ids=[0, 2], stop_token_ids=set())
