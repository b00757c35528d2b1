"""Checkpoints written in the background, atomically, and loaded without unpickling.

`CheckpointWriter.save` copies the model and optimizer state into snapshot buffers reused
from save to save, and hands the copy to a writer thread; the training thread is blocked
only while the copy is queued, never for the device-to-host transfer or the write:

- state on a GPU: a device-side copy into buffers on the same GPU, queued on the training
  stream (a few milliseconds of device time for a 12 GiB checkpoint; the next update is
  queued after it, so the copy is of this step's state). The writer thread then copies the
  buffers to pinned host memory on its own stream and writes them. The device buffers cost
  the checkpoint's size in device memory; when that is not free (`mem_get_info` plus the
  allocator's cached blocks, keeping `DEVICE_RESERVE_FRACTION` of the device spare), the
  snapshot goes to pinned host memory instead, copied on a side stream, and the training
  stream waits for that copy only before its next optimizer update (`before_update`): the
  next forward and backward overlap it. The choice is printed once and logged with every
  checkpoint (`snapshot_to`: "device", "host" or "cpu");
- state on the CPU (CPU training, or FSDP2's gathered state): a copy into host buffers
  (the optimizer updates in place, so a copy is needed).

The thread writes `RUN/checkpoints/.step-XXXXXXXX.tmp/` (model.safetensors,
optimizer.pt, state.json), fsyncs every file and the folder, renames it to `step-XXXXXXXX`
and fsyncs the parent: a crash at any instant leaves either the previous set of complete
checkpoints or the new one, never a readable half. Then it deletes all but the newest
`keep` complete checkpoints. `snapshot` and `start` are the two halves of `save`: fit takes
the snapshot at the end of a step and starts the write after logging that step, so a kill
never leaves a checkpoint of a step that RUN/metrics.jsonl lacks. A failure in the thread
is raised in the training loop on the next `check()` / `save()` / `close()`. A failed file
write (a full disk, a file-size limit) is reported as an OSError naming the file and the
system's cause, which torch.save itself hides behind "[enforce fail at inline_container.cc]
unexpected pos"; the temporary folder is deleted, so nothing partial is left under any name.

Loading reads the weights with safetensors and the optimizer state with
`torch.load(weights_only=True)`: tensors and plain containers only, never arbitrary objects.
A save while the previous write is still running waits for it (logged as `wait_s`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.common.files import atomic_dir, fsync_file
from dflash.train.run_folder import CHECKPOINTS_DIR, OPTIMIZER_FILE, STATE_FILE, WEIGHTS_FILE

# The per-file fsync, by a name of this module: the fault harness (`python -m tests.faults`,
# tests/faults/fit_kill.py) replaces it to kill a write between two files.
_fsync_file = fsync_file

CHECKPOINT_VERSION = 1
_NAME = re.compile(r"^step-(\d{8})$")


@dataclass
class CheckpointEvent:
    """A finished write: its step, folder and durations (snapshot on the training thread,
    wait for the previous write, write in the background)."""

    step: int
    path: str
    snapshot_s: float
    wait_s: float
    write_s: float
    bytes: int
    snapshot_to: str
    """Where the snapshot was copied: "device" (GPU buffers), "host" (pinned, side stream), "cpu"."""


@dataclass
class Snapshot:
    """A checkpoint in host memory, taken by `CheckpointWriter.snapshot`, not yet written."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict
    payload: dict
    """state.json's contents."""
    snapshot_s: float
    wait_s: float
    snapshot_to: str
    copied: object = None
    """torch.cuda.Event: the snapshot's copy is complete (None: complete on return)."""


DEVICE_RESERVE_FRACTION = 0.05  # a device snapshot must leave this share of the GPU free


