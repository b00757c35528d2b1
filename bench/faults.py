"""Fault-tolerance trials: kill, starve, corrupt and poison dflash, and count what survives.

Seven fault classes, each run as N randomised trials (`--trials`, seeded by `--seed`):

1. `precompute-kill`  SIGKILL of `dflash-precompute` at a random instant, then a rerun: the
   cache equals an uninterrupted run's (manifest shard checksums, sequences, rejects, target
   files, every decoded row), `verify` passes, and no file was ever readable under a final
   name unless it was complete (a watcher thread opens every final name it sees during both
   runs and compares it with the uninterrupted run's bytes).
2. `fit-kill`  SIGKILL of `dflash-train fit` at a random instant, or at a random point inside
   a checkpoint write (a half-written model.safetensors or optimizer.pt, before the fsync,
   before or after the rename, while deleting old checkpoints), then a resume: every
   checkpoint left under a final name, and the final one after the resume, is bitwise
   equal (weights, optimizer state, gate, step) to the uninterrupted run's at that step, and
   the logged loss trace equals it too.
3. `disk-full`  a file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored so write() fails with
   EFBIG) during stage one (a random limit from the start, or one that drops to a few KiB at
   a random instant: the failure lands in a shard, the target folder, a record, the
   manifest...) and during a checkpoint write: the command exits non-zero with its last
   line naming the cause ("File too large" / "No space left"; a traceback above it is
   tallied, not failed), no partial file sits under a final name, and a rerun without the
   limit completes and equals the uninterrupted run.
4. `corruption`  truncation, bit flips in a shard, footer damage, manifest damage, a missing
   shard, a shard from another cache of the same configuration: `verify` reports it and
   names the damaged file; reading every row and training on the cache either fail with a
   ValueError naming the cache, or give exactly what the undamaged cache gives (damage in
   bytes nobody reads). Anything else is training on wrong data. Damage that verify passes
   and that changes neither the rows nor the trained weights (a manifest field no reader
   uses) is tallied as "undetected, harmless" and listed, not failed.
5. `bad-input`  random mixes of good and malformed records (invalid JSON, deep nesting,
   wrong types, missing roles, empty turns, huge lines, invalid UTF-8, lone surrogates):
   the run does not crash, processed + rejected = input, every good record is processed,
   every malformed one that must be refused is in rejected.jsonl with its file, line and a
   reason. Token-id overflow in pre-tokenised input is not applicable: stage one reads no
   pre-tokenised records; one with `input_ids` is rejected like any unknown shape.
6. `numeric`  NaN, Inf and huge-loss batches injected into training (through
   `dflash.train.fit.read_batch`, the seam the trainer's own tests use): no checkpoint ever
   holds a non-finite value, each poisoned step is skipped and leaves weights and optimizer
   state untouched, each skip is logged with its batch's sources, and persistent poisoning
   stops the run with a message naming spikes.jsonl.
7. `untrusted`  a checkpoint whose optimizer.pt (or model.safetensors), a run's anchor index
   or a cache's head.safetensors carries a live pickle payload, and a manifest whose paths
   (or a shard symlink) leave the cache: refused, the payload never runs (its marker file
   never appears, its victim outside is untouched), nothing outside is read as data.

Killed and starved commands run in child processes forked from a forkserver that has
imported torch, transformers and dflash once: each trial then costs the command's work,
not the ~5-10 s import, and the child runs the console script's own `main`. Children run
single-threaded, so their numbers are bitwise reproducible across processes.

The trade-off: tiny models (a 6-layer, 32-wide random Qwen3 target; a 1-layer drafter) and
short runs, so that 20 trials of every class fit in minutes on two cores. They exercise the
same code paths, file formats and write sequences as full-size runs.

    python bench/faults.py                  # 3 trials of every class
    python bench/faults.py --trials 20      # the Done-when run
    python bench/faults.py --classes bad-input --seed 0 --trial 7    # one trial again
    python bench/faults.py --json           # ... and one JSON object as the last line
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import io
import json
import multiprocessing
import os
import platform
import re
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# The tiny-target builders live with the precompute tests (tests/test_precompute_support.py).
sys.path.insert(0, str(REPO / "tests"))

CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
# Imported once by the forkserver; every child forks from it with these already loaded.
PRELOAD = ["torch", "transformers", "safetensors.torch", "dflash.precompute.cli", "dflash.precompute.run",
           "dflash.precompute.target", "dflash.train.cli", "dflash.train.fit", "dflash.shards",
           "transformers.models.qwen3.modeling_qwen3"]

# Stage one on the tiny target: ~120 records in 4-row shards, a few seconds of writing.
NUM_CHAT_RECORDS = 120
PRECOMPUTE_OPTIONS = ["--top-k", "4", "--num-feature-layers", "3", "--batch-tokens", "512",
                      "--shard-max-rows", "4", "--max-length", "256", "--device", "cpu", "--no-progress"]
# Stage two: 16 synthetic sequences in 4-row shards, a 1-layer drafter, 24 steps of 96 tokens.
TRAIN_LENGTHS = [40, 56, 33, 71, 48, 64, 29, 52, 45, 60, 38, 66, 50, 35, 58, 44]
FIT_OPTIONS = dict(num_layers=1, block_size=4, anchors_per_seq=6, epochs=6, tokens_per_step=96,
                   checkpoint_every=2, keep_checkpoints=2, eval_every=0, eval_fraction=0.1,
                   spike_warmup_steps=2, device="cpu", wandb=False)

FILE_TOO_LARGE = os.strerror(27)  # "File too large": write() past RLIMIT_FSIZE fails with EFBIG


# ----------------------------------------------------------------------------- results


@dataclass
class Outcome:
    """What one sub-case of one trial did."""

    case: str
    """The sub-case (e.g. "truncated", "inside checkpoint: optimizer.pt"), for the counts."""
    problems: list[str] = field(default_factory=list)
    """Why the sub-case failed; empty when it passed."""
    notes: list[str] = field(default_factory=list)
    """Facts about the trial; those starting with a tag in COUNTED_NOTES are tallied."""
    counts: dict[str, int] = field(default_factory=dict)
    """Quantities summed over the class's trials (e.g. final-name files opened)."""


# Notes with these prefixes are tallied per class in the table; the rest stay per trial.
COUNTED_NOTES = ("undetected", "reported as", "refused:", "error:", "limit hit in:")


@dataclass(kw_only=True)
class FaultsConfig:
    """What `run_faults` runs."""

    trials: int = 3
    """Trials per fault class."""
    seed: int = 0
    """Base seed: trial t of class c draws from default_rng([seed, c, t])."""
    classes: list[str] = field(default_factory=lambda: list(CLASSES))
    """Fault classes to run, by name."""
    first_trial: int = 0
    """Index of the first trial (to rerun one failing trial: --trial T)."""
    workdir: Path | None = None
    """Where targets, caches and runs go; None: a temporary folder deleted at the end."""

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"--trials must be >= 1, got {self.trials}")
        if self.first_trial < 0:
            raise ValueError(f"--trial must be >= 0, got {self.first_trial}")
        unknown = [c for c in self.classes if c not in CLASSES]
        if unknown:
            raise ValueError(f"unknown fault class(es) {unknown}; choose from {list(CLASSES)}")


# ----------------------------------------------------------------------------- children


def _child_main(command: str, args: list[str], output: Any, fsize_limit: int | None,
                kill_point: dict | None) -> None:
    """A forked child: run a console script's `main` with `args`, output to the pipe.

    fsize_limit sets RLIMIT_FSIZE (SIGXFSZ ignored, so an oversized write fails with EFBIG
    instead of killing the process). kill_point makes fit SIGKILL itself inside a checkpoint
    write (see `_install_kill_point`).
    """
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    output.close()
    os.environ.update(CHILD_ENV)
    import torch
    from tqdm import tqdm

    torch.set_num_threads(1)
    # tqdm's default lock is a multiprocessing semaphore, which a SIGKILLed child would leak.
    tqdm.set_lock(threading.RLock())
    # Ignored even without a limit here: the parent may lower the limit later (prlimit).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if fsize_limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    if kill_point is not None:
        _install_kill_point(**kill_point)
    if command == "precompute":
        from dflash.precompute.cli import main

        main(args, prog_name="dflash-precompute")
    else:
        from dflash.train.cli import main

        main(["fit", *args], prog_name="dflash-train")


