"""Units of the trainer: schedule, gate, checkpoint writer, config loading, console line."""

import dataclasses
import json
import math
import os

import pytest
import torch

from dflash.train import checkpoint as checkpoint_module
from dflash.train.checkpoint import CheckpointWriter, latest_checkpoint, list_checkpoints, load_checkpoint
from dflash.train.config import FitConfig, LossConfig, check_resume, describe_fields, resolve
from dflash.train.fit import lr_at
from dflash.train.gating import GatingConfig, SpikeGate
from dflash.train.logging import console_line, format_duration, tau_estimate


@pytest.mark.parametrize("step,expected", [
    (0, 1.5e-4), (3, 6e-4),  # warm-up: 4 steps of 100
    (4, 6e-4), (52, 3e-4), (100, 0.0),  # cosine from step 4 to 100
])
def test_lr_schedule(step, expected):
    assert lr_at(step, 100, 0.04, 6e-4) == pytest.approx(expected, abs=1e-12)


# -- gate ----------------------------------------------------------------------------------


def warmed_gate(steps: int = 5, loss: float = 2.0, grad_norm: float = 1.0) -> SpikeGate:
    gate = SpikeGate(GatingConfig(spike_factor=3.0, spike_warmup_steps=3, max_consecutive_skips=2))
    for _ in range(steps):
        gate.record(loss, grad_norm, skipped=False)
    return gate


@pytest.mark.parametrize("loss,grad_norm,reason", [
    (float("nan"), 1.0, "loss is not finite"),
    (2.0, float("inf"), "gradient norm is not finite"),
    (6.1, 1.0, "loss 6.1 > 3 x running mean 2"),
    (2.0, 3.1, "gradient norm 3.1 > 3 x running mean 1"),
    (5.9, 2.9, None),
])
def test_gate_decisions(loss, grad_norm, reason):
    got = warmed_gate().reason_to_skip(loss, grad_norm)
    assert got == reason if reason is None else got.startswith(reason)


def test_gate_waits_for_warmup_but_never_accepts_nan():
    gate = warmed_gate(steps=2)
    assert gate.reason_to_skip(100.0, 100.0) is None
    assert gate.reason_to_skip(float("nan"), 1.0) is not None


def test_gate_means_move_on_accepted_steps_only_and_stop_after_consecutive_skips():
    gate = warmed_gate()
    before = gate.state_dict()
    gate.record(100.0, 100.0, skipped=True)
    assert gate.loss_mean == pytest.approx(2.0) and not gate.should_stop
    gate.record(100.0, 100.0, skipped=True)
    assert gate.should_stop
    assert {k: v for k, v in gate.state_dict().items() if k != "consecutive_skips"} == \
        {k: v for k, v in before.items() if k != "consecutive_skips"}
    gate.record(2.0, 1.0, skipped=False)
    assert gate.consecutive_skips == 0


def test_gate_state_round_trips_through_json():
    gate = warmed_gate(loss=1.234567890123)
    other = SpikeGate(gate.config)
    other.load_state_dict(json.loads(json.dumps(gate.state_dict())))
    assert other == gate


# -- checkpoints ---------------------------------------------------------------------------


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_checkpoint_round_trip_keeps_last_k(tmp_path):
    model, optimizer = model_and_optimizer()
    writer = CheckpointWriter(tmp_path, keep=2)
    for step in (1, 2, 3):
        writer.save(step, model.state_dict(), optimizer.state_dict(), {"gate": {"x": step}})
        saved = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)  # the snapshot must not see later in-place updates
    writer.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    weights, optim, state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 3 and state["gate"] == {"x": 3}
    torch.testing.assert_close(weights["weight"], saved, rtol=0, atol=0)
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=0.1)
    fresh.load_state_dict(optim)
    for a, b in zip(fresh.state.values(), optimizer.state.values()):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=0, atol=0)
    assert {e.step for e in writer.pop_finished()} == {1, 2, 3}


def test_checkpoint_writer_error_is_raised_in_the_caller(tmp_path, monkeypatch):
    model, optimizer = model_and_optimizer()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.torch, "save", broken)
    writer = CheckpointWriter(tmp_path, keep=2)
    writer.save(1, model.state_dict(), optimizer.state_dict(), {})
    with pytest.raises(RuntimeError, match=r"checkpoint writer failed: cannot write checkpoint file "
                                           r"optimizer\.pt of .*step-00000001: disk full"):
        writer.wait()
    assert latest_checkpoint(tmp_path) is None  # the half-written folder is never listed


