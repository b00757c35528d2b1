"""train/gating.py: the spike gate's decisions, warm-up, running means and saved state."""

import json

import pytest

from dflash.train.gating import GatingConfig, SpikeGate


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
