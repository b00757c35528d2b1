"""Stage one through vLLM (`--engine vllm`) writes the cache the transformers engine writes:
on a tiny Llama (tied embeddings), a tiny Qwen3 (its own head) and a tiny Qwen3-MoE, in
float32, in the engine venv (vLLM 0.32's CPU build), every codec, token ids and loss masks
identical, features and top-k within the tolerances below, a 50-step fit on each cache
ending at the same loss, `--regenerate` giving the same replies; a capture with the layer ids
shifted by one, and a top-k read one position off, fail the same comparison. One vLLM engine
per target for the whole module (dflash.precompute.vllm_engine keeps the process's engine
when the next run asks for the same one).

The refusals come before any engine starts (vLLM absent, an architecture vLLM has no model
for, a TP size that does not divide the heads, a layer past the model, a logit transform, a
max length past the model's context);
the tokenizers' check is tested on two tokenizers directly. The first and the last run
without vLLM too.
"""

import importlib.util
import json

import numpy as np
import pytest
import torch

from dflash.precompute.run import run_precompute
from dflash.shards import open_cache, verify_cache
from dflash.testing.builders import RECORDS, precompute_config, tiny_fit_config, vllm_target, write_jsonl

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here (the engine venv has it: "
                                                     "bash bench/engine_venv.sh)")

# qwen3-moe: vLLM's CPU backend runs Qwen3-MoE (4 experts, 2 a token, every layer sparse).
ARCHS = ["llama", "qwen3", "qwen3-moe"]
CODECS = ["bf16", "fp8", "basis-bf16", "basis-fp8"]
# Feature error, max |vllm - transformers| / max |transformers| over a cache, per codec. The
# float32 forwards differ by about 1e-6 relative (vLLM's fused residual add and its own matmul
# order); a codec's rounding turns that into one step of its grid where a value sits on a
# rounding boundary: bf16's step is at most 2^-7 of a value, e4m3's at most 32/448 = 0.071 of
# the row's max (basis codecs: of the coefficients'). Measured (Llama / Qwen3 / Qwen3-MoE):
# bf16 3.4e-3 / 2.0e-3 / 2.3e-3, fp8 5.9e-3 / 7.2e-5 / 1.8e-3, basis-bf16 8.4e-4 / 7.7e-4 /
# 7.6e-4, basis-fp8 6.2e-3 / 5.0e-3 / 6.0e-7; a wider random Llama (bench/stage_one_engines.py)
# reaches 0.064 in fp8, one step.
FEATURE_RTOL = {"bf16": 2**-7, "fp8": 0.08, "basis-bf16": 2**-7, "basis-fp8": 0.08}
# Top-k ids must agree wherever neighbouring log-probs (the (k+1)-th from a top-(k+1)
# reference) are further apart than this; the float32 log-probs differ by about 2e-5 nat.
GAP_BOUND = 1e-3
# The bf16 caches store the top-k raw (lossless): log-probs and tail mass as the float32 forwards
# computed them, which agree to about 2e-5 nat. The fp8 caches store it packed (the default): a
# 5-bit share code can step once where the forwards' tiny difference crosses a code boundary,
# a jump of up to 0.06 nat on a 5% candidate (measured: probabilities 3.1e-3 apart, tail mass
# 3.6e-4), so those compare in probability. Raw: log-probs 2.0e-5 nat, tail 1.8e-6 at most.
TOPK_CODEC = {"bf16": "raw", "fp8": "packed", "basis-bf16": "raw", "basis-fp8": "packed"}
LOGPROB_ATOL = {"raw": 1e-4, "packed": None}
PROB_ATOL = {"raw": 1e-5, "packed": 1e-2}
TAIL_ATOL = {"raw": 1e-5, "packed": 2e-3}
# The 50th step's loss of fits on the two caches (same seed, same rows, features a bf16 step
# apart at a few positions): measured 1.5e-6 relative at most.
FIT_LOSS_RTOL = 1e-4
MAX_LENGTH = 160


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "data.jsonl", RECORDS * 2)


@pytest.fixture(scope="module", params=ARCHS)
def arch_target(request, tmp_path_factory):
    return request.param, vllm_target(tmp_path_factory.mktemp(request.param) / "target", request.param)


def _config(target, data, out, **overrides):
    return precompute_config(target, data, out, **{"dtype": "float32", "max_length": MAX_LENGTH, **overrides})


