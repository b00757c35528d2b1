"""`fit --save-initial` checkpoints the untrained drafter as step 0: the same weights a run
with the same seed starts from, kept beside the trained ones for a before/after eval."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.train.checkpoint import list_checkpoints
from dflash.train.config import FitConfig
from dflash.train.fit import fit
from dflash.train.model import DFlashDrafter, DrafterConfig
from dflash.train.synthetic import write_synthetic_training_cache


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache") / "cache"
    write_synthetic_training_cache(path, lengths=[40, 56, 33, 71, 48, 64, 29, 52], seed=1)
    return path


def test_save_initial_keeps_the_untrained_weights(cache_dir, tmp_path):
    config = FitConfig.from_dict(dict(
        cache=[str(cache_dir)], out=str(tmp_path / "run"), num_layers=1, block_size=4, anchors_per_seq=6,
        epochs=1, max_steps=3, tokens_per_step=96, checkpoint_every=100, eval_every=0, eval_fraction=0.1,
        wandb=False, save_initial=True, seed=3))
    fit(config)
    checkpoints = list_checkpoints(Path(config.out))
    assert len(checkpoints) == 2 and checkpoints[0].name == "step-00000000"
    assert checkpoints[1].name != checkpoints[0].name

    torch.manual_seed(config.data.seed)  # fit builds the drafter right after seeding, before any step
    drafter_config = DrafterConfig.from_target(cache_dir / "target", num_hidden_layers=1, block_size=4)
    expected = DFlashDrafter(drafter_config).state_dict()
    initial = load_file(checkpoints[0] / "model.safetensors")
    trained = load_file(checkpoints[1] / "model.safetensors")
    assert initial.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(initial[name], tensor), name
    assert any(not torch.equal(initial[n], trained[n]) for n in initial)
