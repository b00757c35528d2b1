"""Stage one's per-record pipeline: prepare, regenerate, forward, write.

Both passes of a rank go through here: the basis fit (`compute_sample`, basis codecs only)
and the main pass (`compute`). A record is

1. prepared (`prepare`): normalised (`dflash.common.records`) and tokenized with the chat
   template and loss mask (`ChatEncoder`). A conversation needs an assistant reply to learn
   from unless the run regenerates: with `--regenerate` a prompt-only record (no assistant
   turn) gets one reply after its last user turn, as `dflash-regenerate` gives it, and is
   planned at its prompt's length plus `max_new_tokens` (at most `max_length`);
2. regenerated (`regenerate`, with `--regenerate`): every assistant turn replaced by the
   target's reply, turn by turn, batched, then re-encoded;
3. run through the target (`forward`): features and top-k, timed;
4. written (`write`): `CacheWriter.add`, skipped for records already in complete shards.

Batches are planned with `plan.plan_batches` over the records' lengths; a batch whose
records are all done is skipped, a partly done one is recomputed whole, so a resumed run
writes what an uninterrupted one would.

The basis sample. With a basis codec the sample records' rows come from the forward that
fed the basis fit: `compute_sample` runs the sample's batches (planned over the sample's
records alone, the same batches in a fresh and in a resumed run), hands each result to the
fit and keeps it in memory; `compute` then writes the kept result when the main plan
reaches the record, and runs only the other records of its batch through the target. The
memory held is the sample's rows as the target returned them: about `basis_sample_tokens`
(plus the last record's length) x (L x H x 2 bytes for bf16 features, 4 for fp32, plus 8
x top_k bytes of top-k) on each rank, freed row by row as the main pass writes them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from dflash.common.records import InputRecord, RecordError, cut_assistant_turns, iter_records, normalize_record
from dflash.precompute.data import ChatEncoder, Encoded
from dflash.precompute.device_codecs import DEVICE_CODECS
from dflash.precompute.group import Group
from dflash.precompute.plan import plan_batches
from dflash.shards import CacheWriter

if TYPE_CHECKING:
    from dflash.precompute.config import PrecomputeConfig
    from dflash.precompute.target import Target, TargetOutput

NO_REPLY = "conversation has no assistant turn: give a reply or use --regenerate"

Key = tuple[str, int]

# The automatic forward budget on a CPU (PrecomputeConfig.forward_batch_tokens).
CPU_FORWARD_TOKENS = 2048


@dataclass(kw_only=True)
class RankStats:
    """What this rank did in this run. The run's summary (run.py's `PrecomputeSummary`) is a
    RankStats too: the counters summed over the ranks, the times rank 0's."""

    written_sequences: int = 0
    """Sequences this run wrote."""
    written_tokens: int = 0
    """Tokens this run wrote."""
    resumed_sequences: int = 0
    """Records found already done (resume), rows and rejects."""
    truncated: int = 0
    """Sequences this run cut to max_length."""
    regenerated_replies: int = 0
    """Assistant replies this run regenerated."""
    cut_replies: int = 0
    """Regenerated replies that hit max_new_tokens (or max_length)."""
    forward_s: float = 0.0
    """Time in the target forward (capture and top-k included)."""
    generate_s: float = 0.0
    """Time in generation."""
    encode_s: float = 0.0
    """Time the device spent encoding features (bf16 and fp8; the basis codecs encode on the host)."""
    host_s: float = 0.0
    """The writer's work on the host (validation, encoding, checksums, rows, writes, fsync), in
    its thread when it has one: CPU seconds, fsync and waits for device copies in wall seconds."""
    host_parts_s: dict[str, float] = field(default_factory=dict)
    """host_s by part: validate, copy_wait, host_encode, topk, crc32, rows, write, shard_checksum, fsync."""
    writer_wait_s: float = 0.0
    """Time the main loop waited on the writer thread (its queue full, or draining at the end)."""
    pass_s: float = 0.0
    """Wall time of the main pass (every batch through the target and the writer, the writer's
    drain at close included): what the forward's share is measured against."""

    TIMES: ClassVar[tuple[str, ...]] = ("forward_s", "generate_s", "encode_s", "host_s", "host_parts_s",
                                        "writer_wait_s", "pass_s")
    """The fields that are times: a run's summary reports rank 0's, the others are summed."""


@dataclass
class Item:
    """One record assigned to this rank."""

    position: int
    """The record's position over all inputs (what the plan and the basis sample use)."""
    source: dict[str, Any]
    conversation: list[dict[str, str]] | str
    encoded: Encoded | None
    """The tokenized record; None for a prompt-only record before its reply is generated."""
    num_tokens: int
    """The length the plan uses: the encoded length, or the prompt plus max_new_tokens."""

    @property
    def key(self) -> Key:
        return self.source["file"], self.source["index"]

    @property
    def name(self) -> str:
        return f"{self.source['file']} record {self.source['index']}"