def _install_kill_point(step: int, point: str, fraction: float) -> None:
    """Make this process SIGKILL itself at `point` of the write of checkpoint `step`.

    Points: "model.safetensors" / "optimizer.pt" (that file is cut to `fraction` of its size,
    then the kill: a half-written file in the temporary folder), "before-fsync" (every file
    written, none fsynced), "before-rename", "after-rename" (the folder has its final name,
    its parent is not fsynced, old checkpoints not deleted), "deleting-old" (after the first
    old checkpoint is deleted). The hooks sit on the writer's fsync, rename and delete calls;
    a hook that is never reached shows as "the planned kill did not happen".
    """
    from dflash.train import checkpoint

    tmp_name = f".step-{step:08d}.tmp"

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point in ("model.safetensors", "optimizer.pt", "before-fsync"):
        real_fsync_file = checkpoint._fsync_file

        def fsync_file(path):
            if tmp_name in str(path) and point == "before-fsync":
                die()
            if tmp_name in str(path) and Path(path).name == point:
                os.truncate(path, int(os.path.getsize(path) * fraction))
                die()
            real_fsync_file(path)

        checkpoint._fsync_file = fsync_file
    elif point in ("before-rename", "after-rename"):
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if tmp_name in str(src) and point == "before-rename":
                die()
            real_replace(src, dst, *args, **kwargs)
            if tmp_name in str(src):
                die()

        checkpoint.os.replace = replace
    elif point == "deleting-old":
        real_rmtree = shutil.rmtree
        final_name = re.compile(r"step-\d{8}$")

        def rmtree(path, *args, **kwargs):
            real_rmtree(path, *args, **kwargs)
            if final_name.search(str(path)) and _writing_step(step):
                die()

        checkpoint.shutil.rmtree = rmtree
    else:
        raise ValueError(f"unknown kill point {point!r}")


def _writing_step(step: int) -> bool:
    """True inside the writer thread of checkpoint `step` (its thread is named after it)."""
    return threading.current_thread().name == f"checkpoint-{step}"


