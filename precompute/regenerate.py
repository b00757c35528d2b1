"""`dflash-regenerate`: the target's own replies, from OpenAI-compatible serving engines.

Reads the inputs stage one reads (`iter_records`), sends every conversation to the
`/v1/chat/completions` endpoint of one or more servers (vLLM, SGLang, `transformers serve`)
with at most `concurrency` records in flight, each request to the least busy server, and
writes one `messages` record per good input to OUT (which `dflash-precompute --data` reads
as is) and one `{"file", "index", "reason"}` line per bad input to OUT.rejected.jsonl:
written + rejected = input.

A regenerated record: `messages` (user and system turns as given, every assistant turn the
engine's reply), `source` ({"file", "index"} of the input), `model` (the engine's model
name), `finish_reasons` (one per assistant turn, in order: "stop", or "length" for a reply
cut at `max_new_tokens`, which stage one keeps out of the end-of-turn mask),
`prompt_tokens` (per turn, the rendered prompt's length as the server counts it) and
`generation` (the settings). Turns are regenerated in order: assistant turn i is generated
from the conversation before it, earlier replies already regenerated. A record with no
assistant turn (a prompt) gets one reply after its last user turn; a `text` record has no
turns and is rejected.

Resume. Records are written to OUT in input order. A record finished ahead of an earlier
one waits in memory and in OUT.pending.jsonl (appended as soon as it finishes); once the
records before it are written it goes to OUT too, and the pending file is emptied whenever
nothing waits. A rerun reads OUT, the rejected file and the pending file (a torn last line
is cut off), sends only the records none of them holds and writes the same bytes an
uninterrupted run would (at temperature 0, with a deterministic server). With `--out
X.jsonl.zst` the records go to X.jsonl.zst.part (plain JSONL, resumable) and are
compressed into X.jsonl.zst at the end.

Faults. A server that does not answer at start is a ValueError naming it. A connection
error, timeout, HTTP 408/429 or 5xx is retried on the least busy server with exponential
backoff (`max_attempts` tries); then the run stops with `ServerGone` (what was written
stays; rerun to resume). An HTTP 4xx or a malformed response rejects that record only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.common.files import atomic_path, fsync_file
from dflash.common.options import FLAG, PATH
from dflash.common.records import InputRecord, RecordError, iter_records, normalize_record


class ServerGone(RuntimeError):
    """The servers stopped answering; what was written so far is kept."""


class _Rejected(Exception):
    """This record cannot be regenerated; str() is the reason."""


@dataclass(kw_only=True)
class RegenerateConfig:
    """Everything `dflash-regenerate` does, as one validated value."""

    data: list[Path]
    """JSONL (.jsonl.zst too), JSON, Parquet or datasets directory, read in this order; repeat for several."""
    out: Path
    """Output .jsonl or .jsonl.zst (compressed when the run finishes); rerun the same command to resume."""
    servers: list[str] = field(metadata={FLAG: "--server"})
    """OpenAI-compatible server URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine); repeat for several."""
    model: str | None = None
    """Model name sent with each request (default: the first one the first server lists)."""
    max_new_tokens: int = 512
    """Longest reply, in tokens."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    seed: int = 0
    """Run seed; each request's seed is derived from it, the record and the turn."""
    concurrency: int = 8
    """Records in flight at once, over all servers (raise it until the servers' batches are full)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """JSON object sent as `chat_template_kwargs` with every request, e.g. '{"enable_thinking": false}'."""
    chat_template: Path | None = field(default=None, metadata={PATH: "file"})
    """A Jinja chat template file, sent as the `chat_template` request field (vLLM accepts it;
    SGLang and transformers serve take a template at launch and refuse the field)."""
    limit: int | None = None
    """Read at most this many records."""
    timeout_s: float = field(default=600.0, metadata={FLAG: "--timeout"})
    """Seconds one request may take."""
    max_attempts: int = 5
    """Tries per request while a server does not answer (connection error, timeout, 408/429, 5xx)."""
    backoff_s: float = 1.0
    """Wait before the second try; doubled for each further one."""
    progress: bool = True
    """Progress bar on stderr."""

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.data = [Path(p) for p in ([self.data] if isinstance(self.data, (str, Path)) else self.data)]
        self.servers = [s.rstrip("/") for s in ([self.servers] if isinstance(self.servers, str) else self.servers)]
        if self.chat_template is not None:
            self.chat_template = Path(self.chat_template)
        checks = [
            (bool(self.data), "give at least one --data input"),
            (bool(self.servers), "give at least one --server URL"),
            (self.out.name.endswith((".jsonl", ".jsonl.zst")),
             f"--out {self.out} must end in .jsonl or .jsonl.zst"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}"),
            (self.concurrency >= 1, f"--concurrency must be >= 1, got {self.concurrency}"),
            (self.limit is None or self.limit >= 1, f"--limit must be >= 1, got {self.limit}"),
            (self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}"),
            (self.max_attempts >= 1, f"max_attempts must be >= 1, got {self.max_attempts}"),
            (self.backoff_s >= 0, f"backoff_s must be >= 0, got {self.backoff_s}"),
            (isinstance(self.chat_template_kwargs, dict),
             f"--chat-template-kwargs must be a JSON object, got {self.chat_template_kwargs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for url in self.servers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--server {url}: give a URL like http://127.0.0.1:8000")
        if self.chat_template is not None and not self.chat_template.is_file():
            raise ValueError(f"--chat-template {self.chat_template}: no such file")

    def generation(self) -> dict[str, Any]:
        """The settings every output record carries."""
        settings = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                    "top_p": self.top_p, "seed": self.seed, "chat_template_kwargs": self.chat_template_kwargs}
        if self.chat_template is not None:
            text = self.chat_template.read_text(encoding="utf-8")
            settings["chat_template_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        return settings


@dataclass
class RegenerateSummary:
    """What a run did."""

    out: str
    model: str
    num_input: int = 0
    """Input records read (this run's view of all inputs, up to --limit)."""
    written: int = 0
    """Records in OUT (all runs)."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Records in the rejected file (all runs), by reason."""
    resumed: int = 0
    """Records found done by an earlier run."""
    regenerated_records: int = 0
    """Records this run finished."""
    requests: int = 0
    """Replies this run received."""
    cut_replies: int = 0
    """Replies this run received that hit max_new_tokens."""
    new_tokens: int = 0
    """Completion tokens this run received (as the servers count them)."""
    retries: int = 0
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self),
                "records_per_s": self.regenerated_records / self.wall_s if self.wall_s else 0.0,
                "new_tokens_per_s": self.new_tokens / self.wall_s if self.wall_s else 0.0}

    def format(self) -> str:
        rate = self.to_dict()
        rejected = sum(self.rejected.values())
        reasons = "; ".join(f"{n} {r}" for r, n in sorted(self.rejected.items(), key=lambda kv: -kv[1])[:5])
        return "\n".join([
            f"dflash-regenerate: {self.out} (model {self.model})",
            f"  records   {self.num_input:,} read: {self.written:,} written, {rejected:,} rejected"
            + (f" ({reasons})" if rejected else "") + f"; {self.resumed:,} done by an earlier run",
            f"  replies   {self.requests:,} this run, {self.cut_replies:,} cut at --max-new-tokens, "
            f"{self.new_tokens:,} new tokens, {self.retries:,} retried requests",
            f"  time      {self.wall_s:,.1f} s; {rate['records_per_s']:,.2f} records/s, "
            f"{rate['new_tokens_per_s']:,.1f} new tokens/s",
        ])


