"""Spike gating: skip an optimizer step whose loss or gradient norm is far above normal.

A step is skipped when its loss or its pre-clip gradient norm is not finite, or (once
`spike_warmup_steps` steps have been accepted) exceeds `spike_factor` times its running
mean. The running means are bias-corrected exponential moving averages that move only on
accepted steps, so a burst of bad batches cannot raise the bar it is measured against. The caller
feeds globally reduced figures (the same on every rank), so every rank takes the same
decision without another collective. After `max_consecutive_skips` skips in a row the
caller stops the run rather than skip forever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash.common.options import RESUMABLE


@dataclass(kw_only=True)
class GatingConfig:
    spike_factor: float = 3.0
    """Skip a step whose loss or grad norm exceeds this x its running mean."""
    spike_warmup_steps: int = 50
    """Accepted steps before the spike test applies (non-finite steps are always skipped)."""
    max_consecutive_skips: int = field(default=20, metadata={RESUMABLE: True})
    """Stop the run after this many skipped steps in a row."""
    spike_ema_decay: float = 0.99
    """Decay of the running means (about the last 1/(1-decay) accepted steps)."""

    def __post_init__(self) -> None:
        if not self.spike_factor > 1.0:
            raise ValueError(f"spike_factor must be > 1, got {self.spike_factor}")
        if self.spike_warmup_steps < 0:
            raise ValueError(f"spike_warmup_steps must be >= 0, got {self.spike_warmup_steps}")
        if self.max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}")
        if not 0.0 < self.spike_ema_decay < 1.0:
            raise ValueError(f"spike_ema_decay must be in (0, 1), got {self.spike_ema_decay}")


@dataclass
class SpikeGate:
    """Running means and counters; `state_dict` round-trips exactly through JSON."""

    config: GatingConfig
    loss_ema: float = 0.0
    grad_norm_ema: float = 0.0
    accepted: int = 0
    consecutive_skips: int = 0

    def _mean(self, ema: float) -> float:
        return ema / (1.0 - self.config.spike_ema_decay ** self.accepted)

    @property
    def loss_mean(self) -> float | None:
        return self._mean(self.loss_ema) if self.accepted else None

    @property
    def grad_norm_mean(self) -> float | None:
        return self._mean(self.grad_norm_ema) if self.accepted else None

    def reason_to_skip(self, loss: float, grad_norm: float) -> str | None:
        """Why this step must be skipped, or None to accept it. Does not change the state."""
        if not math.isfinite(loss):
            return f"loss is not finite ({loss})"
        if not math.isfinite(grad_norm):
            return f"gradient norm is not finite ({grad_norm})"
        if self.accepted < self.config.spike_warmup_steps or self.accepted == 0:
            return None
        f = self.config.spike_factor
        if loss > f * self.loss_mean:
            return f"loss {loss:.4g} > {f:g} x running mean {self.loss_mean:.4g}"
        if grad_norm > f * self.grad_norm_mean:
            return f"gradient norm {grad_norm:.4g} > {f:g} x running mean {self.grad_norm_mean:.4g}"
        return None

    def record(self, loss: float, grad_norm: float, skipped: bool) -> None:
        """Update after the decision: means move on accepted steps only."""
        if skipped:
            self.consecutive_skips += 1
            return
        d = self.config.spike_ema_decay
        self.loss_ema = d * self.loss_ema + (1.0 - d) * loss
        self.grad_norm_ema = d * self.grad_norm_ema + (1.0 - d) * grad_norm
        self.accepted += 1
        self.consecutive_skips = 0

    @property
    def should_stop(self) -> bool:
        return self.consecutive_skips >= self.config.max_consecutive_skips

    def state_dict(self) -> dict:
        return {"loss_ema": self.loss_ema, "grad_norm_ema": self.grad_norm_ema,
                "accepted": self.accepted, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict) -> None:
        self.loss_ema = float(state["loss_ema"])
        self.grad_norm_ema = float(state["grad_norm_ema"])
        self.accepted = int(state["accepted"])
        self.consecutive_skips = int(state["consecutive_skips"])
