"""Speculative decoding with a DFlash drafter against a live Hugging Face target.

Batch 1, greedy (temperature 0), which is the setting the DFlash paper reports and the one
where "lossless" has an exact meaning: the output must equal the target's own greedy output
token for token.

One iteration, with `start` the position of the last committed token (the anchor, which the
target has produced but not yet consumed):

1. The drafter sees the target features of every committed position `< start` (kept in its
   context cache) and drafts the block `[x[start], MASK x (B-1)]` in one forward: block
   position k is its guess for the token at `start + k`.
2. The target consumes the whole block in one forward over its KV cache. Its argmax at
   block position k-1 is its own greedy token for `start + k`. Draft k is accepted while
   every draft 1..k equals that argmax; `accepted` counts them.
3. The committed tokens are the anchor and the accepted drafts (positions `start ..
   start + accepted`); the target's argmax after the last of them is the bonus token, the
   next anchor. The target's cache and the drafter's context are cut back / extended to
   exactly the committed positions, using the target features the verify forward computed
   (train/target_cache.py: how each kind of cache layer, linear attention included, is cut
   back exactly).

Each verify commits `accepted + 1` tokens; the mean of that over verifications is the
acceptance length tau reported by `dflash-train eval --online` (as z-lab's benchmark does).

Sampling (temperature T > 0, `MatchSampler`): the drafter still drafts greedily; the target
draws its own token at every block position from softmax(logits / T), and draft k is accepted
while every draft 1..k equals the target's draw there; the committed tokens are the target's
draws up to and including the first one that differs (the bonus). Every committed token is
therefore a draw from the target's own distribution given the committed prefix (the draw at
position k is independent of the draws before it, which alone decide whether it is used), so
the output has the distribution of plain sampling from the target: lossless in distribution,
not token for token. This is z-lab's benchmark rule, and what standard speculative sampling
(accept draft x with probability min(1, p(x)/q(x)), else draw from norm(max(p - q, 0)))
reduces to for a drafter whose q is one-hot at its argmax: accept with probability p(x),
else draw from p without x. vLLM does exactly that for DFlash drafts by default
(`draft_sample_method="greedy"`: argmax drafts, draft probabilities treated as one-hot), so
the two agree in distribution, and so do their acceptance rates, though not draw for draw.

The target features are `hidden_states[hidden_state_index(id)]` for the drafter's layer ids,
concatenated in that order: the definition of `dflash.shards.layers`, which stage one uses
for the cache. Note that Hugging Face's last `hidden_states` entry is after the final norm;
the DFlash layer rule never selects the last layer.

Numerics: the verify forward runs the target on B query tokens at once, while the reference
(`transformers`' `generate`) runs one token at a time. The two can differ in the last bits,
which flips an argmax only at a near-tie. Every generated token therefore carries the
target's top-1 minus top-2 logit margin at that step and its TOP_K best tokens with their
logits, so that a mismatch can be judged: `dflash.train.online.near_tie_bound` says how close
a tie must be for the target's dtype (a float32 target makes the check exact nearly to the
last bit; bf16 logits sit on a grid of 2^-8 relative, and ties there are common, on random
targets most).

Attention on CUDA: decoding grows the key length by one or a few positions every step. On
Hopper and Blackwell (sm90, sm100) recent torch (2.9 and later, with a recent cuDNN) puts
cuDNN's attention first for bf16/fp16 inputs, and cuDNN builds and caches one execution graph
per problem shape, the key length included: a new length is a new graph, some 20-40 ms of host
time each (reported for torch 2.13 on sm90), at every decode step and every verify. Float32
is not cuDNN's, so it never paid. This is why bf16 online eval on an H200 ran 3-4x slower than
float32 (issue 42: 11-13 s a prompt against 3.6 s at 256 new tokens, which make some 300-500
new key lengths a prompt between the greedy reference, the verifies and the drafter's blocks:
8-10 s of graph builds at those costs); `bench/gpu_online_eval.py` measures it, with a row
decoded with cuDNN's attention allowed. Both loops here therefore decode with cuDNN's
attention switched off (`decoding_attention`), which leaves flash attention for the one-token
steps and the drafter's unmasked block and memory-efficient attention for the masked verify,
neither of which compiles per shape. Switched off for the call only, on CUDA only; the greedy
baseline gets the same, so the speedup compares like with like.

Speed on CPU: a product with a few rows, `F.linear(x, W)` with x [M, K] and M = 2..16 (the
verify forward's block, the drafter's B - 1 head rows), can take a GEMM path that costs 2-4x
the one-row product per call, while `(W @ x.T).T` streams the weight once; which form is faster
depends on the CPU and its BLAS (`python -m bench.small_m_matmul`): on one 2-core sandbox
SmolLM2's 49,152-row head took 37 ms at 2-8 rows through F.linear against 10 ms transposed,
on another (a Xeon with AMX) the transposed form made the 4-token verify forward 2x slower.
So both loops here (speculative and plain greedy, so the baseline gets it too) time the two
forms once per shape (rows, weight shape, dtype) on first use and keep the faster
(`rows_linear`, up to `SMALL_ROWS` rows; the eval's untimed warm-up meets the shapes first).
The linear is passed in where it is used: the target's plain `nn.Linear` layers are routed to
`rows_linear` for the call (`decoding_linear`, per layer instance, removed after), the
drafter's for each of `DrafterProposer`'s calls, and its head product calls it directly;
`torch.nn.functional.linear` itself is never replaced, so any other model, and any other
thread, computes as it would have.
The sums run in another order, so logits move in the last bits (5e-5 at most there), as they
already differ between a B-token verify and a one-token step; at one row the two forms are the
same product.

What this file trades off: it keeps the drafter behind a tiny `Proposer` interface (reset,
commit features, propose a block) so the loop is tested with oracle and always-wrong
proposers as well as the real drafter, at the cost of one indirection per block.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from dflash.shards import hidden_state_index
from dflash.train import drafters
from dflash.train.model import DFlashDrafter, DrafterContextCache, TargetHead
from dflash.train.target_cache import cache_kwarg, record_past, rollback, target_family

SMALL_ROWS = 16
"""Up to this many rows, decoding on CPU picks the faster of F.linear and (W @ x.T).T."""
_TRANSPOSED_FASTER: dict[tuple, bool] = {}
"""(rows, N, K, x dtype, W dtype) -> whether (W @ x.T).T beat F.linear when first timed in this process."""


def _time_ms(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _transposed(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight @ x2d.T).T


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear ([..., K] x [N, K] -> [..., N]); with 2..SMALL_ROWS rows on the CPU, through
    whichever of F.linear and (W @ x.T).T was faster for this shape when first met (both are
    timed then, a few milliseconds per shape)."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if x.device.type != "cpu" or not 1 < rows <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    x2d = x.reshape(rows, x.shape[-1])
    key = (rows, *weight.shape, x.dtype, weight.dtype)
    faster = _TRANSPOSED_FASTER.get(key)
    if faster is None:
        faster = _TRANSPOSED_FASTER[key] = (_time_ms(lambda: _transposed(x2d, weight))
                                            < _time_ms(lambda: F.linear(x2d, weight)))
    if not faster:
        return F.linear(x, weight, bias)
    out = _transposed(x2d, weight)  # [rows, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _routed_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s forward through `rows_linear` (looked up when called, as `_decoding`'s pieces are)."""
    return rows_linear(x, layer.weight, layer.bias)


