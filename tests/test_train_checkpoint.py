"""train/checkpoint.py: the background checkpoint writer (keep-last-k, errors raised in the
caller, temporaries, a full disk) and the loader's refusals (pickles, damaged files)."""

import os

import pytest
import torch

from dflash.train import checkpoint as checkpoint_module
from dflash.train.checkpoint import CheckpointWriter, latest_checkpoint, list_checkpoints, load_checkpoint


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