@dataclass
class Computed:
    """One record as the target computed it, ready to write."""

    item: Item
    output: TargetOutput


@dataclass(kw_only=True)
class RankRun:
    """Everything one rank's steps work with, built once by run.py's setup steps."""

    config: PrecomputeConfig
    group: Group
    """The ranks of the run."""
    target: Target
    encoder: ChatEncoder
    writer: CacheWriter
    done: set[Key]
    """Records (rows and rejects) in complete shards of any rank: never redone."""
    stats: RankStats
    log: Callable[[str], None]
    lengths: list[tuple[int, int]]
    """(position, tokens) of every good record over all ranks, by position."""
    mine: set[int]
    """The positions assigned to this rank."""

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def forward_tokens(self) -> int:
        """The padded-token budget of one target forward (PrecomputeConfig.forward_batch_tokens)."""
        config = self.config
        if config.forward_batch_tokens:
            return min(config.forward_batch_tokens, config.batch_tokens)
        return config.batch_tokens if self.target.device.type == "cuda" else min(CPU_FORWARD_TOKENS,
                                                                                 config.batch_tokens)


# ----------------------------------------------------------------------------- prepare

def prepare(config: PrecomputeConfig, encoder: ChatEncoder, *, position: int, record: InputRecord) -> Item:
    """The record as an Item; RecordError with the reason when it cannot be used."""
    if record.error is not None:
        raise RecordError(record.error)
    conversation = normalize_record(record.data, require_assistant=False)
    if isinstance(conversation, str):
        encoded = encoder.encode(conversation)
    elif not any(m["role"] == "assistant" for m in conversation):
        if not config.regenerate:
            raise RecordError(NO_REPLY)
        return _prompt_only(config, encoder, position=position, record=record, messages=conversation)
    else:
        encoded = encoder.encode(conversation, cut_turns=cut_assistant_turns(record.data, conversation))
    return Item(position=position, source=record.source, conversation=conversation, encoded=encoded,
                num_tokens=len(encoded.input_ids))


