"""A `transformers serve` process on a loopback port, for the embedded default, the tests
and the bench: `with local_server(model_dir) as url: ...`.

It binds 127.0.0.1 only (never another address), serves one model (pinned, float32 on CPU
unless told otherwise) and is terminated when the block exits. Production regeneration
points `dflash-regenerate --server` at vLLM or SGLang servers instead (see the README).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on at the moment (loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: str | Path, *, port: int | None = None, device: str = "cpu",
                 dtype: str = "float32", threads: int | None = None, log: str | Path | None = None,
                 ready_timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """Start `transformers serve` for `model_dir` on 127.0.0.1; returns (process, base URL)
    once /health answers. RuntimeError (with the server's log tail) when it does not start."""
    port = port or free_port()
    exe = Path(sys.executable).with_name("transformers")
    command = [str(exe) if exe.exists() else "transformers", "serve", str(Path(model_dir).resolve()),
               "--host", "127.0.0.1", "--port", str(port), "--device", device, "--dtype", dtype,
               "--log-level", "warning"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log_file = open(log, "wb") if log is not None else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    if log is not None:
        log_file.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if process.poll() is not None:
            tail = Path(log).read_text(errors="replace")[-2000:] if log is not None else ""
            raise RuntimeError(f"transformers serve exited with {process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return process, url
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            stop_server(process)
            raise RuntimeError(f"transformers serve did not answer on {url} within {ready_timeout_s:.0f} s")
        time.sleep(0.25)


def stop_server(process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Terminate the server (SIGTERM, then SIGKILL) and reap it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def local_server(model_dir: str | Path, **options) -> Iterator[str]:
    """`start_server` as a context manager yielding the base URL; stopped on exit."""
    process, url = start_server(model_dir, **options)
    try:
        yield url
    finally:
        stop_server(process)
