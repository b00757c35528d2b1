"""`--max-steps` overrides `--epochs` (the Hugging Face Trainer's convention): a short cache is
cycled for more epochs, each with fresh anchors; a long one is cut. The console states the plan."""

import json
from pathlib import Path

import pytest

from dflash.testing.builders import fit_cache, tiny_fit_config
from dflash.train.config import FitConfig
from dflash.train.fit import fit

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return fit_cache(tmp_path_factory)


def config(cache_dir: Path, out: Path, **overrides) -> FitConfig:
    return tiny_fit_config(cache_dir, out, **(dict(anchors_per_seq=2, epochs=1, checkpoint_every=1000) | overrides))


def steps_per_epoch(out: Path) -> int:
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return next(e["steps_per_epoch"] for e in events if e["event"] == "start")


def test_without_max_steps_the_epochs_decide(cache_dir, tmp_path, capsys):
    result = fit(config(cache_dir, tmp_path / "run", epochs=2))
    per_epoch = steps_per_epoch(tmp_path / "run")
    assert result.total_steps == result.step == 2 * per_epoch
    assert f"plan: {2 * per_epoch} steps of 24 blocks x 4 tokens = 2 epochs of {per_epoch} steps (--epochs 2)" \
        in capsys.readouterr().out


@pytest.mark.parametrize("extra_epochs", [2, 0])
def test_max_steps_overrides_epochs(cache_dir, tmp_path, capsys, extra_epochs):
    """More steps than one epoch holds: the run cycles epochs (fresh anchors each); fewer: cut."""
    probe = fit(config(cache_dir, tmp_path / "probe", max_steps=1))
    assert probe.total_steps == 1  # a cut inside the first epoch
    per_epoch = steps_per_epoch(tmp_path / "probe")
    assert per_epoch >= 2
    max_steps = extra_epochs * per_epoch + 1 if extra_epochs else per_epoch - 1
    capsys.readouterr()
    result = fit(config(cache_dir, tmp_path / "run", max_steps=max_steps))
    assert result.total_steps == result.step == max_steps
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == max_steps
    assert lines[-1]["epoch_index"] == (max_steps - 1) // per_epoch + 1
    out = capsys.readouterr().out
    assert f"plan: {max_steps} steps of 24 blocks x 4 tokens = {max_steps / per_epoch:.3g} epochs of " \
           f"{per_epoch} steps (--max-steps {max_steps} overrides --epochs 1)" in out