def _prompt_only(config: PrecomputeConfig, encoder: ChatEncoder, *, position: int, record: InputRecord,
                 messages: list[dict[str, str]]) -> Item:
    """A prompt (no assistant turn) as dflash-regenerate takes it: one reply to generate after
    its last user turn."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise RecordError("conversation has no user turn")
    conversation = messages[: users[-1] + 1] + [{"role": "assistant", "content": ""}]
    num_prompt = len(encoder.prompt_ids(conversation[:-1]))
    return Item(position=position, source=record.source, conversation=conversation, encoded=None,
                num_tokens=min(num_prompt + config.max_new_tokens, config.max_length))


def read_items(run: RankRun, positions: set[int]) -> list[Item]:
    """The records at `positions` (good ones: the input scan rejected the others), in input order."""
    return [prepare(run.config, run.encoder, position=position, record=record)
            for position, record in enumerate(iter_records(run.config.data, run.config.limit))
            if position in positions]


def reject(config: PrecomputeConfig, writer: CacheWriter, *, source: dict[str, Any], reason: str) -> None:
    """List a record in rejected.jsonl with `reason` (with --strict: stop with it)."""
    if config.strict:
        raise ValueError(f"{source['file']} record {source['index']}: {reason} (--strict)")
    writer.reject(source=source, reason=reason)


# ----------------------------------------------------------------------------- the passes

def compute_sample(run: RankRun, items: list[Item], *,
                   on_result: Callable[[Computed], None] | None = None) -> dict[Key, Computed | None]:
    """Run the basis sample's records (`items`) in batches planned over them alone, handing
    every result to `on_result`; returns {key: result} for every sample record, None for a
    record rejected on the way or already done (kept for `compute` to write)."""
    kept: dict[Key, Computed | None] = {item.key: None for item in items}
    # With a reused basis nothing is fitted: the same records, run first for the same batches.
    with _progress(run, items, "basis sample" if on_result is not None else "sample (basis reused)") as bar:
        for batch in plan_batches([item.num_tokens for item in items], run.config.batch_tokens):
            members = [items[i] for i in batch]
            if all(m.key in run.done for m in members):
                continue
            for result in process(run, members):
                if on_result is not None:
                    on_result(result)
                if result.item.key not in run.done:
                    kept[result.item.key] = result
            bar.update(sum(m.num_tokens for m in members if m.key not in run.done))
    return kept


def compute(run: RankRun, items: list[Item], kept: dict[Key, Computed | None]) -> None:
    """Run this rank's batches and write their rows; the records in `kept` (the basis sample)
    are written from there, not recomputed."""
    began = time.perf_counter()
    done = run.done
    num_done = sum(item.key in done for item in items)
    run.stats.resumed_sequences += num_done
    first = run.stats.written_sequences
    with _progress(run, items, "precompute") as bar:
        for batch in plan_batches([item.num_tokens for item in items], run.config.batch_tokens):
            members = [items[i] for i in batch]
            if all(m.key in done for m in members):
                continue
            if run.config.regenerate and any(m.key not in kept for m in members):
                bar.set_postfix_str(f"{num_done + run.stats.written_sequences - first:,}/{len(items):,} seq, "
                                    f"generating {sum(m.key not in kept for m in members)}")
            _compute_batch(run, members, kept)
            bar.set_postfix_str(f"{num_done + run.stats.written_sequences - first:,}/{len(items):,} seq",
                                refresh=False)
            bar.update(sum(m.num_tokens for m in members if m.key not in done))
    run.stats.pass_s += time.perf_counter() - began


def _progress(run: RankRun, items: list[Item], desc: str) -> Any:
    """A tokens bar (rate and ETA) over `items` on rank 0, starting at the done ones."""
    from tqdm import tqdm

    return tqdm(total=sum(item.num_tokens for item in items),
                initial=sum(item.num_tokens for item in items if item.key in run.done),
                unit="tok", unit_scale=True, desc=desc, file=sys.stderr, dynamic_ncols=True, smoothing=0.05,
                disable=not (run.config.progress and run.rank == 0))


def _compute_batch(run: RankRun, members: list[Item], kept: dict[Key, Computed | None]) -> None:
    """Write the rows of one planned batch: the records in `kept` from there, the others
    regenerated (with --regenerate) and run through the target. The rows are written in the
    order of the forward batches planned over every member, kept ones included, so the
    cache's row order does not depend on the codec."""
    fresh = [m for m in members if m.key not in kept]
    if run.config.regenerate and fresh:
        fresh = regenerate(run, fresh)
    ready = {m.key: m for m in fresh}
    ordered = []  # the members that survived, in member order, regenerated
    for member in members:
        if member.key in kept:
            if kept[member.key] is not None:
                ordered.append(kept[member.key].item)
        elif member.key in ready:
            ordered.append(ready[member.key])
    for part in _parts(run, ordered):
        computed = {c.item.key: c for c in forward(run, [m for m in part if m.key not in kept])}
        for member in part:
            write(run, kept.pop(member.key) if member.key in kept else computed[member.key])


def process(run: RankRun, members: list[Item]) -> Iterator[Computed]:
    """`members` through regeneration (with --regenerate) and the target forward."""
    if run.config.regenerate:
        members = regenerate(run, members)
    for part in _parts(run, members):
        yield from forward(run, part)


def _parts(run: RankRun, members: list[Item]) -> list[list[Item]]:
    """The forward batches of one planned batch: its members (after regeneration the survivors,
    by their new lengths) re-planned under the forward budget. Without regeneration and with
    the forward budget at --batch-tokens this is the planned batch itself."""
    if not members:
        return []
    return [[members[i] for i in batch]
            for batch in plan_batches([len(m.encoded.input_ids) for m in members], run.forward_tokens)]


def forward(run: RankRun, part: list[Item]) -> list[Computed]:
    """One target forward over `part` (one batch)."""
    if not part:
        return []
    began, encode_s = time.perf_counter(), run.target.encode_s
    codec = run.writer.spec.feature_codec
    outputs = run.target.forward([m.encoded.input_ids for m in part], [m.name for m in part],
                                 feature_codec=codec if codec in DEVICE_CODECS else None)
    run.stats.encode_s += run.target.encode_s - encode_s
    run.stats.forward_s += time.perf_counter() - began - (run.target.encode_s - encode_s)
    return [Computed(item=item, output=output) for item, output in zip(part, outputs)]


def write(run: RankRun, result: Computed) -> None:
    """Append the record's row (skipped when it is already in a complete shard)."""
    item, output = result.item, result.output
    if item.key in run.done:
        return
    encoded = {"encoded": True, "feature_scales": output.feature_scales} if output.encoded else {}
    run.writer.add(source=item.source, input_ids=item.encoded.input_ids, loss_mask=item.encoded.loss_mask,
                   features=output.features, topk_ids=output.topk_ids, topk_logprobs=output.topk_logprobs,
                   ready=output.ready, **encoded)
    run.stats.written_sequences += 1
    run.stats.written_tokens += len(item.encoded.input_ids)
    run.stats.truncated += item.encoded.truncated