class Child:
    """A command running in a forked child; its output is drained by a thread."""

    def __init__(self, context: Any, command: str, args: list[str], *, fsize_limit: int | None = None,
                 kill_point: dict | None = None):
        reader, writer = context.Pipe(duplex=False)
        self.process = context.Process(target=_child_main,
                                       args=(command, args, writer, fsize_limit, kill_point), daemon=True)
        self.process.start()
        writer.close()
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._drain, args=(reader,), daemon=True)
        self._reader.start()
        self.killed = False

    def _drain(self, reader: Any) -> None:
        with reader:
            while chunk := os.read(reader.fileno(), 65536):
                self._chunks.append(chunk)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> bool:
        """SIGKILL the child; True when it was still running."""
        if not self.process.is_alive():
            return False
        os.kill(self.process.pid, signal.SIGKILL)
        self.killed = True
        return True

    def wait(self, timeout_s: float = 600.0) -> int:
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.kill()
            self.process.join()
            raise TimeoutError(f"child ran longer than {timeout_s} s and was killed")
        self._reader.join(10)
        return self.process.exitcode

    @property
    def output(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def last_line(self) -> str:
        lines = [line for line in self.output.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def _wait_for(condition: Callable[[], bool], child: Child, timeout_s: float = 300.0) -> bool:
    """Poll until `condition` holds (True) or the child exits (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if not child.alive:
            return condition()
        time.sleep(0.005)
    raise TimeoutError("condition not reached")


# ----------------------------------------------------------------------------- final names


def is_temporary(rel: Path) -> bool:
    """Writers' temporaries: `*.tmp`, `.step-*.tmp/`, `*.tmp.npz`, `target.partial/`, `target.stale/`."""
    return any(".tmp" in part or part.endswith((".partial", ".stale")) for part in rel.parts)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_cache_file(root: Path, rel: Path, reference: Path) -> str | None:
    """Is the file `rel` under a final name in cache `root` complete? None if so, else why.

    Stage one is deterministic, so a final-named file must hold the uninterrupted run's
    bytes; the files that record the run's own path or time (manifest.json, the ranks'
    spec.json) must parse, and the manifest must open.
    """
    from dflash.shards import open_cache

    path = root / rel
    if rel.name == "manifest.json" or rel.name.endswith(".spec.json"):
        try:
            json.loads(path.read_bytes())
            if rel.name == "manifest.json":
                open_cache(root)
        except FileNotFoundError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure to read it is the finding
            return f"{rel} is under its final name but unreadable: {type(error).__name__}: {error}"
        return None
    expected = reference / rel
    if not expected.is_file():
        return f"{rel} is under a final name but the uninterrupted run has no such file"
    if sha256_file(path) != sha256_file(expected):
        return f"{rel} is under its final name but differs from the uninterrupted run's (partial?)"
    return None


def check_checkpoint(run_dir: Path, name: str, reference_run: Path) -> str | None:
    """Does checkpoint `name` of `run_dir` equal the reference run's? None if so, else why.

    A checkpoint folder that misses a file is a problem when it is the newest (resume would
    pick it); an older one is being deleted (or its deletion was interrupted, which resume
    never sees): FileNotFoundError, for the caller to skip.
    """
    from dflash.train.checkpoint import latest_checkpoint, load_checkpoint

    try:
        loaded = load_checkpoint(run_dir / "checkpoints" / name)
    except FileNotFoundError as error:
        newest = latest_checkpoint(run_dir)
        if (run_dir / "checkpoints" / name).is_dir() and newest is not None and newest.name == name:
            return f"checkpoints/{name} is the newest checkpoint under a final name but misses a file: {error}"
        raise
    except Exception as error:  # noqa: BLE001
        return f"checkpoints/{name} is under its final name but does not load: {type(error).__name__}: {error}"
    if not (reference_run / "checkpoints" / name).is_dir():
        return f"checkpoints/{name} exists but the uninterrupted run wrote no such checkpoint"
    difference = checkpoint_difference(loaded, load_checkpoint(reference_run / "checkpoints" / name))
    return f"checkpoints/{name} differs from the uninterrupted run's: {difference}" if difference else None


def checkpoint_difference(a: tuple, b: tuple, *, skip_lr: bool = False) -> str | None:
    """First difference between two loaded checkpoints (model, optimizer, state), or None."""
    import torch

    (model_a, optim_a, state_a), (model_b, optim_b, state_b) = a, b
    if model_a.keys() != model_b.keys():
        return "different parameter names"
    for name in model_a:
        if not torch.equal(model_a[name], model_b[name]):
            return f"weight {name}"
    if optim_a["state"].keys() != optim_b["state"].keys():
        return "different optimizer state keys"
    for index, entry in optim_a["state"].items():
        for key, value in entry.items():
            other = optim_b["state"][index][key]
            if not (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other):
                return f"optimizer state {index}.{key}"
    groups_a, groups_b = optim_a["param_groups"], optim_b["param_groups"]
    if skip_lr:  # the learning rate is set before the gate decides, so a skip changes it
        groups_a = [{k: v for k, v in g.items() if k != "lr"} for g in groups_a]
        groups_b = [{k: v for k, v in g.items() if k != "lr"} for g in groups_b]
    if groups_a != groups_b:
        return "optimizer param_groups"
    if state_a["gate"] != state_b["gate"] and not skip_lr:
        return f"gate state {state_a['gate']} vs {state_b['gate']}"
    return None


class FinalNameWatcher:
    """While a command runs, open every file (or checkpoint) that appears under a final name.

    `check(rel)` returns None or the problem; a file deleted under the watcher's feet
    (FileNotFoundError) is skipped: the writers delete their own stale files.
    """

    def __init__(self, root: Path, check: Callable[[Path], str | None], *, checkpoints: bool = False):
        self.root, self.check, self.checkpoints = root, check, checkpoints
        self.problems: list[str] = []
        self.opened = 0
        self._seen: set[tuple] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FinalNameWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self._scan()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._scan()
            time.sleep(0.01)

    def _candidates(self) -> list[Path]:
        if self.checkpoints:
            folder = self.root / "checkpoints"
            names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
            return [Path("checkpoints", n) for n in names if re.fullmatch(r"step-\d{8}", n)]
        found = []
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                rel = Path(dirpath, name).relative_to(self.root)
                if not is_temporary(rel):
                    found.append(rel)
        return found

    def _scan(self) -> None:
        try:
            candidates = self._candidates()
        except FileNotFoundError:
            return
        for rel in candidates:
            try:
                stat = (self.root / rel).stat()
                key = (rel, stat.st_ino, stat.st_size, stat.st_mtime_ns)
                if key in self._seen:
                    continue
                problem = self.check(rel)
            except FileNotFoundError:
                continue
            self._seen.add(key)
            self.opened += 1
            if problem:
                self.problems.append(problem)


# ----------------------------------------------------------------------------- the workspace


@dataclass
class PrecomputeReference:
    cache: Path
    write_s: float
    """Seconds from the shards folder appearing to the manifest appearing."""
    num_shards: int


@dataclass
class FitReference:
    run: Path
    train_s: float
    """Seconds from metrics.jsonl appearing to the command's exit."""
    total_steps: int


class Workspace:
    """Targets, inputs, caches and reference runs shared by the trials, built on first use."""

    def __init__(self, root: Path, seed: int):
        self.root = root
        self.seed = seed
        self._context = None

    # -- children ---------------------------------------------------------------------------

    @property
    def context(self) -> Any:
        if self._context is None:
            from multiprocessing import forkserver

            self._context = multiprocessing.get_context("forkserver")
            self._context.set_forkserver_preload(PRELOAD)
            # The forkserver imports torch with the children's environment; this process
            # keeps its own (the children set CHILD_ENV again themselves).
            saved = dict(os.environ)
            os.environ.update(CHILD_ENV)
            try:
                forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
        return self._context

    def launch(self, command: str, args: list[str], **kwargs) -> Child:
        return Child(self.context, command, args, **kwargs)

    def trial_dir(self, name: str, trial: int) -> Path:
        path = self.root / "trials" / f"{name}-{trial:03d}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    # -- stage one --------------------------------------------------------------------------

    @cached_property
    def target(self) -> Path:
        from test_precompute_support import build_target

        with quiet():
            return build_target("qwen3", self.root / "target-qwen3")

    @cached_property
    def chat_data(self) -> Path:
        """NUM_CHAT_RECORDS conversations (varied replies) with two broken lines among them."""
        from test_precompute_support import CONVERSATIONS, CORPUS, write_jsonl

        rng = np.random.default_rng([self.seed, 1000])
        words = " ".join(CORPUS).split()
        records: list[Any] = []
        for i in range(NUM_CHAT_RECORDS):
            conversation = [dict(m) for m in CONVERSATIONS[i % len(CONVERSATIONS)]]
            conversation[-1]["content"] += " " + " ".join(rng.choice(words, int(rng.integers(1, 30))))
            records.append({"messages": conversation})
        records.insert(37, "{broken")  # rejects travel through the shards' records too
        records.insert(81, '{"messages": []}')
        return write_jsonl(self.root / "chat.jsonl", records)

    def precompute_args(self, out: Path) -> list[str]:
        return ["--target", str(self.target), "--data", str(self.chat_data), "--out", str(out),
                *PRECOMPUTE_OPTIONS]

    @cached_property
    def precompute_reference(self) -> PrecomputeReference:
        out = self.root / "reference-cache"
        shutil.rmtree(out, ignore_errors=True)
        child = self.launch("precompute", self.precompute_args(out))
        _wait_for(lambda: (out / "shards").is_dir(), child)
        opened = time.monotonic()
        _wait_for(lambda: (out / "manifest.json").exists(), child)
        write_s = time.monotonic() - opened
        code = child.wait()
        if code != 0:
            raise RuntimeError(f"the reference dflash-precompute run failed ({code}):\n{child.output[-3000:]}")
        return PrecomputeReference(cache=out, write_s=write_s,
                                   num_shards=len(list((out / "shards").glob("*.arrow"))))

    # -- stage two --------------------------------------------------------------------------

    def _write_training_cache(self, path: Path, seed: int) -> Path:
        from dflash.shards import CacheSpec
        from dflash.shards.synthetic import write_synthetic_cache
        from dflash.train.synthetic import write_synthetic_target

        spec = CacheSpec(vocab_size=64, hidden_size=32, layer_ids=[0, 2, 4], top_k=4,
                         max_length=max(TRAIN_LENGTHS), shard_max_rows=4,
                         target={"name": "synthetic", "model_type": "qwen3", "num_layers": 6,
                                 "config_sha256": "synthetic", "dtype": "bfloat16"})
        shutil.rmtree(path, ignore_errors=True)
        write_synthetic_cache(path, spec, TRAIN_LENGTHS, seed=seed)
        write_synthetic_target(path / "target", vocab_size=64, hidden_size=32, num_layers=6,
                               layer_ids=[0, 2, 4], num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, intermediate_size=64, seed=1)
        return path

    @cached_property
    def training_cache(self) -> Path:
        """A synthetic training cache (16 sequences, 4 shards) with its target/ folder."""
        return self._write_training_cache(self.root / "train-cache", seed=self.seed)

    @cached_property
    def foreign_cache(self) -> Path:
        """Same configuration and lengths, other rows: its shards are the same size."""
        return self._write_training_cache(self.root / "foreign-cache", seed=self.seed + 1)

    def fit_args(self, out: Path, **overrides) -> list[str]:
        options = {**FIT_OPTIONS, **overrides}
        args = ["--cache", str(self.training_cache), "--out", str(out)]
        for name, value in options.items():
            if isinstance(value, bool):
                args.append(f"--{name}" if value else f"--no-{name}")
            else:
                args += [f"--{name.replace('_', '-')}", str(value)]
        return args

    @cached_property
    def fit_reference(self) -> FitReference:
        """The uninterrupted fit, keeping every checkpoint (keep_checkpoints changes no number)."""
        out = self.root / "reference-run"
        shutil.rmtree(out, ignore_errors=True)
        child = self.launch("fit", self.fit_args(out, keep_checkpoints=1000))
        _wait_for(lambda: (out / "metrics.jsonl").exists(), child)
        started = time.monotonic()
        code = child.wait()
        if code != 0:
            raise RuntimeError(f"the reference dflash-train fit failed ({code}):\n{child.output[-3000:]}")
        steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        return FitReference(run=out, train_s=time.monotonic() - started, total_steps=steps[-1])

    def fit_config(self, cache: Path, out: Path, **overrides):
        from dflash.train.config import FitConfig

        return FitConfig(cache=[str(cache)], out=str(out), **{**FIT_OPTIONS, **overrides})

    @cached_property
    def clean_fit_weights(self) -> dict:
        """Final weights of one epoch on the undamaged training cache (in this process)."""
        return fit_in_process(self.fit_config(self.training_cache, self.root / "clean-fit", epochs=1))


def fit_in_process(config) -> dict:
    """Run `fit` here (its console lines swallowed); returns the final weights."""
    from safetensors.torch import load_file

    from dflash.train.fit import fit

    with contextlib.redirect_stdout(io.StringIO()):
        result = fit(config)
    return load_file(str(Path(result.checkpoint) / "model.safetensors"))


@contextlib.contextmanager
def quiet():
    """Silence stdout and stderr (transformers' loading bars, tqdm) of in-process work."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def compare_caches(cache_dir: Path, reference_dir: Path) -> list[str]:
    """Differences between a cache and the uninterrupted run's: shard list and checksums,
    sequences, rejects, target files, every decoded row; plus verify's verdict."""
    from dflash.shards import open_cache, verify_cache

    problems = []
    try:
        cache, reference = open_cache(cache_dir), open_cache(reference_dir)
    except ValueError as error:
        return [f"the cache does not open: {error}"]
    keys = ("path", "sha256", "num_bytes", "num_sequences", "num_tokens")
    shards = [{k: s[k] for k in keys} for s in cache.manifest["shards"]]
    if shards != [{k: s[k] for k in keys} for s in reference.manifest["shards"]]:
        problems.append("the manifest's shard list or per-shard checksums differ from the uninterrupted run's")
    for key in ("sequences", "source_files", "num_rejected"):
        if cache.manifest[key] != reference.manifest[key]:
            problems.append(f"manifest {key} differs from the uninterrupted run's")
    if (cache_dir / "rejected.jsonl").read_bytes() != (reference_dir / "rejected.jsonl").read_bytes():
        problems.append("rejected.jsonl differs from the uninterrupted run's")
    for path in sorted((reference_dir / "target").iterdir()):
        mine = cache_dir / "target" / path.name
        if not mine.is_file() or mine.read_bytes() != path.read_bytes():
            problems.append(f"target/{path.name} differs from the uninterrupted run's")
    if not problems:
        for i in range(len(reference)):
            a, b = cache[i], reference[i]
            fields = ("input_ids", "loss_mask", "features", "topk_ids", "topk_logprobs", "tail_mass")
            if a.source != b.source or not all(np.array_equal(getattr(a, f), getattr(b, f)) for f in fields):
                problems.append(f"decoded sequence {i} differs from the uninterrupted run's")
                break
    verified = verify_cache(cache_dir)
    if not verified["ok"]:
        problems.append(f"verify fails: {verified['problems'][:2]}")
    return problems


# ----------------------------------------------------------------------------- 1. precompute-kill


def _random_instant(reference: PrecomputeReference, rng: np.random.Generator, out: Path,
                    child: Child) -> None:
    """Return at a random instant of stage one's writing: after a random number of sealed
    shards (0 to all), plus up to one shard's time. Progress, not the clock, places it, so
    the instant falls inside the run however loaded the machine is."""
    sealed = int(rng.integers(0, reference.num_shards + 1))
    jitter_s = float(rng.uniform(0.0, reference.write_s / reference.num_shards))
    shards = out / "shards"
    _wait_for(lambda: shards.is_dir() and len(list(shards.glob("*.arrow"))) >= sealed, child)
    time.sleep(jitter_s)


def trial_precompute_kill(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    """SIGKILL dflash-precompute at a random instant of its writing, rerun, compare."""
    reference = ws.precompute_reference
    out = ws.trial_dir("precompute-kill", trial) / "cache"
    outcome = Outcome(case="kill")
    watch = FinalNameWatcher(out, lambda rel: check_cache_file(out, rel, reference.cache))
    with watch:
        child = ws.launch("precompute", ws.precompute_args(out))
        _random_instant(reference, rng, out, child)
        killed = child.kill()
        code = child.wait()
        sealed = len(list((out / "shards").glob("*.arrow")))
        if not killed:
            outcome.case = "finished before the kill"
            if code != 0:
                outcome.problems.append(f"the run failed on its own ({code}): {child.last_line()}")
        elif (out / "manifest.json").exists():
            outcome.case = "killed after the manifest"
        else:
            outcome.case = "killed before any shard" if sealed == 0 else "killed mid-run"
        outcome.counts["shards sealed at the kills"] = sealed
        rerun = ws.launch("precompute", ws.precompute_args(out))
        if rerun.wait() != 0:
            outcome.problems.append(f"the rerun failed: {rerun.output[-2000:]}")
    outcome.problems += watch.problems
    outcome.counts["final-name files opened during the runs"] = watch.opened
    if not outcome.problems:
        outcome.problems += compare_caches(out, reference.cache)
    return [outcome]


# ----------------------------------------------------------------------------- 2. fit-kill

KILL_POINTS = ["model.safetensors", "optimizer.pt", "before-fsync", "before-rename", "after-rename",
               "deleting-old"]


def trial_fit_kill(ws: Workspace, rng: np.random.Generator, trial: int,
                   kill_point: dict | None = None) -> list[Outcome]:
    """SIGKILL dflash-train fit at a random instant or inside a checkpoint write, resume.

    kill_point ({"step", "point", "fraction"}, see `_install_kill_point`) forces a kill
    inside that checkpoint write; by default half the trials draw one, half a random instant.
    """
    reference = ws.fit_reference
    out = ws.trial_dir("fit-kill", trial) / "run"
    every, keep = FIT_OPTIONS["checkpoint_every"], FIT_OPTIONS["keep_checkpoints"]
    if kill_point is not None:
        outcome = Outcome(case=f"inside checkpoint: {kill_point['point']}")
    elif rng.uniform() < 0.5:
        delay_s = float(rng.uniform(0.0, reference.train_s))
        outcome = Outcome(case="random instant")
    else:
        point = str(rng.choice(KILL_POINTS))
        # Old checkpoints are deleted from the (keep+1)-th one on.
        first = every * (keep + 1) if point == "deleting-old" else every
        step = int(rng.choice(np.arange(first, reference.total_steps + 1, every)))
        kill_point = {"step": step, "point": point, "fraction": float(rng.uniform(0.0, 1.0))}
        outcome = Outcome(case=f"inside checkpoint: {point}")
        outcome.notes.append(f"kill inside the write of step {step}")
    watch = FinalNameWatcher(out, lambda rel: check_checkpoint(out, rel.name, reference.run), checkpoints=True)
    with watch:
        child = ws.launch("fit", ws.fit_args(out), kill_point=kill_point)
        if kill_point is None:
            _wait_for(lambda: (out / "metrics.jsonl").exists(), child)
            time.sleep(delay_s)
            child.kill()
        code = child.wait()
        if code != -signal.SIGKILL:
            if kill_point is not None:
                outcome.problems.append(f"the planned kill did not happen (exit {code}): {child.last_line()}")
            elif code != 0:
                outcome.problems.append(f"the run failed on its own ({code}): {child.last_line()}")
            else:
                outcome.case = "finished before the kill"
        outcome.problems += _left_checkpoints(out, reference.run)
        resumed = ws.launch("fit", ws.fit_args(out))
        if resumed.wait() != 0:
            outcome.problems.append(f"the resume failed: {resumed.output[-2000:]}")
    outcome.problems += watch.problems
    outcome.counts["final-name checkpoints opened during the runs"] = watch.opened
    if not outcome.problems:
        outcome.problems += _same_final_run(out, reference)
    return [outcome]


def _left_checkpoints(run: Path, reference_run: Path) -> list[str]:
    """Every checkpoint under a final name after a crash must load and equal the reference.

    An older checkpoint whose deletion was interrupted may miss files; it is never the
    newest (deletion follows the new checkpoint's rename) and resume never picks it.
    """
    from dflash.train.checkpoint import list_checkpoints

    problems = []
    for path in list_checkpoints(run):
        try:
            problem = check_checkpoint(run, path.name, reference_run)
        except FileNotFoundError:
            continue
        if problem:
            problems.append(problem)
    return problems


def _same_final_run(run: Path, reference: FitReference) -> list[str]:
    from dflash.train.checkpoint import latest_checkpoint

    final = latest_checkpoint(run)
    if final is None or final.name != f"step-{reference.total_steps:08d}":
        return [f"the resumed run ended at {final}, the uninterrupted one at step {reference.total_steps}"]
    problems = []
    problem = check_checkpoint(run, final.name, reference.run)
    if problem:
        problems.append(problem)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (reference.run / "metrics.jsonl").read_text().splitlines()]
    if [(r["step"], r["loss"]) for r in lines] != [(r["step"], r["loss"]) for r in expected]:
        problems.append("metrics.jsonl's (step, loss) trace differs from the uninterrupted run's")
    return problems


# ----------------------------------------------------------------------------- 3. disk-full


def trial_disk_full(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    """Stage one under a file-size limit from the start, stage one whose limit drops to a few
    KiB at a random instant (any write may be the one that fails: a shard, a record, the
    manifest), and fit whose limit lands in a checkpoint write; each then rerun with space."""
    return [_disk_full_precompute(ws, rng, trial), _disk_full_precompute(ws, rng, trial, mid_run=True),
            _disk_full_checkpoint(ws, rng, trial)]


def _clear_error(child: Child) -> str | None:
    """None when the failed command's last line names the cause, else the problem."""
    last = child.last_line()
    if FILE_TOO_LARGE not in last and "No space left" not in last:
        return f"the error does not name the cause: last line {last!r}"
    return None


def _error_notes(child: Child) -> list[str]:
    """How the failure was reported: the exception type of the last line, traceback or not."""
    last = child.last_line()
    kind = last.split(":")[0] if ":" in last else last[:60]
    notes = [f"error: {kind}", f"message: {last[:300]}"]
    if "Traceback" in child.output:
        notes.append("reported as a traceback")
    return notes


def _disk_full_precompute(ws: Workspace, rng: np.random.Generator, trial: int,
                          mid_run: bool = False) -> Outcome:
    reference = ws.precompute_reference
    sizes = [p.stat().st_size for p in reference.cache.rglob("*") if p.is_file()]
    out = ws.trial_dir("disk-full-precompute" + "-mid-run" * mid_run, trial) / "cache"
    outcome = Outcome(case="stage one, disk fills mid-run" if mid_run else "stage one")
    watch = FinalNameWatcher(out, lambda rel: check_cache_file(out, rel, reference.cache))
    with watch:
        if mid_run:
            child = ws.launch("precompute", ws.precompute_args(out))
            _random_instant(reference, rng, out, child)
            limit = int(rng.integers(0, 4096))
            try:  # from now on every file write past `limit` bytes fails
                resource.prlimit(child.process.pid, resource.RLIMIT_FSIZE, (limit, limit))
            except ProcessLookupError:
                pass
        else:
            # Any file of the cache may be the one that hits the limit; the child's own output
            # goes to a pipe, which the limit does not cover.
            limit = int(rng.integers(16 * 1024, max(sizes)))
            child = ws.launch("precompute", ws.precompute_args(out), fsize_limit=limit)
        code = child.wait()
        if code == 0 and mid_run:
            outcome.case = "stage one, finished before the disk filled"
        elif code == 0:
            outcome.problems.append(f"a {limit}-byte file limit did not stop the run")
        elif code < 0:
            outcome.problems.append(f"the run died of signal {-code} instead of failing with an error")
        else:
            problem = _clear_error(child)
            if problem:
                outcome.problems.append(problem)
            outcome.notes += _error_notes(child)
            outcome.notes.append(f"limit hit in: {_where_it_failed(out)}")
        rerun = ws.launch("precompute", ws.precompute_args(out))
        if rerun.wait() != 0:
            outcome.problems.append(f"the rerun with space failed: {rerun.output[-2000:]}")
    outcome.problems += watch.problems
    outcome.counts["final-name files opened during the runs"] = watch.opened
    if not outcome.problems:
        outcome.problems += compare_caches(out, reference.cache)
    return outcome


def _where_it_failed(cache: Path) -> str:
    """Which write a failed stage one was in, from the temporaries it left."""
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if is_temporary(p.relative_to(cache)))
    if any(name.startswith("target.partial") for name in left):
        return "the target folder"
    if any(name.endswith(".arrow.tmp") for name in left):
        return "a shard"
    if any(name.endswith(".json.tmp") or name.endswith(".jsonl.tmp") for name in left):
        return "a record or the manifest"
    return "?"


def _disk_full_checkpoint(ws: Workspace, rng: np.random.Generator, trial: int) -> Outcome:
    reference = ws.fit_reference
    files = [p for p in reference.run.rglob("*") if p.is_file()]
    in_checkpoints = [p.stat().st_size for p in files if "checkpoints" in p.parts]
    others = [p.stat().st_size for p in files if "checkpoints" not in p.parts]
    # Above every log and index the run writes, below its largest checkpoint file: the
    # limit is hit inside a checkpoint write and nowhere else.
    low, high = 2 * max(others), max(in_checkpoints)
    assert low < high, f"checkpoint files ({high} B) must exceed twice the other files ({low // 2} B)"
    limit = int(rng.integers(low, high))
    out = ws.trial_dir("disk-full-checkpoint", trial) / "run"
    outcome = Outcome(case="checkpoint write")
    child = ws.launch("fit", ws.fit_args(out), fsize_limit=limit)
    code = child.wait()
    if code == 0:
        outcome.problems.append(f"a {limit}-byte file limit did not stop the run")
    elif code < 0:
        outcome.problems.append(f"the run died of signal {-code} instead of failing with an error")
    else:
        problem = _clear_error(child)
        if problem:
            outcome.problems.append(problem)
        outcome.notes += _error_notes(child)
    outcome.problems += _left_checkpoints(out, reference.run)
    rerun = ws.launch("fit", ws.fit_args(out))
    if rerun.wait() != 0:
        outcome.problems.append(f"the rerun with space failed: {rerun.output[-2000:]}")
    elif not outcome.problems:
        outcome.problems += _same_final_run(out, reference)
    return outcome


# ----------------------------------------------------------------------------- 4. corruption

CORRUPTIONS = ["truncated shard", "bit flips in a shard", "bit flip in row data", "footer damage",
               "manifest damage", "missing shard", "shard from another cache"]
MANIFEST_DAMAGE = ["truncated", "byte flip", "key removed", "checksum changed", "length changed",
                   "shards swapped", "path changed"]


def trial_corruption(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    """Every kind of damage once, on fresh copies of the training cache."""
    root = ws.trial_dir("corruption", trial)
    return [_corruption_case(ws, rng, root / f"case{i}", kind) for i, kind in enumerate(CORRUPTIONS)]


def _corrupt(cache: Path, foreign: Path, rng: np.random.Generator, kind: str,
             manifest_damage: str | None = None) -> tuple[str, str]:
    """Damage `cache` in place; returns (the damaged file's name, a description)."""
    manifest = json.loads((cache / "manifest.json").read_text())
    shard_rel = str(rng.choice([s["path"] for s in manifest["shards"]]))
    shard = cache / shard_rel
    data = bytearray(shard.read_bytes())
    if kind == "truncated shard":
        size = int(rng.integers(0, len(data)))
        shard.write_bytes(data[:size])
        return shard_rel, f"{shard_rel} cut to {size} of {len(data)} bytes"
    if kind in ("bit flips in a shard", "footer damage"):
        # Arrow IPC file: ... <footer flatbuffer> <int32 footer length> "ARROW1".
        footer_bytes = int.from_bytes(data[-10:-6], "little")
        footer_start = len(data) - 10 - footer_bytes
        if kind == "bit flips in a shard":
            lo, hi = 8, footer_start
        else:
            lo, hi = footer_start, len(data)
        offsets = rng.integers(lo, hi, size=int(rng.integers(1, 4)))
        for offset in offsets:
            data[int(offset)] ^= 1 << int(rng.integers(0, 8))
        shard.write_bytes(data)
        return shard_rel, f"{shard_rel}: bits flipped at {sorted(int(o) for o in offsets)}"
    if kind == "bit flip in row data":
        offset = _prompt_feature_byte(shard, rng)
        data[offset] ^= 1 << int(rng.integers(0, 8))
        shard.write_bytes(data)
        return shard_rel, f"{shard_rel}: a bit flipped in a row's prompt features, byte {offset}"
    if kind == "missing shard":
        shard.unlink()
        return shard_rel, f"{shard_rel} deleted"
    if kind == "shard from another cache":
        shutil.copyfile(foreign / shard_rel, shard)
        return shard_rel, f"{shard_rel} replaced by the other cache's {shard_rel}"
    how = manifest_damage or str(rng.choice(MANIFEST_DAMAGE))
    return "manifest.json", _damage_manifest(cache / "manifest.json", manifest, rng, how)


def _prompt_feature_byte(shard: Path, rng: np.random.Generator) -> int:
    """File offset of a random byte of a random row's features in the prompt (the first
    third of the synthetic rows, before the loss mask starts): context every block reads."""
    import pyarrow as pa

    from dflash.shards import rows

    mapped = pa.memory_map(str(shard), "r")
    base = mapped.read_buffer(1).address  # the mapping's first byte (zero-copy buffer)
    mapped.seek(0)
    reader = pa.ipc.open_file(mapped)
    batch = reader.get_batch(int(rng.integers(0, reader.num_record_batches)))
    features = rows.list_values(batch.column("features"))  # [T * L * H] uint16 view of the file
    num_tokens = batch.column("num_tokens")[0].as_py()
    per_token = features.size // num_tokens
    index = int(rng.integers(0, (num_tokens // 3) * per_token))
    return features.ctypes.data - base + index * features.itemsize + int(rng.integers(0, features.itemsize))


def _damage_manifest(path: Path, manifest: dict, rng: np.random.Generator, how: str) -> str:
    text = path.read_bytes()
    if how == "truncated":
        size = int(rng.integers(0, len(text)))
        path.write_bytes(text[:size])
        return f"manifest cut to {size} of {len(text)} bytes"
    if how == "byte flip":
        data = bytearray(text)
        offset = int(rng.integers(0, len(data)))
        data[offset] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(data)
        return f"manifest bit flipped at byte {offset} ({text[max(0, offset - 12):offset + 12]!r})"
    if how == "key removed":
        holders = [("", manifest), ("spec.", manifest["spec"]), ("sequences.", manifest["sequences"]),
                   ("shards[0].", manifest["shards"][0])]
        prefix, holder = holders[int(rng.integers(0, len(holders)))]
        key = str(rng.choice(sorted(holder)))
        del holder[key]
        description = f"manifest key {prefix}{key} removed"
    elif how == "checksum changed":
        shard = manifest["shards"][int(rng.integers(0, len(manifest["shards"])))]
        shard["sha256"] = hashlib.sha256(rng.bytes(8)).hexdigest()
        description = f"manifest sha256 of {shard['path']} changed"
    elif how == "length changed":
        lengths = manifest["sequences"]["length"]
        i = int(rng.integers(0, len(lengths)))
        lengths[i] += int(rng.choice([-3, -1, 1, 2]))
        description = f"manifest length of sequence {i} changed"
    elif how == "shards swapped":
        a, b = rng.choice(len(manifest["shards"]), size=2, replace=False)
        shards = manifest["shards"]
        shards[a]["path"], shards[b]["path"] = shards[b]["path"], shards[a]["path"]
        description = f"manifest paths of shards {a} and {b} swapped"
    else:  # a path that stays inside the cache but names no file
        shard = manifest["shards"][int(rng.integers(0, len(manifest["shards"])))]
        shard["path"] = shard["path"].replace("rank", "rnak")
        description = f"manifest path of a shard changed to {shard['path']}"
    path.write_text(json.dumps(manifest, separators=(",", ":")))
    return description


def _names(text: str, damaged: str, cache: Path) -> bool:
    """Does `text` say which file is damaged (the file itself, the manifest, or the cache)?"""
    name = Path(damaged).name
    return name in text or str(cache) in text or (name == "manifest.json" and "manifest" in text)


def _corruption_case(ws: Workspace, rng: np.random.Generator, root: Path, kind: str,
                     manifest_damage: str | None = None) -> Outcome:
    from dflash.shards import open_cache, verify_cache

    cache = root / "cache"
    shutil.copytree(ws.training_cache, cache)
    damaged, description = _corrupt(cache, ws.foreign_cache, rng, kind, manifest_damage)
    outcome = Outcome(case=kind, notes=[description])
    try:
        verified = verify_cache(cache)
    except Exception as error:  # noqa: BLE001 - verify must report, not crash
        verified = {"ok": False, "problems": []}
        outcome.problems.append(f"verify crashes instead of reporting: {_describe(error)}")
    report = json.dumps(verified["problems"])
    detected = not verified["ok"]
    if verified["problems"] and not _names(report, damaged, cache):
        outcome.problems.append(f"verify reports the damage without naming {damaged}: {report[:300]}")

    # Reading every row: a clear error, or exactly the undamaged rows.
    clean = open_cache(ws.training_cache)
    try:
        damaged_cache = open_cache(cache)
        rows_equal = len(damaged_cache) == len(clean) and all(
            _same_row(damaged_cache[i], clean[i]) for i in range(len(clean)))
        read_error = None
    except Exception as error:  # noqa: BLE001 - which exception it is is the finding
        rows_equal, read_error = False, error
    if read_error is not None and not _clear(read_error, damaged, cache):
        outcome.problems.append(f"reading fails without a clear message: {_describe(read_error)}")
    elif read_error is None and not rows_equal:
        outcome.problems.append("reading every row succeeds but returns other data than the undamaged cache")

    # Training one epoch: a clear error, or exactly the undamaged cache's weights.
    import torch

    try:
        weights = fit_in_process(ws.fit_config(cache, root / "run", epochs=1))
        fit_error = None
    except Exception as error:  # noqa: BLE001
        weights, fit_error = None, error
    if fit_error is not None and not _clear(fit_error, damaged, cache):
        outcome.problems.append(f"training fails without a clear message: {_describe(fit_error)}")
    elif fit_error is None:
        clean_weights = ws.clean_fit_weights
        if not all(torch.equal(weights[k], clean_weights[k]) for k in clean_weights):
            outcome.problems.append("training on the damaged cache succeeds and gives other weights than "
                                    "the undamaged cache: it trained on wrong data silently")
    if not detected:
        if outcome.problems:
            outcome.problems.append("verify passes")
        else:
            outcome.notes.append("undetected, harmless: verify passes, rows and training are unchanged")
    return outcome


def _same_row(a, b) -> bool:
    fields = ("input_ids", "loss_mask", "features", "topk_ids", "topk_logprobs", "tail_mass")
    return a.source == b.source and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in fields)


def _clear(error: BaseException, damaged: str, cache: Path) -> bool:
    """A user error (ValueError) whose message names the damaged file or the cache."""
    return isinstance(error, ValueError) and _names(str(error), damaged, cache)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:300]}"


# ----------------------------------------------------------------------------- 5. bad-input

# Each kind: (must it be rejected?, a generator of one JSONL line as bytes).
# "either": processed or rejected are both right (the text is usable as it is, or not).


def _good(rng: np.random.Generator) -> bytes:
    from test_precompute_support import CONVERSATIONS

    conversation = CONVERSATIONS[int(rng.integers(0, len(CONVERSATIONS)))]
    shape = int(rng.integers(0, 3))
    if shape == 0:
        record: dict = {"messages": conversation}
    elif shape == 1:
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        record = {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in conversation]}
    else:
        record = {"prompt": conversation[-2]["content"], "response": conversation[-1]["content"]}
    return json.dumps(record).encode()


def _pick(rng: np.random.Generator, options: list) -> Any:
    return options[int(rng.integers(0, len(options)))]


def _reply(rng: np.random.Generator) -> dict:
    return {"role": "assistant", "content": "Paris is the capital."}


BAD_INPUT_KINDS: dict[str, tuple[str, Callable[[np.random.Generator], bytes]]] = {
    "invalid JSON": ("reject", lambda rng: _pick(rng, [
        "{broken", '{"messages": [}', "{'messages': []}", '{"text": "a"} trailing', "[1, 2,", '{"a":1,}',
        "nul\x00l"]).encode()),
    "deeply nested JSON": ("reject", lambda rng: b"[" * int(rng.integers(10_000, 200_000))),
    "not an object": ("reject", lambda rng: _pick(rng, ['"a string"', "42", "null", "[1, 2]", "true"]).encode()),
    "wrong types": ("reject", lambda rng: json.dumps(_pick(rng, [
        {"messages": "hello"}, {"messages": {"role": "user"}}, {"messages": [1, 2]},
        {"messages": [{"role": "user", "content": 5}, _reply(rng)]},
        {"messages": [{"role": ["user"], "content": "hi"}, _reply(rng)]},
        {"prompt": ["q"], "response": "a"}, {"prompt": "q", "response": {"x": 1}},
        {"text": 3.5}, {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "a"}]},
    ])).encode()),
    "missing roles": ("reject", lambda rng: json.dumps(_pick(rng, [
        {"messages": [{"content": "hi"}, {"content": "there"}]},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "a"}]},
        {"conversations": [{"value": "hi"}]}, {"prompt": "q"}, {"response": "a"},
        {"unrelated": "field"},
    ])).encode()),
    "empty turns": ("reject", lambda rng: json.dumps(_pick(rng, [
        {"messages": []}, {"conversations": []}, {"text": ""}, {"messages": [{}]},
    ])).encode()),
    "empty reply": ("either", lambda rng: json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}).encode()),
    "huge line": ("either", lambda rng: json.dumps(
        {"messages": [{"role": "user", "content": "hello " * int(rng.integers(1, 40_000))},
                      {"role": "assistant", "content": "fine " * int(rng.integers(1, 40_000))}]}).encode()),
    "invalid UTF-8": ("reject", lambda rng: b'{"messages": [{"role": "user", "content": "caf'
                      + rng.bytes(3).replace(b'"', b"\xff").replace(b"\\", b"\xfe").replace(b"\n", b"\xfd")
                      + b'\xff"}, {"role": "assistant", "content": "ok"}]}'),
    "lone surrogate": ("reject", lambda rng: json.dumps(_pick(rng, [
        {"messages": [{"role": "user", "content": "a\ud800b"}, _reply(rng)]},
        {"text": "x\udfffy"}, {"prompt": "\ud83d", "response": "ok"},
    ])).encode()),
    "pre-tokenised ids": ("reject", lambda rng: json.dumps(
        {"input_ids": [1, 2, int(rng.integers(2**31, 2**62))], "loss_mask": [0, 1, 1]}).encode()),
}


