"""`dflash-train eval` and `export` end to end: a real (tiny) fit run, its held-out set, the
online check against a tiny Hugging Face target with a chat template, and the export card.

The online test builds its cache the way stage one does with `--regenerate` (the target's
own greedy replies to each record's prompt, features `hidden_states[id + 1]`, top-k of the
log-softmax), written with the real cache writer, so that the held-out records of the cache
are prompts of the JSONL file and offline and online figures come out side by side.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from dflash.shards import CacheSpec, CacheWriter, finalize_cache, open_cache
from dflash.testing.builders import char_chat_target, char_tokenizer, tiny_fit_config, write_jsonl
from dflash.train.acceptance import evaluate_offline
from dflash.train.cli import main
from dflash.train.data import held_out_mask
from dflash.train.fit import fit
from dflash.train.loading import load_drafter, load_exported
from dflash.train.model import TargetHead
from dflash.train.synthetic import write_synthetic_training_cache

LAYER_IDS = [1, 3]


pytestmark = pytest.mark.e2e


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def fit_run(cache: Path, out: Path, **overrides) -> Path:
    defaults = dict(anchors_per_seq=8, epochs=1, max_steps=3, checkpoint_every=3, eval_fraction=0.25)
    fit(tiny_fit_config(cache, out, **(defaults | overrides)))
    return out


@pytest.fixture(scope="module")
def synthetic_run(synthetic_training_cache, tmp_path_factory) -> tuple[Path, Path]:
    return synthetic_training_cache, fit_run(synthetic_training_cache, tmp_path_factory.mktemp("synthetic") / "run")


def test_offline_eval_scores_the_held_out_sequences(synthetic_run):
    cache_dir, run = synthetic_run
    result = CliRunner().invoke(main, ["eval", "--run", str(run), "--json"])
    assert result.exit_code == 0, result.output
    figures = last_json(result.output)
    held = np.flatnonzero(held_out_mask(8, 0.25, 0))
    assert figures["num_sequences"] == len(held) == 2
    # The same figures from the plain function on exactly those sequences.
    cache = open_cache(cache_dir)
    loaded = load_drafter(run)
    expected = evaluate_offline(loaded.drafter, TargetHead.load(cache.target_dir, dtype=torch.float32),
                                [cache[int(i)] for i in held], verify_size=4)
    for key in ("acceptance_length", "per_position_acceptance", "num_anchors", "replay_acceptance_length"):
        assert figures[key] == expected[key], key
    assert 1.0 <= figures["acceptance_length"] <= 4.0
    assert len(figures["per_position_acceptance"]) == 3
    assert Path(figures["saved_to"]) == run / "eval" / f"{Path(figures['checkpoint']).name}.json"
    saved = json.loads(Path(figures["saved_to"]).read_text())
    assert saved["acceptance_length"] == figures["acceptance_length"]
    assert "offline  tau" in result.output


def test_other_cache_is_scored_whole_and_num_drafts_can_shrink(synthetic_run, tmp_path):
    _, run = synthetic_run
    write_synthetic_training_cache(tmp_path / "other", lengths=[30, 31, 32], seed=5)
    result = CliRunner().invoke(main, ["eval", "--run", str(run), "--cache", str(tmp_path / "other"),
                                       "--num-drafts", "2", "--no-save", "--json"])
    assert result.exit_code == 0, result.output
    figures = last_json(result.output)
    assert figures["num_sequences"] == 3
    assert (figures["num_drafts"], figures["verify_size"]) == (2, 3) and len(figures["per_position_acceptance"]) == 2


def test_export_cli_carries_the_measured_tau(synthetic_run, tmp_path):
    _, run = synthetic_run
    runner = CliRunner()
    figures = last_json(runner.invoke(main, ["eval", "--run", str(run), "--json"]).output)
    result = runner.invoke(main, ["export", "--run", str(run), "--out", str(tmp_path / "export"),
                                  "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert 'the folder name lacks "dflash"' in result.output  # vLLM would guess another method
    named = runner.invoke(main, ["export", "--run", str(run), "--out", str(tmp_path / "my-dflash")])
    assert named.exit_code == 0 and "lacks" not in named.output, named.output
    card = (tmp_path / "export" / "README.md").read_text()
    assert f"| {figures['acceptance_length']:.3f} |" in card
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 2, 4]
    reloaded = load_exported(tmp_path / "export")
    original = load_drafter(run).drafter
    for name, tensor in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_eval_errors_are_one_line(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["eval", "--online", "--run", str(tmp_path)])
    assert result.exit_code == 1 and result.output.startswith("Error: ") and "--target" in result.output
    result = runner.invoke(main, ["eval", "--run", str(tmp_path / "missing")])
    assert result.exit_code == 1 and result.output.startswith("Error: ") and "dflash-train fit" in result.output


# --------------------------------------------------------------------------- online


def regenerated_cache(target, tokenizer, prompts_path: Path, cache_dir: Path, max_new_tokens: int) -> None:
    """A cache of the target's greedy replies to every record's prompt (as stage one's --regenerate)."""
    from dflash.train.online import ChatRenderer, load_prompts
    from dflash.train.speculative import greedy_generate, target_features

    V, H = target.config.vocab_size, target.config.hidden_size
    spec = CacheSpec(vocab_size=V, hidden_size=H, layer_ids=LAYER_IDS, top_k=8, topk_codec="raw",
                     max_length=256, regenerated=True, generation_temperature=0.0,
                     target={"name": "tiny-chat", "model_type": "qwen3", "num_layers": 6, "dtype": "float32"})
    prompts, _ = load_prompts(prompts_path, ChatRenderer(tokenizer))
    writer = CacheWriter(cache_dir, spec, rank=0, world_size=1)
    for prompt in prompts:
        reply = greedy_generate(target, prompt.token_ids, max_new_tokens=max_new_tokens,
                                stop_token_ids={2}).tokens
        ids = torch.tensor([prompt.token_ids + reply])  # [1, T]
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
        features = target_features(out.hidden_states, LAYER_IDS)[0].view(ids.shape[1], len(LAYER_IDS), H)
        top = torch.log_softmax(out.logits[0].double(), -1).topk(8)
        mask = np.zeros(ids.shape[1], dtype=bool)
        mask[len(prompt.token_ids):] = True
        writer.add(input_ids=ids[0].numpy(), loss_mask=mask, features=features.numpy(),
                   topk_ids=top.indices.numpy().astype(np.int32),
                   topk_logprobs=top.values.float().numpy(), source=prompt.source)
    writer.close()
    finalize_cache(cache_dir, spec, 1)
    head = cache_dir / "target"
    head.mkdir()
    save_file({"embed_tokens.weight": target.get_input_embeddings().weight.detach().contiguous(),
               "lm_head.weight": target.get_output_embeddings().weight.detach().contiguous()},
              str(head / "head.safetensors"))
    (head / "config.json").write_text(target.config.to_json_string())
    (head / "target.json").write_text(json.dumps({
        "layer_ids": LAYER_IDS, "num_layers": 6, "hidden_size": H, "vocab_size": V,
        "tie_word_embeddings": False, "model_type": "qwen3", "mask_token_id": None, "pad_token_id": 0,
        "eos_token_id": 2, "bos_token_id": None, "rms_norm_eps": 1e-6, "rope_theta": 1e6}))


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tokenizer = char_tokenizer()
    target = char_chat_target(tokenizer)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    words = ["hello", "how are you", "tell me a story", "what is this", "ok", "fine thanks", "why", "no"]
    prompts = root / "chat.jsonl"
    with open(prompts, "w") as f:
        for i in range(10):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": words[i % 8]}, {"role": "assistant", "content": words[(i + 3) % 8]},
                {"role": "user", "content": words[(i * 5) % 8] + "?"}]}) + "\n")
    regenerated_cache(target, tokenizer, prompts, root / "cache", max_new_tokens=20)
    run = fit_run(root / "cache", root / "run", eval_fraction=0.3)
    return root, prompts, run


