"""Online speculative decoding against tiny random Hugging Face targets: the output equals the
target's own `generate(do_sample=False)` token for token, and tau counts what was accepted.

Targets are built from configs in code (no download, `tiny_causal_lm` in dflash.testing.builders) with a
large initialisation, so their logits are far apart and the verify-vs-one-token numerics
cannot flip an argmax.
"""

import pytest
import torch

from dflash.testing.builders import drafter_config, tiny_causal_lm
from dflash.train.model import DFlashDrafter, TargetHead
from dflash.train.online import Prompt, evaluate_online
from dflash.train.speculative import (
    DrafterProposer,
    greedy_generate,
    speculative_generate,
    target_features,
)

V, H, NUM_LAYERS = 64, 32, 6
LAYER_IDS = [1, 3]



@pytest.fixture(scope="module", params=["qwen3", "llama"])
def any_target(request):
    """Both architectures (their caches and masks differ inside transformers)."""
    return tiny_causal_lm(request.param)


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("qwen3")


def untrained_proposer(target, verify_size: int) -> DrafterProposer:
    torch.manual_seed(1)
    config = drafter_config(num_hidden_layers=2, vocab_size=V, target_layer_ids=LAYER_IDS,
                            num_target_layers=NUM_LAYERS, num_drafts=verify_size - 1, mask_token_id=V - 1,
                            initializer_range=0.2)
    head = TargetHead(embed_tokens=target.get_input_embeddings().weight.detach(),
                      lm_head=target.get_output_embeddings().weight.detach())
    return DrafterProposer(DFlashDrafter(config, attention="dense"), head)


class OracleProposer:
    """Drafts from the known greedy output, corrupting block position `wrong_at(block)` (None:
    nothing) so that every accepted length is exercised."""

    def __init__(self, reference: list[int], prompt_length: int, wrong_at=lambda block, size: None):
        self.reference, self.prompt_length, self.wrong_at = reference, prompt_length, wrong_at
        self.length = 0
        self.blocks = 0
        self.proposed = []  # (wrong position or None, block size) per proposed block

    def reset(self):
        self.length = 0
        self.blocks = 0

    def commit(self, features):
        assert features.shape[-1] == len(LAYER_IDS) * H
        self.length += features.shape[0]

    def propose(self, anchor_token, verify_size):
        g = self.length - self.prompt_length  # index of the anchor in the generated tokens
        assert self.reference[g] == anchor_token
        drafts = list(self.reference[g + 1:g + verify_size])
        drafts += [0] * (verify_size - 1 - len(drafts))
        wrong = self.wrong_at(self.blocks, verify_size)
        self.proposed.append((wrong, verify_size))
        if wrong is not None and wrong - 1 < len(drafts):
            drafts[wrong - 1] = (drafts[wrong - 1] + 1) % V
        self.blocks += 1
        return drafts


def prompt_ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, V, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("verify_size", [2, 4, 16])
@pytest.mark.parametrize("prompt_length, max_new_tokens", [(3, 21), (10, 37), (17, 16)])
def test_untrained_drafter_is_lossless(any_target, verify_size, prompt_length, max_new_tokens):
    """Max new token counts that are not multiples of the block size end mid-block."""
    target = any_target
    prompt = prompt_ids(prompt_length, seed=prompt_length)
    reference = greedy_generate(target, prompt, max_new_tokens=max_new_tokens, stop_token_ids=set())
    assert len(reference.tokens) == max_new_tokens
    out = speculative_generate(target, untrained_proposer(target, verify_size), prompt,
                               max_new_tokens=max_new_tokens, verify_size=verify_size,
                               layer_ids=LAYER_IDS, stop_token_ids=set())
    assert out.tokens == reference.tokens
    # The prefill makes the first token; every verify commits accepted + 1 of the rest.
    assert sum(out.acceptance_lengths) == max_new_tokens - 1
    assert all(1 <= n <= verify_size for n in out.acceptance_lengths)