def test_stale_temporary_checkpoint_is_ignored_and_removed(tmp_path):
    (tmp_path / "checkpoints" / ".step-00000009.tmp").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) is None
    CheckpointWriter(tmp_path, keep=1)
    assert not (tmp_path / "checkpoints" / ".step-00000009.tmp").exists()


def test_checkpoint_refuses_pickled_objects(tmp_path):
    model, optimizer = model_and_optimizer()
    writer = CheckpointWriter(tmp_path, keep=1)
    writer.save(1, model.state_dict(), optimizer.state_dict(), {})
    writer.wait()
    path = latest_checkpoint(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"state": Evil()}, path / "optimizer.pt")
    with pytest.raises(ValueError,
                       match=r"optimizer\.pt: cannot read the checkpoint's optimizer state: .*[Ww]eights only"):
        load_checkpoint(path)


@pytest.mark.parametrize("name, damage, message", [
    ("model.safetensors", b"\x00" * 16, r"model\.safetensors: cannot read the checkpoint's weights"),
    ("state.json", b'{"step": ', r"state\.json: cannot read the checkpoint's state"),
])
def test_damaged_checkpoint_names_the_file(tmp_path, name, damage, message):
    model, optimizer = model_and_optimizer()
    writer = CheckpointWriter(tmp_path, keep=1)
    writer.save(1, model.state_dict(), optimizer.state_dict(), {})
    writer.wait()
    path = latest_checkpoint(tmp_path)
    (path / name).write_bytes(damage)
    with pytest.raises(ValueError, match=message + r".*delete step-00000001"):
        load_checkpoint(path)


# -- config --------------------------------------------------------------------------------


def test_toml_then_flags(tmp_path):
    path = tmp_path / "fit.toml"
    path.write_text('cache = ["a", "b"]\nout = "run"\nblock-size = 8\nlr = 1e-3\ndecay_gamma = "auto"\n')
    config = resolve(path, {"lr": 2e-3, "epochs": None})
    # Paths in the file are relative to the file.
    assert config.cache == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert config.model.block_size == 8 and config.optimizer.lr == 2e-3
    assert config.data.epochs == 6 and config.loss.decay_gamma is None


@pytest.mark.parametrize("text,message", [
    ('cache = ["a"]\nout = "r"\nlearning_rate = 1\n', "unknown field"),
    ('cache = ["a"]\nout = "r"\nblock_size = 1\n', "block_size must be >= 2"),
    ('cache = ["a"]\nout = "r"\ntokens_per_step = 100\n', "multiple of block_size"),
    ('cache = ["a"]\nout = "r"\nloss = "mse"\n', "loss must be one of"),
    ('out = "r"\n', "cache"),
    ('cache = [\n', "not valid TOML"),
])
def test_config_errors_name_the_field(tmp_path, text, message):
    path = tmp_path / "fit.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        resolve(path, {})


def test_resume_refuses_a_changed_numeric_field(tmp_path):
    saved = FitConfig.from_dict({"cache": ["c"], "out": str(tmp_path), "lr": 1e-3})
    (tmp_path / "config.json").write_text(json.dumps(saved.to_dict()))
    check_resume(tmp_path / "config.json", FitConfig.from_dict({"cache": ["c"], "out": str(tmp_path), "lr": 1e-3,
                                                              "eval_every": 7}))
    with pytest.raises(ValueError, match="lr = 0.001"):
        check_resume(tmp_path / "config.json", FitConfig.from_dict({"cache": ["c"], "out": str(tmp_path), "lr": 2e-3}))



def test_toml_section_tables_and_top_level_keys_mix(tmp_path):
    path = tmp_path / "fit.toml"
    path.write_text('cache = ["a"]\nout = "run"\nepochs = 2\n[optimizer]\nlr = 1e-3\n'
                    '[gating]\nspike-factor = 4.0\n')
    config = resolve(path, {})
    assert config.optimizer.lr == 1e-3 and config.gating.spike_factor == 4.0 and config.data.epochs == 2
    path.write_text('cache = ["a"]\nout = "run"\n[optimizer]\nspike_factor = 4.0\n')
    with pytest.raises(ValueError, match=r"\[optimizer\] has no field 'spike_factor'"):
        resolve(path, {})


@pytest.mark.parametrize("name,value", [("loss", "mse"), ("device", "tpu"), ("dtype", "float16"),
                                        ("attention", "sdpa"), ("parallel", "zero3")])