def trial_bad_input(ws: Workspace, rng: np.random.Generator, trial: int,
                    kinds: list[str] | None = None) -> list[Outcome]:
    """One input file of good and malformed records (every kind at least once), one run."""
    from dflash.precompute.run import PrecomputeConfig, run_precompute

    kinds = list(BAD_INPUT_KINDS) if kinds is None else kinds
    # Every kind once, a few kinds twice, between good records, in a random order.
    chosen = kinds + [_pick(rng, kinds) for _ in range(int(rng.integers(0, 4)))]
    lines = [("good", _good(rng)) for _ in range(int(rng.integers(4, 10)))]
    lines += [(kind, BAD_INPUT_KINDS[kind][1](rng)) for kind in chosen]
    lines = [lines[i] for i in rng.permutation(len(lines))]
    root = ws.trial_dir("bad-input", trial)
    data = root / "input.jsonl"
    data.write_bytes(b"".join(line + b"\n" for _, line in lines))
    outcome = Outcome(case="mixed file", notes=[f"{len(lines)} records, kinds {sorted(set(kinds))}"])
    try:
        with quiet():
            run_precompute(PrecomputeConfig(target=ws.target, data=[data], out=root / "cache", top_k=4,
                                            num_feature_layers=3, max_length=256, batch_tokens=2048,
                                            device="cpu", progress=False))
    except Exception as error:  # noqa: BLE001 - a crash is the finding
        outcome.problems.append(f"the run crashed: {_describe(error)}")
        return [outcome]
    outcome.problems += _account(root / "cache", data, lines)
    outcome.counts["records"] = len(lines)
    outcome.counts["malformed records"] = sum(kind != "good" for kind, _ in lines)
    outcome.counts["rejected"] = len((root / "cache" / "rejected.jsonl").read_text().splitlines())
    return [outcome]