@pytest.mark.parametrize("verify_size", [2, 4, 16])
def test_perfect_drafter_fills_every_block(target, verify_size):
    prompt, n = prompt_ids(9, seed=3), 40
    reference = greedy_generate(target, prompt, max_new_tokens=n, stop_token_ids=set())
    out = speculative_generate(target, OracleProposer(reference.tokens, len(prompt)), prompt,
                               max_new_tokens=n, verify_size=verify_size, layer_ids=LAYER_IDS,
                               stop_token_ids=set())
    assert out.tokens == reference.tokens
    full, rest = divmod(n - 1, verify_size)
    assert out.acceptance_lengths == [verify_size] * full + ([rest] if rest else [])


@pytest.mark.parametrize("verify_size", [4, 16])
def test_partly_wrong_drafter_accepts_up_to_the_first_error(target, verify_size):
    """Block j's draft at position w = 1 + j % (B-1) is wrong: that block commits exactly w
    tokens (the w - 1 accepted drafts and the bonus; a block the token budget shortened below
    w commits all of it), and the output stays exact."""
    prompt, n = prompt_ids(6, seed=4), 60
    reference = greedy_generate(target, prompt, max_new_tokens=n, stop_token_ids=set())
    proposer = OracleProposer(reference.tokens, len(prompt),
                              wrong_at=lambda block, size: 1 + block % (size - 1))
    out = speculative_generate(target, proposer, prompt, max_new_tokens=n, verify_size=verify_size,
                               layer_ids=LAYER_IDS, stop_token_ids=set())
    assert out.tokens == reference.tokens
    expected = [wrong if wrong < size else size for wrong, size in proposer.proposed]
    assert [wrong for wrong, _ in proposer.proposed[:3]] == [1, 2, 3]
    # A last verify of one token (budget) drafts nothing and commits the bonus alone.
    assert out.acceptance_lengths == expected + [1] * (len(out.acceptance_lengths) - len(expected))


@pytest.mark.parametrize("verify_size", [2, 16])
def test_stop_token_ends_both_outputs(target, verify_size):
    prompt = prompt_ids(8, seed=5)
    free = greedy_generate(target, prompt, max_new_tokens=30, stop_token_ids=set()).tokens
    stop = free[12]
    first = free.index(stop)
    reference = greedy_generate(target, prompt, max_new_tokens=30, stop_token_ids={stop})
    assert reference.tokens == free[:first + 1]
    out = speculative_generate(target, OracleProposer(free, len(prompt)), prompt, max_new_tokens=30,
                               verify_size=verify_size, layer_ids=LAYER_IDS, stop_token_ids={stop})
    assert out.tokens == reference.tokens


def test_target_features_are_the_shared_layer_outputs(any_target):
    """Features are hidden_states[id + 1] (decoder layer id's output), layer-major."""
    ids = torch.tensor([prompt_ids(7, seed=6)])
    outputs = {}
    target = any_target
    hooks = [target.model.layers[i].register_forward_hook(
        lambda module, args, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in LAYER_IDS]
    try:
        with torch.no_grad():
            hidden = target(ids, output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    features = target_features(hidden, LAYER_IDS)  # [1, 7, L*H]
    assert features.shape == (1, 7, len(LAYER_IDS) * H)
    for slot, layer in enumerate(LAYER_IDS):
        torch.testing.assert_close(features[..., slot * H:(slot + 1) * H], outputs[layer], rtol=0, atol=0)


def test_evaluate_online_reports_lossless_and_speed(target):
    prompts = [Prompt(source={"file": "p.jsonl", "index": i}, token_ids=prompt_ids(4 + 3 * i, seed=10 + i))
               for i in range(3)]
    result = evaluate_online(target, untrained_proposer(target, 4), prompts, max_new_tokens=12,
                             verify_size=4, layer_ids=LAYER_IDS, stop_token_ids=set())
    assert result["lossless"] is True
    assert result["mismatches"] == []
    assert result["num_prompts"] == 3
    assert result["new_tokens"] == 36
    assert (result["num_drafts"], result["verify_size"]) == (3, 4) and len(result["per_position_acceptance"]) == 3
    assert 1.0 <= result["acceptance_length"] <= 4.0
    assert result["tokens_per_s"] > 0 and result["baseline_tokens_per_s"] > 0


def test_evaluate_online_reports_a_mismatch(target, monkeypatch):
    """If the speculative path diverged, `lossless` is false and the mismatch is located."""
    import dflash.train.online as online

    prompts = [Prompt(source={"file": "p.jsonl", "index": 7}, token_ids=prompt_ids(5, seed=20))]
    real = online.speculative_generate

    def diverging(*args, **kwargs):
        out = real(*args, **kwargs)
        out.tokens[3] = (out.tokens[3] + 1) % V
        return out

    monkeypatch.setattr(online, "speculative_generate", diverging)
    result = evaluate_online(target, untrained_proposer(target, 4), prompts, max_new_tokens=10,
                             verify_size=4, layer_ids=LAYER_IDS, stop_token_ids=set(), warmup=False)
    assert result["lossless"] is False
    (mismatch,) = result["mismatches"]
    assert (mismatch["file"], mismatch["index"], mismatch["position"]) == ("p.jsonl", 7, 3)
    assert mismatch["speculative_token"] == (mismatch["reference_token"] + 1) % V
    assert mismatch["reference_margin"] > 0


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 17])
def test_rows_linear_is_linear(rows):
    import torch.nn.functional as F

    from dflash.train.speculative import rows_linear

    torch.manual_seed(0)
    x, weight, bias = torch.randn(1, rows, 41), torch.randn(1031, 41), torch.randn(1031)
    expected = (x.double() @ weight.double().T + bias.double()).float()  # [1, rows, 1031]
    # Another summation order: float32 rounding of 41-term sums only.
    assert torch.allclose(rows_linear(x, weight, bias), expected, rtol=1e-5, atol=1e-5)
    if rows == 1:
        assert torch.equal(rows_linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 17])