def test_every_choice_field_is_checked(name, value):
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        FitConfig.from_dict({"cache": ["c"], "out": "r", name: value})


def test_flat_keys_round_trip_and_stay_unique():
    config = FitConfig.from_dict({"cache": ["c"], "out": "r", "lr": 1e-3, "spike_factor": 4.0,
                                  "decay_gamma": "auto", "mask_token_id": 7})
    flat = config.to_dict()
    assert flat["lr"] == 1e-3 and flat["spike_factor"] == 4.0 and flat["decay_gamma"] is None
    assert config.model.mask_token_id == 7 and FitConfig.from_dict(flat) == config
    assert set(flat) == {info.name for info in describe_fields()}


def test_every_flag_has_the_field_docstring_and_default():
    from click.testing import CliRunner

    from dflash.train.cli import main

    options = {param.opts[0]: param for param in main.commands["fit"].params}
    for info in describe_fields():
        assert info.doc, f"{info.name} has no docstring"
        option = options["--" + info.name.replace("_", "-")]
        assert option.name == info.name and option.help.startswith(info.doc)
        if info.default not in (dataclasses.MISSING, None):
            shown = ("on" if info.default else "off") if isinstance(info.default, bool) else str(info.default)
            assert option.help.endswith(f"[{shown}]"), option.help
    assert options["--lr"].help.endswith("[0.0006]") and options["--decay-gamma"].help.endswith("[auto]")
    result = CliRunner().invoke(main, ["fit", "--help"])
    assert result.exit_code == 0 and "--spike-factor" in result.output and "--max-consecutive-skips" in result.output



@pytest.mark.parametrize("args,message", [
    (["--decay-gamma", "banana"], "'banana' is neither 'auto' nor a number"),
    (["--loss", "mse"], "'mse' is not one of"),
    (["--lr", "fast"], "'fast' is not a valid float"),
])
def test_bad_flag_values_are_usage_errors(tmp_path, args, message):
    from click.testing import CliRunner

    from dflash.train.cli import main

    result = CliRunner().invoke(main, ["fit", "--cache", str(tmp_path), "--out", str(tmp_path / "r"), *args])
    assert result.exit_code == 2 and message in result.output, result.output

def test_resume_accepts_a_config_json_without_newer_fields(tmp_path):
    config = FitConfig.from_dict({"cache": ["c"], "out": str(tmp_path)})
    old = {k: v for k, v in config.to_dict().items() if k != "spike_ema_decay"}  # written before it existed
    (tmp_path / "config.json").write_text(json.dumps(old))
    check_resume(tmp_path / "config.json", config)
    with pytest.raises(ValueError, match="spike_ema_decay = 0.99"):
        check_resume(tmp_path / "config.json", FitConfig.from_dict({**old, "spike_ema_decay": 0.9}))


# -- console -------------------------------------------------------------------------------


def test_console_line_format():
    record = {"step": 4700, "epoch": 0.412, "epoch_index": 1, "epoch_fraction": 0.412, "loss": 0.53,
              "accuracy": [0.8, 0.5, None], "grad_norm": 1.0, "lr": 1e-4, "skipped": False,
              "tokens": 1, "tokens_per_s": 26200.0, "data_time_s": 0.0, "step_time_s": 1.0}
    line = console_line(record, epochs=6, total_steps=68780, eta_s=4 * 86400 + 13 * 3600 + 60)
    assert line == "epoch 1/6 (41.2%) step 4700/68780 loss 0.53 acc 0.65 tau~2.2 26.2k tok/s ETA 4d13h"