@pytest.fixture(scope="module")
def caches(arch_target, data, tmp_path_factory):
    """{(engine, codec): cache path} for one target, both engines, every codec; the vLLM basis
    caches encode with the transformers cache's basis (`feature_basis`), so their coefficients
    compare, and a vLLM cache with its own basis fit ("vllm-fit", basis-fp8) is built too."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed here (the engine venv has it: bash bench/engine_venv.sh)")
    _, target = arch_target
    root = tmp_path_factory.mktemp("caches")
    paths = {}
    for codec in CODECS:
        paths["transformers", codec] = root / f"transformers-{codec}"
        run_precompute(_config(target, data, paths["transformers", codec], feature_codec=codec,
                               topk_codec=TOPK_CODEC[codec]))
    for codec in CODECS:
        paths["vllm", codec] = root / f"vllm-{codec}"
        basis = {"feature_basis": paths["transformers", codec]} if codec.startswith("basis") else {}
        run_precompute(_config(target, data, paths["vllm", codec], feature_codec=codec, engine="vllm",
                               topk_codec=TOPK_CODEC[codec], **basis))
    paths["vllm-fit", "basis-fp8"] = root / "vllm-fit-basis-fp8"
    run_precompute(_config(target, data, paths["vllm-fit", "basis-fp8"], feature_codec="basis-fp8", engine="vllm"))
    return paths


def compare(reference, candidate, top_k_plus_one: list[np.ndarray], *, position_shift: int = 0) -> dict:
    """The parity figures of two caches of the same records: whether ids and masks are equal,
    the feature error (max abs / max abs of the reference), the worst log-prob and tail
    differences, and the top-k rows whose ids differ where the reference's neighbouring
    log-probs (the (k+1)-th from `top_k_plus_one`, [T, k + 1] per row) are more than GAP_BOUND
    apart. `position_shift` reads the candidate's top-k that many positions late (a broken
    capture, for the test that this comparison catches it)."""
    a, b = open_cache(reference), open_cache(candidate)
    assert len(a) == len(b) > 0
    figures = {"ids_equal": True, "masks_equal": True, "feature_err": 0.0, "logprob_err": 0.0, "prob_err": 0.0,
               "tail_err": 0.0, "topk_mismatches": 0}
    for i in range(len(a)):
        x, y = a[i], b[i]
        figures["ids_equal"] &= np.array_equal(x.input_ids, y.input_ids)
        figures["masks_equal"] &= np.array_equal(x.loss_mask, y.loss_mask)
        scale = max(float(np.abs(x.features).max()), 1e-30)
        figures["feature_err"] = max(figures["feature_err"], float(np.abs(x.features - y.features).max()) / scale)
        ids, logprobs, tail = y.topk_ids, y.topk_logprobs, y.tail_mass
        if position_shift:
            ids, logprobs, tail = (np.roll(v, position_shift, axis=0) for v in (ids, logprobs, tail))
        figures["logprob_err"] = max(figures["logprob_err"], float(np.abs(x.topk_logprobs - logprobs).max()))
        figures["prob_err"] = max(figures["prob_err"], float(np.abs(np.exp(x.topk_logprobs) - np.exp(logprobs)).max()))
        figures["tail_err"] = max(figures["tail_err"], float(np.abs(x.tail_mass - tail).max()))
        gaps = -np.diff(top_k_plus_one[i], axis=1)  # [T, k] gap below each of the top k
        clear = np.minimum(gaps, np.concatenate([gaps[:, :1] * 0 + np.inf, gaps[:, :-1]], axis=1)) > GAP_BOUND
        figures["topk_mismatches"] += int(((x.topk_ids != ids) & clear).sum())
    return figures


@pytest.fixture(scope="module")
def top_k_plus_one(arch_target, caches):
    """Per row of the caches, the transformers target's top-(k+1) log-probs [T, 9] of its ids."""
    from dflash.precompute.target import Target

    _, path = arch_target
    target = Target(path, layer_ids=None, num_feature_layers=3, top_k=9, device=torch.device("cpu"),
                    dtype=torch.float32, trust_remote_code=False)
    cache = open_cache(caches["transformers", "bf16"])
    return [target.forward([cache.input_ids(i)], ["row"])[0].topk_logprobs for i in range(len(cache))]


@needs_vllm
@pytest.mark.parametrize("codec", CODECS)
def test_vllm_cache_equals_transformers_cache(caches, top_k_plus_one, codec):
    figures = compare(caches["transformers", codec], caches["vllm", codec], top_k_plus_one)
    assert figures["ids_equal"] and figures["masks_equal"], figures
    assert figures["feature_err"] <= FEATURE_RTOL[codec], figures
    assert figures["topk_mismatches"] == 0, figures
    topk_codec = TOPK_CODEC[codec]
    assert LOGPROB_ATOL[topk_codec] is None or figures["logprob_err"] <= LOGPROB_ATOL[topk_codec], figures
    assert figures["prob_err"] <= PROB_ATOL[topk_codec] and figures["tail_err"] <= TAIL_ATOL[topk_codec], figures
    verify_cache(caches["vllm", codec])


