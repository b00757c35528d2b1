"""What the fault classes share: the forkserver and its children, the workspace (tiny target,
inputs, caches and the uninterrupted reference runs, built on first use), the final-name
watcher and the comparisons with the reference runs.

Killed and starved commands run in child processes forked from a forkserver that has
imported torch, transformers and dflash once: each trial then costs the command's work,
not the ~5-10 s import, and the child runs the console script's own `main`. Children run
single-threaded, so their numbers are bitwise reproducible across processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import multiprocessing
import os
import re
import resource
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from dflash.testing.builders import FIT_LENGTHS, TINY_FIT, tiny_fit_config

CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
             # --engine vllm: the engine core in the run's own process (a SIGKILL takes all of it)
             # with a 1 GiB KV cache on a CPU
             "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# Imported once by the forkserver; every child forks from it with these already loaded.
PRELOAD = ["torch", "transformers", "safetensors.torch", "dflash.precompute.cli", "dflash.precompute.run",
           "dflash.precompute.target", "dflash.train.cli", "dflash.train.fit", "dflash.shards",
           "transformers.models.qwen3.modeling_qwen3"]

# Stage one on the tiny target: ~120 records in 4-row shards, a few seconds of writing.
NUM_CHAT_RECORDS = 120
PRECOMPUTE_OPTIONS = ["--top-k", "4", "--num-feature-layers", "3", "--batch-tokens", "512",
                      "--shard-max-rows", "4", "--max-length", "256", "--device", "cpu", "--no-progress"]
# Stage two: 16 synthetic sequences in 4-row shards, a 1-layer drafter, 24 steps of 96 tokens.
TRAIN_LENGTHS = FIT_LENGTHS
FIT_OPTIONS = TINY_FIT | dict(anchors_per_seq=6, epochs=6, checkpoint_every=2, keep_checkpoints=2, device="cpu")

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


# ----------------------------------------------------------------------------- children


def _child_main(command: str, args: list[str], output: Any, fsize_limit: int | None,
                prepare: Callable[[], None] | None) -> None:
    """A forked child: run a console script's `main` with `args`, output to the pipe.

    fsize_limit sets RLIMIT_FSIZE (SIGXFSZ ignored, so an oversized write fails with EFBIG
    instead of killing the process). prepare (a picklable callable) runs in the child just
    before the command: fit-kill installs its kill point with it
    (`tests.faults.fit_kill.install_kill_point`).
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
    if prepare is not None:
        prepare()
    if command == "precompute":
        from dflash.precompute.cli import main

        main(args, prog_name="dflash-precompute")
    else:
        from dflash.train.cli import main

        main(["fit", *args], prog_name="dflash-train")


class Child:
    """A command running in a forked child; its output is drained by a thread."""

    def __init__(self, context: Any, command: str, args: list[str], *, fsize_limit: int | None = None,
                 prepare: Callable[[], None] | None = None):
        reader, writer = context.Pipe(duplex=False)
        self.process = context.Process(target=_child_main,
                                       args=(command, args, writer, fsize_limit, prepare), daemon=True)
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


def wait_for(condition: Callable[[], bool], child: Child, timeout_s: float = 300.0) -> bool:
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
    """Writers' temporaries: `*.tmp`, `.step-*.tmp/`, `*.tmp.npz`, `.target.tmp/`, `.target.stale/`
    (common.files.atomic_dir)."""
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

    def __init__(self, root: Path, seed: int, engine: str = "transformers"):
        self.root = root
        self.seed = seed
        self.engine = engine
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
        from dflash.testing.builders import build_target, vllm_target

        with quiet():
            if self.engine == "vllm":  # vLLM's CPU attention needs heads of 32 or more
                return vllm_target(self.root / "target-qwen3-vllm", "qwen3")
            return build_target("qwen3", self.root / "target-qwen3")

    @cached_property
    def chat_data(self) -> Path:
        """NUM_CHAT_RECORDS conversations (varied replies) with two broken lines among them."""
        from dflash.testing.builders import CONVERSATIONS, CORPUS, write_jsonl

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
        engine = ["--engine", "vllm", "--dtype", "float32"] if self.engine == "vllm" else []
        return ["--target", str(self.target), "--data", str(self.chat_data), "--out", str(out),
                *PRECOMPUTE_OPTIONS, *engine]

    @cached_property
    def precompute_reference(self) -> PrecomputeReference:
        out = self.root / "reference-cache"
        shutil.rmtree(out, ignore_errors=True)
        child = self.launch("precompute", self.precompute_args(out))
        wait_for(lambda: (out / "shards").is_dir(), child)
        opened = time.monotonic()
        wait_for(lambda: (out / "manifest.json").exists(), child)
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
        wait_for(lambda: (out / "metrics.jsonl").exists(), child)
        started = time.monotonic()
        code = child.wait()
        if code != 0:
            raise RuntimeError(f"the reference dflash-train fit failed ({code}):\n{child.output[-3000:]}")
        steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        return FitReference(run=out, train_s=time.monotonic() - started, total_steps=steps[-1])

    def fit_config(self, cache: Path, out: Path, **overrides):
        return tiny_fit_config(cache, out, **(FIT_OPTIONS | overrides))

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
    from dflash.shards.reader import shard_checksum

    problems = []
    try:
        cache, reference = open_cache(cache_dir), open_cache(reference_dir)
    except ValueError as error:
        return [f"the cache does not open: {error}"]
    def entries(manifest: dict) -> list[dict]:  # the checksum is sha256 or xxh3-128, as each shard records
        keys = ("path", "num_bytes", "num_sequences", "num_tokens")
        return [{**{k: s[k] for k in keys}, "checksum": shard_checksum(s)} for s in manifest["shards"]]

    if entries(cache.manifest) != entries(reference.manifest):
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

# ----------------------------------------------------------------------------- shared by the classes


def random_instant(reference: PrecomputeReference, rng: np.random.Generator, out: Path,
                    child: Child) -> None:
    """Return at a random instant of stage one's writing: after a random number of sealed
    shards (0 to all), plus up to one shard's time. Progress, not the clock, places it, so
    the instant falls inside the run however loaded the machine is."""
    sealed = int(rng.integers(0, reference.num_shards + 1))
    jitter_s = float(rng.uniform(0.0, reference.write_s / reference.num_shards))
    shards = out / "shards"
    wait_for(lambda: shards.is_dir() and len(list(shards.glob("*.arrow"))) >= sealed, child)
    time.sleep(jitter_s)




def left_checkpoints(run: Path, reference_run: Path) -> list[str]:
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


def same_final_run(run: Path, reference: FitReference) -> list[str]:
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
    trace, expected_trace = [(r["step"], r["loss"]) for r in lines], [(r["step"], r["loss"]) for r in expected]
    if trace != expected_trace:
        steps, expected_steps = [step for step, _ in trace], [step for step, _ in expected_trace]
        missing = sorted(set(expected_steps) - set(steps))
        first = next(a for a, b in zip(trace + [None], expected_trace + [None]) if a != b)
        problems.append("metrics.jsonl's (step, loss) trace differs from the uninterrupted run's: "
                        + (f"step lines {missing} missing" if missing else f"first at {first}"))
    return problems




def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:300]}"