@contextlib.contextmanager
def decoding_linear(*models: torch.nn.Module) -> Iterator[None]:
    """Inside the block, every plain `nn.Linear` of `models` whose weight is on the CPU computes
    through `rows_linear`: the layer instance's own `forward` is set for the block and removed
    after it.

    Nothing process-wide changes: torch.nn.functional.linear stays torch's, and every other
    module, on this thread or another, computes as before. A layer left alone: one whose instance
    already has its own forward (a hook library's wrapper, or an enclosing `decoding_linear`,
    which then removes it), a subclass of nn.Linear (a quantized layer computes its own way), a
    layer on another device (the small-row product is a CPU matter)."""
    routed = []
    for model in models:
        for layer in model.modules():
            if type(layer) is torch.nn.Linear and "forward" not in vars(layer) and layer.weight.device.type == "cpu":
                layer.forward = functools.partial(_routed_forward, layer)
                routed.append(layer)
    try:
        yield
    finally:
        for layer in routed:
            del layer.forward


@contextlib.contextmanager
def decoding_attention(device: torch.device) -> Iterator[None]:
    """Inside the block, on CUDA, scaled_dot_product_attention does not use cuDNN's backend,
    which builds a graph per key length (module docstring); the other backends stay as the
    caller set them, and cuDNN's flag is restored after the block."""
    if device.type != "cuda":
        yield
        return
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)