def _account(cache_dir: Path, data: Path, lines: list[tuple[str, bytes]]) -> list[str]:
    """processed + rejected = input; good records processed; must-reject ones rejected with a reason."""
    from dflash.shards import open_cache

    cache = open_cache(cache_dir)
    processed = {cache.source(i)["index"] for i in range(len(cache))}
    rejected = [json.loads(line) for line in (cache_dir / "rejected.jsonl").read_text().splitlines()]
    problems = []
    if len(processed) + len(rejected) != len(lines) or processed & {r["index"] for r in rejected}:
        problems.append(f"processed ({len(processed)}) + rejected ({len(rejected)}) != input ({len(lines)})")
    for entry in rejected:
        if entry.get("file") != str(data) or not isinstance(entry.get("index"), int) or not entry.get("reason"):
            problems.append(f"rejection without location or reason: {entry}")
    for index, (kind, _) in enumerate(lines):
        if kind == "good" and index not in processed:
            problems.append(f"good record at line {index} was not processed")
        elif kind != "good" and BAD_INPUT_KINDS[kind][0] == "reject" and index in processed:
            problems.append(f"{kind} record at line {index} was trained on instead of rejected")
    return problems


# ----------------------------------------------------------------------------- 6. numeric

POISONS = ["NaN feature", "Inf feature", "NaN log-prob", "Inf log-prob", "huge loss"]