def test_online_eval_is_lossless_beside_offline(chat_setup):
    root, prompts, run = chat_setup
    result = CliRunner().invoke(main, [
        "eval", "--online", "--run", str(run), "--cache", str(root / "cache"), "--target", str(root / "target"),
        "--prompts", str(prompts), "--max-new-tokens", "20", "--json"])
    assert result.exit_code == 0, result.output
    figures = last_json(result.output)
    online = figures["online"]
    held = np.flatnonzero(held_out_mask(10, 0.3, 0))
    # The held-out sequences are the prompts: both sides see the same conversations.
    assert figures["num_sequences"] == online["num_prompts"] == len(held)
    assert sorted(p["index"] for p in online["per_prompt"]) == held.tolist()
    steps = [n for p in online["per_prompt"] for n in p["acceptance_lengths"]]  # per verify, for engine checks
    assert all(1 <= n <= 4 for n in steps) and np.mean(steps) == pytest.approx(online["acceptance_length"])
    assert online["lossless"] is True and online["mismatches"] == []
    assert online["stop_token_ids"] == [2]
    assert 1.0 <= online["acceptance_length"] <= 4.0
    assert online["tokens_per_s"] > 0 and online["baseline_tokens_per_s"] > 0
    assert figures["regenerated"] is True and figures["replay_acceptance_length"] is not None
    # The cache holds the target's greedy replies (cut at 20 tokens or ended by the stop token):
    # decoding replayed along them commits what online decoding commits, verification for
    # verification (the drafter sees the same features up to fp32 rounding).
    assert figures["num_replay_verifications"] == online["num_verifications"]
    assert figures["replay_acceptance_length"] == pytest.approx(online["acceptance_length"], abs=1e-12)
    assert "online   tau" in result.output and "lossless yes" in result.output
    assert figures["generation_dtype"] == "float32"  # the precision online decoding used: the replay is its tau
    assert "(= online greedy tau (replies regenerated greedily in float32))" in result.output


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_online_eval_decodes_suites_by_name(chat_setup, tmp_path, temperature):
    """Local copies of two suites in their hub columns; the report has one column per suite,
    and RUN/eval/<checkpoint>.json keeps each (suite, temperature, seed)."""
    root, prompts, run = chat_setup
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": q} for q in ["what is 2+2", "and 3+3", "why"]])
    mt_bench = write_jsonl(tmp_path / "mt.jsonl", [{"prompt": ["hello", "tell me a story"]}])
    result = CliRunner().invoke(main, [
        "eval", "--online", "--run", str(run), "--target", str(root / "target"),
        "--prompts", f"gsm8k={gsm8k},mt-bench={mt_bench}", "--limit", "2", "--max-new-tokens", "10",
        "--temperature", temperature, "--seed", "3", "--json"])
    assert result.exit_code == 0, result.output
    figures = last_json(result.output)
    suites = {e["suite"]: e for e in figures["suites"]}
    assert (suites["gsm8k"]["num_prompts"], suites["mt-bench"]["num_prompts"]) == (2, 1)
    assert suites["mt-bench"]["num_turns"] == 2 and suites["gsm8k"]["num_turns"] == 2
    sampled = temperature != "0"
    assert all(e["lossless"] is (None if sampled else True) and e["temperature"] == float(temperature)
               for e in suites.values())
    assert all(1.0 <= e["acceptance_length"] <= 4.0 and len(e["per_position_acceptance"]) == 3
               for e in suites.values())
    header = next(line for line in result.output.splitlines() if "gsm8k" in line and "mt-bench" in line)
    assert header.split() == ["gsm8k", "mt-bench"]
    assert "tau, mean over turns" in result.output and "accepted through 3" in result.output
    assert "3 drafts per verify of 4, at most 10 new tokens per turn" in result.output
    assert all((e["num_drafts"], e["verify_size"]) == (3, 4) for e in suites.values())
    saved = json.loads(Path(figures["saved_to"]).read_text())["suites"]
    assert all(any(s == e for s in saved) for e in figures["suites"])