class CheckpointWriter:
    def __init__(self, run_dir: Path, keep: int, snapshot_to: str = "auto"):
        """snapshot_to: "auto" (device buffers when they fit, else pinned host memory),
        "device" or "host" (forced: for tests and benchmarks). Only matters for GPU state."""
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
        assert snapshot_to in ("auto", "device", "host"), snapshot_to
        self.snapshot_to = snapshot_to
        self._device_buffers: dict[str, torch.Tensor] = {}
        self._side_stream = None  # CUDA stream of the host fallback's copies
        self._pending_copy = None  # the host fallback's copy, which the next update must wait for
        self._announced = False
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._finished: list[CheckpointEvent] = []
        self._lock = threading.Lock()
        self._buffers: dict[str, torch.Tensor] = {}
        for stale in [*self.root.glob(".step-*.tmp"), *self.root.glob(".step-*.stale")]:  # left by a crash
            shutil.rmtree(stale, ignore_errors=True)

    def check(self) -> None:
        """Raise the writer thread's exception, if it failed."""
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, OSError):  # already names the file and the cause
                raise OSError(error.errno, f"checkpoint writer failed: {error.strerror}") from error
            raise RuntimeError(f"checkpoint writer failed: {error}") from error

    def pop_finished(self) -> list[CheckpointEvent]:
        with self._lock:
            events, self._finished = self._finished, []
        return events

    def save(self, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict,
             state: dict) -> None:
        """Snapshot to host memory now, write in the background. `state` is JSON-able."""
        self.start(self.snapshot(step, model_state, optimizer_state, state))

    def snapshot(self, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict,
                 state: dict) -> Snapshot:
        """Queue the copy of the state into the snapshot buffers (after the previous write,
        which reads them, has finished); `start` writes the copy. `state` is JSON-able."""
        self.check()
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self.check()
        wait_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        tensors = [t for t in [*model_state.values(), *_tensors(optimizer_state)] if t.is_cuda]
        where = self._where(tensors) if tensors else "cpu"
        copied = None
        if where == "host":  # after the training stream's queued work, beside the work queued next
            device = tensors[0].device
            self._side_stream = self._side_stream or torch.cuda.Stream(device)
            self._side_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._side_stream):
                model_copy, optimizer_copy = self._copy_all(model_state, optimizer_state, where)
                copied = self._pending_copy = _record(self._side_stream)
        else:
            model_copy, optimizer_copy = self._copy_all(model_state, optimizer_state, where)
            if where == "device":
                copied = _record(torch.cuda.current_stream(tensors[0].device))
        snapshot_s = time.perf_counter() - t1
        payload = {"version": CHECKPOINT_VERSION, "step": step, **state}
        return Snapshot(step, model_copy, optimizer_copy, payload, snapshot_s, wait_s, where, copied)

    def before_update(self) -> None:
        """Call before updating the state in place (the optimizer step): the training stream
        waits (on the device) for a host-fallback snapshot copy still reading the state."""
        if self._pending_copy is not None:
            torch.cuda.current_stream(self._side_stream.device).wait_event(self._pending_copy)
            self._pending_copy = None

    def start(self, snapshot: Snapshot) -> None:
        """Write `snapshot` (the latest one taken) in the background."""
        self._thread = threading.Thread(target=self._write, name=f"checkpoint-{snapshot.step}", daemon=True,
                                        args=(snapshot,))
        self._thread.start()

    def wait(self) -> None:
        """Block until the pending write (if any) is done, then raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    close = wait

    # -- internals -------------------------------------------------------------------

    def _where(self, tensors: list[torch.Tensor]) -> str:
        """"device" or "host" for a snapshot of these GPU tensors (see the module docstring)."""
        if self.snapshot_to != "auto":
            return self.snapshot_to
        if self._device_buffers:  # allocated by an earlier snapshot of the same state
            return "device"
        device = tensors[0].device
        needed = sum(t.numel() * t.element_size() for t in tensors)
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        where = "device" if needed <= free - DEVICE_RESERVE_FRACTION * total else "host"
        if not self._announced:
            self._announced = True
            how = ("a copy in device memory" if where == "device"
                   else "pinned host memory filled on a side stream (a device copy does not fit)")
            print(f"checkpoint snapshots: {how}: {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB of "
                  f"{total / 2**30:.1f} GiB free on {device}", flush=True)
        return where

    def _copy_all(self, model_state: dict, optimizer_state: dict, where: str) -> tuple[dict, dict]:
        return ({name: self._copy(f"model.{name}", t, where) for name, t in model_state.items()},
                self._copy_tree(optimizer_state, "optim", where))

    def _copy(self, key: str, tensor: torch.Tensor, where: str) -> torch.Tensor:
        """Copy into a buffer kept across saves: on the tensor's GPU ("device"), pinned host
        memory ("host", asynchronous on the current stream), or host memory (a CPU tensor).
        The previous write has finished reading it (snapshot() joined it), and reuse skips
        the page faults of fresh allocations. A copy is needed on CPU too: the optimizer
        updates in place."""
        tensor = tensor.detach()
        on_device = where == "device" and tensor.is_cuda
        buffers = self._device_buffers if on_device else self._buffers
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = (torch.empty_like(tensor, memory_format=torch.contiguous_format) if on_device
                      else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda))
            buffers[key] = buffer
        if buffer.data_ptr() == tensor.data_ptr():  # a device snapshot's CPU tensor (AdamW's step), copied already
            return buffer
        return buffer.copy_(tensor, non_blocking=tensor.is_cuda)

    def _copy_tree(self, value, key: str, where: str):
        if isinstance(value, torch.Tensor):
            return self._copy(key, value, where)
        if isinstance(value, dict):
            return {k: self._copy_tree(v, f"{key}.{k}", where) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy_tree(v, f"{key}.{i}", where) for i, v in enumerate(value))
        return value

    def _to_host(self, snapshot: Snapshot) -> tuple[dict, dict]:
        """(model, optimizer) in host memory: after the snapshot's copy, and for a device
        snapshot through this thread's own stream into pinned buffers."""
        if snapshot.copied is not None:
            snapshot.copied.synchronize()
        if snapshot.snapshot_to != "device":
            return snapshot.model, snapshot.optimizer
        device = next(t.device for t in [*snapshot.model.values(), *_tensors(snapshot.optimizer)] if t.is_cuda)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            host = self._copy_all(snapshot.model, snapshot.optimizer, "host")
        stream.synchronize()
        return host

    def _write(self, snapshot: Snapshot) -> None:
        step, payload = snapshot.step, snapshot.payload
        try:
            t0 = time.perf_counter()
            model_host, optimizer_host = self._to_host(snapshot)
            final = self.root / f"step-{step:08d}"
            from safetensors.torch import save_file

            writes = {
                WEIGHTS_FILE: lambda path: save_file(model_host, str(path)),
                OPTIMIZER_FILE: lambda path: _torch_save(optimizer_host, path),
                STATE_FILE: lambda path: path.write_text(json.dumps(payload, indent=1, sort_keys=True)),
            }
            size = 0
            # A rerun that reached the same step again replaces that checkpoint.
            with atomic_dir(final, fsync_files=False) as tmp:
                for file_name, write in writes.items():
                    with _naming_failure(tmp / file_name, final):
                        write(tmp / file_name)
                for path in sorted(tmp.iterdir()):  # fsync after every write, so a kill can land between
                    with _naming_failure(path, final):
                        size += path.stat().st_size
                        _fsync_file(path)
            for old in list_checkpoints(self.root.parent)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            event = CheckpointEvent(step, str(final), snapshot.snapshot_s, snapshot.wait_s, time.perf_counter() - t0,
                                    size, snapshot.snapshot_to)
            with self._lock:
                self._finished.append(event)
        except BaseException as error:  # noqa: BLE001 - re-raised in the training loop by check()
            # atomic_dir has deleted the temporary folder (it may hold the space a rerun needs).
            self._error = error


