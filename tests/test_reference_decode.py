"""An export decoded by a loop written the way reference inference code is (z-lab's
`dflash_generate`: the output buffer pre-filled with the mask token, the block drafted from the
buffer's next B slots, decoding stopped as soon as a stop token appears anywhere in the
generated part of the buffer, mask tokens dropped from the result) gives the same tokens and
acceptance lengths as `dflash-train eval --online` (`evaluate_online`), with the mask token
`choose_mask_token_id` picks. With a stop token as the mask token (the old rule's pick for
SmolLM2 and Qwen3) that loop stops after the first block.
"""

import json

import pytest
import torch

from dflash.shards import TargetInfo
from dflash.testing.builders import drafter_config, tiny_causal_lm
from dflash.train.export import write_export
from dflash.train.loading import load_exported
from dflash.train.mask_token import choose_mask_token_id
from dflash.train.model import DFlashDrafter, DrafterContextCache, TargetHead
from dflash.train.online import Prompt, evaluate_online
from dflash.train.speculative import DrafterProposer, greedy_generate, target_features
from dflash.train.target_cache import cache_kwarg, rollback

V, NUM_LAYERS, LAYER_IDS, BLOCK = 64, 6, [1, 3], 4
TOKENIZER_IDS = 60  # the tokenizer defines ids 0..59; rows 60..63 are spare, as Qwen3's past 151668
MAX_NEW_TOKENS = 48


@torch.inference_mode()
def reference_style_generate(target, drafter: DFlashDrafter, head: TargetHead, prompt: list[int], *,
                             max_new_tokens: int, stop_token_ids: set[int]) -> tuple[list[int], list[int]]:
    """(generated tokens up to and including the first stop token, committed tokens per verify)."""
    from transformers import DynamicCache

    mask_id, B = drafter.config.mask_token_id, drafter.config.num_drafts + 1
    n0 = len(prompt)
    max_length = n0 + max_new_tokens
    output = torch.full((1, max_length + B), mask_id, dtype=torch.long)  # [1, max_length + B]
    output[0, :n0] = torch.tensor(prompt)
    stops = torch.tensor(sorted(stop_token_ids), dtype=torch.long)
    kv = DynamicCache(config=target.config)
    cache_arg = cache_kwarg(target)  # the transformers version's name for the KV cache argument
    out = target(output[:, :n0], **{cache_arg: kv}, use_cache=True, output_hidden_states=True)
    output[0, n0] = out.logits[0, -1].argmax()
    context = DrafterContextCache()
    drafter.append_context(context, target_features(out.hidden_states, LAYER_IDS))
    start, acceptance = n0, []
    while start < max_length:
        block = output[:, start:start + B].clone()  # [1, B]: the anchor, then mask tokens
        hidden = drafter.forward_block(head.embed(block), context)  # [1, B, H]
        block[0, 1:] = head.logits(hidden[0, 1:]).argmax(-1)
        out = target(block, position_ids=torch.arange(start, start + B)[None], **{cache_arg: kv},
                     use_cache=True, output_hidden_states=True)
        posterior = out.logits.argmax(-1)  # [1, B]
        accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum())
        output[:, start:start + accepted + 1] = block[:, :accepted + 1]
        output[:, start + accepted + 1] = posterior[:, accepted]
        start += accepted + 1
        acceptance.append(accepted + 1)
        rollback(kv, start, fed=B, family="qwen3")
        drafter.append_context(context, target_features(out.hidden_states, LAYER_IDS)[:, :accepted + 1])
        if torch.isin(output[0, n0:], stops).any():  # anywhere in the buffer, mask slots included
            break
    generated = output[0, :max_length]
    generated = generated[generated != mask_id][n0:].tolist()
    first_stop = next((i for i, t in enumerate(generated) if t in stop_token_ids), len(generated) - 1)
    return generated[:first_stop + 1], acceptance


