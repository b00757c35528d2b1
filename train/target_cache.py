"""The target's cache in speculative decoding: after every verify it holds exactly the
committed tokens, on every kind of layer transformers builds (full, sliding-window, linear
attention).

A verify forward feeds the anchor and the block's drafts (`fed` tokens, at most the verify
size); once the target accepts n drafts, the cache must be what it would be after feeding only
the n + 1 committed tokens. Per kind of cache layer (transformers' `cache_utils`; 5.25 unless
said otherwise):

- Full attention (`DynamicLayer`): dropping the last positions' keys and values is exact; the
  layer records nothing (it has no `activate_past_recording`, in any 5.x).
- Sliding window (`DynamicSlidingWindowLayer`): it forgets keys older than its window as it
  goes, so a crop once the sequence is past the window needs the layer to keep its past
  (`activate_past_recording`) until the crop, which cuts the rejected positions and trims the
  rest back to the window. The same in 5.17 and 5.19, where the method takes no argument (5.25
  takes and ignores keywords); `record_past` calls each layer's own form.
- Linear attention (`LinearAttentionLayer`: the gated delta net layers of Qwen3-Next and
  Qwen3.5/3.6, Mamba-style layers): a fixed-size recurrent state into which every token is
  mixed, which no crop can undo, and a causal-conv state of the last inputs. Recording with
  `recurrent_states_to_keep=N` makes the layer keep its whole conv input until the crop, and
  the model compute the last N tokens of a forward one at a time (the recurrent rule the
  target's own one-token decoding uses, instead of the chunked one) and hand the cache the
  state after each; `crop(-r)` then puts back the state after the first `fed - r` tokens.
  That is "snapshot the state and re-run the accepted tokens" without the re-run: the verify
  itself computes the state after every prefix of the block, and the committed one is kept.

  N must cover the whole verify: anchor and drafts, i.e. the verify size. transformers' own
  assisted decoding passes the number of drafts, one short: then the first fed token runs
  through the chunked rule, the state after it is never recorded, and a verify that rejects
  every draft puts back the state from before the anchor (the anchor is lost from the state,
  and the output drifts from greedy). `record_past` passes the verify size.

  Before 5.25 (5.17, 5.19) the keyword does not exist: the layer records its conv input only
  and marks itself not croppable once it holds a recurrent state, so a target with recurrent
  layers is refused there, naming the version (a conv-only layer crops as in 5.25). Which form
  a layer has is read from its method's signature, not from the version string.

Recording is switched on after the prefill, so the prefill is the target's own (the same
forward `generate` runs); the verifies then run the recurrent rule token by token as one-token
decoding does, and only the projections over the block's rows differ in the last bits (as an
attention layer's do): ids equal, margins judge a near-tie (train/speculative.py).

A family whose modeling code does not hand the cache the per-token states (transformers 5.25:
Zamba and Zaya ignore `recurrent_states_to_keep`), or whose cache cannot be cropped at all
(MiniMax's lightning attention), cannot be rolled back exactly this way: `rollback_refusal`
finds that with a two-token probe before decoding, and `rollback` refuses it after the first
verify, in both cases naming the family and the reason.

What this file trades off: the rollback costs the verify the recurrent rule over the block
(B steps instead of one chunk) and B copies of each linear layer's state, held until the crop
(`python -m bench.hybrid_rollback`); re-running the committed tokens instead would cost a
second forward per verify.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def target_family(target: torch.nn.Module) -> str:
    """The name refusals give the target's family: its config's model_type."""
    return getattr(target.config, "model_type", None) or type(target).__name__


def _linear_layers(cache: Any) -> list[tuple[int, Any]]:
    """(index, layer) of the cache layers with a conv or recurrent state (hybrid layers that
    also hold keys and values included)."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    return [(index, layer) for index, layer in enumerate(getattr(cache, "layers", []))
            if mixin is not None and isinstance(layer, mixin)]


