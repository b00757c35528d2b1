"""Stage one's setup and per-rank run, and its distributed orchestration:
`run_precompute(config)`.

One process per device (spawned here with `nproc`, or started by `torchrun`), each running
the same steps, with a collective check after each step so that one rank's failure becomes
an error on every rank instead of a hang (group.py: `Group.step` gathers small results,
`Group.local` keeps big ones in the process):

1. rank 0: `--overwrite` clears the output; a finished cache of the same configuration is
   reported and left untouched.
2. every rank: load the target (checks first: path, causal LM, layer ids), open its
   `CacheWriter` (which refuses a cache started with another configuration or world size);
   the ranks exchange what their complete shards already hold (resume).
3. rank 0 writes CACHE/target/. Every rank reads all inputs and tokenizes every
   world_size-th record (rejecting the bad ones it meets); the ranks exchange lengths, and
   each computes the same token-balanced assignment (plan.py). Steps 2-3 build this rank's
   `pipeline.RankRun`.
4. basis codecs: the basis fit (basis.py) over the sample, through the per-record pipeline;
   its rows are kept for step 5.
5. every rank runs its batches through the pipeline (pipeline.py: regeneration, the target
   forward, `writer.add`). Batches whose records are all in complete shards are skipped; a
   partly done batch is recomputed whole, so a resumed run writes exactly what an
   uninterrupted one would.
6. rank 0 finalizes the cache (manifest.json last) and returns the summary.

Control traffic goes through gloo even on GPUs: stage one exchanges only a few Python
objects, and gloo keeps every collective off the devices that run the target.

Regeneration (`regenerate=True`, pipeline.py) replaces every assistant turn of a
conversation by the target's own reply, turn by turn: turn i is generated from the
conversation up to it with turns before i already regenerated (the user turns stay as they
were); a prompt-only record gets one reply after its last user turn. Replies stop at an
end-of-sequence token or `max_new_tokens`; they are decoded without special tokens and put
back into the conversation, which is then rendered and masked like any other, except that
a reply cut at `max_new_tokens` keeps the template's end-of-turn token out of the loss mask
(the target did not write it there), so the mask holds exactly the tokens the target
generated. `text` records have no turns and are cached as they are. Rank balancing uses the
original replies' lengths as the estimate of the regenerated ones (a prompt's length plus
`max_new_tokens` for a prompt-only record).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash.common.files import write_atomic
from dflash.common.options import resumable
from dflash.common.records import RecordError, input_sha256, iter_records
from dflash.precompute.basis import fit_or_load_basis
from dflash.precompute.config import PrecomputeConfig
from dflash.precompute.data import ChatEncoder
from dflash.precompute.group import Group
from dflash.precompute.pipeline import RankRun, RankStats, close_writer, compute, prepare, read_items, reject
from dflash.precompute.plan import assign_ranks
from dflash.shards import CacheSpec, CacheWriter, finalize_cache, open_cache
from dflash.shards.layout import MANIFEST, REJECTED, SHARDS_DIR, TARGET_DIR
from dflash.shards.spec import BASIS_CODECS


@dataclass(kw_only=True)
class PrecomputeSummary(RankStats):
    """What a run did (this run) and what the cache now holds (all runs). The `RankStats`
    counters are this run's, summed over its ranks; the times (`RankStats.TIMES`) are rank 0's."""

    cache_dir: str
    num_sequences: int
    """Sequences in the cache."""
    num_tokens: int
    """Tokens in the cache."""
    num_loss_tokens: int
    """Loss-masked tokens in the cache."""
    rejected: dict[str, int]
    """Rejected records in the cache, by reason."""
    bytes_per_token: dict[str, float]
    """Stored bytes per token by column, and "total" (whole shard files)."""
    regenerated: bool = False
    generation_temperature: float | None = None
    max_length: int = 0
    max_new_tokens: int = 0
    wall_s: float = 0.0
    """Wall time of this run, loading included."""
    world_size: int = 1
    already_complete: bool = False
    """The cache was complete for this configuration; nothing was computed."""

    @property
    def tokens_per_s(self) -> float:
        return self.written_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tokens_per_s": self.tokens_per_s}

    def format(self) -> str:
        """The human summary the CLI prints."""
        rejected = sum(self.rejected.values())
        reasons = sorted(self.rejected.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = "; ".join(f"{n} {reason}" for reason, n in reasons[:5])
        if len(reasons) > 5:
            shown += f"; {sum(n for _, n in reasons[5:])} other"
        columns = ", ".join(f"{k} {v:,.1f}" for k, v in self.bytes_per_token.items() if k != "total")
        lines = [f"dflash-precompute: {self.cache_dir}" + (" (already complete)" if self.already_complete else "")]
        lines.append(f"  sequences    {self.num_sequences:,} in the cache; {self.written_sequences:,} written "
                     f"by this run, {self.resumed_sequences:,} records already done")
        lines.append(f"  tokens       {self.num_tokens:,} ({self.num_loss_tokens:,} in the loss mask)")
        lines.append(f"  rejected     {rejected:,}" + (f": {shown}" if rejected else ""))
        lines.append(f"  truncated    {self.truncated:,} to --max-length {self.max_length} (this run)")
        if self.regenerated:
            lines.append(f"  regenerated  {self.regenerated_replies:,} replies at temperature "
                         f"{self.generation_temperature:g}; {self.cut_replies:,} cut at "
                         f"--max-new-tokens {self.max_new_tokens} (this run)")
        lines.append(f"  bytes/token  {self.bytes_per_token.get('total', 0.0):,.1f} ({columns})")
        lines.append(f"  time         {self.wall_s:,.1f} s on {self.world_size} rank(s); "
                     f"{self.tokens_per_s:,.1f} tokens/s; rank 0: forward {self.forward_s:,.1f} s, "
                     f"generation {self.generate_s:,.1f} s, device encode {self.encode_s:,.1f} s, "
                     f"host {self.host_s:,.1f} s, waiting on the writer {self.writer_wait_s:,.1f} s")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- entry

def run_precompute(config: PrecomputeConfig) -> PrecomputeSummary:
    """Run stage one as `config` says; returns rank 0's summary.

    Under torchrun (RANK/WORLD_SIZE set) this process is one rank and every rank returns
    the summary. With `config.nproc > 1` it spawns that many local workers and waits.
    """
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world > 1:
        if config.nproc > 1:
            raise ValueError("--nproc spawns local workers; under torchrun leave it at 1")
        summary = _worker_main(config, rank=int(os.environ["RANK"]), world_size=env_world,
                               local_rank=int(os.environ.get("LOCAL_RANK", "0")), init_method="env://")
    elif config.nproc == 1:
        summary = _worker_main(config, rank=0, world_size=1, local_rank=0, init_method=None)
    else:
        summary = _spawn(config)
    _check_not_empty(config, summary)
    return summary


def _check_not_empty(config: PrecomputeConfig, summary: PrecomputeSummary) -> None:
    """A cache without a sequence is a failure, not a result (fit would have nothing to read)."""
    if not summary.num_sequences:
        raise _empty_error(config, Counter(summary.rejected))


def _empty_error(config: PrecomputeConfig, rejected: Counter[str]) -> ValueError:
    """The one-line error of a run that wrote no sequence, whatever the feature codec."""
    num_rejected = sum(rejected.values())
    where = ", ".join(str(p) for p in config.data)
    if not num_rejected:
        return ValueError(f"no record was read from --data {where}: the input is empty (or --limit cut "
                          f"everything); give a file with chat records")
    top = sorted(rejected.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    reasons = "; ".join(f"{n} x {reason}" for reason, n in top)
    return ValueError(f"no sequence was written: {num_rejected} record{'s' if num_rejected != 1 else ''} read "
                      f"from --data {where}, all rejected ({reasons}); each record's reason is in "
                      f"{config.out / REJECTED}")


def _spawn(config: PrecomputeConfig) -> PrecomputeSummary:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # This process hosts the rendezvous store and outlives every worker: a rank left talking to
    # a store that went away with its host can abort in a C++ thread ("terminate called
    # without an active exception"), which happened when rank 0 hosted it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=config.dist_timeout_s))
    results = mp.get_context("spawn").SimpleQueue()
    try:
        mp.start_processes(_spawned_worker, args=(config, store.port, results),
                           nprocs=config.nproc, join=True, start_method="spawn")
    except mp.ProcessRaisedException as error:
        # Every rank reports its ValueError before raising; the first report is the cause
        # or names the rank that caused it.
        while not results.empty():
            kind, payload = results.get()
            if kind == "error":
                raise ValueError(payload) from None
        raise RuntimeError(f"a precompute worker failed:\n{error}") from None
    except mp.ProcessExitedException as error:
        raise RuntimeError(f"a precompute worker died: {error}") from None
    finally:
        del store
    while True:
        kind, payload = results.get()
        if kind == "ok":
            return PrecomputeSummary(**payload)


def _spawned_worker(local_rank: int, config: PrecomputeConfig, store_port: int, results) -> None:
    import torch

    if config.device == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.nproc))  # share the cores
    try:
        summary = _worker_main(config, rank=local_rank, world_size=config.nproc,
                               local_rank=local_rank, init_method=f"store://127.0.0.1:{store_port}")
    except ValueError as error:
        results.put(("error", str(error)))
        raise
    if local_rank == 0:
        results.put(("ok", dataclasses.asdict(summary)))


# ----------------------------------------------------------------------------- one rank

def _worker_main(config: PrecomputeConfig, *, rank: int, world_size: int, local_rank: int,
                 init_method: str | None) -> PrecomputeSummary:
    group = Group(rank, world_size, init_method, config.dist_timeout_s)
    try:
        summary = _run_rank(config, group, local_rank)
    except BaseException:
        group.close(together=False)
        raise
    group.close(together=True)
    return summary


def _run_rank(config: PrecomputeConfig, group: Group, local_rank: int) -> PrecomputeSummary:
    """Stage one on this rank: the setup steps build a `RankRun`, then the basis fit (basis
    codecs) and the main pass run through the pipeline."""
    start = time.perf_counter()
    rank, world_size = group.rank, group.world_size
    log = _logger(rank, config.progress)
    target, spec, finished = group.local("loading the target",
                                        lambda: _load(config, rank=rank, world_size=world_size, local_rank=local_rank))
    if any(group.step("looking for a finished cache", lambda: finished)):
        log(f"{config.out} is already complete for this configuration; nothing to do")
        return _summary(config, open_cache(config.out), gathered=[RankStats()], start=start,
                        world_size=world_size, already_complete=True)
    log(f"target {config.target} on {target.device} ({target.dtype}), layers {target.layer_ids}, "
        f"{world_size} rank(s)")
    writer = group.local("opening the cache",
                         lambda: _open_writer(config, spec, target=target, rank=rank, world_size=world_size))
    try:
        done = _expand(group.step("exchanging the records done", lambda: _compact(writer.done_sources)))
        if done:
            log(f"resuming: {len(done):,} records already in complete shards")
        run = _scan(config, group, target=target, writer=writer, done=done, log=log)
        items = group.local("reading this rank's records", lambda: read_items(run, run.mine))
        kept = fit_or_load_basis(run, items) if spec.is_basis else {}
        group.step("computing", lambda: compute(run, items, kept))
        gathered = group.step("closing the shards", lambda: close_writer(run))
    except BaseException:
        writer.abort()
        raise

    def finalize() -> None:
        if rank == 0:
            finalize_cache(config.out, spec, world_size)

    group.step("writing the manifest", finalize)
    if world_size > 1:
        # vLLM's in-process engine adopts the ranks' default process group as its world and
        # destroys it when it stops (at exit otherwise, after the group is gone): every rank
        # is done here, then each stops its engine (Group.close finds the group gone).
        group.step("stopping the engines", lambda: None)
        target.close()
    return _summary(config, open_cache(config.out), gathered=gathered, start=start, world_size=world_size)


def _load(config: PrecomputeConfig, *, rank: int, world_size: int, local_rank: int) -> tuple[Any, CacheSpec, bool]:
    """The target (checked first), the cache spec, and (rank 0) whether `out` already holds
    this cache finished."""
    from dflash.precompute.target import Target, resolve_device, resolve_dtype

    if rank == 0:
        _check_out_dir(config)
    device = resolve_device(config.device, local_rank)
    if config.engine == "vllm":
        from dflash.precompute.vllm_engine import VllmTarget, rank_gpus

        rank_gpus(local_rank, config.tensor_parallel_size)
        target = VllmTarget(config.target, layer_ids=config.feature_layers,
                            num_feature_layers=config.num_feature_layers, top_k=config.top_k,
                            dtype=resolve_dtype(config.dtype, device), trust_remote_code=config.trust_remote_code,
                            tensor_parallel_size=config.tensor_parallel_size, max_length=config.max_length)
    else:
        target = Target(config.target, layer_ids=config.feature_layers, num_feature_layers=config.num_feature_layers,
                        top_k=config.top_k, device=device, dtype=resolve_dtype(config.dtype, device),
                        trust_remote_code=config.trust_remote_code)
    spec = _build_spec(config, target, world_size)
    if rank != 0:
        return target, spec, False
    if config.overwrite and config.out.exists():  # only once the target and inputs checked out
        shutil.rmtree(config.out)
    return target, spec, _finished_cache(config, spec)


def _open_writer(config: PrecomputeConfig, spec: CacheSpec, *, target: Any, rank: int, world_size: int) -> CacheWriter:
    try:
        # On a GPU, encoding and disk writes overlap the next batch's forward; on CPU a
        # writer thread would only compete with the forward for the same cores. At most two
        # planned batches wait for the writer (bounded host memory: 2 x batch_tokens tokens).
        background = config.writer_thread == "on" or (config.writer_thread == "auto" and target.device.type == "cuda")
        return CacheWriter(config.out, spec, rank=rank, world_size=world_size, background=background,
                           queue_tokens=2 * config.batch_tokens, shard_checksum=config.shard_checksum)
    except ValueError as error:
        raise ValueError(f"{error}; or pass --overwrite to replace the cache") from None


def _scan(config: PrecomputeConfig, group: Group, *, target: Any, writer: CacheWriter,
          done: set[tuple[str, int]], log: Callable[[str], None]) -> RankRun:
    """Write CACHE/target/ (rank 0), tokenize this rank's stride of the inputs (rejecting the
    bad records), exchange the lengths and assign the records: the RankRun."""
    rank, world_size = group.rank, group.world_size
    encoder = ChatEncoder(target.tokenizer, config.max_length, chat_template=_template_text(config),
                          chat_template_kwargs=config.chat_template_kwargs)
    stats = RankStats()

    def scan() -> tuple[list[tuple[int, int]], list[dict[str, Any]]]:
        if rank == 0:
            target.write_target_dir(config.out / TARGET_DIR)
        return _scan_stride(config, encoder=encoder, writer=writer, done=done, stats=stats, rank=rank,
                            world_size=world_size)

    scanned = group.step("reading the inputs", scan)
    lengths = sorted(item for part, _ in scanned for item in part)
    if not lengths and writer.spec.is_basis:
        _refuse_all_rejected(config, rank=rank, rejects=[r for _, part in scanned for r in part])
    mine = {lengths[j][0] for j in assign_ranks([n for _, n in lengths], world_size)[rank]}
    return RankRun(config=config, group=group, target=target, encoder=encoder, writer=writer, done=done,
                   stats=stats, log=log, lengths=lengths, mine=mine)


def _scan_stride(config: PrecomputeConfig, *, encoder: ChatEncoder, writer: CacheWriter, done: set[tuple[str, int]],
                 stats: RankStats, rank: int, world_size: int) -> tuple[list[tuple[int, int]], list[dict[str, Any]]]:
    """Tokenize every world_size-th record (this rank's share of the length scan) and reject
    the bad ones; returns [(position, tokens)] of the good ones and the rejects made."""
    lengths, rejects = [], []
    for position, record in enumerate(iter_records(config.data, config.limit)):
        if position % world_size != rank:
            continue
        try:
            lengths.append((position, prepare(config, encoder, position=position, record=record).num_tokens))
        except RecordError as error:
            if (record.file, record.index) in done:
                stats.resumed_sequences += 1
            else:
                reject(config, writer, source=record.source, reason=str(error))
                rejects.append({**record.source, "reason": str(error)})
    return lengths, rejects


def _refuse_all_rejected(config: PrecomputeConfig, *, rank: int, rejects: list[dict[str, Any]]) -> None:
    """Every record was rejected and a basis codec has nothing to fit on: rank 0 writes the
    reasons to CACHE/rejected.jsonl (nothing is committed, a rerun scans again) and every
    rank raises the error the raw codecs give once their empty cache is finalized."""
    if rank == 0:
        rejects = sorted(rejects, key=lambda r: (r["file"], r["index"]))
        write_atomic(config.out / REJECTED,
                     "".join(json.dumps(r, sort_keys=True) + "\n" for r in rejects).encode())
    raise _empty_error(config, Counter(r["reason"] for r in rejects))


def _check_out_dir(config: PrecomputeConfig) -> None:
    """Refuse to write into (or, with --overwrite, delete) a directory that is not a cache."""
    out = config.out
    if out.exists() and any(out.iterdir()) and not (
            (out / MANIFEST).exists() or (out / SHARDS_DIR).is_dir()):
        raise ValueError(f"--out {out} exists and is not a dflash cache; choose another directory")


def _logger(rank: int, enabled: bool) -> Callable[[str], None]:
    def log(message: str) -> None:
        if rank == 0 and enabled:
            from tqdm import tqdm

            tqdm.write(f"[dflash-precompute] {message}", file=sys.stderr)
    return log


def _build_spec(config: PrecomputeConfig, target: Any, world_size: int) -> CacheSpec:
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()}
    options["data"] = [str(p) for p in config.data]
    options["world_size"] = world_size
    for key in resumable(PrecomputeConfig):  # a resumed run may change them: not the cache's identity
        options.pop(key)
    options["chat_template_text"] = _template_text(config)
    options["replies"] = replies_provenance(config)
    return CacheSpec(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, layer_ids=target.layer_ids,
        top_k=config.top_k, feature_codec=config.feature_codec, topk_codec=config.topk_codec,
        feature_rank=(config.feature_rank or target.hidden_size) if config.feature_codec in BASIS_CODECS else None,
        max_length=config.max_length, logit_temperature=1.0, regenerated=config.regenerate,
        generation_temperature=config.temperature if config.regenerate else None,
        target=target.identity(), tokenizer_sha256=target.tokenizer_sha256(),
        inputs=[{"path": str(p), "sha256": input_sha256(p)} for p in config.data],
        shard_max_rows=config.shard_max_rows, options=options)


def _template_text(config: PrecomputeConfig) -> str | None:
    return None if config.chat_template is None else config.chat_template.read_text(encoding="utf-8")


def replies_provenance(config: PrecomputeConfig) -> dict[str, Any]:
    """How the cached replies were made: "in-process" (--regenerate), "engine" (inputs
    written by dflash-regenerate: model and settings as their first record states) or "data"."""
    if config.regenerate:
        return {"made_by": "in-process", "model": str(config.target), "max_new_tokens": config.max_new_tokens,
                "temperature": config.temperature, "seed": config.seed,
                "chat_template_kwargs": config.chat_template_kwargs}
    first = next(iter(iter_records(config.data, 1)), None)
    data = first.data if first is not None else None
    if isinstance(data, dict) and isinstance(data.get("generation"), dict) and "model" in data:
        return {"made_by": "engine", "model": data["model"], **data["generation"]}
    return {"made_by": "data"}


def _finished_cache(config: PrecomputeConfig, spec: CacheSpec) -> bool:
    """True when `out` holds a finalized cache made by this same command; ValueError when
    it holds one of another configuration. A finalized cache of this configuration made
    with other options (e.g. a larger --limit) is extended: the run continues it."""
    if not (config.out / MANIFEST).exists():
        return False
    cache = open_cache(config.out)
    differ = cache.spec.identity_diff(spec)
    if differ:
        raise ValueError(
            f"{config.out} holds a cache built with a different configuration (fields {differ} "
            "differ): pass --overwrite to replace it, or choose another --out"
        )
    return cache.spec.options == spec.options


def _compact(done: set[tuple[str, int]]) -> dict[str, np.ndarray]:
    """{file: sorted indices} (small to gather) from a set of (file, index)."""
    by_file: dict[str, list[int]] = {}
    for file, index in done:
        by_file.setdefault(file, []).append(index)
    return {file: np.asarray(sorted(ix), dtype=np.int64) for file, ix in by_file.items()}


def _expand(gathered: list[dict[str, np.ndarray]]) -> set[tuple[str, int]]:
    """Every rank's done records, as one set: a record done anywhere is never redone."""
    return {(file, int(i)) for part in gathered for file, ix in part.items() for i in ix}


def _summary(config: PrecomputeConfig, cache: Any, *, gathered: list[RankStats], start: float,
             world_size: int, already_complete: bool = False) -> PrecomputeSummary:
    manifest = cache.manifest
    num_tokens = max(1, manifest["num_tokens"])
    bytes_per_token = {name: size / num_tokens for name, size in sorted(manifest["column_bytes"].items())}
    bytes_per_token["total"] = sum(s["num_bytes"] for s in manifest["shards"]) / num_tokens
    rejected: Counter[str] = Counter()
    with open(cache.rejected_path, encoding="utf-8") as f:
        for line in f:
            rejected[json.loads(line)["reason"]] += 1
    total = {f.name: sum(getattr(s, f.name) for s in gathered) for f in dataclasses.fields(RankStats)
             if f.name not in RankStats.TIMES}
    total.update({name: getattr(gathered[0], name) for name in RankStats.TIMES})  # rank 0's times
    return PrecomputeSummary(
        **total, cache_dir=str(config.out), num_sequences=len(cache), num_tokens=manifest["num_tokens"],
        num_loss_tokens=manifest["num_loss_tokens"], rejected=dict(rejected),
        bytes_per_token=bytes_per_token, regenerated=cache.spec.regenerated,
        generation_temperature=cache.spec.generation_temperature, max_length=config.max_length,
        max_new_tokens=config.max_new_tokens, wall_s=time.perf_counter() - start,
        world_size=world_size, already_complete=already_complete)