@pytest.fixture(scope="module")
def target():
    """A random Qwen3 whose spare rows are never produced: their LM-head rows are zero (logit 0,
    below the best of 60 large random logits), like the untrained padding rows of a real one."""
    model = tiny_causal_lm("qwen3", vocab_size=V, num_layers=NUM_LAYERS)
    with torch.no_grad():
        model.get_output_embeddings().weight[TOKENIZER_IDS:] = 0
    return model


@pytest.fixture
def target_dir(tmp_path):
    """CACHE/target's tokenizer files for that target: ids 0..59, no special tokens."""
    path = tmp_path / "target"
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {
        f"t{i}": i for i in range(TOKENIZER_IDS)}}, "added_tokens": []}))
    return path


def prompt_ids(seed: int) -> list[int]:
    return torch.randint(0, TOKENIZER_IDS, (7,), generator=torch.Generator().manual_seed(seed)).tolist()


def stop_token_for(target, prompt: list[int]) -> int:
    """A token the target emits for the first time some steps into its greedy output, as the
    stop token (so that decoding ends on it, mid-output)."""
    tokens = greedy_generate(target, prompt, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=set()).tokens
    return next(t for i, t in enumerate(tokens) if i >= 6 and t not in tokens[:i])


def exported_drafter(tmp_path, mask_token_id: int) -> DFlashDrafter:
    torch.manual_seed(2)
    config = drafter_config(num_hidden_layers=1, vocab_size=V, target_layer_ids=LAYER_IDS,
                            num_target_layers=NUM_LAYERS, num_drafts=BLOCK - 1, mask_token_id=mask_token_id,
                            initializer_range=0.2)
    out = write_export(DFlashDrafter(config, attention="dense"), tmp_path / f"draft-{mask_token_id}",
                       dtype=torch.float32)
    return load_exported(out).eval()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_style_loop_matches_online_eval(target, target_dir, tmp_path, seed):
    prompt = prompt_ids(seed)
    stop = stop_token_for(target, prompt)
    info = TargetInfo(layer_ids=LAYER_IDS, num_layers=NUM_LAYERS, hidden_size=32, vocab_size=V,
                      tie_word_embeddings=False, model_type="qwen3", pad_token_id=stop, eos_token_id=stop)
    mask = choose_mask_token_id(info, target_dir)
    assert mask == TOKENIZER_IDS != stop
    drafter = exported_drafter(tmp_path, mask)
    head = TargetHead(embed_tokens=target.get_input_embeddings().weight.detach(),
                      lm_head=target.get_output_embeddings().weight.detach())
    online = evaluate_online(target, DrafterProposer(drafter, head), [Prompt(source={}, token_ids=prompt)],
                             max_new_tokens=MAX_NEW_TOKENS, verify_size=BLOCK, layer_ids=LAYER_IDS,
                             stop_token_ids={stop}, warmup=False)
    tokens, acceptance = reference_style_generate(target, drafter, head, prompt, max_new_tokens=MAX_NEW_TOKENS,
                                                  stop_token_ids={stop})
    assert online["lossless"] and tokens[-1] == stop
    assert len(tokens) == online["new_tokens"] and len(acceptance) == online["num_verifications"]
    assert sum(acceptance) / len(acceptance) == pytest.approx(online["acceptance_length"], abs=0)
    reference = greedy_generate(target, prompt, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids={stop})
    assert tokens == reference.tokens


def test_a_stop_token_as_mask_token_ends_reference_decoding_after_one_block(target, tmp_path):
    prompt = prompt_ids(0)
    stop = stop_token_for(target, prompt)
    drafter = exported_drafter(tmp_path, stop)
    head = TargetHead(embed_tokens=target.get_input_embeddings().weight.detach(),
                      lm_head=target.get_output_embeddings().weight.detach())
    tokens, acceptance = reference_style_generate(target, drafter, head, prompt, max_new_tokens=MAX_NEW_TOKENS,
                                                  stop_token_ids={stop})
    reference = greedy_generate(target, prompt, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids={stop})
    assert len(acceptance) == 1 and len(tokens) < len(reference.tokens)
