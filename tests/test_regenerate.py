"""dflash-regenerate against a real server: `transformers serve` on a loopback port with a
tiny random Qwen3 target (one server for the module; the fault tests start their own).

The template of the tiny target prints `flag` (a chat-template argument) into the system
turn when it is given, so that the prompt length the server reports shows whether the
argument reached the rendered prompt.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zstandard
from click.testing import CliRunner

from dflash.precompute.local_server import free_port, start_server, stop_server
from dflash.precompute.regenerate import RegenerateConfig, run_regenerate
from dflash.precompute.regenerate_cli import main as regenerate_main
from dflash.testing.builders import CHATML_TEMPLATE, build_target, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e

FLAG_TEMPLATE = (
    "{%- if flag is defined %}{{- '<|im_start|>system\\nflag=' ~ flag ~ '<|im_end|>\\n' }}{%- endif %}"
    + CHATML_TEMPLATE
)

RECORDS = [
    {"messages": [{"role": "user", "content": "Hello there!"},
                  {"role": "assistant", "content": "I am fine."}]},
    {"conversations": [{"from": "human", "value": "Tell me a short story."},
                       {"from": "gpt", "value": "The cat reads."},
                       {"from": "human", "value": "And then?"},
                       {"from": "gpt", "value": "The fox jumps."}]},
    {"prompt": "What is the capital of France?"},
    {"text": "a plain document has no turns"},
    "{not json",
    {"messages": [{"role": "assistant", "content": "no user before me"}]},
    {"prompt": "Numbers: 1 2 3", "response": "4 5 6"},
    {"messages": [{"role": "system", "content": "You are a cat."},
                  {"role": "user", "content": "Meow?"},
                  {"role": "assistant", "content": "Meow."}]},
]
GOOD = [0, 1, 2, 6, 7]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    path = build_target("qwen3", tmp_path_factory.mktemp("regen") / "target")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = FLAG_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(target, tmp_path_factory) -> str:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    process, url = start_server(target, threads=1, log=log)
    yield url
    stop_server(process)


def _config(data, out, url, **options) -> RegenerateConfig:
    defaults = dict(max_new_tokens=8, concurrency=2, progress=False, backoff_s=0.05, max_attempts=2)
    return RegenerateConfig(data=data, out=out, servers=url if isinstance(url, list) else [url],
                            **{**defaults, **options})


def test_single_and_multi_turn_records(target, server, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out.jsonl"
    summary = run_regenerate(_config([data], out, server))
    written, rejected = read_jsonl(out), read_jsonl(tmp_path / "out.rejected.jsonl")
    assert [r["source"]["index"] for r in written] == GOOD
    assert sorted(r["index"] for r in rejected) == [3, 4, 5]
    assert summary.written + sum(summary.rejected.values()) == len(RECORDS) == summary.num_input
    assert not (tmp_path / "out.pending.jsonl").exists()
    by_index = {r["source"]["index"]: r for r in written}
    story = by_index[1]
    assert [m["role"] for m in story["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in story["messages"] if m["role"] == "user"] == ["Tell me a short story.", "And then?"]
    assert len(story["finish_reasons"]) == 2 and len(story["prompt_tokens"]) == 2
    assert story["messages"][1]["content"] != "The cat reads."
    # Turn 2 was generated from the conversation with turn 1's reply already regenerated:
    # its prompt length is the rendering of exactly those messages.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    rendered = tokenizer.apply_chat_template(story["messages"][:3], tokenize=False, add_generation_prompt=True)
    assert story["prompt_tokens"][1] == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    prompt_only = by_index[2]
    assert [m["role"] for m in prompt_only["messages"]] == ["user", "assistant"]
    assert all(r["model"] == str(target.resolve()) for r in written)
    assert written[0]["generation"]["max_new_tokens"] == 8
    assert {tuple(r["finish_reasons"]) for r in written} <= {("length",), ("stop",), ("length", "length"),
                                                            ("length", "stop"), ("stop", "length"), ("stop", "stop")}


@pytest.mark.parametrize("flag", ["XYZ", "a-much-longer-flag-value"])
def test_chat_template_kwargs_reach_the_prompt(target, server, tmp_path, flag):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    plain, flagged = tmp_path / "plain.jsonl", tmp_path / "flagged.jsonl"
    run_regenerate(_config([data], plain, server))
    run_regenerate(_config([data], flagged, server, chat_template_kwargs={"flag": flag}))
    messages = RECORDS[0]["messages"][:1]
    for path, kwargs in ((plain, {}), (flagged, {"flag": flag})):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert read_jsonl(path)[0]["prompt_tokens"] == [len(tokenizer(text, add_special_tokens=False)["input_ids"])]
    assert read_jsonl(flagged)[0]["generation"]["chat_template_kwargs"] == {"flag": flag}
    assert read_jsonl(flagged)[0]["prompt_tokens"][0] > read_jsonl(plain)[0]["prompt_tokens"][0]


def test_cut_reply_is_kept_and_masked(target, server, tmp_path):
    """A reply cut at --max-new-tokens is kept with finish reason "length"; stage one leaves
    the end-of-turn token after it out of the loss mask."""
    from transformers import AutoTokenizer

    from dflash.common.records import cut_assistant_turns, normalize_record
    from dflash.precompute.data import ChatEncoder

    data = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    out = tmp_path / "out.jsonl"
    run_regenerate(_config([data], out, server, max_new_tokens=1))
    record = read_jsonl(out)[1]
    assert record["finish_reasons"] == ["length", "length"]
    messages = normalize_record(record)
    assert cut_assistant_turns(record, messages) == frozenset({1, 3})
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(target), max_length=512)
    cut = encoder.encode(messages, cut_turns=cut_assistant_turns(record, messages))
    full = encoder.encode(messages)
    assert full.loss_mask.sum() - cut.loss_mask.sum() == 2  # the two <|im_end|> tokens


def test_zst_in_and_out(server, tmp_path):
    plain_in = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    zst_in = tmp_path / "in.jsonl.zst"
    zst_in.write_bytes(zstandard.ZstdCompressor().compress(plain_in.read_bytes()))
    run_regenerate(_config([plain_in], tmp_path / "a.jsonl", server))
    run_regenerate(_config([zst_in], tmp_path / "b.jsonl.zst", server))
    assert not (tmp_path / "b.jsonl.zst.part").exists()
    a = [{**r, "source": None} for r in read_jsonl(tmp_path / "a.jsonl")]
    b = [{**r, "source": None} for r in read_jsonl(tmp_path / "b.jsonl.zst")]
    assert a == b and len(a) == len(GOOD)
    # A rerun of a finished compressed output sends nothing and leaves it as it was.
    before = (tmp_path / "b.jsonl.zst").read_bytes()
    summary = run_regenerate(_config([zst_in], tmp_path / "b.jsonl.zst", server))
    assert summary.requests == 0 and summary.resumed == len(RECORDS)
    assert zstandard.ZstdDecompressor().decompress(before, max_output_size=1 << 20) == \
        zstandard.ZstdDecompressor().decompress((tmp_path / "b.jsonl.zst").read_bytes(), max_output_size=1 << 20)


def test_kill_and_resume_equals_uninterrupted(server, tmp_path):
    records = [{"prompt": f"Numbers: {i} {i + 1} {i + 2}"} for i in range(24)]
    data = write_jsonl(tmp_path / "in.jsonl", records)
    reference = tmp_path / "ref.jsonl"
    run_regenerate(_config([data], reference, server, concurrency=3))
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "dflash.precompute.regenerate_cli", "--data", str(data), "--out", str(out),
               "--server", server, "--max-new-tokens", "8", "--concurrency", "3", "--no-progress"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 4:
            break
        time.sleep(0.02)
    process.kill()
    process.wait()
    killed_at = out.read_bytes().count(b"\n")
    assert 4 <= killed_at < len(records), "the run was killed mid-way"
    summary = run_regenerate(_config([data], out, server, concurrency=3))
    assert summary.resumed >= killed_at
    assert summary.regenerated_records == len(records) - summary.resumed  # nothing finished was sent again
    assert out.read_bytes() == reference.read_bytes()


def test_server_down_at_start_names_the_url(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=f"--server {url} is not answering"):
        run_regenerate(_config([data], tmp_path / "out.jsonl", url))
    result = CliRunner().invoke(regenerate_main, ["--data", str(data), "--out", str(tmp_path / "o.jsonl"),
                                                  "--server", url, "--no-progress"])
    assert result.exit_code == 1 and url in result.output


def test_server_dying_mid_run_stops_with_a_resume_hint(target, server, tmp_path):
    records = [{"prompt": f"Numbers: {i} {i + 1}"} for i in range(40)]
    data = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    process, url = start_server(target, threads=1, log=tmp_path / "dying.log")
    try:
        def kill_when_started() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if out.exists() and out.read_bytes().count(b"\n") >= 3:
                    break
                time.sleep(0.02)
            process.kill()

        killer = threading.Thread(target=kill_when_started)
        killer.start()
        result = CliRunner().invoke(regenerate_main, ["--data", str(data), "--out", str(out), "--server", url,
                                                      "--max-new-tokens", "8", "--concurrency", "2",
                                                      "--max-attempts", "2", "--no-progress"])
        killer.join()
    finally:
        stop_server(process)
    assert result.exit_code == 1, result.output
    assert "rerun the same command to resume" in result.output and url in result.output
    kept = read_jsonl(out)
    assert 3 <= len(kept) < len(records)
    # Resumed against another (live) server, the run completes without losing what was kept.
    summary = run_regenerate(_config([data], out, server))
    assert summary.written == len(records) and read_jsonl(out)[: len(kept)] == kept
    assert [r["source"]["index"] for r in read_jsonl(out)] == list(range(len(records)))


def test_http_4xx_rejects_the_records_and_the_run_goes_on(server, tmp_path):
    """The real server refuses a request naming a model it does not serve with HTTP 400
    (the 4xx transformers serve answers to a well-formed request)."""
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out.jsonl"
    summary = run_regenerate(_config([data], out, server, model="not-the-served-model"))
    rejected = read_jsonl(tmp_path / "out.rejected.jsonl")
    assert summary.written == 0 and len(rejected) == len(RECORDS)
    assert sum("HTTP 400" in r["reason"] and "pinned" in r["reason"] for r in rejected) == len(GOOD)


class _Garbage(http.server.BaseHTTPRequestHandler):
    """A real HTTP server on loopback that answers the model listing properly and every
    chat completion with a 200 whose body is not a completion: transformers serve never
    sends a malformed response, so this stands in for an engine that does (this case only)."""

    def do_GET(self):
        self._send(b'{"object": "list", "data": [{"id": "garbage", "object": "model"}]}')

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(b'{"id": "x", "object": "chat.completion", "choices": []}')

    def _send(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_malformed_response_rejects_the_record(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        data = write_jsonl(tmp_path / "in.jsonl", RECORDS[:3])
        summary = run_regenerate(_config([data], tmp_path / "out.jsonl", f"http://127.0.0.1:{httpd.server_port}"))
    finally:
        httpd.shutdown()
        httpd.server_close()
    rejected = read_jsonl(tmp_path / "out.rejected.jsonl")
    assert summary.written == 0 and len(rejected) == 3
    assert all("malformed response" in r["reason"] for r in rejected)


def test_several_servers_share_the_work(server, target, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    single, double = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    run_regenerate(_config([data], single, server))
    run_regenerate(_config([data], double, [server, server + "/v1"], concurrency=4))
    assert single.read_bytes() == double.read_bytes()


def test_regenerated_records_build_a_cache_that_trains_and_evaluates(target, server, tmp_path):
    from dflash.precompute.config import PrecomputeConfig
    from dflash.precompute.run import run_precompute
    from dflash.shards import open_cache

    data = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "regen.jsonl"
    run_regenerate(_config([data], out, server, max_new_tokens=12, chat_template_kwargs={"flag": "on"}))
    cache_dir = tmp_path / "cache"
    summary = run_precompute(PrecomputeConfig(target=target, data=[out], out=cache_dir, top_k=4, feature_layers=[1, 3],
                                              max_length=128, progress=False,
                                              chat_template_kwargs={"flag": "on"}))
    assert summary.num_sequences == len(GOOD)
    cache = open_cache(cache_dir)
    options = cache.spec.options
    assert options["chat_template_kwargs"] == {"flag": "on"}
    assert options["replies"]["made_by"] == "engine" and options["replies"]["model"] == str(target.resolve())
    from dflash.train.cli import main as train_main

    run_dir = tmp_path / "run"
    result = CliRunner().invoke(train_main, [
        "fit", "--cache", str(cache_dir), "--out", str(run_dir), "--num-layers", "1", "--num-drafts", "3",
        "--anchors-per-seq", "8", "--epochs", "1", "--max-steps", "3", "--tokens-per-step", "96",
        "--checkpoint-every", "3", "--eval-every", "0", "--eval-fraction", "0.4", "--device", "cpu",
        "--no-wandb"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(train_main, ["eval", "--run", str(run_dir), "--online", "--target", str(target),
                                             "--prompts", str(out), "--cache", str(cache_dir),
                                             "--max-new-tokens", "4", "--device", "cpu", "--no-save", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    assert figures["online"]["chat_template_kwargs"] == {"flag": "on"}
    assert figures["online"]["num_prompts"] >= 1