@needs_vllm
def test_vllm_cache_records_the_engine_and_the_same_target_folder(caches):
    a, b = open_cache(caches["transformers", "bf16"]), open_cache(caches["vllm", "bf16"])
    assert b.spec.target["engine"].startswith("vllm 0.")
    assert "engine" not in a.spec.target
    assert b.spec.options["engine"] == "vllm"
    target_a, target_b = caches["transformers", "bf16"] / "target", caches["vllm", "bf16"] / "target"
    assert json.loads((target_a / "target.json").read_text()) == json.loads((target_b / "target.json").read_text())
    from safetensors.torch import load_file

    head_a, head_b = load_file(target_a / "head.safetensors"), load_file(target_b / "head.safetensors")
    assert head_a.keys() == head_b.keys()
    for name in head_a:  # the transformers engine reads the norm by probing the module: an ulp apart
        torch.testing.assert_close(head_a[name], head_b[name], rtol=1e-6, atol=0)


@needs_vllm
def test_vllm_basis_fit_matches_the_transformers_one(caches):
    """A vLLM run fitting its own basis finds the transformers run's spectrum."""
    a = open_cache(caches["transformers", "basis-fp8"]).load_feature_basis()
    b = open_cache(caches["vllm-fit", "basis-fp8"]).load_feature_basis()
    np.testing.assert_allclose(b.eigenvalues, a.eigenvalues, rtol=1e-3, atol=1e-6 * float(a.eigenvalues[0]))


@needs_vllm
def test_top_k_one_position_off_fails_the_comparison(caches, top_k_plus_one):
    figures = compare(caches["transformers", "bf16"], caches["vllm", "bf16"], top_k_plus_one, position_shift=1)
    assert figures["topk_mismatches"] > 0 and figures["prob_err"] > 0.1, figures


@needs_vllm
def test_layer_ids_shifted_by_one_fail_the_comparison(arch_target, data, caches, top_k_plus_one, tmp_path):
    """vLLM ids one too high (the off-by-one users report): the features are another layer's."""
    _, target = arch_target
    cache = open_cache(caches["transformers", "bf16"])
    shifted = [i + 1 for i in cache.spec.layer_ids]
    out = tmp_path / "shifted"
    run_precompute(_config(target, data, out, engine="vllm", feature_layers=shifted))
    figures = compare(caches["transformers", "bf16"], out, top_k_plus_one)
    assert figures["feature_err"] > 0.2, figures  # measured 0.81-0.89: another layer's values


@needs_vllm
def test_fit_on_either_cache_ends_at_the_same_loss(caches, tmp_path):
    from dflash.train.fit import fit

    losses = {}
    for engine in ("transformers", "vllm"):
        out = tmp_path / engine
        fit(tiny_fit_config(caches[engine, "bf16"], out, max_steps=50, seed=0))
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[engine] = [line["loss"] for line in lines if "loss" in line]
    assert len(losses["vllm"]) == len(losses["transformers"]) == 50
    np.testing.assert_allclose(losses["vllm"][-1], losses["transformers"][-1], rtol=FIT_LOSS_RTOL)


@needs_vllm
def test_regenerated_cache_equals_transformers_cache(arch_target, data, caches, tmp_path):
    """--regenerate: the replies come from the same vLLM engine (greedy), and the cache equals
    the transformers engine's regenerated one."""
    _, target = arch_target
    paths = {}
    for engine in ("transformers", "vllm"):
        paths[engine] = tmp_path / engine
        run_precompute(_config(target, data, paths[engine], engine=engine, regenerate=True, max_new_tokens=24,
                               topk_codec="raw", limit=6))
    a, b = open_cache(paths["transformers"]), open_cache(paths["vllm"])
    assert a.spec.regenerated and b.spec.regenerated and len(a) == len(b) == 6
    for i in range(len(a)):
        np.testing.assert_array_equal(b.input_ids(i), a.input_ids(i))
        np.testing.assert_array_equal(b.loss_mask(i), a.loss_mask(i))
        scale = float(np.abs(a[i].features).max())
        assert float(np.abs(a[i].features - b[i].features).max()) <= FEATURE_RTOL["bf16"] * scale


# ----------------------------------------------------------------------------- refusals


