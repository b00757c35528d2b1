"""The run folder: what `fit --out` may be, and one process at a time in it.

`check_out_folder` refuses an `--out` that is neither absent, empty, nor a dflash run folder
(a cache, a model folder, anything else), before anything is written. `RunLock` holds an OS
lock (`fcntl.flock`) on RUN/.lock for the life of a fit: a second fit on the same folder exits
at once naming the holder's pid and host. The kernel drops the lock when the holder exits or
crashes, so a stale .lock file never blocks a rerun. The file stays (it also marks the folder
as a run); only the lock is released.

Under torchrun only rank 0 takes the lock: the run folder is one run of all ranks, and a
second launch's rank 0 fails at once (its other ranks end with the launch).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from dflash.shards.layout import MANIFEST, SHARDS_DIR
from dflash.train.run_folder import LOCK_FILE, RUN_CONFIG_FILE


def is_run_folder(folder: Path) -> bool:
    """Whether `folder` was made by `dflash-train fit`: it holds RUN/.lock, or a config.json of
    fit's flat keys (runs started before the lock file existed)."""
    if (folder / LOCK_FILE).is_file():
        return True
    config = folder / RUN_CONFIG_FILE
    try:
        saved = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and "cache" in saved and "tokens_per_step" in saved


def check_out_folder(out: Path) -> bool:
    """Refuse an --out that fit must not write into; returns whether it already exists."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the run")
    if not out.exists():
        return False
    if any(out.iterdir()) and not is_run_folder(out):
        what = ("a dflash cache" if (out / MANIFEST).is_file() or (out / SHARDS_DIR).is_dir()
                else "a model folder" if (out / "config.json").is_file() else "a folder of other files")
        raise ValueError(f"--out {out} is not empty and not a dflash run folder (it looks like {what}): "
                         "give a new or empty folder, or an earlier run's folder to resume it")
    return True


class RunLocked(ValueError):
    """Another process holds the run folder."""


class RunLock:
    """An exclusive, non-blocking lock on `run_dir`/.lock holding this process's pid and host."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._file: Any = None

    def acquire(self) -> RunLock:
        f = open(self.path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _parse(f.read())
            f.close()
            raise RunLocked(
                f"{self.path.parent} is in use by another dflash-train process (pid {holder.get('pid', '?')} "
                f"on host {holder.get('host', '?')}, since {holder.get('started_utc', '?')}): wait for it to "
                "end or stop it, or train into another --out") from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _parse(text: str) -> dict[str, Any]:
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


__all__ = ["LOCK_FILE", "RunLock", "RunLocked", "check_out_folder", "is_run_folder"]