def _record(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in a state dict's nested dicts and lists."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _torch_save(obj, path: Path) -> None:
    """torch.save, which on a failed write drops the system's error ("[enforce fail at
    inline_container.cc] unexpected pos"): on such a failure it writes again through a Python
    file, whose OSError (EFBIG, ENOSPC: the disk is still full) then rides along as torch's
    error's context; a transient failure is simply healed by the second write."""
    try:
        torch.save(obj, path)
    except RuntimeError:
        with open(path, "wb") as f:
            torch.save(obj, f)


@contextlib.contextmanager
def _naming_failure(path: Path, final: Path):
    """Turn any failure while writing `path` into an error naming the file and the cause."""
    try:
        yield
    except Exception as error:
        cause = _os_error_of(error)
        where = f"cannot write checkpoint file {path.name} of {final}"
        hint = (f"check the free space and the file-size limit (ulimit -f) of {final.parent}, "
                "then rerun: training resumes from the last complete checkpoint")
        if cause is not None:
            raise OSError(cause.errno, f"{where}: {cause.strerror}; {hint}") from error
        raise RuntimeError(f"{where}: {error} (a short write: often a full disk); {hint}") from error


def _os_error_of(error: BaseException) -> OSError | None:
    """The OSError behind a write failure: the error itself, one in its cause/context chain
    (torch.save through a Python file), or the `os error N` in a safetensors message."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    match = re.search(r"os error (\d+)\)", str(error))
    if match:
        code = int(match.group(1))
        return OSError(code, os.strerror(code))
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are never listed)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(path: Path, device: torch.device | str = "cpu") -> tuple[dict, dict, dict]:
    """(model state, optimizer state, state.json) of a checkpoint folder; no unpickling."""
    from safetensors.torch import load_file

    path = Path(path)
    state = _read_part(path / STATE_FILE, "state", lambda f: json.loads(f.read_text()))
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(
            f"{path / STATE_FILE} has checkpoint version {state.get('version')!r}; this dflash "
            f"reads version {CHECKPOINT_VERSION}: resume with the dflash that wrote it"
        )
    model = _read_part(path / WEIGHTS_FILE, "weights", lambda f: load_file(str(f), device=str(device)))
    optimizer = _read_part(path / OPTIMIZER_FILE, "optimizer state",
                           lambda f: torch.load(f, map_location=device, weights_only=True))
    return model, optimizer, state


def _read_part(file: Path, what: str, read):
    """read(file), with any failure but a missing file (which callers tell apart: a
    half-written folder) turned into a ValueError that names the file: a damaged safetensors
    header, torn JSON, or a pickle that `weights_only` refuses."""
    try:
        return read(file)
    except FileNotFoundError:
        raise
    except Exception as error:
        raise ValueError(f"{file}: cannot read the checkpoint's {what}: {error}; resume from an "
                         f"earlier checkpoint (delete {file.parent.name})") from error