def _poison(batch: Any, how: str, rng: np.random.Generator) -> None:
    """Damage one batch in place, the way a bad row or a broken label would."""
    import torch

    if how in ("NaN feature", "Inf feature"):
        value = float("nan") if how == "NaN feature" else float(rng.choice([np.inf, -np.inf]))
        flat = batch.context_features.view(-1)
        flat[int(rng.integers(0, flat.numel()))] = value
    elif how in ("NaN log-prob", "Inf log-prob"):
        value = float("nan") if how == "NaN log-prob" else float("inf")
        n, k = batch.topk_logprobs.shape
        batch.topk_logprobs[int(rng.integers(0, n)), int(rng.integers(0, k))] = value
    else:  # log-probs far above 0: the "distribution" has mass e^40.. e^60, the loss explodes
        batch.topk_logprobs += torch.tensor(float(rng.uniform(40.0, 60.0)))


def trial_numeric(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    """Isolated poisoned batches (each must be skipped), then persistent poisoning (must stop)."""
    return [_numeric_isolated(ws, rng, trial), _numeric_persistent(ws, rng, trial)]


@contextlib.contextmanager
def poisoned_batches(schedule: dict[int, str], rng: np.random.Generator, sequences: dict[int, list[int]]):
    """Poison the training batch read at each (1-based) step in `schedule`; record every
    step's batch sequences in `sequences`."""
    from dflash.train import fit as fit_module

    real = fit_module.read_batch
    step = {"n": 0}

    def read_batch(corpus, segments, **kwargs):
        batch = real(corpus, segments, **kwargs)
        if kwargs["stream"] != fit_module.EVAL_STREAM:
            step["n"] += 1
            sequences[step["n"]] = list(batch.sequences)
            if step["n"] in schedule:
                _poison(batch, schedule[step["n"]], rng)
        return batch

    fit_module.read_batch = read_batch
    try:
        yield
    finally:
        fit_module.read_batch = real


def _numeric_checks(run: Path, schedule: dict[int, str], sequences: dict[int, list[int]]) -> list[str]:
    """Every checkpoint finite; a poisoned step skipped, logged with its sources, and equal
    (weights, optimizer moments) to the step before it."""
    import torch

    from dflash.train.checkpoint import list_checkpoints, load_checkpoint

    problems = []
    checkpoints = {int(p.name[5:]): p for p in list_checkpoints(run)}
    if not checkpoints:
        problems.append("no checkpoint to check")
    loaded = {}
    for step, path in sorted(checkpoints.items()):
        loaded[step] = load_checkpoint(path)
        model, optimizer, _ = loaded[step]
        tensors = list(model.values()) + [v for s in optimizer["state"].values() for v in s.values()
                                          if isinstance(v, torch.Tensor)]
        if not all(torch.isfinite(t).all() for t in tensors):
            problems.append(f"checkpoint step {step} holds a non-finite value")
    metrics = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    spikes_path = run / "spikes.jsonl"
    spikes = {r["step"]: r for r in map(json.loads, spikes_path.read_text().splitlines())} \
        if spikes_path.exists() else {}
    for step, how in sorted(schedule.items()):
        if step not in metrics:
            continue  # the run stopped before it
        if not metrics[step]["skipped"]:
            problems.append(f"step {step} ({how}) was not skipped (loss {metrics[step]['loss']})")
            continue
        logged = spikes.get(step)
        if logged is None:
            problems.append(f"step {step} ({how}) was skipped but not logged in spikes.jsonl")
        elif [s["sequence"] for s in logged["sources"]] != sequences[step] or not all(
                "file" in s and "index" in s for s in logged["sources"]):
            problems.append(f"step {step}'s spikes.jsonl sources do not name its batch's sequences")
        if step in loaded and step - 1 in loaded:
            difference = checkpoint_difference(loaded[step], loaded[step - 1], skip_lr=True)
            if difference:
                problems.append(f"skipped step {step} changed the {difference}")
    extra = sorted(s for s, r in metrics.items() if r["skipped"] and s not in schedule)
    if extra:
        problems.append(f"steps {extra} were skipped without being poisoned")
    return problems


def _numeric_isolated(ws: Workspace, rng: np.random.Generator, trial: int) -> Outcome:
    total, warmup = 16, FIT_OPTIONS["spike_warmup_steps"]
    # Poisoned steps are apart (never max_consecutive_skips in a row); a huge loss is only
    # recognised once the running mean exists, after the warm-up steps.
    steps = sorted(rng.choice(np.arange(warmup + 2, total + 1, 2), size=int(rng.integers(2, 5)), replace=False))
    schedule = {int(s): str(rng.choice(POISONS)) for s in steps}
    outcome = Outcome(case="isolated", notes=[f"poisoned {schedule}"])
    run = ws.trial_dir("numeric-isolated", trial) / "run"
    sequences: dict[int, list[int]] = {}
    try:
        with poisoned_batches(schedule, rng, sequences):
            fit_in_process(ws.fit_config(ws.training_cache, run, max_steps=total, checkpoint_every=1,
                                         keep_checkpoints=1000))
    except Exception as error:  # noqa: BLE001
        outcome.problems.append(f"the run did not complete: {_describe(error)}")
    outcome.problems += _numeric_checks(run, schedule, sequences)
    outcome.counts["poisoned steps"] = len(schedule)
    return outcome


def _numeric_persistent(ws: Workspace, rng: np.random.Generator, trial: int) -> Outcome:
    from dflash.train.fit import SpikeStop

    max_skips = int(rng.integers(2, 6))
    start = int(rng.integers(FIT_OPTIONS["spike_warmup_steps"] + 2, 10))
    schedule = {s: str(rng.choice(POISONS)) for s in range(start, 200)}
    outcome = Outcome(case="persistent", notes=[f"poisoned from step {start}, stop after {max_skips}"])
    run = ws.trial_dir("numeric-persistent", trial) / "run"
    sequences: dict[int, list[int]] = {}
    try:
        with poisoned_batches(schedule, rng, sequences):
            fit_in_process(ws.fit_config(ws.training_cache, run, checkpoint_every=1, keep_checkpoints=1000,
                                         max_consecutive_skips=max_skips, epochs=50))
        outcome.problems.append("persistent poisoning did not stop the run")
    except SpikeStop as stop:
        expected = f"stopped at step {start + max_skips - 1}: {max_skips} steps in a row"
        if expected not in str(stop) or str(run / "spikes.jsonl") not in str(stop):
            outcome.problems.append(f"the stop message does not say where and why: {str(stop)[:300]}")
    except Exception as error:  # noqa: BLE001
        outcome.problems.append(f"the run failed otherwise: {_describe(error)}")
    outcome.problems += _numeric_checks(run, schedule, sequences)
    outcome.counts["poisoned steps"] = len(sequences) - start + 1
    return outcome


# ----------------------------------------------------------------------------- 7. untrusted


class Payload:
    """Pickles as a call of `function(*args)`: unpickling it runs the call."""

    def __init__(self, function: Callable, args: tuple):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def make_payload(kind: str, marker: Path, victim: Path) -> Payload:
    """A pickle payload that, when run, creates `marker` or destroys `victim`."""
    import builtins
    import subprocess

    if kind == "os.system":
        return Payload(os.system, (f"touch {marker}",))
    if kind == "subprocess":
        return Payload(subprocess.call, (["touch", str(marker)],))
    if kind == "exec":
        return Payload(builtins.exec, (f"open({str(marker)!r}, 'w').close()",))
    if kind == "eval":
        return Payload(builtins.eval, (f"open({str(marker)!r}, 'w')",))
    if kind == "rmtree":
        return Payload(shutil.rmtree, (str(victim.parent),))
    return Payload(os.remove, (str(victim),))


PAYLOADS = ["os.system", "subprocess", "exec", "eval", "rmtree", "remove"]
UNTRUSTED = ["pickle in optimizer.pt", "pickle as model.safetensors", "pickle in the anchor index",
             "pickle as head.safetensors", "shard path escapes", "target_dir escapes",
             "rejected path escapes", "shard symlink escapes"]


def _read_every_row(cache_dir: Path) -> None:
    from dflash.shards import open_cache

    cache = open_cache(cache_dir)
    for i in range(len(cache)):
        cache[i]


def _outside_snapshot(outside: Path) -> dict[str, tuple]:
    return {str(p.relative_to(outside)): (p.stat().st_size, p.stat().st_mtime_ns, sha256_file(p))
            for p in sorted(outside.rglob("*")) if p.is_file()}


def trial_untrusted(ws: Workspace, rng: np.random.Generator, trial: int) -> list[Outcome]:
    root = ws.trial_dir("untrusted", trial)
    return [_untrusted_case(ws, rng, root / f"case{i}", kind) for i, kind in enumerate(UNTRUSTED)]


def _payload_is_live(kind: str, root: Path) -> bool:
    """Unpickle the payload the unsafe way in a scratch folder: it must do its harm there."""
    import torch

    scratch = root / "liveness"
    (scratch / "victim").mkdir(parents=True)
    marker, victim = scratch / "marker", scratch / "victim" / "file"
    victim.write_text("victim")
    torch.save({"x": make_payload(kind, marker, victim)}, scratch / "payload.pt")
    torch.load(scratch / "payload.pt", weights_only=False)
    live = marker.exists() or not victim.exists()
    shutil.rmtree(scratch)
    return live


def _untrusted_case(ws: Workspace, rng: np.random.Generator, root: Path, kind: str) -> Outcome:
    import torch

    from dflash.shards import open_cache, verify_cache
    from dflash.train.checkpoint import latest_checkpoint, load_checkpoint

    outside = root / "outside"
    (outside / "victim").mkdir(parents=True)
    marker, victim = outside / "marker", outside / "victim" / "data.arrow"
    payload_kind = str(rng.choice(PAYLOADS))
    cache, run = root / "cache", root / "run"
    shutil.copytree(ws.training_cache, cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    shard_rel = str(rng.choice([s["path"] for s in manifest["shards"]]))
    # The outside file is a valid copy of a shard: following the path would "work" silently.
    shutil.copyfile(cache / shard_rel, victim)
    before = _outside_snapshot(outside)
    outcome = Outcome(case=kind)
    attempts: list[Callable[[], Any]] = []
    config = ws.fit_config(cache, run, max_steps=4)

    if kind.startswith("pickle"):
        outcome.notes.append(f"payload {payload_kind}")
        if not _payload_is_live(payload_kind, root):
            outcome.problems.append(f"the {payload_kind} payload is not live: the trial proves nothing")
        payload = make_payload(payload_kind, marker, victim)
    if kind in ("pickle in optimizer.pt", "pickle as model.safetensors"):
        fit_in_process(config)  # a real run with checkpoints, then one of them is poisoned
        newest = latest_checkpoint(run)
        if kind == "pickle in optimizer.pt":
            optimizer = torch.load(newest / "optimizer.pt", weights_only=True)
            optimizer["state"][0]["exp_avg"] = payload  # deep inside an otherwise valid state
            torch.save(optimizer, newest / "optimizer.pt")
        else:
            torch.save({"fc.weight": payload}, newest / "model.safetensors")
        # The same command again resumes from the poisoned newest checkpoint.
        attempts = [lambda: load_checkpoint(newest), lambda: fit_in_process(config)]
    elif kind == "pickle in the anchor index":
        run.mkdir(parents=True)
        np.savez(run / "anchor_index.npz", fingerprint=np.array([payload], dtype=object),
                 num_eligible=np.array([payload], dtype=object), allow_pickle=True)
        attempts = [lambda: fit_in_process(config)]
    elif kind == "pickle as head.safetensors":
        torch.save({"lm_head.weight": payload}, cache / "target" / "head.safetensors")
        attempts = [lambda: fit_in_process(config)]
    else:
        escape = {
            "shard path escapes": str(rng.choice([f"../outside/victim/{victim.name}", str(victim),
                                                  f"shards/../../outside/victim/{victim.name}"])),
            "target_dir escapes": str(rng.choice(["../outside", str(outside), "target/../../outside"])),
            "rejected path escapes": str(rng.choice([f"../outside/victim/{victim.name}", str(victim)])),
        }.get(kind)
        if kind == "shard path escapes":
            next(s for s in manifest["shards"] if s["path"] == shard_rel)["path"] = escape
        elif kind == "target_dir escapes":
            manifest["target_dir"] = escape
        elif kind == "rejected path escapes":
            manifest["rejected"] = escape
        else:
            (cache / shard_rel).unlink()
            (cache / shard_rel).symlink_to(victim)
        outcome.notes.append(f"path {escape or shard_rel + ' -> ' + str(victim)}")
        (cache / "manifest.json").write_text(json.dumps(manifest))
        verified = verify_cache(cache)
        if verified["ok"]:
            outcome.problems.append("verify passes a cache whose paths leave it")
        attempts = [lambda: _read_every_row(cache), lambda: fit_in_process(config)]

    for attempt in attempts:
        try:
            with quiet():
                attempt()
            outcome.problems.append("an untrusted file was accepted (no error)")
        except Exception as error:  # noqa: BLE001 - refused is what we want; how is noted
            if kind.endswith("escapes") and not (isinstance(error, ValueError) and "outside" in str(error)
                                                 or "relative path" in str(error)):
                outcome.problems.append(f"refused, but not as an escaping path: {_describe(error)}")
            outcome.notes += [f"refused: {type(error).__name__}", f"message: {str(error)[:200]}"]
    if marker.exists():
        outcome.problems.append(f"the payload ran: {marker} was created")
    if _outside_snapshot(outside) != before:
        outcome.problems.append("something outside the cache and the run was changed")
    return outcome


# ----------------------------------------------------------------------------- driver


CLASSES: dict[str, tuple[Callable, str]] = {
    "precompute-kill": (trial_precompute_kill, "SIGKILL of dflash-precompute, rerun"),
    "fit-kill": (trial_fit_kill, "SIGKILL of dflash-train fit (random instant or inside a checkpoint write), resume"),
    "disk-full": (trial_disk_full, "file-size limit in stage one and in a checkpoint write, rerun"),
    "corruption": (trial_corruption, "truncation, bit flips, footer/manifest damage, missing/foreign shard"),
    "bad-input": (trial_bad_input, "malformed records (JSON, types, roles, empty, huge, UTF-8, surrogates)"),
    "numeric": (trial_numeric, "NaN/Inf/huge-loss batches, isolated and persistent"),
    "untrusted": (trial_untrusted, "pickle payloads in checkpoints/index/head, paths escaping the cache"),
}


def run_trial(ws: Workspace, name: str, seed: int, trial: int) -> list[Outcome]:
    """One trial of class `name`; an exception in the bench itself is a failed trial."""
    rng = np.random.default_rng([seed, list(CLASSES).index(name), trial])
    try:
        return CLASSES[name][0](ws, rng, trial)
    except Exception:  # noqa: BLE001 - reported, the other trials go on
        return [Outcome(case="bench error", problems=["".join(traceback.format_exc().splitlines(True)[-8:])])]


def run_faults(config: FaultsConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    """Run the trials; returns {"classes": {name: counts and failures}, ...} (see main)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # in-process runs compared bit for bit share one summation order
    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-faults-")) if config.workdir is None else config.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    ws = Workspace(workdir, config.seed)
    results: dict[str, Any] = {}
    try:
        for name in config.classes:
            class_began = time.perf_counter()
            entry = {"trials": 0, "failures": 0, "cases": {}, "notes": {}, "counts": {}, "failed": [],
                     "undetected": []}
            for trial in range(config.first_trial, config.first_trial + config.trials):
                outcomes = run_trial(ws, name, config.seed, trial)
                entry["trials"] += 1
                failed = [o for o in outcomes if o.problems]
                entry["failures"] += bool(failed)
                for outcome in outcomes:
                    runs, fails = entry["cases"].get(outcome.case, (0, 0))
                    entry["cases"][outcome.case] = (runs + 1, fails + bool(outcome.problems))
                    for note in outcome.notes:
                        if note.startswith(COUNTED_NOTES):
                            entry["notes"][note] = entry["notes"].get(note, 0) + 1
                    if any(note.startswith("undetected") for note in outcome.notes):
                        entry["undetected"].append({"trial": trial, "case": outcome.case, "notes": outcome.notes})
                    for quantity, value in outcome.counts.items():
                        entry["counts"][quantity] = entry["counts"].get(quantity, 0) + value
                for outcome in failed:
                    entry["failed"].append({"trial": trial, "case": outcome.case,
                                            "problems": outcome.problems, "notes": outcome.notes})
                log(f"{name} trial {trial}: " + ("ok" if not failed else
                                                  "FAILED " + "; ".join(o.problems[0][:200] for o in failed)))
            entry["wall_s"] = round(time.perf_counter() - class_began, 1)
            results[name] = entry
    finally:
        torch.set_num_threads(threads)
        if config.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "seed": config.seed,
        "trials": config.trials,
        "classes": results,
        "failures": sum(r["failures"] for r in results.values()),
        "wall_s": round(time.perf_counter() - began, 1),
    }


def format_table(result: dict) -> str:
    lines = [f"{'fault class':<18} {'trials':>6} {'failures':>8} {'time':>7}  sub-cases (run/failed)",
             "-" * 100]
    for name, entry in result["classes"].items():
        cases = ", ".join(f"{case} {runs}/{fails}" for case, (runs, fails) in sorted(entry["cases"].items()))
        lines.append(f"{name:<18} {entry['trials']:>6} {entry['failures']:>8} {entry['wall_s']:>6.0f}s  {cases}")
        if entry["counts"]:
            lines.append(f"{'':<44}" + ", ".join(f"{k} {v}" for k, v in entry["counts"].items()))
        for note, count in sorted(entry["notes"].items()):
            lines.append(f"{'':<44}{count} x {note}")
    lines.append("-" * 100)
    lines.append(f"seed {result['seed']}, {result['failures']} failed trials, {result['wall_s']:.0f} s")
    for name, entry in result["classes"].items():
        for harmless in entry["undetected"]:
            lines.append(f"undetected {name} trial {harmless['trial']} ({harmless['case']}): {harmless['notes'][0]}")
        for failure in entry["failed"]:
            lines.append(f"FAILED {name} trial {failure['trial']} ({failure['case']}): "
                         + " | ".join(p[:400] for p in failure["problems"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per fault class (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    parser.add_argument("--classes", default=",".join(CLASSES), help="comma-separated fault classes")
    parser.add_argument("--trial", type=int, default=None, help="run only this trial index")
    parser.add_argument("--workdir", type=Path, default=None, help="keep targets, caches and runs here")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--verbose", action="store_true", help="a line per trial on stderr")
    args = parser.parse_args()
    os.environ.update(CHILD_ENV)
    config = FaultsConfig(trials=1 if args.trial is not None else args.trials, seed=args.seed,
                          classes=[c for c in args.classes.split(",") if c],
                          first_trial=args.trial or 0, workdir=args.workdir)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
    result = run_faults(config, log)
    print(format_table(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