def test_a_routed_layer_gives_what_f_linear_gives(rows):
    """Inside decoding_linear a layer computes through rows_linear: F.linear's values up to the
    order of the sums (equal bit for bit at one row and past SMALL_ROWS, where rows_linear is
    F.linear), and after the block it is torch's layer again."""
    import torch.nn.functional as F

    from dflash.train.speculative import SMALL_ROWS, decoding_linear, rows_linear

    torch.manual_seed(0)
    x, layer = torch.randn(1, rows, 41), torch.nn.Linear(41, 1031)
    with torch.no_grad():
        plain = F.linear(x, layer.weight, layer.bias)  # [1, rows, 1031]
        with decoding_linear(layer):
            routed = layer(x)
            assert torch.equal(routed, rows_linear(x, layer.weight, layer.bias))
        torch.testing.assert_close(routed, plain, rtol=1e-5, atol=1e-5)  # float32 sums of 41 terms
        if rows == 1 or rows > SMALL_ROWS:
            assert torch.equal(routed, plain)
        assert "forward" not in vars(layer) and torch.equal(layer(x), plain)


def test_cpu_decoding_leaves_torch_linear_alone(target):
    """While a CPU decode runs, torch.nn.functional.linear is torch's own (no process-wide swap:
    every other model and thread computes as it would), yet the target's and the drafter's
    layers compute through rows_linear; afterwards neither keeps a routed layer."""
    torch_linear = torch.nn.functional.linear
    proposer = untrained_proposer(target, 4)
    drafter_layer = next(m for m in proposer.drafter.modules() if type(m) is torch.nn.Linear)
    seen = []  # (which layer, F.linear is torch's, the layer routed) at every forward of either
    hooks = [layer.register_forward_hook(
        lambda module, args, out, name=name: seen.append(
            (name, torch.nn.functional.linear is torch_linear, "forward" in vars(module))))
        for name, layer in (("target", target.lm_head), ("drafter", drafter_layer))]
    try:
        prompt = prompt_ids(7, seed=8)
        reference = greedy_generate(target, prompt, max_new_tokens=9, stop_token_ids=set())
        out = speculative_generate(target, proposer, prompt, max_new_tokens=9, verify_size=4,
                                   layer_ids=LAYER_IDS, stop_token_ids=set())
    finally:
        for hook in hooks:
            hook.remove()
    assert out.tokens == reference.tokens
    assert {name for name, _, _ in seen} == {"target", "drafter"}
    assert all(unswapped and routed for _, unswapped, routed in seen), seen
    assert not any("forward" in vars(m) for model in (target, proposer.drafter) for m in model.modules())