# ----------------------------------------------------------------------------- paths and resume

def _paths(out: Path) -> tuple[Path, Path, Path]:
    """(work file the records are appended to, rejected file, pending file)."""
    base = out.name[: -len(".zst")] if out.name.endswith(".zst") else out.name
    stem = base[: -len(".jsonl")]
    work = out.with_name(out.name + ".part") if out.name.endswith(".zst") else out
    return work, out.with_name(stem + ".rejected.jsonl"), out.with_name(stem + ".pending.jsonl")


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of `path`, cutting off a torn last line (a killed run's)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].split(b"\n") if line.strip()]  # b"\n" only, as iter_records


def _key(source: dict[str, Any]) -> tuple[str, int]:
    return str(source["file"]), int(source["index"])


def request_seed(seed: int, source: dict[str, Any], turn: int) -> int:
    """A per-request seed that depends only on the run seed, the record and the turn (so a
    resumed or reordered run asks for the same samples); 31 bits, which every engine takes."""
    text = json.dumps([seed, source["file"], source["index"], turn])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & (2**31 - 1)


# ----------------------------------------------------------------------------- servers

class _Server:
    def __init__(self, url: str, timeout_s: float):
        from openai import AsyncOpenAI

        self.url = url
        base = url if url.endswith("/v1") else url + "/v1"
        # Retries are ours (backoff, another server, then stop with a resume hint).
        self.client = AsyncOpenAI(base_url=base, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                  max_retries=0, timeout=timeout_s)
        self.in_flight = 0

    async def models(self) -> list[str]:
        try:
            page = await self.client.models.list(timeout=30.0)
        except Exception as error:  # noqa: BLE001 - any failure here means "not usable"
            raise ValueError(f"--server {self.url} is not answering ({type(error).__name__}: {error}); "
                             "start it, or drop this --server") from None
        return [m.id for m in page.data]


class _Regenerator:
    def __init__(self, config: RegenerateConfig, servers: list[_Server], model: str,
                 summary: RegenerateSummary, bar: Any):
        self.config, self.servers, self.model, self.summary, self.bar = config, servers, model, summary, bar
        self.generation = config.generation()
        extra: dict[str, Any] = {}
        if config.chat_template_kwargs:
            extra["chat_template_kwargs"] = config.chat_template_kwargs
        if config.chat_template is not None:
            extra["chat_template"] = config.chat_template.read_text(encoding="utf-8")
        self.extra_body = extra or None
        self.started = time.perf_counter()

    async def record(self, record: InputRecord) -> dict[str, Any]:
        """The regenerated record, or {"reason": ...} for a rejected one."""
        try:
            if record.error is not None:
                raise RecordError(record.error)
            messages = normalize_record(record.data, require_assistant=False)
            if isinstance(messages, str):
                raise RecordError("a 'text' record has no turns to regenerate")
            messages = [dict(m) for m in messages]
            turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            if not turns:
                users = [i for i, m in enumerate(messages) if m["role"] == "user"]
                if not users:
                    raise RecordError("conversation has no user turn")
                messages = messages[: users[-1] + 1] + [{"role": "assistant", "content": ""}]
                turns = [len(messages) - 1]
            if turns[0] == 0 or not any(m["role"] == "user" for m in messages[: turns[0]]):
                raise RecordError("assistant turn 0 has no user turn before it")
            finish_reasons, prompt_tokens = [], []
            for turn, i in enumerate(turns):
                content, reason, model, num_prompt = await self._complete(
                    messages[:i], request_seed(self.config.seed, record.source, turn))
                messages[i]["content"] = content
                finish_reasons.append(reason)
                prompt_tokens.append(num_prompt)
        except (RecordError, _Rejected) as error:
            return {"reason": str(error)}
        return {"messages": messages, "source": record.source, "model": model,
                "finish_reasons": finish_reasons, "prompt_tokens": prompt_tokens,
                "generation": self.generation}

    async def _complete(self, messages: list[dict[str, str]], seed: int) -> tuple[str, str, str, int | None]:
        import openai

        config = self.config
        last: BaseException | None = None
        tried: list[str] = []
        for attempt in range(config.max_attempts):
            if attempt:
                self.summary.retries += 1
                await asyncio.sleep(config.backoff_s * 2 ** (attempt - 1))
            server = min(self.servers, key=lambda s: s.in_flight)
            tried.append(server.url)
            server.in_flight += 1
            try:
                response = await server.client.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=config.max_new_tokens,
                    temperature=config.temperature, top_p=config.top_p, seed=seed,
                    extra_body=self.extra_body)
            except openai.APIStatusError as error:
                if error.status_code in (408, 429) or error.status_code >= 500:
                    last = error
                    continue
                raise _Rejected(f"HTTP {error.status_code} from {server.url}: {_detail(error)}") from None
            except openai.APIConnectionError as error:  # timeouts included
                last = error
                continue
            except (openai.APIResponseValidationError, ValueError, TypeError, KeyError) as error:
                raise _Rejected(f"malformed response from {server.url}: {error}") from None
            finally:
                server.in_flight -= 1
            return self._reply(response, server.url)
        raise ServerGone(
            f"no answer after {config.max_attempts} tries (last from {tried[-1]}: "
            f"{type(last).__name__}: {last})")

    def _reply(self, response: Any, url: str) -> tuple[str, str, str, int | None]:
        choices = getattr(response, "choices", None)
        if not isinstance(choices, list) or not choices:
            raise _Rejected(f"malformed response from {url}: no choices")
        choice = choices[0]
        message = getattr(choice, "message", None)
        content = getattr(message, "content", None)
        reason = getattr(choice, "finish_reason", None)
        if not isinstance(content, str) or reason not in ("stop", "length"):
            raise _Rejected(f"malformed response from {url}: content {type(content).__name__}, "
                            f"finish_reason {reason!r}")
        usage = getattr(response, "usage", None)
        tokens = getattr(usage, "completion_tokens", None)
        self.summary.requests += 1
        self.summary.cut_replies += reason == "length"
        self.summary.new_tokens += tokens if isinstance(tokens, int) else 0
        model = getattr(response, "model", None)
        prompt = getattr(usage, "prompt_tokens", None)
        return (content, reason, model if isinstance(model, str) and model else self.model,
                prompt if isinstance(prompt, int) else None)