def cache_kwarg(target: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in newer transformers 5 releases,
    `past_key_values` before (and deprecated since)."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _keeps_recurrent_states(layer: Any) -> bool:
    """Whether `layer` can record its recurrent state per fed token (transformers >= 5.25)."""
    return "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters


def record_past(cache: Any, verify_size: int) -> None:
    """Make every layer of `cache` able to drop up to `verify_size` freshly fed positions (one
    verify: the anchor and its drafts), in the form its transformers has (call it after the
    prefill, before the first verify; see the module docstring). Full-attention layers record
    nothing; a recurrent layer that cannot record per token is refused by `rollback` and
    `rollback_refusal`, not here."""
    for layer in cache.layers:
        activate = getattr(layer, "activate_past_recording", None)
        if activate is None:  # full attention: a crop alone is exact
            continue
        if _keeps_recurrent_states(layer):
            activate(recurrent_states_to_keep=verify_size)
        else:
            activate()


def _unrecorded(cache: Any, fed: int, family: str) -> str | None:
    """Why the last forward of `fed` tokens cannot be rolled back exactly, or None: a
    transformers that cannot record a recurrent state per token, a layer that cannot be
    cropped, or a linear-attention layer that did not keep a recurrent state (or conv input)
    per fed token."""
    import transformers

    for _, layer in _linear_layers(cache):
        if any(layer.is_recurrent_states_initialized.values()) and not _keeps_recurrent_states(layer):
            return f"needs transformers >= 5.25 for {family}'s recurrent state; this is {transformers.__version__}"
    if not getattr(cache, "is_croppable", True):
        kinds = sorted({type(layer).__name__ for layer in cache.layers if not layer.is_croppable})
        return f"its cache layers ({', '.join(kinds) or type(cache).__name__}) cannot be cropped"
    for index, layer in _linear_layers(cache):
        for state in range(layer.number_of_states):
            if layer.is_recurrent_states_initialized[state] and len(layer.recurrent_states_history[state]) < fed:
                return (f"its linear-attention layer {index} does not keep the recurrent state after each token of "
                        f"a forward (the model ignores recurrent_states_to_keep), so rejected drafts cannot be "
                        f"taken back out of it")
            if (layer.is_conv_states_initialized[state]
                    and layer.conv_states[state].shape[-1] < fed + layer.conv_kernel_size[state]):
                return (f"its linear-attention layer {index} updates its conv state in place, so rejected drafts "
                        f"cannot be taken back out of it")
    return None


def rollback(cache: Any, length: int, *, fed: int, family: str) -> None:
    """Cut `cache` back to its first `length` positions after a forward of `fed` tokens (a
    verify), trimming recorded history back to what the next forward needs.

    ValueError naming `family` when the forward left no exact way back (module docstring)."""
    reason = _unrecorded(cache, fed, family)
    if reason is not None:
        raise ValueError(refusal_line(family, reason))
    remove = int(cache.get_seq_length()) - length
    assert 0 <= remove <= fed, (remove, fed)
    cache.crop(-remove)  # crop(0) too: it trims the recorded past


def refusal_line(family: str, reason: str) -> str:
    """The one line that refuses speculative decoding of a target."""
    return f"speculative decoding cannot be made exact on {family} targets: {reason}"


@torch.inference_mode()
def rollback_refusal(target: torch.nn.Module) -> str | None:
    """The one-line reason why speculative decoding of `target` cannot be exact, or None: a
    probe feeds one token, switches recording on, feeds two more and checks that the cache
    recorded what a rollback of both needs (no other state is touched; the target is left as
    it was)."""
    from transformers import DynamicCache

    device = target.device
    family = target_family(target)
    cache = DynamicCache(config=target.config)
    kwargs = {cache_kwarg(target): cache, "use_cache": True}
    try:
        target(torch.zeros((1, 1), dtype=torch.long, device=device), **kwargs)
        record_past(cache, 2)
        target(torch.zeros((1, 2), dtype=torch.long, device=device),
               position_ids=torch.arange(1, 3, device=device)[None], **kwargs)
        reason = _unrecorded(cache, 2, family)
        if reason is None:
            cache.crop(-2)
    except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as error:
        first = (str(error).splitlines() or [""])[0]
        reason = f"its cache cannot be rolled back ({type(error).__name__}: {first})"
    return None if reason is None else refusal_line(family, reason)


__all__ = ["cache_kwarg", "record_past", "refusal_line", "rollback", "rollback_refusal", "target_family"]
