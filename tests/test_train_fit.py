"""`fit` end to end on a tiny synthetic cache: logs, exact resume after SIGKILL, spike gating,
2-rank gloo == 1 rank, the CLI.

Runs whose numbers are compared bit for bit all run in subprocesses with one intra-op
thread, so they share one summation order (and a SIGKILLed one cannot take pytest with it).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash.testing.builders import FIT_LENGTHS, fit_cache, tiny_fit_config
from dflash.train import fit as fit_module
from dflash.train.checkpoint import latest_checkpoint, list_checkpoints
from dflash.train.cli import main
from dflash.train.config import FitConfig
from dflash.train.fit import SpikeStop, fit
from dflash.train.logging import STEP_KEYS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return fit_cache(tmp_path_factory)


def tiny_config(cache_dir: Path, out: Path, **overrides) -> FitConfig:
    defaults = dict(anchors_per_seq=6, epochs=2, checkpoint_every=3, keep_checkpoints=10)
    return tiny_fit_config(cache_dir, out, **(defaults | overrides))


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------
# Subprocess runs
# ---------------------------------------------------------------------------------------

DRIVER = r"""
import json, os, signal, sys
import torch
from dflash.train import checkpoint, fit as fit_module
from dflash.train.config import FitConfig

config = FitConfig.from_dict(json.loads(sys.argv[1]))
kill_at, mode = int(sys.argv[2]), sys.argv[3]
if mode == "between-checkpoints":
    # Finish each checkpoint before the next step, so that the kill surely lands after the
    # step-3 write (only the timing changes, not a number). fit hands its snapshots to the
    # writer's `start`, so that is where the wait goes.
    start = checkpoint.CheckpointWriter.start
    def start_and_wait(self, *args, **kwargs):
        start(self, *args, **kwargs)
        self.wait()
    checkpoint.CheckpointWriter.start = start_and_wait
    log_step = fit_module.RunLogger.step
    def step(self, record):
        log_step(self, record)
        if record["step"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    fit_module.RunLogger.step = step
elif mode == "during-checkpoint":
    torch_save = torch.save
    def save(obj, path, *args, **kwargs):
        if f"step-{kill_at:08d}" in str(path):  # model.safetensors is written, optimizer.pt half
            with open(path, "wb") as f:
                f.write(b"half a file")
            os.kill(os.getpid(), signal.SIGKILL)
        return torch_save(obj, path, *args, **kwargs)
    checkpoint.torch.save = save
fit_module.fit(config)
"""


def run_subprocess(config: FitConfig, kill_at: int = 0, mode: str = "none") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-c", DRIVER, json.dumps(config.to_dict()), str(kill_at), mode],
                          env=env, capture_output=True, text=True, timeout=300)


def assert_same_checkpoint(a: Path, b: Path) -> None:
    weights_a, weights_b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    optim_a = torch.load(a / "optimizer.pt", weights_only=True)
    optim_b = torch.load(b / "optimizer.pt", weights_only=True)
    assert optim_a["param_groups"] == optim_b["param_groups"]
    for index, state in optim_a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, optim_b["state"][index][key]), (index, key)
    state_a, state_b = (json.loads((p / "state.json").read_text()) for p in (a, b))
    assert state_a["gate"] == state_b["gate"] and state_a["step"] == state_b["step"]


@pytest.fixture(scope="module")
def straight_run(cache_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    result = run_subprocess(tiny_config(cache_dir, out))
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize("mode,kill_at,resumes_from", [
    ("between-checkpoints", 5, "step-00000003"),
    ("during-checkpoint", 6, "step-00000003"),
])
def test_resume_after_sigkill_is_exact(cache_dir, straight_run, tmp_path, mode, kill_at, resumes_from):
    out = tmp_path / "run"
    config = tiny_config(cache_dir, out)
    killed = run_subprocess(config, kill_at, mode)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert latest_checkpoint(out).name == resumes_from
    resumed = run_subprocess(config)
    assert resumed.returncode == 0, resumed.stderr
    final = latest_checkpoint(straight_run)
    assert final.name == latest_checkpoint(out).name
    assert_same_checkpoint(latest_checkpoint(out), final)
    # The redone steps replace the lines the killed run logged after its checkpoint.
    steps = [line["step"] for line in read_lines(out / "metrics.jsonl")]
    assert steps == list(range(1, int(final.name[5:]) + 1))
    losses = [line["loss"] for line in read_lines(out / "metrics.jsonl")]
    assert losses == [line["loss"] for line in read_lines(straight_run / "metrics.jsonl")]


# ---------------------------------------------------------------------------------------
# In-process runs
# ---------------------------------------------------------------------------------------


def test_metrics_and_events(cache_dir, tmp_path, capsys):
    config = tiny_config(cache_dir, tmp_path / "run", eval_every=4)
    result = fit(config)
    lines = read_lines(tmp_path / "run" / "metrics.jsonl")
    assert result.step == result.total_steps == len(lines)
    steps_per_epoch = result.total_steps // config.data.epochs
    for line in lines:
        assert tuple(line) == STEP_KEYS
        assert line["gpu_data_wait_s"] is None  # no CUDA events on a CPU: absent, not 0
        assert len(line["accuracy"]) == config.model.num_drafts
        assert line["tokens"] <= config.data.tokens_per_step and line["data_time_s"] <= line["step_time_s"]
        assert line["epoch"] == pytest.approx(line["step"] / steps_per_epoch)
        assert line["epoch_index"] == (line["step"] - 1) // steps_per_epoch + 1
    events = read_lines(tmp_path / "run" / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "done"
    assert "eval" in kinds and all(e["duration_s"] >= 0 for e in events if e["event"] == "eval")
    assert all(e["write_s"] > 0 for e in events if e["event"] == "checkpoint")
    out = capsys.readouterr().out
    assert f"epoch 2/2 (100.0%) step {result.total_steps}/{result.total_steps} loss" in out
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["mask_token_id"] == 62  # no tokenizer: the highest row that is not the eos (63)


def test_no_checkpoint_is_on_disk_before_its_step_line(cache_dir, tmp_path, monkeypatch):
    # On a loaded machine the writer thread can rename checkpoint N before the loop writes
    # step N's metrics line; a kill then leaves checkpoint N complete and line N missing, and
    # the resume (from N) never writes it. Here every write is let finish first, the worst case.
    out = tmp_path / "run"
    seen = []
    log_step = fit_module.RunLogger.step

    def step(self, record):
        for thread in threading.enumerate():
            if thread.name == f"checkpoint-{record['step']}":
                thread.join()
        seen.append((record["step"], (out / "checkpoints" / f"step-{record['step']:08d}").exists()))
        log_step(self, record)

    monkeypatch.setattr(fit_module.RunLogger, "step", step)
    result = fit(tiny_config(cache_dir, out))
    assert [s for s, _ in seen] == list(range(1, result.total_steps + 1))
    assert [s for s, on_disk in seen if on_disk] == []
    assert len(list_checkpoints(out)) > 1 and latest_checkpoint(out).name == f"step-{result.total_steps:08d}"


@pytest.mark.parametrize("written, resumed", [(2, 1), (1, 2)])
def test_a_cpu_resume_takes_the_checkpoints_thread_count(cache_dir, tmp_path, written, resumed):
    # A CPU matrix product's summation order depends on the intra-op thread count: a resume
    # at another count drifts from the uninterrupted run, so it takes the checkpoint's.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(written)
        config = tiny_config(cache_dir, tmp_path / "run", max_steps=6)
        fit(config)
        shutil.rmtree(latest_checkpoint(config.out))  # as a kill before step 6's checkpoint
        state = json.loads((latest_checkpoint(config.out) / "state.json").read_text())
        assert state["step"] == 3 and state["cpu_threads"] == written
        torch.set_num_threads(resumed)
        fit(config)
        assert torch.get_num_threads() == written
    finally:
        torch.set_num_threads(before)


def test_held_out_sequences_are_never_trained_on(cache_dir, tmp_path, monkeypatch):
    seen = []
    real = fit_module.read_batch

    def spy(corpus, segments, **kwargs):
        if kwargs["stream"] != fit_module.EVAL_STREAM:
            seen.extend(s.sequence for s in segments)
        return real(corpus, segments, **kwargs)

    monkeypatch.setattr(fit_module, "read_batch", spy)
    config = tiny_config(cache_dir, tmp_path / "run", eval_fraction=0.25, eval_every=2)
    fit(config)
    held_out = set(np.flatnonzero(fit_module.held_out_mask(len(FIT_LENGTHS), 0.25, config.data.seed)).tolist())
    assert len(held_out) == 4 and seen and not held_out & set(seen)


def poison_steps(monkeypatch, steps: set[int], how: str) -> None:
    """Corrupt the targets of the batches read at the given (1-based) training steps."""
    real = fit_module.read_batch
    calls = {"n": 0}

    def poisoned(corpus, segments, **kwargs):
        batch = real(corpus, segments, **kwargs)
        calls["n"] += 1
        if calls["n"] in steps:
            if how == "nan":
                batch.topk_logprobs[0, 0] = float("nan")
            else:  # log-probs in the wrong units: q is no longer a distribution, KL explodes
                batch.topk_logprobs *= 0.01
        return batch

    monkeypatch.setattr(fit_module, "read_batch", poisoned)


@pytest.mark.parametrize("how,reason", [("nan", "loss is not finite"), ("scaled", "loss ")])
def test_spiking_batch_is_skipped_logged_and_leaves_weights_unchanged(cache_dir, tmp_path, monkeypatch,
                                                                      how, reason):
    poison_steps(monkeypatch, {4}, how)
    config = tiny_config(cache_dir, tmp_path / "run", checkpoint_every=1, max_steps=6)
    fit(config)
    lines = read_lines(tmp_path / "run" / "metrics.jsonl")
    assert [line["skipped"] for line in lines] == [False, False, False, True, False, False]
    spikes = read_lines(tmp_path / "run" / "spikes.jsonl")
    assert len(spikes) == 1 and spikes[0]["step"] == 4 and spikes[0]["reason"].startswith(reason)
    # The sources are the whole global batch of step 4 (epoch 1, step 4 of the plan).
    plan_sequences = [s.sequence for s in _plan(config).step_segments(0, 3)]
    assert [s["sequence"] for s in spikes[0]["sources"]] == plan_sequences
    assert all(s["file"] == "synthetic.jsonl" and "index" in s for s in spikes[0]["sources"])
    # The skipped step changed nothing: weights and optimizer state after step 4 == after 3.
    checkpoints = {p.name: p for p in list_checkpoints(tmp_path / "run")}
    before, after = checkpoints["step-00000003"], checkpoints["step-00000004"]
    a, b = load_file(str(before / "model.safetensors")), load_file(str(after / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (torch.load(p / "optimizer.pt", weights_only=True) for p in (before, after))
    assert all(torch.equal(oa["state"][i]["exp_avg"], ob["state"][i]["exp_avg"]) for i in oa["state"])
    final = load_file(str(latest_checkpoint(tmp_path / "run") / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in final.values())


def _plan(config: FitConfig):
    from dflash.shards import open_cache
    from dflash.train.data import Corpus, DataPlan, held_out_mask

    corpus = Corpus([open_cache(config.cache[0])])
    return DataPlan(num_eligible=corpus.num_eligible,
                    held_out=held_out_mask(len(corpus), config.eval.eval_fraction, config.data.seed),
                    block_size=config.block_rows, anchors_per_seq=config.data.anchors_per_seq,
                    tokens_per_step=config.data.tokens_per_step, seed=config.data.seed, world_size=1)


def test_persistent_spikes_stop_the_run(cache_dir, tmp_path, monkeypatch):
    poison_steps(monkeypatch, set(range(5, 100)), "nan")
    config = tiny_config(cache_dir, tmp_path / "run", max_consecutive_skips=3, epochs=4)
    with pytest.raises(SpikeStop) as stop:
        fit(config)
    message = str(stop.value)
    assert "stopped at step 7" in message and "3 steps in a row" in message
    assert str(tmp_path / "run" / "spikes.jsonl") in message
    assert str(tmp_path / "run" / "checkpoints" / "step-00000006") in message
    assert len(read_lines(tmp_path / "run" / "spikes.jsonl")) == 3


# ---------------------------------------------------------------------------------------
# Distributed
# ---------------------------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, port: int, config_dict: dict) -> None:
    # As under torchrun: the store is the launcher's (TORCHELASTIC_USE_AGENT_STORE), not rank 0's.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    fit(FitConfig.from_dict(config_dict))


def _spawn(world_size: int, config: FitConfig) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    torch.multiprocessing.spawn(_rank_main, args=(world_size, store.port, config.to_dict()), nprocs=world_size)
    del store


def _final_state(run: Path) -> tuple[dict, dict]:
    last = latest_checkpoint(run)
    return load_file(str(last / "model.safetensors")), torch.load(last / "optimizer.pt", weights_only=True)


@pytest.fixture(scope="module")
def one_process_run(cache_dir, tmp_path_factory):
    """The single-process run that the 2-rank runs are compared with, by draft vocabulary: fitted
    in this process once, and shared by the DDP and FSDP cases (its config has no `parallel`).
    The comparison is within fp32 tolerance, so this run's thread count does not matter."""
    runs = {}

    def run(draft_vocab) -> Path:
        if draft_vocab not in runs:
            out = tmp_path_factory.mktemp("one-process") / "run"
            fit(tiny_config(cache_dir, out, max_steps=4, anchors_per_seq=5, eval_every=2, draft_vocab=draft_vocab))
            runs[draft_vocab] = out
        return runs[draft_vocab]

    return run


@pytest.mark.parametrize("parallel,draft_vocab", [("ddp", None), ("fsdp", None), ("fsdp", 24)])
def test_two_ranks_equal_one_rank(cache_dir, one_process_run, tmp_path, parallel, draft_vocab):
    # 24 blocks per step of 5 per sequence: each rank's 12 blocks end mid-sequence. With a
    # draft vocabulary each rank counts half the sample and the counts are summed.
    one = one_process_run(draft_vocab)
    two = tiny_config(cache_dir, tmp_path / "two", max_steps=4, anchors_per_seq=5, eval_every=2,
                      parallel=parallel, draft_vocab=draft_vocab)
    _spawn(2, two)
    lines_one = read_lines(one / "metrics.jsonl")
    lines_two = read_lines(tmp_path / "two" / "metrics.jsonl")
    # Same global batch, same weights: only the order of fp32 sums differs.
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([x[key] for x in lines_two], [x[key] for x in lines_one], rtol=1e-5)
    assert [x["tokens"] for x in lines_two] == [x["tokens"] for x in lines_one]
    assert read_lines(tmp_path / "two" / "events.jsonl")[0]["parallel"] == parallel
    evals = [[e for e in read_lines(run / "events.jsonl") if e["event"] == "eval"] for run in (one, tmp_path / "two")]
    assert [e["step"] for e in evals[1]] == [e["step"] for e in evals[0]] == [2, 4]
    for key in ("loss", "tau"):
        np.testing.assert_allclose([e[key] for e in evals[1]], [e[key] for e in evals[0]], rtol=1e-5)
    (a, optim_a), (b, optim_b) = _final_state(one), _final_state(tmp_path / "two")
    assert sorted(b) == sorted(a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)
    # The optimizer state is saved unsharded, keyed as one process's AdamW keys it.
    assert optim_b["param_groups"][0]["params"] == optim_a["param_groups"][0]["params"]
    for i, state in optim_a["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optim_b["state"][i][key], state[key], rtol=1e-4, atol=1e-9)


def test_fsdp_resume_is_exact_and_checkpoints_move_between_modes(cache_dir, tmp_path):
    """Two FSDP2 ranks, 4 steps with a checkpoint at 2; the run restarted from step 2 ends
    bit for bit where the straight run did; the same step-2 checkpoint resumed under DDP ends
    within fp32 tolerance of it (checkpoints are unsharded)."""
    import shutil

    straight = tiny_config(cache_dir, tmp_path / "straight", max_steps=4, anchors_per_seq=5,
                           checkpoint_every=2, parallel="fsdp")
    _spawn(2, straight)
    for mode in ("fsdp", "ddp"):
        run = tmp_path / mode
        shutil.copytree(tmp_path / "straight", run)
        shutil.rmtree(run / "checkpoints" / "step-00000004")
        (run / "config.json").write_text(json.dumps({**json.loads((run / "config.json").read_text()),
                                                     "out": str(run), "parallel": mode}))
        _spawn(2, FitConfig.from_dict({**straight.to_dict(), "out": str(run), "parallel": mode}))
        assert read_lines(run / "events.jsonl")[-2]["event"] == "checkpoint"  # resumed, ran, saved
    want, want_optim = _final_state(tmp_path / "straight")
    got, got_optim = _final_state(tmp_path / "fsdp")
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for i, state in want_optim["state"].items():
        assert torch.equal(got_optim["state"][i]["exp_avg_sq"], state["exp_avg_sq"])
    moved, _ = _final_state(tmp_path / "ddp")
    for name in want:
        torch.testing.assert_close(moved[name], want[name], rtol=1e-4, atol=1e-6)
    resumed = [e for e in read_lines(tmp_path / "ddp" / "events.jsonl") if e["event"] == "resume"]
    assert resumed[-1]["step"] == 2 and resumed[-1]["parallel"] == "ddp"


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def test_cli_fit_with_config_file_and_flags(cache_dir, tmp_path):
    config_file = tmp_path / "fit.toml"
    config_file.write_text(f'cache = ["{cache_dir}"]\nnum_layers = 1\nnum_drafts = 3\n'
                           f'anchors_per_seq = 6\ntokens_per_step = 96\neval_every = 0\n')
    result = CliRunner().invoke(main, ["fit", "--config", str(config_file), "--out", str(tmp_path / "run"),
                                       "--max-steps", "2", "--no-wandb", "--decay-gamma", "3.5"])
    assert result.exit_code == 0, result.output
    assert "done: 2/2 steps" in result.output
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["decay_gamma"] == 3.5 and saved["max_steps"] == 2 and saved["num_drafts"] == 3
    # Rerunning resumes (nothing left to do) and refuses a changed learning rate.
    again = CliRunner().invoke(main, ["fit", "--config", str(config_file), "--out", str(tmp_path / "run"),
                                      "--max-steps", "2", "--no-wandb", "--decay-gamma", "3.5", "--lr", "1e-3"])
    assert again.exit_code == 1 and again.output.startswith("Error: ") and "lr" in again.output


@pytest.mark.parametrize("loss", ["ce", "kl+ce", "tv+ce"])
def test_other_losses_and_bf16_compute(cache_dir, tmp_path, loss):
    result = fit(tiny_config(cache_dir, tmp_path / "run", loss=loss, dtype="bfloat16", max_steps=3))
    lines = read_lines(tmp_path / "run" / "metrics.jsonl")
    assert result.step == 3 and all(np.isfinite(line["loss"]) and not line["skipped"] for line in lines)


# ---------------------------------------------------------------------------------------
# The read-ahead and the device-side snapshot
# ---------------------------------------------------------------------------------------


def test_the_read_ahead_gives_the_batches_a_fresh_read_gives(cache_dir, tmp_path, monkeypatch):
    """The loop's batches (read one step ahead into two reused staging buffers, through the
    BatchFeed) equal, tensor for tensor, the batches read on their own into fresh buffers,
    across an epoch boundary and with held-out evaluations between steps; so do the layouts.
    A slot refilled too early, a stale part of a reused buffer, an evaluation reading over the
    next step's batch or an order that depends on the read-ahead would show here."""
    from dflash.train.data import read_batch
    from dflash.train.model import BlockLayout

    seen, layouts, runs = [], [], []
    real_forward_loss, real_step_figures = fit_module.forward_loss, fit_module._step_figures

    def spy_layout(run, batch, layout):
        if not run.wrapped.training:  # a held-out evaluation between two steps
            return real_forward_loss(run, batch, layout)
        runs.append(run)
        layouts.append(([layout.anchors.clone(), layout.context_positions.clone(), layout.block_positions.clone()],
                        (layout.context_lengths, layout.num_blocks, layout.context_offsets, layout.block_offsets)))
        return real_forward_loss(run, batch, layout)

    def spy_batch(run, batch, *args):  # after the next step's read: the batch must still be intact
        seen.append({name: getattr(batch, name).clone() for name in
                     ("block_ids", "label_rows", "label_positions", "topk_ids", "topk_logprobs", "weights",
                      "label_tokens", "context_features")})
        return real_step_figures(run, batch, *args)

    monkeypatch.setattr(fit_module, "forward_loss", spy_layout)
    monkeypatch.setattr(fit_module, "_step_figures", spy_batch)
    fit(tiny_config(cache_dir, tmp_path / "run", epochs=2, checkpoint_every=100, eval_every=2, eval_fraction=0.25))
    run = runs[0]
    assert len(seen) == run.total_steps > run.plan.steps_per_epoch  # the second epoch is compared too
    for step, (tensors, (layout_tensors, layout_lists)) in enumerate(zip(seen, layouts, strict=True)):
        epoch, step_in_epoch = divmod(step, run.plan.steps_per_epoch)
        alone = read_batch(run.corpus, run.plan.segments(epoch, step_in_epoch, 0), stream=epoch,
                           plan_anchors=run.config.data.anchors_per_seq, seed=run.config.data.seed,
                           block_size=run.config.block_rows, gamma=run.gamma,
                           mask_token_id=run.drafter_config.mask_token_id)
        for name, value in tensors.items():
            assert torch.equal(value, getattr(alone, name)), (step, name)
        layout = BlockLayout.build(alone.segments, run.config.block_rows)
        for got, expected in zip(layout_tensors, [layout.anchors, layout.context_positions, layout.block_positions]):
            assert torch.equal(got, expected), step
        assert layout_lists == (layout.context_lengths, layout.num_blocks, layout.context_offsets,
                                layout.block_offsets)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("snapshot_to", ["device", "host"])
def test_a_gpu_snapshot_holds_the_state_of_its_step(tmp_path, snapshot_to):
    """A snapshot queued on the device (or, when it does not fit, copied to pinned memory on a
    side stream) is of the step it was taken at, although the next updates are queued at
    once: the written checkpoint equals a copy of the state taken then."""
    from dflash.train.checkpoint import CheckpointWriter, load_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    writer = CheckpointWriter(tmp_path, keep=2, snapshot_to=snapshot_to)

    def train_step():
        model(torch.randn(4096, 256, device="cuda")).square().mean().backward()
        writer.before_update()
        optimizer.step()
        optimizer.zero_grad()

    train_step()
    expected = {name: t.detach().clone() for name, t in model.state_dict().items()}
    expected_moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    snapshot = writer.snapshot(1, model.state_dict(), optimizer.state_dict(), {"gate": {}})
    assert snapshot.snapshot_to == snapshot_to
    writer.start(snapshot)
    for _ in range(3):  # queued behind (device) or beside (host) the copy
        train_step()
    writer.wait()
    event, = writer.pop_finished()
    weights, optim, _ = load_checkpoint(event.path)
    assert event.snapshot_to == snapshot_to
    for name, value in expected.items():
        assert torch.equal(weights[name], value.cpu()), name
        assert not torch.equal(model.state_dict()[name].cpu(), value.cpu())  # the live state moved on
    for index, moment in enumerate(expected_moments):
        assert torch.equal(optim["state"][index]["exp_avg"], moment.cpu())