def close_writer(run: RankRun) -> RankStats:
    """Close this rank's writer (its thread drains first) and return the rank's stats with
    the writer's times."""
    began = time.perf_counter()
    run.writer.close()
    stats, writer = run.stats, run.writer
    stats.pass_s += time.perf_counter() - began
    stats.host_parts_s = dict(sorted(writer.times.seconds.items()))
    stats.host_s = sum(stats.host_parts_s.values())
    stats.writer_wait_s = writer.wait_s
    return stats


# ----------------------------------------------------------------------------- regenerate

@dataclass
class _Replies:
    """The conversations of one regeneration call as their turns are replaced."""

    members: list[Item]
    conversations: list[list[dict[str, str]] | str]
    turns: list[list[int]]
    """Per conversation: the indices of its assistant turns."""
    cut: list[set[int]]
    """Per conversation: the assistant turns cut at max_new_tokens."""
    dropped: set[int]


def regenerate(run: RankRun, members: list[Item]) -> list[Item]:
    """Replace every assistant turn of `members` by the target's reply (turn by turn,
    batched); returns the re-encoded items, rejecting those that no longer fit."""
    conversations = [[dict(m) for m in item.conversation] if isinstance(item.conversation, list)
                     else item.conversation for item in members]
    replies = _Replies(
        members=members, conversations=conversations,
        turns=[[i for i, m in enumerate(c) if m["role"] == "assistant"] if isinstance(c, list) else []
               for c in conversations],
        cut=[set() for _ in members], dropped=set())
    for round_ in range(max((len(t) for t in replies.turns), default=0)):
        _generate_turn(run, replies, round_=round_, prompts=_turn_prompts(run, replies, round_))
    regenerated = []
    for j, item in enumerate(members):
        if j in replies.dropped:
            continue
        try:
            encoded = run.encoder.encode(conversations[j], cut_turns=frozenset(replies.cut[j]))
        except RecordError as error:
            _drop(run, replies, j, str(error))
            continue
        regenerated.append(Item(position=item.position, source=item.source, conversation=conversations[j],
                                encoded=encoded, num_tokens=len(encoded.input_ids)))
    return regenerated


def _drop(run: RankRun, replies: _Replies, j: int, reason: str) -> None:
    replies.dropped.add(j)
    if replies.members[j].key not in run.done:
        reject(run.config, run.writer, source=replies.members[j].source, reason=reason)


def _turn_prompts(run: RankRun, replies: _Replies, round_: int) -> dict[int, list[int]]:
    """{conversation: prompt token ids} of assistant turn `round_`, for the conversations that
    have one (and room for it below max_length)."""
    prompts = {}
    for j, conversation in enumerate(replies.conversations):
        if j in replies.dropped or round_ >= len(replies.turns[j]):
            continue
        try:
            prompt = run.encoder.prompt_ids(conversation[: replies.turns[j][round_]])
        except RecordError as error:
            _drop(run, replies, j, str(error))
            continue
        if len(prompt) >= run.config.max_length:
            _drop(run, replies, j, f"prompt of assistant turn {round_} has {len(prompt)} tokens, no room "
                                   f"below --max-length {run.config.max_length}")
            continue
        prompts[j] = prompt
    return prompts


def _generate_turn(run: RankRun, replies: _Replies, *, round_: int, prompts: dict[int, list[int]]) -> None:
    """Generate assistant turn `round_` of the conversations in `prompts`, in batches."""
    config, target = run.config, run.target
    order = list(prompts)
    budgets = {j: min(config.max_new_tokens, config.max_length - len(prompts[j])) for j in order}
    for batch in plan_batches([len(prompts[j]) + budgets[j] for j in order], config.batch_tokens):
        js = [order[b] for b in batch]
        seed = generation_seed(config.seed, round_, replies.members[js[0]].source)
        began = time.perf_counter()
        generated = target.generate([prompts[j] for j in js], [budgets[j] for j in js], config.temperature, seed)
        run.stats.generate_s += time.perf_counter() - began
        for j, reply in zip(js, generated):
            turn = replies.turns[j][round_]
            replies.conversations[j][turn]["content"] = target.tokenizer.decode(
                reply.token_ids, skip_special_tokens=True)
            if not reply.finished:
                replies.cut[j].add(turn)
            if replies.members[j].key not in run.done:
                run.stats.regenerated_replies += 1
                run.stats.cut_replies += not reply.finished


def generation_seed(seed: int, round_: int, source: dict[str, Any]) -> int:
    """A sampling seed that depends only on the run seed, the turn and the batch's first record."""
    text = json.dumps([seed, round_, source["file"], source["index"]])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


__all__ = ["NO_REPLY", "Computed", "Item", "RankRun", "RankStats", "close_writer", "compute", "compute_sample",
           "forward", "generation_seed", "prepare", "process", "read_items", "regenerate", "reject", "write"]
