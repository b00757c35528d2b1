"""`fit --drafter dspark` end to end on the tiny synthetic cache: exact resume after SIGKILL,
spike gating, `--init-from` a DFlash drafter; `eval` offline drafts as online decoding does;
online decoding with a DSpark drafter is lossless (greedy and sampled)."""

import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash.shards import open_cache
from dflash.testing.builders import drafter_config, fit_cache, tiny_causal_lm
from dflash.train import drafters
from dflash.train.acceptance import sequence_acceptance, target_top1
from dflash.train.checkpoint import latest_checkpoint, list_checkpoints
from dflash.train.drafters import make as make_drafter
from dflash.train.drafters.dspark import DSparkDrafter
from dflash.train.export import write_export
from dflash.train.fit import fit
from dflash.train.loading import load_drafter
from dflash.train.model import DFlashDrafter, DrafterConfig, TargetHead
from dflash.train.speculative import DrafterProposer, MatchSampler, greedy_generate, speculative_generate
from tests import test_train_fit as train_fit
from tests.test_train_fit import DRIVER, assert_same_checkpoint, poison_steps, read_lines, run_subprocess, tiny_config

pytestmark = pytest.mark.e2e

DSPARK = dict(drafter="dspark", num_drafts=4, markov_rank=8, confidence_head=True)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return fit_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def straight_run(cache_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    result = run_subprocess(tiny_config(cache_dir, out, **DSPARK))
    assert result.returncode == 0, result.stderr
    return out


def test_a_dspark_run_trains_its_heads(straight_run):
    first, last = list_checkpoints(straight_run)[0], latest_checkpoint(straight_run)
    weights = load_file(str(last / "model.safetensors"))
    assert weights["markov_head.markov_w1.weight"].shape == (64, 8)
    assert "confidence_head.proj.bias" in weights
    lines = read_lines(straight_run / "metrics.jsonl")
    assert len(lines[0]["accuracy"]) == 4  # block 4: positions 0..3 all draft
    assert type(load_drafter(straight_run).drafter) is DSparkDrafter
    assert first != last


# test_train_fit's driver: each checkpoint finished before the next step (through the writer's
# `start`), so that on a loaded machine the kill at step 5 surely lands after the step-3 write.
WAITING_DRIVER = DRIVER


def test_resume_after_sigkill_is_exact(cache_dir, straight_run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    config = tiny_config(cache_dir, out, **DSPARK)
    monkeypatch.setattr(train_fit, "DRIVER", WAITING_DRIVER)
    killed = run_subprocess(config, 5, "between-checkpoints")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert latest_checkpoint(out).name == "step-00000003"
    resumed = run_subprocess(config)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_checkpoint(latest_checkpoint(out), latest_checkpoint(straight_run))
    assert [line["loss"] for line in read_lines(out / "metrics.jsonl")] == [
        line["loss"] for line in read_lines(straight_run / "metrics.jsonl")]


def test_a_spiking_batch_is_skipped(cache_dir, tmp_path, monkeypatch):
    poison_steps(monkeypatch, {4}, "nan")
    fit(tiny_config(cache_dir, tmp_path / "run", checkpoint_every=1, max_steps=6, **DSPARK))
    assert [line["skipped"] for line in read_lines(tmp_path / "run" / "metrics.jsonl")] == [
        False, False, False, True, False, False]
    checkpoints = {p.name: p for p in list_checkpoints(tmp_path / "run")}
    a, b = (load_file(str(checkpoints[name] / "model.safetensors")) for name in ("step-00000003", "step-00000004"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the Markov and confidence heads too


def test_init_from_a_dflash_drafter_warm_starts_the_backbone(cache_dir, tmp_path):
    torch.manual_seed(3)
    source = DFlashDrafter(DrafterConfig.from_target(cache_dir / "target", num_hidden_layers=1, num_drafts=7))
    folder = write_export(source, tmp_path / "source", dtype=torch.float32)
    values = dict(max_steps=1, checkpoint_every=100, save_initial=True, num_layers=None, **DSPARK)
    fit(tiny_config(cache_dir, tmp_path / "warm", init_from=str(folder), **values))
    fit(tiny_config(cache_dir, tmp_path / "scratch", **{**values, "num_layers": 1}))
    warm = load_file(str(list_checkpoints(tmp_path / "warm")[0] / "model.safetensors"))
    scratch = load_file(str(list_checkpoints(tmp_path / "scratch")[0] / "model.safetensors"))
    for name, tensor in source.state_dict().items():
        assert torch.equal(warm[name], tensor), name
    heads = [name for name in warm if name.startswith(("markov_head.", "confidence_head."))]
    assert len(heads) == 4
    for name in heads:  # fresh: what a run from scratch of the same seed starts from
        assert torch.equal(warm[name], scratch[name]), name


def test_offline_drafts_are_what_online_decoding_drafts(straight_run, cache_dir):
    """Offline scoring drafts each anchor left to right from its own drafts (the online rule):
    block [x[a], MASK x (N-1)] over the cached features before a, as DrafterProposer does after
    committing them."""
    drafter = load_drafter(straight_run).drafter.eval()
    cache = open_cache(cache_dir)
    head = TargetHead.load(cache.target_dir)
    seq = cache[0]
    B = drafter.config.num_drafts
    scored = sequence_acceptance(drafter, head, seq.input_ids, seq.loss_mask, seq.features,
                                 target_top1(seq.topk_ids, seq.topk_logprobs), verify_size=B + 1)
    assert scored.drafts.shape[1] == B
    proposer = DrafterProposer(drafter, head)
    features = torch.as_tensor(np.asarray(seq.features, dtype=np.float32).reshape(len(seq.input_ids), -1))
    for i in (0, len(scored.anchors) // 2, len(scored.anchors) - 1):
        a = int(scored.anchors[i])
        proposer.reset()
        proposer.commit(features[:a])
        assert proposer.propose(int(seq.input_ids[a]), B + 1) == scored.drafts[i].tolist()


# -- online ---------------------------------------------------------------------------------

V, LAYER_IDS = 64, [1, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("qwen3")


def dspark_proposer(target, num_drafts: int, repeats: bool) -> DrafterProposer:
    torch.manual_seed(1)
    config = drafter_config("dspark", num_hidden_layers=2, vocab_size=V, target_layer_ids=LAYER_IDS,
                            num_target_layers=6,
                            num_drafts=num_drafts, mask_token_id=V - 1, initializer_range=0.2, markov_rank=V)
    drafter = make_drafter(config, attention="dense")
    if repeats:  # a Markov bias that drafts the previous token again, far above the backbone's logits
        with torch.no_grad():
            drafter.markov_head.markov_w1.weight.copy_(torch.eye(V))
            drafter.markov_head.markov_w2.weight.copy_(torch.eye(V) * 1e3)
    head = TargetHead(embed_tokens=target.get_input_embeddings().weight.detach(),
                      lm_head=target.get_output_embeddings().weight.detach())
    return DrafterProposer(drafter, head)


@pytest.mark.parametrize("num_drafts", [2, 3, 5])
@pytest.mark.parametrize("repeats", [False, True])
def test_dspark_online_decoding_is_lossless(target, num_drafts, repeats):
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    reference = greedy_generate(target, prompt, max_new_tokens=23, stop_token_ids=set())
    proposer = dspark_proposer(target, num_drafts, repeats)
    out = speculative_generate(target, proposer, prompt, max_new_tokens=23, verify_size=num_drafts + 1,
                               layer_ids=LAYER_IDS, stop_token_ids=set())
    assert out.tokens == reference.tokens
    assert max(out.drafted) == num_drafts  # a DSpark block of N drafts N tokens
    if repeats:
        drafts = proposer.propose(reference.tokens[-1], num_drafts + 1)
        assert drafts == [reference.tokens[-1]] * num_drafts


def test_dspark_sampled_decoding_runs_with_match_sampler(target):
    prompt = list(range(5, 14))
    proposer = dspark_proposer(target, 3, repeats=False)
    runs = [speculative_generate(target, proposer, prompt, max_new_tokens=17, verify_size=4, layer_ids=LAYER_IDS,
                                 stop_token_ids=set(),
                                 sampler=MatchSampler(1.0, torch.Generator().manual_seed(7))).tokens
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 17


def test_a_dspark_config_round_trips_through_the_run_file():
    config = drafter_config("dspark", num_hidden_layers=1, vocab_size=V, target_layer_ids=[1], num_target_layers=3,
                            mask_token_id=0, markov_rank=4, confidence_head=True)
    assert drafters.config_from_dict(config.to_dict()) == config
    legacy = {name: value for name, value in config.to_dict().items() if name != "kind"}  # written before kinds
    assert drafters.config_from_dict(legacy) == config
    assert drafters.of_config(config).block_rows(config.num_drafts) == config.num_drafts  # the anchor drafts too
    assert drafters.get("dflash").block_rows(config.num_drafts) == config.num_drafts + 1