def _decoding(fn):
    """Run `fn(target, ...)` inside `decoding_linear(target)` and `decoding_attention(target.device)`
    (looked up when called, so a bench can swap either for a comparison)."""
    @functools.wraps(fn)
    def wrapped(target: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with decoding_linear(target), decoding_attention(target.device):
            return fn(target, *args, **kwargs)

    return wrapped


def _drafting(method):
    """Run a `DrafterProposer` method inside `decoding_linear(self.drafter)` (looked up when
    called): the drafter's layers compute through `rows_linear` as the target's do in the loop."""
    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with decoding_linear(self.drafter):
            return method(self, *args, **kwargs)

    return wrapped


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """The drafter's context features from a Hugging Face forward's `hidden_states`.

    hidden_states: `output_hidden_states=True` output, each [batch, T, H]. Returns
    [batch, T, L*H], layer-major in the order of `layer_ids` (the cache's [T, L, H]
    flattened).
    """
    return torch.cat([hidden_states[hidden_state_index(i)] for i in layer_ids], dim=-1)


class Proposer(Protocol):
    """What the decoding loop needs of a drafter."""

    def reset(self) -> None:
        """Forget all context (a new prompt starts)."""

    def commit(self, features: torch.Tensor) -> None:
        """Append the target features [n, L*H] of the next n committed positions."""

    def propose(self, anchor_token: int, verify_size: int) -> list[int]:
        """Draft the block anchored at the position right after the committed context:
        returns verify_size - 1 token ids (block positions 1..verify_size-1): the drafts of a
        verify of `verify_size` tokens, the anchor and its drafts."""


class DrafterProposer:
    """A `DFlashDrafter` with its context cache, drafting greedily through the target's
    embedding and LM head; its drafter's linear layers compute through `rows_linear` during
    each call (`decoding_linear`)."""

    def __init__(self, drafter: DFlashDrafter, head: TargetHead):
        self.drafter = drafter.eval()
        self.head = head.for_drafter(drafter)  # a draft vocabulary's rows, when it has one
        self.mask_token_id = drafter.config.mask_token_id
        self.cache = DrafterContextCache()
        self.context: torch.Tensor | None = None  # [1, L*H]: the features of the last committed position

    def reset(self) -> None:
        self.cache = DrafterContextCache()
        self.context = None

    @_drafting
    def commit(self, features: torch.Tensor) -> None:
        self.drafter.append_context(self.cache, features[None])  # [1, n, L*H]
        self.context = features[-1:]

    def propose(self, anchor_token: int, verify_size: int) -> list[int]:
        return self.draft(anchor_token, verify_size).tokens[0].tolist()

    @_drafting
    @torch.inference_mode()
    def draft(self, anchor_token: int, verify_size: int, *, margins: bool = False) -> drafters.Drafts:
        """`propose`'s drafts of one block (tokens [1, verify_size - 1]), and each draft's top-1
        minus top-2 logit when `margins`: the kind's block (train/drafters/) through the
        decoding loop's small-row product."""
        device = self.head.embed_tokens.device
        kind = drafters.of(self.drafter)
        rows = kind.block_rows(verify_size - 1)
        block = torch.full((1, rows), self.mask_token_id, dtype=torch.long, device=device)  # [1, rows]
        block[0, 0] = anchor_token
        hidden = self.drafter.forward_block(self.head.embed(block), self.cache)  # [1, rows, H]
        return kind.draft(self.drafter, hidden, block[:, 0], self.head, linear=rows_linear, margins=margins,
                          context=self.context)


class MatchSampler:
    """Sampling at temperature > 0 by the match-the-sample rule (module docstring): one draw
    from the target per block position, drafts accepted while they equal the draws.

    The draws come from `generator` (on the target's device) alone, so a seeded generator
    makes a decoding reproducible."""

    def __init__(self, temperature: float, generator: torch.Generator):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        self.temperature, self.generator = temperature, generator

    def sample(self, logits: torch.Tensor) -> list[int]:
        """[n, V] logits -> n token ids, each drawn from softmax(logits / T) of its row (float32)."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)  # [n, V]
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0].tolist()

    def verify(self, drafts: list[int], logits: torch.Tensor) -> list[int]:
        """The tokens one verify commits: drafts [size - 1] against the target's logits
        [size, V] at the block positions; the accepted drafts and the target's draw after them."""
        draws = self.sample(logits)  # [size]: the target's token after each block position
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == draws[accepted]:
            accepted += 1
        return draws[: accepted + 1]


@dataclass
class DecodeResult:
    """One prompt's decoding."""

    tokens: list[int]
    """Generated ids after the prompt, ending at the first stop token or max_new_tokens."""
    margins: list[float]
    """Per generated token: the target's top-1 minus top-2 logit where it chose that token."""
    top_ids: list[list[int]] = field(default_factory=list)
    """Per generated token: the target's TOP_K highest-logit token ids there, best first (a
    mismatch is judged by where the other run's token stands among them)."""
    top_logits: list[list[float]] = field(default_factory=list)
    """Per generated token: those tokens' logits, in float32."""
    acceptance_lengths: list[int] = field(default_factory=list)
    """Per target verify: tokens committed (accepted drafts + 1). Empty for plain greedy."""
    drafted: list[int] = field(default_factory=list)
    """Per target verify: drafts it checked (verify size - 1, fewer in a last block the token
    budget shortened)."""
    elapsed_s: float = 0.0
    """Wall time of the whole call, prefill included."""


TOP_K = 8
"""Contenders kept per generated token (`DecodeResult.top_ids`)."""


def _top(logits: torch.Tensor) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """[n, V] -> per row: top-1 minus top-2 logit, the TOP_K best ids and their logits, in
    float32 (bf16 logits are exact in it)."""
    top = logits.float().topk(min(TOP_K, logits.shape[-1]), dim=-1)  # values, indices: [n, K]
    values = top.values.tolist()
    return [row[0] - row[1] for row in values], top.indices.tolist(), values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@_decoding
@torch.inference_mode()
def speculative_generate(
    target: torch.nn.Module,
    proposer: Proposer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    verify_size: int,
    layer_ids: list[int],
    stop_token_ids: set[int],
    sampler: MatchSampler | None = None,
) -> DecodeResult:
    """Speculative decoding of one prompt (see the module docstring for the loop): greedy, or
    sampled by `sampler` (its `sample` and `verify`) when one is given.

    verify_size: the tokens one verify checks, the anchor and its drafts (num_drafts + 1; 1 is
    plain decoding). The last verification is shortened so that no more than `max_new_tokens`
    tokens are produced; a stop token ends the output (and is part of it), as in `generate`.
    """
    from transformers import DynamicCache  # here, so that `dflash-train --help` stays fast

    if verify_size < 1:
        raise ValueError(f"verify_size must be >= 1, got {verify_size}")
    device = target.device
    family = target_family(target)
    _sync(device)
    t0 = time.perf_counter()
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, T0]
    kv = DynamicCache(config=target.config)
    cache_arg = cache_kwarg(target)
    out = target(prompt, **{cache_arg: kv}, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    record_past(kv, verify_size)  # after the prefill: the prefill stays the target's own (target_cache.py)
    proposer.reset()
    proposer.commit(target_features(out.hidden_states, layer_ids)[0])  # [T0, L*H]
    last = out.logits[0, -1:]  # [1, V]
    tokens = last.argmax(-1).tolist() if sampler is None else sampler.sample(last)
    margins, top_ids, top_logits = _top(last)
    acceptance: list[int] = []
    drafted: list[int] = []
    while tokens[-1] not in stop_token_ids and len(tokens) < max_new_tokens:
        start = len(prompt_ids) + len(tokens) - 1  # position of the anchor, not yet consumed
        size = min(verify_size, max_new_tokens - len(tokens))  # commits at most `size` tokens
        block = [tokens[-1]] + (proposer.propose(tokens[-1], size) if size > 1 else [])
        out = target(
            torch.tensor([block], dtype=torch.long, device=device),  # [1, size]
            position_ids=torch.arange(start, start + size, device=device)[None],
            **{cache_arg: kv}, use_cache=True, output_hidden_states=True,
        )
        logits = out.logits[0]  # [size, V]
        if sampler is None:
            choice = logits.argmax(-1).tolist()  # target's greedy token after each block position
            accepted = 0
            while accepted < size - 1 and block[accepted + 1] == choice[accepted]:
                accepted += 1
            new = choice[: accepted + 1]  # accepted drafts (equal to the target's) + bonus
        else:
            new = sampler.verify(block[1:], logits)
            accepted = len(new) - 1
        new_margins, new_top_ids, new_top_logits = _top(logits[: accepted + 1])
        for i, token in enumerate(new):
            tokens.append(token)
            margins.append(new_margins[i])
            top_ids.append(new_top_ids[i])
            top_logits.append(new_top_logits[i])
            if token in stop_token_ids:
                break
        acceptance.append(accepted + 1)
        drafted.append(size - 1)
        rollback(kv, start + accepted + 1, fed=size, family=family)
        proposer.commit(target_features(out.hidden_states, layer_ids)[0, : accepted + 1])  # [a+1, L*H]
    _sync(device)
    return DecodeResult(tokens=tokens, margins=margins, top_ids=top_ids, top_logits=top_logits,
                        acceptance_lengths=acceptance, drafted=drafted, elapsed_s=time.perf_counter() - t0)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """torch's global generators seeded with `seed` inside the block, restored after it."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


@_decoding
def greedy_generate(
    target: torch.nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    stop_token_ids: set[int],
    temperature: float = 0.0,
    seed: int = 0,
) -> DecodeResult:
    """The target's own greedy output through `generate(do_sample=False)`, timed; with
    `temperature` > 0, its plain sampling (`do_sample=True`, no top-k or top-p) from torch's
    generator seeded with `seed` (forked: the caller's random state is left as it was).

    The target's `generation_config` is swapped for a bare one during the call: `generate`
    merges a model's saved defaults (repetition penalty, forced tokens, ...) into any config
    it is given, and speculative decoding reproduces plain decoding only.
    """
    from transformers import GenerationConfig

    device = target.device
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, T0]
    stops = sorted(stop_token_ids)
    sampling = dict(temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    bare = GenerationConfig(
        do_sample=temperature > 0, max_new_tokens=max_new_tokens, **sampling,
        eos_token_id=stops or None,
        pad_token_id=stops[0] if stops else 0,
        output_scores=True, return_dict_in_generate=True,
    )
    saved = target.generation_config
    target.generation_config = GenerationConfig()
    try:
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode(), _seeded(seed, device) if temperature > 0 else contextlib.nullcontext():
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=bare)
        _sync(device)
        elapsed = time.perf_counter() - t0
    finally:
        target.generation_config = saved
    tokens = out.sequences[0, prompt.shape[1]:].tolist()
    margins, top_ids, top_logits = _top(torch.cat(out.scores)) if out.scores else ([], [], [])
    n = len(tokens)
    return DecodeResult(tokens=tokens, margins=margins[:n], top_ids=top_ids[:n], top_logits=top_logits[:n],
                        elapsed_s=elapsed)


__all__ = [
    "TOP_K",
    "DecodeResult",
    "DrafterProposer",
    "MatchSampler",
    "Proposer",
    "decoding_attention",
    "decoding_linear",
    "greedy_generate",
    "speculative_generate",
    "target_features",
]
