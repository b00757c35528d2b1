"""7. `untrusted`: live pickle payloads and paths that leave the cache.

A checkpoint whose optimizer.pt (or model.safetensors), a run's anchor index or a cache's
head.safetensors carries a live pickle payload, and a manifest whose paths (or a shard
symlink) leave the cache: refused, the payload never runs (its marker file never appears,
its victim outside is untouched), nothing outside is read as data.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.faults.workspace import Outcome, Workspace, describe, fit_in_process, quiet, sha256_file


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
    return [untrusted_case(ws, rng, root / f"case{i}", kind) for i, kind in enumerate(UNTRUSTED)]


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


def untrusted_case(ws: Workspace, rng: np.random.Generator, root: Path, kind: str) -> Outcome:
    import torch

    from dflash.shards import verify_cache
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
                outcome.problems.append(f"refused, but not as an escaping path: {describe(error)}")
            outcome.notes += [f"refused: {type(error).__name__}", f"message: {str(error)[:200]}"]
    if marker.exists():
        outcome.problems.append(f"the payload ran: {marker} was created")
    if _outside_snapshot(outside) != before:
        outcome.problems.append("something outside the cache and the run was changed")
    return outcome