def _detail(error: Any) -> str:
    body = getattr(error, "body", None)
    if isinstance(body, dict):
        body = body.get("detail") or body.get("message") or body.get("error") or body
    text = str(body if body is not None else error)
    return text if len(text) <= 300 else text[:300] + "..."


# ----------------------------------------------------------------------------- output

class _Output:
    """OUT, the rejected file and the pending file; writes records in input order."""

    def __init__(self, config: RegenerateConfig):
        self.work, self.rejected_path, self.pending_path = _paths(config.out)
        self.out = config.out
        if self.work != self.out and self.out.exists() and not self.work.exists():
            _decompress(self.out, self.work)  # a finished compressed output, extended or rerun
        written = _read_lines(self.work)
        rejected = _read_lines(self.rejected_path)
        self.done = {_key(r["source"]) for r in written} | {_key(r) for r in rejected}
        self.num_written = len(written)
        self.rejected = {}
        for r in rejected:
            self.rejected[r["reason"]] = self.rejected.get(r["reason"], 0) + 1
        self.pending = {}
        for r in _read_lines(self.pending_path):
            if _key(r["source"]) not in self.done:
                self.pending[_key(r["source"])] = r["result"]
        # Results held only by the pending file; it is emptied when this drops to 0.
        self.num_journaled = len(self.pending)
        self._files = {path: open(path, "ab") for path in (self.work, self.rejected_path, self.pending_path)}

    def journal(self, source: dict[str, Any], result: dict[str, Any]) -> None:
        self._append(self.pending_path, {"source": source, "result": result})
        self.num_journaled += 1

    def write(self, source: dict[str, Any], result: dict[str, Any], journaled: bool) -> None:
        if "reason" in result:
            self._append(self.rejected_path, {**source, "reason": result["reason"]})
            self.rejected[result["reason"]] = self.rejected.get(result["reason"], 0) + 1
        else:
            self._append(self.work, result)
            self.num_written += 1
        self.num_journaled -= journaled
        if journaled and self.num_journaled == 0:
            f = self._files[self.pending_path]
            f.truncate(0)  # everything it held is now in OUT or the rejected file
            f.seek(0)

    def _append(self, path: Path, obj: dict[str, Any]) -> None:
        f = self._files[path]
        f.write(json.dumps(obj, ensure_ascii=False).encode() + b"\n")
        f.flush()

    def close(self, finished: bool) -> None:
        for f in self._files.values():
            f.close()
        if finished:
            if self.work != self.out:
                fsync_file(self.work)
                with atomic_path(self.out) as tmp:
                    _compress(self.work, tmp)
                self.work.unlink()
            else:
                fsync_file(self.work)
            fsync_file(self.rejected_path)
            self.pending_path.unlink(missing_ok=True)


