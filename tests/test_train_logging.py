"""train/logging.py: the console line, durations, the tau estimate, and RunLogger's files and
W&B steps (fresh and resumed)."""

import json
import math

import pytest

from dflash.train.logging import console_line, format_duration, tau_estimate


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


def test_resumed_logger_drops_events_and_spikes_past_the_checkpoint(tmp_path):
    """The redone steps log their evaluations and skipped updates again: the old lines must go."""
    from dflash.train.logging import RunLogger

    events = [{"event": "start", "step": 0}, {"event": "eval", "step": 4}, {"event": "checkpoint", "step": 5},
              {"event": "eval", "step": 6}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "spikes.jsonl").write_text("".join(json.dumps({"step": s, "reason": "loss"}) + "\n" for s in (3, 7)))
    logger = RunLogger(tmp_path, enabled=True, resume_step=5)
    logger.event("resume", step=5)
    logger.close()
    kept = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in kept] == [("start", 0), ("eval", 4), ("checkpoint", 5), ("resume", 5)]
    assert [json.loads(line)["step"] for line in (tmp_path / "spikes.jsonl").read_text().splitlines()] == [3]


def test_fresh_logger_drops_steps_of_an_attempt_without_checkpoint(tmp_path):
    """A restart with no checkpoint redoes steps 1..k: their old lines must not stay (fault F8)."""
    from dflash.train.logging import RunLogger

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 4)))
    RunLogger(tmp_path, enabled=True).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
