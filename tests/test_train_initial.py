"""`fit --save-initial` checkpoints the untrained drafter as step 0: the same weights a run
with the same seed starts from, kept beside the trained ones for a before/after eval."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.testing.builders import FIT_LENGTHS, fit_cache, tiny_fit_config
from dflash.train.checkpoint import list_checkpoints
from dflash.train.fit import fit
from dflash.train.model import DFlashDrafter, DrafterConfig

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return fit_cache(tmp_path_factory, FIT_LENGTHS[:8])


def test_save_initial_keeps_the_untrained_weights(cache_dir, tmp_path):
    config = tiny_fit_config(cache_dir, tmp_path / "run", anchors_per_seq=6, epochs=1, max_steps=3,
                             checkpoint_every=100, save_initial=True, seed=3)
    fit(config)
    checkpoints = list_checkpoints(Path(config.out))
    assert len(checkpoints) == 2 and checkpoints[0].name == "step-00000000"
    assert checkpoints[1].name != checkpoints[0].name

    torch.manual_seed(config.data.seed)  # fit builds the drafter right after seeding, before any step
    drafter_config = DrafterConfig.from_target(cache_dir / "target", num_hidden_layers=1, num_drafts=3)
    expected = DFlashDrafter(drafter_config).state_dict()
    initial = load_file(checkpoints[0] / "model.safetensors")
    trained = load_file(checkpoints[1] / "model.safetensors")
    assert initial.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(initial[name], tensor), name
    assert any(not torch.equal(initial[n], trained[n]) for n in initial)