def test_decoding_linear_routes_only_plain_cpu_layers_and_nests():
    """Left alone: a layer off the CPU (meta here, as CUDA would be: the small-row product is
    a CPU matter), a subclass of nn.Linear (a quantized layer computes its own way) and a
    layer whose instance already has its own forward, which an inner block leaves in place."""
    from dflash.train.speculative import decoding_linear

    class Subclass(torch.nn.Linear):
        pass

    cpu, meta, sub = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, device="meta"), Subclass(4, 4)
    model = torch.nn.Sequential(cpu, meta, sub)
    with decoding_linear(model):
        assert ["forward" in vars(m) for m in (cpu, meta, sub)] == [True, False, False]
        outer = cpu.forward
        with decoding_linear(model):
            assert cpu.forward is outer
        assert cpu.forward is outer
    assert not any("forward" in vars(m) for m in (cpu, meta, sub))


@pytest.mark.parametrize("transposed", [True, False])
def test_rows_linear_keeps_the_form_it_timed_and_both_forms_are_linear(transposed):
    import torch.nn.functional as F

    from dflash.train import speculative

    torch.manual_seed(1)
    x, weight = torch.randn(2, 3, 37), torch.randn(517, 37)  # 6 rows
    key = (6, 517, 37, torch.float32, torch.float32)
    speculative._TRANSPOSED_FASTER.pop(key, None)
    speculative.rows_linear(x, weight)
    assert isinstance(speculative._TRANSPOSED_FASTER[key], bool)  # timed once, remembered
    speculative._TRANSPOSED_FASTER[key] = transposed
    try:
        out = speculative.rows_linear(x, weight)
        expected = (x.double() @ weight.double().T).float()
        assert out.shape == (2, 3, 517) and torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
        if not transposed:
            assert torch.equal(out, F.linear(x, weight))
    finally:
        speculative._TRANSPOSED_FASTER.pop(key, None)


# --------------------------------------------------------------------------- near-ties in bf16


def decoded(tokens, top_ids, top_logits):
    """A DecodeResult from per-token contenders (margins from the logits)."""
    from dflash.train.speculative import DecodeResult

    return DecodeResult(tokens=tokens, margins=[z[0] - z[1] for z in top_logits], top_ids=top_ids,
                        top_logits=top_logits)


# One reference token, 5, with contenders 9 (0.02 below), 7 (2.0 below); the bf16 bound at a top
# logit of 4.0 is 16 * 2^-8 * 4 = 0.25, the float32 one 16 * 2^-24 * 4 = 3.8e-6.
REFERENCE = decoded([1, 5], [[1, 2], [5, 9, 7]], [[8.0, 1.0], [4.0, 3.98, 2.0]])


@pytest.mark.parametrize("speculative, dtype, near_tie, gap", [
    ([1, 9], torch.bfloat16, True, 0.02),    # the runner-up, within bf16 rounding: a near-tie
    ([1, 9], torch.float32, False, 0.02),    # the same gap is far beyond float32 rounding
    ([1, 7], torch.bfloat16, False, 2.0),    # the third choice, 2 logits below: real
    ([1, 3], torch.bfloat16, False, None),   # not among the reference's contenders: real
    ([1], torch.bfloat16, False, None),      # an output that ends early: real
])
def test_first_mismatch_tells_a_near_tie_from_a_real_one(speculative, dtype, near_tie, gap):
    from dflash.train.online import first_mismatch, near_tie_bound

    out = first_mismatch(REFERENCE, decoded(speculative, [[1, 2], [speculative[-1], 5]], [[8.0, 1.0], [4.0, 3.9]]),
                         dtype)
    assert out["position"] == 1 and out["near_tie"] is near_tie
    assert out["reference_margin"] == pytest.approx(0.02)
    assert out["reference_gap"] == (None if gap is None else pytest.approx(gap))
    if gap is not None:
        assert out["tie_bound"] == pytest.approx(near_tie_bound(4.0, dtype))
    assert near_tie_bound(4.0, torch.bfloat16) == pytest.approx(0.25)


