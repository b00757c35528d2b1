"""dflash-regenerate against a real vLLM OpenAI server (vLLM's CPU build, in the engine venv),
on 127.0.0.1 with a tiny random Qwen3 target whose chat template reads `enable_thinking`
(bench/engine_check.py's): the replies vLLM regenerates are the target's own greedy replies
(what stage one's in-process regeneration caches), chat-template kwargs reach vLLM's prompt
rendering, and a run whose client or server is killed mid-way completes on rerun with nothing
lost and nothing finished sent twice.

Skipped, with the reason, where the engine venv is absent or incomplete (the `engine_venv` fixture, conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.precompute.local_server import start_vllm_server, stop_server
from dflash.precompute.regenerate import RegenerateConfig, run_regenerate
from dflash.precompute.regenerate_cli import main as regenerate_main
from dflash.testing.builders import read_jsonl, vllm_target, write_jsonl

pytestmark = [pytest.mark.engine, pytest.mark.e2e]

NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def venv_python(engine_venv) -> Path:
    return engine_venv / "bin" / "python"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return vllm_target(tmp_path_factory.mktemp("vllm-regen") / "target", "qwen3")


def _start(target: Path, venv_python: Path, log: Path):
    try:
        return start_vllm_server(target, python=venv_python, log=log, engine_core_in_process=True)
    except RuntimeError as error:
        pytest.skip(f"vLLM's server does not start here: {str(error).splitlines()[0]}")


@pytest.fixture(scope="module")
def server(target, venv_python, tmp_path_factory) -> str:
    process, url = _start(target, venv_python, tmp_path_factory.mktemp("vllm-serve") / "serve.log")
    yield url
    stop_server(process)


def _records(n: int) -> list[dict]:
    return [{"prompt": f"Numbers: {i} {i + 1} {i + 2}"} for i in range(n)]


def _config(data: Path, out: Path, url: str, **options) -> RegenerateConfig:
    defaults = dict(max_new_tokens=16, concurrency=3, progress=False, backoff_s=0.05, max_attempts=2,
                    chat_template_kwargs=NO_THINKING)
    return RegenerateConfig(data=[data], out=out, servers=[url], **{**defaults, **options})


def _wait_for_lines(path: Path, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        time.sleep(0.01)


def test_vllm_regenerates_the_targets_greedy_replies_with_the_template_kwargs(target, server, tmp_path):
    """Each reply equals dflash's float32 greedy decoding of the prompt dflash renders with the
    same kwargs, and the prompt length vLLM reports is that rendering's, with and without them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.train.speculative import greedy_generate

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    records = _records(6)
    data = write_jsonl(tmp_path / "in.jsonl", records)
    lengths = {}
    for name, kwargs in (("plain", {}), ("no-thinking", NO_THINKING)):
        out = tmp_path / f"{name}.jsonl"
        run_regenerate(_config(data, out, server, chat_template_kwargs=kwargs))
        written = read_jsonl(out)
        assert [r["source"]["index"] for r in written] == list(range(len(records)))
        for record, row in zip(records, written):
            messages = [{"role": "user", "content": record["prompt"]}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert row["prompt_tokens"] == [len(ids)]
            greedy = greedy_generate(model, ids, max_new_tokens=16, stop_token_ids={tokenizer.eos_token_id})
            assert row["messages"][-1]["content"] == tokenizer.decode(greedy.tokens, skip_special_tokens=True)
        lengths[name] = written[0]["prompt_tokens"][0]
        assert written[0]["generation"]["chat_template_kwargs"] == kwargs
    assert lengths["no-thinking"] - lengths["plain"] == len("<think>\n\n</think>\n\n")  # one token per character


@pytest.fixture(scope="module")
def uninterrupted(server, tmp_path_factory) -> tuple[list[dict], Path, Path]:
    """48 records, their file and the uninterrupted run's output over them: what both kill tests'
    resumed runs must equal (one run for both; neither writes to it)."""
    work = tmp_path_factory.mktemp("uninterrupted")
    records = _records(48)
    data = write_jsonl(work / "in.jsonl", records)
    reference = work / "ref.jsonl"
    run_regenerate(_config(data, reference, server))
    return records, data, reference


def test_client_killed_mid_run_then_rerun_equals_uninterrupted(server, uninterrupted, tmp_path):
    records, data, reference = uninterrupted
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "dflash.precompute.regenerate_cli", "--data", str(data), "--out", str(out),
               "--server", server, "--max-new-tokens", "16", "--concurrency", "3", "--no-progress",
               "--chat-template-kwargs", json.dumps(NO_THINKING)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_lines(out, 4)
    process.kill()
    process.wait()
    killed_at = out.read_bytes().count(b"\n")
    assert 4 <= killed_at < len(records), "the run was killed mid-way"
    summary = run_regenerate(_config(data, out, server))
    assert summary.resumed >= killed_at
    assert summary.regenerated_records == len(records) - summary.resumed  # nothing finished was sent again
    assert out.read_bytes() == reference.read_bytes()


def test_server_killed_mid_run_then_rerun_completes_nothing_lost_or_sent_twice(target, venv_python, server,
                                                                              uninterrupted, tmp_path):
    records, data, reference = uninterrupted
    out = tmp_path / "out.jsonl"
    dying, url = _start(target, venv_python, tmp_path / "dying.log")
    try:
        def kill_when_started() -> None:
            _wait_for_lines(out, 4)
            dying.kill()

        killer = threading.Thread(target=kill_when_started)
        killer.start()
        result = CliRunner().invoke(regenerate_main, [
            "--data", str(data), "--out", str(out), "--server", url, "--max-new-tokens", "16", "--concurrency", "3",
            "--max-attempts", "2", "--no-progress", "--chat-template-kwargs", json.dumps(NO_THINKING)])
        killer.join()
    finally:
        stop_server(dying)
    assert result.exit_code == 1, result.output
    assert "rerun the same command to resume" in result.output and url in result.output
    kept = read_jsonl(out)
    assert 4 <= len(kept) < len(records), "the server was killed mid-way"
    # Rerun against a live vLLM server: the kept records are not sent again, the rest are.
    summary = run_regenerate(_config(data, out, server))
    assert summary.resumed == len(kept) and summary.regenerated_records == len(records) - len(kept)
    assert read_jsonl(out)[: len(kept)] == kept
    assert out.read_bytes() == reference.read_bytes()