def _compress(src: Path, dst: Path) -> None:
    import zstandard

    with open(src, "rb") as fin, open(dst, "wb") as fout:
        zstandard.ZstdCompressor(level=10).copy_stream(fin, fout)


def _decompress(src: Path, dst: Path) -> None:
    import zstandard

    with open(src, "rb") as fin, atomic_path(dst) as tmp, open(tmp, "wb") as fout:
        zstandard.ZstdDecompressor().copy_stream(fin, fout)


# ----------------------------------------------------------------------------- entry

def run_regenerate(config: RegenerateConfig) -> RegenerateSummary:
    """Regenerate as `config` says. ValueError for bad options or a server down at start;
    ServerGone when the servers stop answering mid-run (rerun to resume)."""
    return asyncio.run(_run(config))


async def _run(config: RegenerateConfig) -> RegenerateSummary:
    from tqdm import tqdm

    start = time.perf_counter()
    servers = [_Server(url, config.timeout_s) for url in config.servers]
    model = await _pick_model(config, servers)
    total = None
    if config.progress:
        total = sum(1 for _ in iter_records(config.data, config.limit))
    config.out.parent.mkdir(parents=True, exist_ok=True)
    output = _Output(config)
    summary = RegenerateSummary(out=str(config.out), model=model)
    bar = tqdm(total=total, desc="regenerate", unit="rec", file=sys.stderr, disable=not config.progress,
               dynamic_ncols=True, smoothing=0.05)
    worker = _Regenerator(config, servers, model, summary, bar)
    queue: deque[list[Any]] = deque()  # [source, result or None, journaled], in input order
    tasks: set[asyncio.Task] = set()
    window = 4 * config.concurrency + 64  # records read ahead of the oldest unfinished one
    slots = asyncio.Semaphore(config.concurrency)
    finished = False

    def drain() -> None:
        while queue and queue[0][1] is not None:
            source, result, journaled = queue.popleft()
            output.write(source, result, journaled)

    def update_bar() -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix_str(f"{summary.new_tokens / elapsed:,.1f} tok/s, {sum(output.rejected.values()):,} "
                            f"rejected, {summary.retries:,} retries", refresh=False)
        bar.update(1)

    async def one(entry: list[Any], record: InputRecord) -> None:
        async with slots:
            result = await worker.record(record)
        entry[1] = result
        summary.regenerated_records += 1
        if queue and queue[0] is not entry:
            output.journal(entry[0], result)
            entry[2] = True
        drain()
        update_bar()

    try:
        for record in iter_records(config.data, config.limit):
            summary.num_input += 1
            key = (record.file, record.index)
            if key in output.done:
                summary.resumed += 1
                bar.update(1)
                continue
            if key in output.pending:
                summary.resumed += 1
                queue.append([record.source, output.pending.pop(key), True])
                bar.update(1)
                drain()
                continue
            entry = [record.source, None, False]
            queue.append(entry)
            task = asyncio.create_task(one(entry, record))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            while len(queue) >= window or len(tasks) >= window:
                await _first_failure(set(tasks), asyncio.FIRST_COMPLETED)
        while tasks:
            await _first_failure(set(tasks), asyncio.FIRST_EXCEPTION)
        drain()
        assert not queue, "every record is written once all tasks are done"
        finished = True
    finally:
        await _shut_down(tasks, bar, output, servers, finished=finished)
    summary.written = output.num_written
    summary.rejected = dict(output.rejected)
    summary.wall_s = time.perf_counter() - start
    return summary


async def _shut_down(tasks: set[asyncio.Task], bar: Any, output: _Output, servers: list[_Server], *,
                     finished: bool) -> None:
    """Cancel what still runs, then close the bar, the output (published only when `finished`)
    and the server clients."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    bar.close()
    output.close(finished)
    for server in servers:
        await server.client.close()


async def _pick_model(config: RegenerateConfig, servers: list[_Server]) -> str:
    """--model, or the first model the first server lists (ValueError when it lists none); a
    server that does not list it is warned about. A server that does not answer is an error."""
    from tqdm import tqdm

    listed = [await s.models() for s in servers]
    model = config.model or (listed[0][0] if listed[0] else None)
    if model is None:
        raise ValueError(f"--server {servers[0].url} lists no model; pass --model")
    for server, names in zip(servers, listed):
        if names and model not in names:
            tqdm.write(f"[dflash-regenerate] warning: {server.url} lists {names}, not --model {model!r}",
                       file=sys.stderr)
    return model


async def _first_failure(tasks: set[asyncio.Task], when: str) -> None:
    """Wait on `tasks`; re-raise the first exception one of them raised (ServerGone)."""
    done, _ = await asyncio.wait(tasks, return_when=when)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
