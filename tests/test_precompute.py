"""Stage one end to end on tiny random targets (a Qwen3 and a Llama with tied embeddings):
the cache holds what a direct forward computes, batches do not leak, bad records are
accounted for, regeneration writes the target's own greedy replies, configurations are
checked, and the command line works. Distributed and kill/resume runs are in
test_precompute_dist.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.common.records import normalize_record
from dflash.precompute.cli import main
from dflash.precompute.data import ChatEncoder
from dflash.precompute.run import _build_spec, run_precompute
from dflash.precompute.target import Target
from dflash.shards import open_cache, verify_cache
from dflash.shards.codecs import topk_kl
from dflash.testing.builders import CONVERSATIONS, RECORDS, build_target, precompute_config, write_jsonl

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {kind: build_target(kind, root / kind) for kind in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", RECORDS)


def reference(model, input_ids: np.ndarray, layer_ids: list[int], top_k: int):
    """The same sequence alone through the model with every hidden state: features [T, L, H]
    and torch.topk of the fp32 log-softmax [T, k]."""
    with torch.no_grad():
        out = model(torch.as_tensor(input_ids, dtype=torch.long)[None], output_hidden_states=True)
    features = torch.stack([out.hidden_states[i + 1][0] for i in layer_ids], dim=1).float()
    values, ids = torch.topk(torch.log_softmax(out.logits[0].float(), dim=-1), top_k)
    return features.numpy(), ids.numpy(), values.numpy()


CASES = {
    # kind, explicit layer ids (None: the DFlash rule), feature codec, top-k codec, dtype
    "qwen3-auto-bf16-raw": ("qwen3", None, "bf16", "raw", "float32"),
    "llama-tied-fp8-packed": ("llama", [0, 2], "fp8", "packed", "float32"),
    # The GPU default: the target in bf16, features handed over as bf16 bits.
    "qwen3-bf16-target": ("qwen3", None, "bf16", "raw", "bfloat16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cache_holds_what_a_direct_forward_computes(targets, data, tmp_path, case):
    kind, layer_ids, feature_codec, topk_codec, dtype = CASES[case]
    # In bf16 the rounding depends on the batch's shape: one sequence per batch there.
    batch_tokens = 1 if dtype == "bfloat16" else 300
    summary = run_precompute(precompute_config(targets[kind], data, tmp_path / "cache", feature_layers=layer_ids,
                                               feature_codec=feature_codec, topk_codec=topk_codec, dtype=dtype,
                                               batch_tokens=batch_tokens))
    cache = open_cache(tmp_path / "cache")
    assert len(cache) == summary.num_sequences == len(RECORDS)
    assert summary.rejected == {}
    assert cache.spec.target["dtype"] == dtype
    model = AutoModelForCausalLM.from_pretrained(targets[kind], dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(targets[kind])
    encoder = ChatEncoder(tokenizer, max_length=3072)
    expected_layers = layer_ids or [1, 2, 3]  # the DFlash rule for 6 layers, 3 features
    assert cache.spec.layer_ids == expected_layers
    for i in range(len(cache)):
        seq = cache[i]
        encoded = encoder.encode(normalize_record(RECORDS[seq.source["index"]]))
        np.testing.assert_array_equal(seq.input_ids, encoded.input_ids)
        np.testing.assert_array_equal(seq.loss_mask, encoded.loss_mask)
        features, ids, logprobs = reference(model, seq.input_ids, expected_layers, 8)
        if dtype == "bfloat16":  # bf16 features pass through bit for bit
            np.testing.assert_array_equal(seq.features, features)
            np.testing.assert_array_equal(seq.topk_ids, ids)
            np.testing.assert_allclose(seq.topk_logprobs, logprobs, atol=1e-5)
            continue
        # Codec bounds: bf16 rounds to 8 significant bits (relative 2^-9); fp8 e4m3 keeps 4
        # (relative 2^-4) with a per-(token, layer) scale, plus its subnormal step of
        # max|x| * 2^-9 / 448 * 448 = max|x| * 2^-9.
        if feature_codec == "bf16":
            np.testing.assert_allclose(seq.features, features, rtol=2**-8, atol=1e-6)
        else:
            amax = np.abs(features).max(axis=-1, keepdims=True)
            assert (np.abs(seq.features - features) <= np.abs(features) * 2**-4 + amax * 2**-9).all()
        np.testing.assert_array_equal(seq.topk_ids, ids)
        exact_tail = np.maximum(0.0, 1.0 - np.exp(logprobs.astype(np.float64)).sum(-1))
        if topk_codec == "raw":
            np.testing.assert_allclose(seq.topk_logprobs, logprobs, atol=1e-5)
            np.testing.assert_allclose(seq.tail_mass, exact_tail, atol=1e-5)
        else:  # the packed codec's budget is 1e-3 nat per token
            kl = topk_kl(logprobs, exact_tail, seq.topk_logprobs, seq.tail_mass)
            assert kl.mean() < 1e-3 and kl.max() < 1e-2
    info = json.loads((tmp_path / "cache" / "target" / "target.json").read_text())
    assert info["layer_ids"] == expected_layers
    assert info["tie_word_embeddings"] == (kind == "llama")
    assert info["vocab_size"] == cache.spec.vocab_size
    head = load_file(tmp_path / "cache" / "target" / "head.safetensors")
    assert head["lm_head.weight"].dtype == getattr(torch, dtype) and info["dtype"] == dtype
    torch.testing.assert_close(head["embed_tokens.weight"], model.get_input_embeddings().weight.detach())
    torch.testing.assert_close(head["lm_head.weight"], model.get_output_embeddings().weight.detach())
    torch.testing.assert_close(head["norm.weight"], model.base_model.norm.weight.detach().float())
    assert AutoTokenizer.from_pretrained(tmp_path / "cache" / "target").chat_template == tokenizer.chat_template
    assert verify_cache(tmp_path / "cache")["ok"]


def test_batch_mates_do_not_change_a_sequences_values(targets):
    target = Target(targets["qwen3"], layer_ids=None, num_feature_layers=3, top_k=8,
                    device=torch.device("cpu"), dtype=torch.float32, trust_remote_code=False)
    encoder = ChatEncoder(target.tokenizer, max_length=3072)
    sequences = [encoder.encode(c).input_ids for c in CONVERSATIONS]  # lengths differ
    alone = target.forward([sequences[2]], ["alone"])[0]
    mixed = target.forward(sequences, [str(i) for i in range(len(sequences))])[2]
    assert mixed.features.shape == alone.features.shape == (len(sequences[2]), 3, 32)
    np.testing.assert_allclose(mixed.features, alone.features, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(mixed.topk_ids, alone.topk_ids)
    np.testing.assert_allclose(mixed.topk_logprobs, alone.topk_logprobs, atol=1e-5)


@pytest.mark.parametrize("regenerate", [False, True])
def test_the_forward_budget_splits_batches_without_changing_the_cache(targets, data, tmp_path, monkeypatch,
                                                                     regenerate):
    """--forward-batch-tokens cuts each planned batch into smaller forwards; the cache holds the
    same rows, in the same order, as with one forward per planned batch."""
    shapes = []
    forward = Target.forward

    def recording(self, sequences, names, **options):
        shapes.append((len(sequences), max(len(s) for s in sequences)))
        return forward(self, sequences, names, **options)

    monkeypatch.setattr(Target, "forward", recording)
    options = dict(regenerate=regenerate, max_new_tokens=6, batch_tokens=300)
    run_precompute(precompute_config(targets["qwen3"], data, tmp_path / "whole", forward_batch_tokens=300,
                                     **options))
    whole, shapes[:] = list(shapes), []
    run_precompute(precompute_config(targets["qwen3"], data, tmp_path / "split", forward_batch_tokens=60,
                                     **options))
    assert all(count * width <= 60 or count == 1 for count, width in shapes)
    assert len(shapes) > len(whole) and max(count for count, _ in whole) > 1
    a, b = open_cache(tmp_path / "whole"), open_cache(tmp_path / "split")
    assert len(a) == len(b) == len(RECORDS)
    for i in range(len(a)):
        assert a.source(i) == b.source(i)
        np.testing.assert_array_equal(a[i].input_ids, b[i].input_ids)
        np.testing.assert_allclose(a[i].features, b[i].features, rtol=2**-8, atol=1e-6)
        np.testing.assert_array_equal(a[i].topk_ids, b[i].topk_ids)


def test_the_automatic_forward_budget_is_small_on_a_cpu_and_the_batch_on_a_gpu(targets, data, tmp_path):
    from types import SimpleNamespace

    from dflash.precompute.pipeline import CPU_FORWARD_TOKENS, RankRun, RankStats

    def budget(device: str, **overrides) -> int:
        config = precompute_config(targets["qwen3"], data, tmp_path / "cache", **overrides)
        return RankRun(config=config, group=None, target=SimpleNamespace(device=torch.device(device)), encoder=None,
                       writer=None, done=set(), stats=RankStats(), log=print, lengths=[], mine=set()).forward_tokens

    assert budget("cpu", batch_tokens=16384) == CPU_FORWARD_TOKENS == 2048
    assert budget("cpu", batch_tokens=300) == 300
    assert budget("cuda", batch_tokens=16384) == 16384
    assert budget("cuda", batch_tokens=16384, forward_batch_tokens=4096) == 4096
    assert budget("cpu", batch_tokens=1024, forward_batch_tokens=4096) == 1024
    with pytest.raises(ValueError, match="--forward-batch-tokens must be >= 0"):
        precompute_config(targets["qwen3"], data, tmp_path / "cache", forward_batch_tokens=-1)


def test_chunked_topk_equals_one_pass(targets, monkeypatch):
    import dflash.precompute.topk as topk_module

    target = Target(targets["llama"], layer_ids=[1, 2], num_feature_layers=2, top_k=5,
                    device=torch.device("cpu"), dtype=torch.float32, trust_remote_code=False)
    sequences = [ChatEncoder(target.tokenizer, 3072).encode(c).input_ids for c in CONVERSATIONS]
    whole = target.forward(sequences, ["x"] * 4)
    monkeypatch.setattr(topk_module, "TOPK_CHUNK_BYTES", 4 * target.vocab_size * 7)  # 7 rows a chunk
    chunked = target.forward(sequences, ["x"] * 4)
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
        # Only the LM-head matmul's row blocking differs: last-bit differences.
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, rtol=0, atol=2e-6)


def test_non_finite_logits_are_an_error_naming_the_record(targets):
    target = Target(targets["qwen3"], layer_ids=None, num_feature_layers=3, top_k=8,
                    device=torch.device("cpu"), dtype=torch.float32, trust_remote_code=False)
    sequences = [ChatEncoder(target.tokenizer, 3072).encode(c).input_ids for c in CONVERSATIONS[:2]]
    with torch.no_grad():
        target.model.get_output_embeddings().weight[7] = float("nan")
    with pytest.raises(ValueError, match="chat.jsonl record 5: non-finite target log-probability at position 0"):
        target.forward(sequences, ["chat.jsonl record 5", "chat.jsonl record 6"])


def test_bad_records_are_rejected_with_reasons(targets, tmp_path):
    records = RECORDS[:2] + ["{broken", {"messages": [{"role": "user", "content": "no reply"}]},
                             {"prompt": "q"}, {"nothing": 1}, RECORDS[2]]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    summary = run_precompute(precompute_config(targets["qwen3"], path, tmp_path / "cache"))
    rejected = [json.loads(line) for line in (tmp_path / "cache" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["index"], r["reason"].split(":")[0]) for r in rejected] == [
        (2, "invalid JSON"), (3, "conversation has no assistant turn"),
        (4, "conversation has no assistant turn"), (5, "record has none of the fields 'messages', 'conversations', "
                                                "'prompt'+'response', 'text'")]
    cache = open_cache(tmp_path / "cache")
    assert sorted(cache.source(i)["index"] for i in range(len(cache))) == [0, 1, 6]
    assert len(cache) + len(rejected) == len(records)
    assert sum(summary.rejected.values()) == 4 and summary.num_sequences == 3
    with pytest.raises(ValueError, match=r"mixed.jsonl record 2: invalid JSON.*--strict"):
        run_precompute(precompute_config(targets["qwen3"], path, tmp_path / "strict", strict=True))


def test_truncation_is_counted_and_overlong_prompts_rejected(targets, data, tmp_path):
    # With the ChatML tiny tokenizer the records render to 59, 109, 56, 130, 60, 49 and 30
    # tokens; record 3's first reply token is at position 84.
    summary = run_precompute(precompute_config(targets["qwen3"], data, tmp_path / "cache", max_length=50))
    cache = open_cache(tmp_path / "cache")
    assert sorted(cache.lengths.tolist()) == [30, 49, 50, 50, 50, 50]
    assert summary.truncated == 4
    assert summary.rejected == {"no assistant token within the first 50 tokens (--max-length)": 1}
    assert cache.source(int(np.argmax(cache.lengths == 49)))["index"] == 5


def test_regeneration_caches_the_targets_greedy_replies(targets, data, tmp_path):
    max_new = 6
    summary = run_precompute(precompute_config(targets["qwen3"], data, tmp_path / "cache", regenerate=True,
                                               max_new_tokens=max_new, limit=2))
    cache = open_cache(tmp_path / "cache")
    assert cache.spec.regenerated and cache.spec.generation_temperature == 0.0
    model = AutoModelForCausalLM.from_pretrained(targets["qwen3"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(targets["qwen3"])
    encoder = ChatEncoder(tokenizer, 3072)
    eos = tokenizer.eos_token_id
    replies = cut_replies = 0
    for i in range(len(cache)):
        seq = cache[i]
        messages = [dict(m) for m in CONVERSATIONS[seq.source["index"]]]
        cut = set()
        for turn, message in enumerate(messages):  # the reference: a plain argmax loop
            if message["role"] != "assistant":
                continue
            ids = torch.tensor([encoder.prompt_ids(messages[:turn])])
            new, finished = [], False
            with torch.no_grad():
                while len(new) < max_new:
                    token = int(model(ids).logits[0, -1].argmax())
                    if token == eos:
                        finished = True
                        break
                    new.append(token)
                    ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            message["content"] = tokenizer.decode(new, skip_special_tokens=True)
            replies += 1
            if not finished:
                cut.add(turn)
        cut_replies += len(cut)
        expected = encoder.encode(messages, cut_turns=frozenset(cut))
        np.testing.assert_array_equal(seq.input_ids, expected.input_ids)
        np.testing.assert_array_equal(seq.loss_mask, expected.loss_mask)
        # A reply cut at max_new_tokens keeps the template's end-of-turn token in the
        # sequence but out of the mask (the target did not write it): the only difference
        # from masking every turn's end.
        every_end = encoder.encode(messages).loss_mask
        unmasked = np.flatnonzero(every_end != seq.loss_mask)
        assert len(unmasked) == len(cut) and every_end[unmasked].all()
        assert all(int(seq.input_ids[p]) in encoder.special_ids for p in unmasked)
    assert summary.regenerated_replies == replies == 3
    assert cut_replies >= 1  # random tiny targets rarely stop within 6 tokens: the cut case is covered
    assert "regenerated  3 replies at temperature 0" in summary.format()


def test_sampled_generation_is_seeded(targets):
    target = Target(targets["llama"], layer_ids=[1], num_feature_layers=1, top_k=4,
                    device=torch.device("cpu"), dtype=torch.float32, trust_remote_code=False)
    prompts = [ChatEncoder(target.tokenizer, 3072).prompt_ids(c[:1]) for c in CONVERSATIONS[:2]]
    first = target.generate(prompts, [8, 8], temperature=1.0, seed=1)
    assert first == target.generate(prompts, [8, 8], temperature=1.0, seed=1)
    assert first != target.generate(prompts, [8, 8], temperature=1.0, seed=2)
    greedy = target.generate(prompts, [8, 3], temperature=0.0, seed=0)
    assert len(greedy[1].token_ids) <= 3


def test_rerun_resumes_refuses_other_configurations_and_overwrites(targets, data, tmp_path):
    out = tmp_path / "cache"
    first = run_precompute(precompute_config(targets["qwen3"], data, out, limit=4))
    assert first.written_sequences == 4
    again = run_precompute(precompute_config(targets["qwen3"], data, out, limit=4))
    assert again.already_complete and again.written_sequences == 0
    extended = run_precompute(precompute_config(targets["qwen3"], data, out, limit=6))  # options differ: continue
    assert extended.written_sequences == 2 and extended.num_sequences == 6
    with pytest.raises(ValueError, match=r"top_k.*--overwrite"):
        run_precompute(precompute_config(targets["qwen3"], data, out, top_k=4))
    replaced = run_precompute(precompute_config(targets["qwen3"], data, out, top_k=4, overwrite=True))
    assert replaced.num_sequences == len(RECORDS) and open_cache(out).spec.top_k == 4


def test_a_partial_cache_of_another_configuration_is_refused(targets, data, tmp_path):
    from dflash.shards import CacheWriter

    out = tmp_path / "cache"
    target = Target(targets["qwen3"], layer_ids=None, num_feature_layers=3, top_k=8,
                    device=torch.device("cpu"), dtype=torch.float32, trust_remote_code=False)
    CacheWriter(out, _build_spec(precompute_config(targets["qwen3"], data, out, top_k=8), target, 1)).abort()
    with pytest.raises(ValueError, match=r"different configuration.*--overwrite"):
        run_precompute(precompute_config(targets["qwen3"], data, out, top_k=5))


@pytest.mark.parametrize("problem, match", [
    ("missing", "no such directory"),
    ("not-causal", "not a causal language model"),
    ("layers", r"--feature-layers 1,9: \[9\] out of range .* 6 decoder layers"),
    ("last-layer", r"--feature-layers 1,5: 5 is the last decoder layer"),
])
def test_target_problems_are_clear_errors_before_any_work(targets, data, tmp_path, problem, match):
    target = targets["qwen3"]
    if problem == "missing":
        target = tmp_path / "nope"
    elif problem == "not-causal":
        target = tmp_path / "vit"
        target.mkdir()
        (target / "config.json").write_text(json.dumps({"model_type": "vit"}))
    layers = {"layers": [1, 9], "last-layer": [1, 5]}.get(problem)
    with pytest.raises(ValueError, match=match):
        run_precompute(precompute_config(target, data, tmp_path / "cache", feature_layers=layers))
    assert not (tmp_path / "cache" / "shards").exists()


def test_out_directory_that_is_not_a_cache_is_refused(targets, data, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a dflash cache"):
        run_precompute(precompute_config(targets["qwen3"], data, tmp_path / "mine", overwrite=True))
    assert (tmp_path / "mine" / "notes.txt").exists()


def test_a_full_disk_writing_the_target_head_is_a_clear_error(targets, data, tmp_path, monkeypatch):
    import safetensors
    import safetensors.torch

    def full_disk(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    args = ["--target", str(targets["llama"]), "--data", str(data), "--out", str(tmp_path / "cache"),
            "--top-k", "4", "--feature-layers", "1,2", "--batch-tokens", "256", "--device", "cpu", "--limit", "2",
            "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "head.safetensors: cannot write the target's embedding and LM head" in result.output
    assert "No space left on device" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_cli_prints_the_summary_and_reports_errors(targets, data, tmp_path):
    args = ["--target", str(targets["llama"]), "--data", str(data), "--out", str(tmp_path / "cache"),
            "--top-k", "4", "--feature-layers", "1,2", "--batch-tokens", "256", "--device", "cpu",
            "--limit", "3", "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "sequences    3 in the cache; 3 written by this run" in result.output
    assert "bytes/token" in result.output and "tokens/s" in result.output
    result = CliRunner().invoke(main, [*args[:-3], "--top-k", "0"])
    assert result.exit_code == 1 and "--top-k must be >= 1" in result.output
    result = CliRunner().invoke(main, [*args, "--feature-layers", "x"])
    assert result.exit_code == 2 and "expected 'auto' or int values separated by ','" in result.output


def test_logit_softcapping_falls_back_to_the_models_own_logits(tmp_path):
    from transformers import Gemma2Config

    from dflash.testing.builders import VOCAB_SIZE, build_tokenizer

    tokenizer = build_tokenizer("chatml")
    gemma = Gemma2Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         final_logit_softcapping=5.0, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma)
    with torch.no_grad():  # logits of several units, where tanh capping is far from identity
        model.get_output_embeddings().weight.normal_(0.0, 1.0)
    model.save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    target = Target(tmp_path / "gemma2", layer_ids=[1], num_feature_layers=1, top_k=6,
                    device=torch.device("cpu"), dtype=torch.float32, trust_remote_code=False)
    assert not target.head_path  # lm_head(h) misses the soft-capping
    sequence = ChatEncoder(tokenizer, 3072).encode(CONVERSATIONS[0]).input_ids
    output = target.forward([sequence], ["x"])[0]
    _, ids, logprobs = reference(target.model, sequence, [1], 6)
    np.testing.assert_array_equal(output.topk_ids, ids)
    np.testing.assert_allclose(output.topk_logprobs, logprobs, atol=1e-5)


def test_overwrite_keeps_the_old_cache_when_the_target_is_wrong(targets, data, tmp_path):
    run_precompute(precompute_config(targets["qwen3"], data, tmp_path / "cache", limit=2))
    with pytest.raises(ValueError, match="no such directory"):
        run_precompute(precompute_config(tmp_path / "typo", data, tmp_path / "cache", overwrite=True))
    assert len(open_cache(tmp_path / "cache")) == 2