def test_vllm_not_installed_names_the_install_line(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    target = vllm_target(tmp_path / "target", "llama")
    data = write_jsonl(tmp_path / "data.jsonl", RECORDS)
    with pytest.raises(ValueError, match=r"^--engine vllm: vLLM is not installed .*pip install vllm.*"
                                         r"--engine transformers$"):
        run_precompute(_config(target, data, tmp_path / "cache", engine="vllm"))


@needs_vllm
def test_an_architecture_vllm_cannot_load_is_named(tmp_path):
    from transformers import XGLMConfig

    from dflash.precompute.vllm_engine import VllmTarget

    XGLMConfig(vocab_size=64, d_model=32, num_layers=4, attention_heads=4, ffn_dim=64,
               architectures=["XGLMForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"cannot load architecture XGLMForCausalLM; use --engine transformers$"):
        VllmTarget(tmp_path, layer_ids=[1], num_feature_layers=1, top_k=4, dtype=torch.float32,
                   trust_remote_code=False, tensor_parallel_size=1, max_length=64)


@needs_vllm
@pytest.mark.parametrize(("options", "message"), [
    (dict(feature_layers=[1, 9]), r"--feature-layers 1,9: \[9\] out of range .* 6 decoder layers"),
    (dict(tensor_parallel_size=3), r"--tensor-parallel-size 3 does not divide the 2 attention heads .*give one "
                                   r"of 1, 2$"),
    (dict(max_length=512), r"--max-length 512 does not fit .* context of 512 positions under vLLM .*give "
                           r"--max-length 511 or less$"),
])
def test_bad_options_get_one_line(arch_target, data, tmp_path, options, message):
    _, target = arch_target
    with pytest.raises(ValueError, match=message):
        run_precompute(_config(target, data, tmp_path / "cache", engine="vllm", **options))


@needs_vllm
@pytest.mark.parametrize(("family", "why", "value"), [("gemma2", "final_logit_softcapping", None),
                                                     ("granite", "logits_scaling", 8.0)])
def test_logits_not_head_of_norm_are_refused(tmp_path, family, why, value):
    from dflash.precompute.vllm_engine import VllmTarget
    from dflash.testing.builders import build_family_target
    from dflash.testing.families import FAMILIES

    path = build_family_target(FAMILIES[family], tmp_path / family)
    if value is not None:  # the tiny family's default is the identity (1.0)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, why: value}))
    with pytest.raises(ValueError, match=rf"logits are not lm_head\(norm\(h\)\) \(its config sets .*{why}.*"
                                         r"use --engine transformers$"):
        VllmTarget(path, layer_ids=[1], num_feature_layers=1, top_k=4, dtype=torch.float32,
                   trust_remote_code=False, tensor_parallel_size=1, max_length=64)


def test_tokenizers_that_disagree_are_refused(tmp_path):
    from dflash.precompute.vllm_engine import check_tokenizers_agree
    from dflash.testing.builders import build_tokenizer, char_tokenizer

    with pytest.raises(ValueError, match=r"vLLM's tokenizer and transformers' disagree on .*use --engine "
                                         r"transformers, or fix the tokenizer files$"):
        check_tokenizers_agree(tmp_path, char_tokenizer(), build_tokenizer("chatml"))
    check_tokenizers_agree(tmp_path, char_tokenizer(), char_tokenizer())  # agreeing ones pass


@needs_vllm
@pytest.mark.slow
def test_two_ranks_write_the_rows_of_one(data, tmp_path):
    """Data parallelism: two ranks, one engine each, write the rows one rank writes (by record)."""
    target = vllm_target(tmp_path / "target", "qwen3")
    caches = {}
    for nproc in (1, 2):
        caches[nproc] = tmp_path / f"ranks-{nproc}"
        run_precompute(_config(target, data, caches[nproc], engine="vllm", topk_codec="raw", nproc=nproc))
    one, two = open_cache(caches[1]), open_cache(caches[2])
    by_source = {(two.source(i)["file"], two.source(i)["index"]): i for i in range(len(two))}
    assert len(one) == len(two) == len(by_source)
    for i in range(len(one)):
        j = by_source[one.source(i)["file"], one.source(i)["index"]]
        np.testing.assert_array_equal(two.input_ids(j), one.input_ids(i))
        np.testing.assert_allclose(two[j].features, one[i].features, rtol=0, atol=FEATURE_RTOL["bf16"] *
                                   float(np.abs(one[i].features).max()))
        np.testing.assert_allclose(two[j].topk_logprobs, one[i].topk_logprobs, rtol=0, atol=1e-4)
    verify_cache(caches[2])