def test_online_eval_refuses_a_cache_with_suites(chat_setup):
    root, prompts, run = chat_setup
    result = CliRunner().invoke(main, [
        "eval", "--online", "--run", str(run), "--cache", str(root / "cache"), "--target", str(root / "target"),
        "--prompts", "gsm8k"])
    assert result.exit_code == 1 and result.output.startswith("Error: ") and "drop --cache" in result.output


@pytest.mark.parametrize("num_drafts", ["1", "15"])
def test_online_eval_without_cache_uses_every_prompt(chat_setup, num_drafts):
    root, prompts, run = chat_setup
    result = CliRunner().invoke(main, [
        "eval", "--online", "--run", str(run), "--target", str(root / "target"), "--prompts", str(prompts),
        "--max-new-tokens", "13", "--num-drafts", num_drafts, "--limit", "3", "--no-save", "--json"])
    assert result.exit_code == 0, result.output
    figures = last_json(result.output)
    assert "acceptance_length" not in figures
    assert figures["online"]["num_prompts"] == 3 and figures["online"]["lossless"] is True


def test_the_demos_out_of_domain_line(chat_setup, tmp_path):
    """demo/out_of_domain.py on a tiny run: in domain and suite-style prompts at T = 0 and 1."""
    from demo.out_of_domain import format_line, format_table, out_of_domain

    root, prompts, run = chat_setup
    result = out_of_domain(work=tmp_path, run_dir=run, target=root / "target", cache=root / "cache", data=prompts,
                           suites=["gsm8k", "mt-bench"], num_prompts=2, max_new_tokens=8, seeds=(0, 1))
    assert [(r["temperature"], r["seed"]) for r in result["runs"]] == [(0.0, None), (1.0, 0), (1.0, 1)]
    greedy, sampled = result["runs"][0], result["runs"][1]
    assert greedy["in_domain"]["lossless"] is True and sampled["in_domain"]["lossless"] is None
    assert [e["suite"] for e in sampled["suites"]] == ["gsm8k", "mt-bench"]
    assert greedy["suites"][1]["num_turns"] == 4 and greedy["in_domain"]["num_prompts"] == 2
    line, table = format_line(result), format_table(result)
    assert "T=0: in domain" in line and "T=1: in domain" in line and "gsm8k-style" in line
    assert table.splitlines()[0] == "| prompts | T = 0 | T = 1 (2 seeds) |" and len(table.splitlines()) == 5
    assert " +- " in table.splitlines()[2]
    print(line, table, sep="\n")