@pytest.fixture(scope="module")
def bf16_target():
    """A random Llama at the default initialisation (0.02), in bf16: logits about 1, on bf16's
    grid of 2^-7 there, so near-ties (exact ones too) are common, as on the H200 (issue 42)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=NUM_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def planted(monkeypatch, position_of, replacement):
    """Make online's speculative_generate return its real output with the token at
    `position_of(reference)` replaced by `replacement(reference, position)`, the reference being
    the target's greedy output (recorded from greedy_generate)."""
    import dflash.train.online as online

    references = []
    real_greedy, real_speculative = online.greedy_generate, online.speculative_generate

    def greedy(*args, **kwargs):
        references.append(real_greedy(*args, **kwargs))
        return references[-1]

    def speculative(*args, **kwargs):
        out, reference = real_speculative(*args, **kwargs), references[-1]
        i = position_of(reference)
        out.tokens = reference.tokens[:i] + [replacement(reference, i)] + reference.tokens[i + 1:]
        return out

    monkeypatch.setattr(online, "greedy_generate", greedy)
    monkeypatch.setattr(online, "speculative_generate", speculative)


def closest_call(reference):
    """The generated position where the reference's top-2 margin is smallest."""
    return min(range(len(reference.tokens)), key=lambda i: reference.margins[i])


def widest_call(reference):
    return max(range(len(reference.tokens)), key=lambda i: reference.margins[i])


def outsider(reference, i):
    """A token the reference does not rank among its contenders at position i."""
    return next(t for t in range(V) if t not in reference.top_ids[i])


@pytest.mark.parametrize("position_of, replacement, near_ties, real", [
    (closest_call, lambda ref, i: ref.top_ids[i][1], 1, 0),   # the runner-up at the closest call
    (widest_call, outsider, 0, 1),                            # a wrong token where the target is sure
    (closest_call, outsider, 0, 1),                           # a wrong token even where it hesitates
])
def test_planted_mismatches_in_bf16(bf16_target, monkeypatch, position_of, replacement, near_ties, real):
    """A planted near-tie is reported as one and passes; a planted real mismatch fails."""
    from dflash.train.online import near_tie_bound

    prompts = [Prompt(source={"file": "p.jsonl", "index": 3}, token_ids=prompt_ids(6, seed=30))]
    planted(monkeypatch, position_of, replacement)
    result = evaluate_online(bf16_target, untrained_proposer(bf16_target, 4), prompts, max_new_tokens=24,
                             verify_size=4, layer_ids=LAYER_IDS, stop_token_ids=set(), warmup=False)
    (mismatch,) = result["mismatches"]
    assert (result["num_near_ties"], result["num_real_mismatches"]) == (near_ties, real)
    assert result["lossless"] is (real == 0) and result["per_prompt"][0]["lossless"] is (real == 0)
    assert mismatch["near_tie"] is (near_ties == 1)
    if near_ties:  # the closest call of a bf16 random target is within rounding (the fixture's premise)
        assert mismatch["reference_gap"] == mismatch["reference_margin"] <= near_tie_bound(1.0, torch.bfloat16)


@pytest.mark.parametrize("verify_size", [4, 16])
def test_bf16_decoding_differs_only_at_near_ties(bf16_target, verify_size):
    """Real speculative decoding of the bf16 random target: wherever it leaves the greedy output
    (a B-token verify and a one-token step round differently), it is at a near-tie."""
    prompts = [Prompt(source={"file": "p.jsonl", "index": i}, token_ids=prompt_ids(5 + 4 * i, seed=40 + i))
               for i in range(4)]
    result = evaluate_online(bf16_target, untrained_proposer(bf16_target, verify_size), prompts, max_new_tokens=32,
                             verify_size=verify_size, layer_ids=LAYER_IDS, stop_token_ids=set(), warmup=False)
    assert result["num_real_mismatches"] == 0 and result["lossless"] is True
    assert result["num_near_ties"] == len(result["mismatches"])