@pytest.mark.parametrize("seconds,text", [(59.4, "59s"), (61, "1m01s"), (3 * 3600 + 300, "3h05m"),
                                          (math.inf, "?")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_tau_estimate():
    assert tau_estimate([0.5, 0.5, 1.0]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert tau_estimate([None, 0.9]) == 1.0


# -- loss ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["kl", "ce", "kl+ce"])
def test_loss_matches_materialised_reference(kind, seed):
    from types import SimpleNamespace

    from dflash.train.fit import _loss

    N, H, V, k = 7, 5, 11, 3
    hidden, weight = torch.randn(N, H), torch.randn(V, H)
    topk_ids = torch.stack([torch.randperm(V)[:k] for _ in range(N)])  # [N, k]
    q = torch.softmax(torch.randn(N, k + 1), -1)[:, :k]  # a tail of mass q[:, k] left out
    batch = SimpleNamespace(topk_ids=topk_ids, topk_logprobs=q.log(), weights=torch.rand(N))
    config = LossConfig(loss=kind, ce_weight=0.5)
    loss, argmax = _loss(hidden, weight, batch, config)

    logp = torch.log_softmax(hidden.double() @ weight.double().T, -1)  # [N, V]
    qd = q.double()
    p_sel = logp.gather(1, topk_ids).exp()
    tail_q = 1 - qd.sum(1)
    kl = (qd * (qd.log() - logp.gather(1, topk_ids))).sum(1) + tail_q * (tail_q.log() - (1 - p_sel.sum(1)).log())
    top1 = topk_ids.gather(1, q.argmax(1, keepdim=True))[:, 0]
    ce = -logp.gather(1, top1[:, None])[:, 0]
    rows = {"kl": kl, "ce": ce, "kl+ce": kl + 0.5 * ce}[kind]
    torch.testing.assert_close(loss.double(), (batch.weights.double() * rows).sum(), rtol=1e-4, atol=1e-5)
    assert torch.equal(argmax, logp.argmax(1))


def test_run_logger_with_wandb_disabled(tmp_path, monkeypatch):
    """The W&B path runs (WANDB_MODE=disabled, as in CI); files get exactly the step keys."""
    from dflash.train.logging import STEP_KEYS, RunLogger

    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = RunLogger(tmp_path, enabled=True, wandb_config={"lr": 1.0})
    record = dict.fromkeys(STEP_KEYS, 0.0) | {"step": 1, "accuracy": [0.5, None], "skipped": False}
    logger.step(record)
    logger.event("checkpoint", step=1, write_s=0.5, path="x")
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == record
    assert json.loads((tmp_path / "events.jsonl").read_text())["write_s"] == 0.5


def test_wandb_steps_never_go_back(tmp_path, monkeypatch):
    """A background checkpoint of step 0 finishes after step 1 is logged: W&B would drop (and
    warn about) a log at step 0, so it lands at step 1 with its own step as checkpoint/step."""
    from dflash.train.logging import STEP_KEYS, RunLogger

    class Recorder:
        def __init__(self):
            self.calls = []

        def log(self, data, step):
            self.calls.append((step, data))

        def finish(self):
            pass

    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = RunLogger(tmp_path, enabled=True, wandb_config={})
    logger._wandb = recorder = Recorder()
    record = dict.fromkeys(STEP_KEYS, 0.0) | {"accuracy": [0.5], "skipped": False}
    logger.step(record | {"step": 1})
    logger.event("checkpoint", step=0, write_s=0.5, path="x")
    logger.step(record | {"step": 2})
    logger.close()
    assert [step for step, _ in recorder.calls] == [1, 1, 2]
    assert recorder.calls[1][1] == {"checkpoint/step": 0, "checkpoint/write_s": 0.5}


def test_resumed_logger_drops_steps_past_the_checkpoint(tmp_path):
    from dflash.train.logging import RunLogger

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8))
                                            + '{"step": 8, "los')  # torn by the crash
    RunLogger(tmp_path, enabled=True, resume_step=5).close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [1, 2, 3, 4, 5]


def test_fresh_logger_drops_steps_of_an_attempt_without_checkpoint(tmp_path):
    """A restart with no checkpoint redoes steps 1..k: their old lines must not stay (fault F8)."""
    from dflash.train.logging import RunLogger

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 4)))
    RunLogger(tmp_path, enabled=True).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_failed_checkpoint_write_names_the_file_and_cause(tmp_path, monkeypatch):
    """A full disk in a checkpoint write: an OSError naming the file and the cause, raised in
    the training loop, and no folder left under any name (fault F7)."""
    import errno

    def full_disk(obj, path):
        path.write_bytes(b"partial")
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:  # torch.save reports it as its own RuntimeError, the OSError as context (not cause)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 72256 vs 72144")  # noqa: B904

    monkeypatch.setattr(checkpoint_module, "_torch_save", full_disk)
    writer = CheckpointWriter(tmp_path, keep=2)
    writer.save(3, {"w": torch.ones(4)}, {"state": {}, "param_groups": []}, {})
    with pytest.raises(OSError, match=r"optimizer\.pt of .*step-00000003: No space left on device; "
                                      r"check the free space") as caught:
        writer.wait()
    assert caught.value.errno == errno.ENOSPC
    assert list((tmp_path / "checkpoints").iterdir()) == []