@pytest.mark.parametrize("caller_flash", [True, False])
@pytest.mark.parametrize("device, cudnn", [("cpu", True), ("cuda", False)])
def test_decoding_attention_leaves_out_cudnn_on_cuda_only(device, cudnn, caller_flash):
    """cuDNN's attention builds a graph per key length (a new one every decode step): decoding
    on CUDA runs without it, the other backends as the caller set them, and torch's flags come
    back after; the CPU is left alone."""
    from dflash.train.speculative import decoding_attention

    flags = torch.backends.cuda

    def state():
        return (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled(),
                flags.math_sdp_enabled())

    flags.enable_flash_sdp(caller_flash)
    try:
        before = state()
        assert before == (True, caller_flash, True, True)
        with decoding_attention(torch.device(device)):
            assert state() == (cudnn, caller_flash, True, True)
        assert state() == before
    finally:
        flags.enable_flash_sdp(True)


@pytest.mark.parametrize("near_tie, lossless_line, mismatch_line", [
    (True, "lossless yes (1 near-tie within bfloat16 rounding, no real mismatch)",
     "near-tie p.jsonl:3 at token 5: target 11 (margin 0, gap to it 0 (bound 0.25)), speculative 12"),
    (False, "lossless NO (1 real mismatch)",
     "mismatch p.jsonl:3 at token 5: target 11 (margin 2, gap to it 2 (bound 0.25)), speculative 12"),
])
def test_the_report_names_near_ties_and_real_mismatches(near_tie, lossless_line, mismatch_line):
    from dflash.train.evaluate import format_report

    gap = 0.0 if near_tie else 2.0
    online = {"acceptance_length": 2.0, "num_verifications": 10, "num_prompts": 1, "tokens_per_s": 10.0,
              "baseline_tokens_per_s": 5.0, "speedup": 2.0, "device": "cuda", "dtype": "bfloat16",
              "temperature": 0.0, "seed": None, "rejected": [], "lossless": near_tie,
              "num_near_ties": int(near_tie), "num_real_mismatches": int(not near_tie),
              "mismatches": [{"file": "p.jsonl", "index": 3, "position": 5, "reference_token": 11,
                              "speculative_token": 12, "reference_margin": gap, "reference_gap": gap,
                              "tie_bound": 0.25, "near_tie": near_tie}]}
    report = format_report({"checkpoint": "run/checkpoints/step-1", "online": online})
    assert lossless_line in report and mismatch_line in report


@pytest.mark.parametrize("regenerated, made, online, label", [
    (True, "float32", "float32", "(= online greedy tau (replies regenerated greedily in float32))"),
    (True, "bfloat16", None, "(= online greedy tau (replies regenerated greedily in bfloat16))"),  # offline only
    (True, None, "float32", "(= online greedy tau (replies regenerated greedily))"),  # an engine's replies
    (True, "bfloat16", "float32",
     "(near online greedy tau: replies regenerated greedily in bfloat16, decoded online in float32)"),
    (False, None, "float32", "(proxy: replies not the target's greedy output)"),
])
def test_the_replay_says_when_it_is_the_online_tau(regenerated, made, online, label):
    """The replay equals online greedy tau only when the cached replies are the target's greedy
    output at the precision online decoding uses (a bf16 stage one, a float32 online check:
    near-ties go the other way)."""
    from dflash.train.evaluate import format_report

    result = {"checkpoint": "run/checkpoints/step-1", "acceptance_length": 2.0, "num_anchors": 9,
              "num_sequences": 2, "num_drafts": 3, "verify_size": 4, "replay_acceptance_length": 1.5,
              "num_replay_verifications": 4, "per_position_acceptance": [0.5, 0.25, 0.0],
              "per_position_match": [0.5, 0.5, 0.25], "regenerated": regenerated,
              "generation_temperature": 0.0 if regenerated else None, "generation_dtype": made}
    if online is not None:
        result["online"] = {"acceptance_length": 2.0, "num_verifications": 10, "num_prompts": 1,
                            "tokens_per_s": 10.0, "baseline_tokens_per_s": 5.0, "speedup": 2.0, "device": "cpu",
                            "dtype": online, "temperature": 0.0, "seed": None, "rejected": [], "lossless": True,
                            "num_near_ties": 0, "num_real_mismatches": 0, "mismatches": []}
    assert f"replayed decoding tau 1.500 over 4 verifications {label}" in format_report(result)
