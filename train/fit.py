"""`dflash-train fit`: `_setup` builds a `Run` (data, plan, drafter, optimizer, gate, writer,
logger), and `_train`, the loop, reads top to bottom.

Each step: run the drafter over all blocks of this rank's batch at once, take the sparse
KL (or CE) of the labelled block positions through the frozen LM head without forming
logits, backpropagate; then read the next step's batch (the plan's segments for that step,
a pure function of epoch and step, copied out of the memory-mapped shards into a pinned
buffer, its copy to the device started on a side stream: train/data.py's BatchFeed) while
the device still works through this step's kernels; reduce the figures over ranks, let the
spike gate decide, step (or skip), every `checkpoint_every` steps snapshot the state (a
device-side copy: train/checkpoint.py), log, and then hand the snapshot to the background
writer (after the log line: see `_train`). There is nothing running beside the loop except
that writer: the read-ahead is one batch, done by the loop itself. `data_time_s` is the
host's time reading rows in a step (the next step's; the first step also reads its own);
`gpu_data_wait_s` the time the device sat idle for them (CUDA events: during the read, and
waiting for the copy; None on a CPU).

Distributed: launched by `torchrun`, one process per device; DDP averages gradients (or
FSDP2 shards the drafter, its gradients and optimizer state: `--parallel`, train/parallel.py). Each
rank's summed loss is scaled by world_size / (global label weight), so the averaged gradient
is exactly the gradient of the global weighted mean: a 2-rank run equals a 1-rank run of the
same global batch up to floating-point summation order. All ranks see the same reduced loss
and gradient norm, so the gate's decision needs no extra collective. Rank 0 writes logs and
checkpoints. Multi-node runs need RUN on a shared filesystem (every rank loads the resume
checkpoint from it). Checkpoints are unsharded under both, so a run can resume under the
other mode or another world size.

Resume: the newest complete checkpoint holds weights, optimizer, gate and the global step;
the data position (epoch, step in epoch) follows from the step, and the plan is stateless,
so the resumed run computes exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflash.common.files import write_json_atomic
from dflash.kernels.loss import sparse_kl_loss
from dflash.shards import open_cache
from dflash.shards.layout import HEAD_FILE, TARGET_INFO_FILE
from dflash.train import draft_vocab, drafters, parallel
from dflash.train.checkpoint import CheckpointWriter, Snapshot, latest_checkpoint, load_checkpoint
from dflash.train.config import DEFAULT_NUM_LAYERS, FitConfig, LossConfig, ModelConfig, check_resume
from dflash.train.data import (
    EVAL_STREAM,
    BatchFeed,
    Corpus,
    DataPlan,
    Sent,
    decay_gamma,
    held_out_mask,
    read_batch,
)
from dflash.train.gating import SpikeGate
from dflash.train.identity import caches_fingerprint, record_run_target
from dflash.train.init_from import (
    InitSource,
    adopt,
    attention_fields,
    load_state,
    model_fields,
    record_source,
    resolve_source,
    warm_start,
)
from dflash.train.logging import RunLogger, console_line
from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig, TargetHead, count_parameters
from dflash.train.run_folder import DRAFTER_CONFIG_FILE, RUN_CONFIG_FILE, SPIKES_FILE
from dflash.train.runlock import RunLock, check_out_folder


class SpikeStop(RuntimeError):
    """Raised when the run stops because of persistent spikes (the message says what to read)."""


@dataclass
class FitResult:
    step: int
    """Global steps completed."""
    checkpoint: str | None
    """The newest complete checkpoint."""
    total_steps: int
    """Steps the run is planned for."""


@dataclass(eq=False)
class Run:
    """Everything the loop works with, built once by `_setup`; `step`, `last_checkpoint` and
    `step_times` advance as it runs."""

    config: FitConfig
    """The resolved config (mask_token_id filled in from the target)."""
    rank: int
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    run_dir: Path
    corpus: Corpus
    plan: DataPlan
    """The training plan (the held-out sequences excluded)."""
    eval_plan: DataPlan | None
    """The plan over the held-out sequences; None when they are too few, or eval is off."""
    drafter_config: DrafterConfig
    gamma: float
    """Position-weight decay of the loss."""
    total_steps: int
    planned_epochs: int
    """Epochs the run touches (max_steps, when set, overrides epochs)."""
    model: DFlashDrafter
    """The drafter itself (fp32 master weights; sharded in place under FSDP2)."""
    wrapped: torch.nn.Module
    """The drafter as called: under DDP its wrapper, else the drafter."""
    parallel_kind: str
    head: TargetHead
    optimizer: torch.optim.Optimizer
    gate: SpikeGate
    writer: CheckpointWriter | None
    """The background checkpoint writer (rank 0 only)."""
    logger: RunLogger
    step: int
    """Global steps completed."""
    last_checkpoint: str | None
    feed: BatchFeed
    """Training batches to the device (two slots: this step's and the next)."""
    eval_feed: BatchFeed
    """Held-out batches, apart: an evaluation between two steps leaves the next step's batch alone."""
    step_times: list[float] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def lr_at(step: int, total_steps: int, warmup_ratio: float, peak: float) -> float:
    """Linear warm-up over round(warmup_ratio * total) steps, then cosine decay to 0."""
    warmup = round(warmup_ratio * total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def fit(config: FitConfig) -> FitResult:
    rank, world_size, device = _init_distributed(config.runtime.device)
    try:
        return _fit(config, rank, world_size, device)
    finally:
        if world_size > 1 and dist.is_initialized():
            # DDP and FSDP2 hold the process group from inside reference cycles; collected
            # at interpreter exit, Gloo's threads would be torn down without the GIL and the
            # rank could abort ("terminate called without an active exception").
            gc.collect()
            dist.destroy_process_group()


def _fit(config: FitConfig, rank: int, world_size: int, device: torch.device) -> FitResult:
    run_dir, lock, created = Path(config.out), None, False
    if rank == 0:  # one lock per run, whatever the number of ranks (see train/runlock.py)
        created = not check_out_folder(run_dir)  # before anything is written
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir).acquire()
    run = None
    try:
        run = _setup(config, rank, world_size, device)
        try:
            _train(run)
        finally:
            run.logger.close()
    except KeyboardInterrupt:
        if rank == 0 and run is not None and run.step > 0:
            _drain_quietly(run)
            where = latest_checkpoint(run_dir)
            print(f"interrupted after step {run.step}; newest checkpoint: {where or 'none'}. Rerun the same "
                  "command to resume" + (f" from {where.name}" if where else " (from the start)"),
                  file=sys.stderr, flush=True)
        _forget(run_dir, created, run)
        raise
    except BaseException:
        _forget(run_dir, created, run)
        raise
    finally:
        if lock is not None:
            lock.release()
    if world_size > 1:
        # Non-zero ranks learn where the last checkpoint is from the run folder.
        _barrier(world_size)
        last = latest_checkpoint(run.run_dir)
        run.last_checkpoint = str(last) if last else None
    return FitResult(step=run.step, checkpoint=run.last_checkpoint, total_steps=run.total_steps)


def _drain_quietly(run: Run) -> None:
    """Let the checkpoint writer finish what it holds (an interrupted run keeps it)."""
    if run.writer is not None:
        try:
            run.writer.wait()
        except Exception:  # noqa: BLE001 - the interrupt is what is reported
            pass


def _forget(run_dir: Path, created: bool, run: Run | None) -> None:
    """Remove the run folder this process created when it failed before its first step."""
    if created and (run is None or run.step == 0):
        shutil.rmtree(run_dir, ignore_errors=True)


def _train(run: Run) -> None:
    """The loop, from `run.step` to `run.total_steps` (or a SpikeStop)."""
    config, plan = run.config, run.plan
    pending = None  # the next step's batch, read and sent to the device while the device computes
    if config.checkpoint.save_initial and run.step == 0:
        _save_checkpoint(run)
    while run.step < run.total_steps:
        t_start = time.perf_counter()
        step = run.step
        epoch, step_in_epoch = divmod(step, plan.steps_per_epoch)
        reads = [] if pending is not None else [_read_step(run, step)]  # the reads this step does
        sent = pending or reads[0]
        batch, layout = _receive(run, run.feed, sent)
        start, stop = plan.step_blocks(step_in_epoch)
        tokens = (stop - start) * config.block_rows  # global block tokens of this step

        lr = lr_at(step, run.total_steps, config.optimizer.warmup_ratio, config.optimizer.lr)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        # Global label weight first, so every rank scales its summed loss the same way.
        weight_sum = _all_reduce(batch.weights.sum().double(), run.world_size)
        if config.data.feature_noise:
            batch.decoded = feature_noise(batch.context_features, config.data.feature_noise, seed=config.data.seed,
                                          rank=run.rank, step=step)
        loss_sum, argmax = forward_loss(run, batch, layout)
        (loss_sum * (run.world_size / weight_sum).float()).backward()
        # Read the next step's rows now and start their copy: CUDA kernels run asynchronously,
        # so the read overlaps this step's compute until the first value is needed below (on
        # CPU it is the same read, only earlier). Still no thread and no queue: one batch ahead.
        pending = _read_step(run, step + 1) if step + 1 < run.total_steps else None
        reads += [pending] if pending is not None else []
        grad_norm = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.optimizer.grad_clip))
        loss, accuracy = _step_figures(run, batch, loss_sum, argmax, weight_sum)
        run.feed.release(sent)
        data_time_s = sum(read.read_s for read in reads)  # the host's reading
        gpu_data_wait_s = BatchFeed.device_wait_s(reads, sent)  # the device's waiting (None on a CPU)

        reason = run.gate.reason_to_skip(loss, grad_norm)
        if reason is None:
            if run.writer is not None:
                run.writer.before_update()  # a snapshot still being copied to the host is of this state
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.gate.record(loss, grad_norm, skipped=reason is not None)
        run.step += 1
        stopping = reason is not None and run.gate.should_stop
        snapshot = None
        if not stopping and (run.step % config.checkpoint.checkpoint_every == 0 or run.step == run.total_steps):
            snapshot = _snapshot_checkpoint(run)  # part of this step's time; the write is not

        step_time_s = time.perf_counter() - t_start
        _log_step(run, {
            "step": run.step, "epoch": run.step / plan.steps_per_epoch, "epoch_index": epoch + 1,
            "epoch_fraction": (step_in_epoch + 1) / plan.steps_per_epoch, "loss": loss,
            "accuracy": accuracy, "grad_norm": grad_norm, "lr": lr, "skipped": reason is not None,
            "tokens": tokens, "tokens_per_s": tokens / step_time_s, "data_time_s": data_time_s,
            "gpu_data_wait_s": gpu_data_wait_s, "step_time_s": step_time_s,
        }, always_print=reason is not None)
        if reason is not None:
            _handle_spike(run, epoch, step_in_epoch, loss, grad_norm, reason, stopping)
        if snapshot is not None:
            # Only now, the step's lines written: a checkpoint that a kill leaves complete is of a
            # step already in metrics.jsonl (the resume redoes the steps after it, not that one).
            run.writer.start(snapshot)
        every = config.eval.eval_every
        if every and (run.step % every == 0 or run.step == run.total_steps) and run.eval_plan is not None:
            _evaluate(run)
        _drain_checkpoints(run)
    _drain_checkpoints(run, wait=True)
    run.logger.event("done", step=run.step)


# -- setup ---------------------------------------------------------------------------------


def _setup(config: FitConfig, rank: int, world_size: int, device: torch.device) -> Run:
    """Open the data and plan the run, build (or resume) the drafter, optimizer and gate, and
    start the logs."""
    run_dir = Path(config.out)
    is_main = rank == 0
    _barrier(world_size)  # rank 0 made and locked the folder (_fit)

    # Row checks on: every row's crc32 is verified the first time the run reads it, so a flipped
    # bit in the cache is an error naming the shard, never trained on; later epochs skip it (the
    # mapping is read-only). ISA-L's crc32 keeps a first read near a re-read (bench/train_step.py).
    caches = [open_cache(path, check_rows=True, check_once=True) for path in config.cache]
    fingerprint, warnings = caches_fingerprint(caches)  # refuses caches of different targets
    # The first start counts every sequence's anchors, split over the ranks; a resume reads the
    # index rank 0 stored then.
    corpus = Corpus(caches, index_dir=run_dir, rank=rank, world_size=world_size,
                    combine=lambda counts: _all_reduce(torch.from_numpy(counts).to(device), world_size).cpu().numpy(),
                    progress=is_main, all_tokens=config.data.train_on == "all")
    source = resolve_source(run_dir, config.init_from)  # None: from scratch; refuses another source than the run's
    model_config, drafter_config = _drafter_config(caches[0].target_dir, corpus, config, source)
    if corpus.spec.is_basis:  # fc reads the coefficients; export folds the basis back in
        drafter_config = dataclasses.replace(drafter_config, feature_width=corpus.spec.feature_width,
                                             feature_basis_sha256=caches[0].feature_basis_sha256)
    config = dataclasses.replace(config, init_from=source.path if source else None,
                                 model=dataclasses.replace(model_config, mask_token_id=drafter_config.mask_token_id))
    held_out = held_out_mask(len(corpus), config.eval.eval_fraction, config.data.seed)
    plan = _plan(corpus, held_out, config, world_size)
    # As the Hugging Face Trainer: max_steps, when set, overrides epochs (more epochs, each
    # with fresh anchors, or a cut in the last one).
    total_steps = config.data.max_steps or config.data.epochs * plan.steps_per_epoch
    eval_plan = _held_out_plan(corpus, held_out, config, world_size) if config.eval.eval_every else None

    if (run_dir / RUN_CONFIG_FILE).exists():
        check_resume(run_dir / RUN_CONFIG_FILE, config)
    if is_main:
        _write_run_files(run_dir, config, drafter_config, fingerprint, warnings, caches, held_out, eval_plan, source)

    compute_dtype = _compute_dtype(config.runtime.dtype, device)
    torch.manual_seed(config.data.seed)
    kind = drafters.of_config(drafter_config)
    model = kind.make(drafter_config, attention=config.runtime.attention).to(device)  # fp32 master weights
    num_parameters = count_parameters(model)
    head = TargetHead.load(caches[0].target_dir, device=device, dtype=compute_dtype)
    initial_weights(model, config.model, head, caches[0].target_dir)
    if config.model.draft_vocab is not None:
        _draft_vocabulary(run_dir, model, head, corpus, plan, config, rank, world_size, device, is_main)
        head = head.for_drafter(model)
    resume_from = latest_checkpoint(run_dir)
    if source is not None and resume_from is None:  # weights only: optimizer, schedule and data order start fresh
        warm_start(model, load_state(source), source.config, where=source.weights,
                   basis=caches[0].load_feature_basis() if corpus.spec.is_basis else None)
    gate = SpikeGate(config.gating)
    parallel_kind = parallel.choose(config.runtime.parallel, num_parameters, world_size, device)
    if parallel_kind == "fsdp" and not kind.fsdp:
        raise ValueError(f"--drafter {kind.name} trains on one device or under DDP, not FSDP2: pass --parallel ddp")
    step, wrapped, optimizer = _resume(resume_from, model, gate, config, parallel_kind, world_size, device)

    if is_main and resume_from is not None:
        print(f"resuming from {resume_from} (step {step})", flush=True)
    # Every kind as DFlash of its drafts: the block of the anchor and its drafts.
    gamma = config.loss.decay_gamma or decay_gamma(drafter_config.num_drafts + 1)
    writer = CheckpointWriter(run_dir, config.checkpoint.keep_checkpoints) if is_main else None
    # A fresh start (step 0) drops the step lines of an earlier attempt that saved no checkpoint.
    logger = RunLogger(run_dir, enabled=is_main, resume_step=step,
                       wandb_config={**config.to_dict(), "drafter": drafter_config.to_dict()}
                       if config.logging.wandb else None, wandb_project=config.logging.wandb_project)
    logger.event("resume" if resume_from else "start", step=step,
                 checkpoint=str(resume_from) if resume_from else None,
                 total_steps=total_steps, steps_per_epoch=plan.steps_per_epoch,
                 num_sequences=len(corpus), num_train_sequences=int(plan.train_sequences.shape[0]),
                 num_held_out=int(held_out.sum()), parameters=num_parameters, parallel=parallel_kind,
                 held_out_blocks=eval_plan.blocks_per_epoch if eval_plan else 0,
                 world_size=world_size, device=str(device), dtype=str(compute_dtype), gamma=gamma,
                 mask_token_id=drafter_config.mask_token_id)
    if is_main:
        print(plan_line(total_steps, plan.steps_per_epoch, config), flush=True)
    return Run(config=config, rank=rank, world_size=world_size, device=device, compute_dtype=compute_dtype,
               run_dir=run_dir, corpus=corpus, plan=plan, eval_plan=eval_plan, drafter_config=drafter_config,
               gamma=gamma, total_steps=total_steps, planned_epochs=math.ceil(total_steps / plan.steps_per_epoch),
               model=model, wrapped=wrapped, parallel_kind=parallel_kind, head=head, optimizer=optimizer,
               gate=gate, writer=writer, logger=logger, step=step,
               last_checkpoint=str(resume_from) if resume_from else None, feed=BatchFeed(device),
               eval_feed=BatchFeed(device))


def initial_weights(model: DFlashDrafter, config: ModelConfig, head: TargetHead, target_dir: Path) -> None:
    """Apply --norm-init and --out-init to a freshly initialised drafter (a warm start then
    overwrites every weight, and a resume loads its checkpoint)."""
    with torch.no_grad():
        if config.norm_init == "target":
            if head.final_norm is None:
                raise ValueError(f"--norm-init target: {target_dir / HEAD_FILE} holds no norm.weight "
                                 "(a cache written before the target's final norm was stored); rebuild the cache "
                                 "with dflash-precompute, or use --norm-init ones")
            model.norm.weight.copy_(head.final_norm)
        elif config.norm_init == "flat":
            model.norm.weight.fill_(model.config.hidden_size ** -0.5)
        if config.out_init == "zero":
            for layer in model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()


def _draft_vocabulary(run_dir: Path, model: DFlashDrafter, head: TargetHead, corpus: Corpus, plan: DataPlan,
                      config: FitConfig, rank: int, world_size: int, device: torch.device, is_main: bool) -> None:
    """Choose (or, resuming, read) the run's draft vocabulary and fill the drafter's head."""
    def count() -> np.ndarray:
        return draft_vocab.count_tokens(
            corpus, plan.train_sequences, seed=config.data.seed, rank=rank, world_size=world_size,
            combine=lambda c: _all_reduce(torch.from_numpy(c).to(device), world_size).cpu().numpy(),
            progress=is_main)

    vocab = draft_vocab.load_or_choose(run_dir, config.model.draft_vocab, count, write=is_main)
    draft_vocab.install(model, vocab["ids"], head)
    if is_main:
        share = float(vocab["counts"].sum()) / max(1, vocab["total"])
        print(f"draft vocabulary: {vocab['ids'].shape[0]:,} of {head.lm_head.shape[0]:,} tokens, "
              f"{share:.2%} of the {vocab['total']:,} training tokens counted", flush=True)


def feature_noise(features: torch.Tensor, amplitude: float, *, seed: int, rank: int, step: int) -> torch.Tensor:
    """features + U[-amplitude, amplitude], drawn on the features' device from a generator
    seeded by (seed, rank, step): a resumed run draws what the uninterrupted one did."""
    state = int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0] >> 1)
    generator = torch.Generator(device=features.device).manual_seed(state)
    noise = torch.rand(features.shape, generator=generator, dtype=torch.float32, device=features.device)
    return (features.float() + noise.mul_(2 * amplitude).sub_(amplitude)).to(features.dtype)


def _write_run_files(run_dir: Path, config: FitConfig, drafter_config: DrafterConfig, fingerprint: str | None,
                     warnings: list[str], caches: list, held_out: np.ndarray, eval_plan: DataPlan | None,
                     source: InitSource | None) -> None:
    """Rank 0, before the model is built: RUN/run.json (with the --init-from source), the
    setup's warnings (and one when --eval-every cannot evaluate), RUN/config.json and
    RUN/drafter_config.json (resolved)."""
    record_run_target(run_dir, fingerprint, caches)
    if source is not None:
        record_source(run_dir, source)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if config.eval.eval_every and eval_plan is None:
        why = ("--eval-fraction is 0" if not held_out.any()
               else f"the {int(held_out.sum())} held-out sequences hold less than a block per rank")
        print(f"warning: --eval-every {config.eval.eval_every} has no effect: {why}, so there is no "
              "held-out evaluation", file=sys.stderr, flush=True)
    write_json_atomic(run_dir / RUN_CONFIG_FILE, config.to_dict())
    write_json_atomic(run_dir / DRAFTER_CONFIG_FILE, drafter_config.to_dict())


def plan_line(total_steps: int, steps_per_epoch: int, config: FitConfig) -> str:
    """The console's statement of what the run will do, printed at start."""
    blocks = config.data.tokens_per_step // config.block_rows
    epochs = total_steps / steps_per_epoch
    why = (f"--max-steps {config.data.max_steps} overrides --epochs {config.data.epochs}"
           if config.data.max_steps else f"--epochs {config.data.epochs}")
    return (f"plan: {total_steps} steps of {blocks} blocks x {config.block_rows} tokens = "
            f"{epochs:.3g} epochs of {steps_per_epoch} steps ({why})")


def _drafter_config(target_dir: Path, corpus: Corpus, config: FitConfig,
                    source: InitSource | None) -> tuple[ModelConfig, DrafterConfig]:
    """(the model config with num_layers resolved, the drafter sized for the target and, when
    warm-starting, checked against the source), checked against the cache's spec."""
    spec, model = corpus.spec, config.model
    mask_given = model.mask_token_id is not None
    layer_types, sliding_window, is_causal = attention_fields(source, layer_types=model.layer_types,
                                                              sliding_window=model.sliding_window,
                                                              is_causal=model.is_causal)
    given_layers = model.num_layers if model.layer_types is None else len(model.layer_types)
    num_layers, mask_token_id = model_fields(source, num_layers=given_layers, mask_token_id=model.mask_token_id,
                                             default_num_layers=DEFAULT_NUM_LAYERS)
    model = dataclasses.replace(model, num_layers=num_layers, mask_token_id=mask_token_id, layer_types=layer_types,
                                sliding_window=sliding_window, is_causal=is_causal)
    drafter_config = DrafterConfig.from_target(target_dir, num_hidden_layers=model.num_layers,
                                               num_drafts=model.num_drafts, mask_token_id=model.mask_token_id)
    drafter_config = dataclasses.replace(drafter_config, draft_vocab_size=model.draft_vocab, layer_types=layer_types,
                                         sliding_window=sliding_window, is_causal=is_causal)
    drafter_config = drafters.get(model.drafter).drafter_config(drafter_config, config.drafter_options)
    if drafter_config.target_layer_ids != spec.layer_ids or drafter_config.hidden_size != spec.hidden_size:
        raise ValueError(
            f"{target_dir / TARGET_INFO_FILE} (layers {drafter_config.target_layer_ids}, hidden "
            f"{drafter_config.hidden_size}) disagrees with the cache spec (layers {spec.layer_ids}, "
            f"hidden {spec.hidden_size}): the cache is inconsistent; rebuild it"
        )
    if source is not None:
        drafter_config = adopt(drafter_config, source, target_dir=target_dir, mask_given=mask_given)
    return model, drafter_config


def _plan(corpus: Corpus, excluded, config: FitConfig, world_size: int) -> DataPlan:
    """The plan over the sequences not in `excluded` ([num sequences] bool)."""
    return DataPlan(num_eligible=corpus.num_eligible, held_out=excluded, block_size=config.block_rows,
                    anchors_per_seq=config.data.anchors_per_seq, tokens_per_step=config.data.tokens_per_step,
                    seed=config.data.seed, world_size=world_size)


def _held_out_plan(corpus: Corpus, held_out, config: FitConfig, world_size: int) -> DataPlan | None:
    """The plan over the held-out sequences (None when they hold less than a block per rank)."""
    if not held_out.any():
        return None
    try:
        return _plan(corpus, ~held_out, config, world_size)
    except ValueError:
        return None


def _resume(resume_from: Path | None, model: DFlashDrafter, gate: SpikeGate, config: FitConfig,
            parallel_kind: str, world_size: int, device: torch.device):
    """(step, wrapped model, optimizer): wrap the drafter for `parallel_kind` and build AdamW,
    loading the checkpoint's weights, optimizer state, gate and step when resuming."""
    step, optimizer_state = 0, None
    if resume_from is not None:
        # Under FSDP2 the full checkpoint stays on the host: each tensor goes to the device
        # only to be sharded (a large drafter's full optimizer state need not fit beside it).
        model_state, optimizer_state, state = load_checkpoint(
            resume_from, "cpu" if parallel_kind == "fsdp" else device)
        model.load_state_dict(model_state)  # full weights, before any sharding
        del model_state
        gate.load_state_dict(state["gate"])
        step = int(state["step"])
        _same_cpu_threads(state, device)
    wrapped = parallel.wrap(model, parallel_kind, device, world_size)  # fsdp: shards model in place
    opt = config.optimizer
    # fused: one pass over each tensor per step instead of a dozen (torch's default on a CPU is
    # a loop of separate element-wise ops): on the demo's fit a step's optimizer time fell from
    # ~30 ms to a few (bench/RESULTS.md "train_step", 2026-12-05 22:37), most of it over a
    # head's table with a row per vocabulary token. The same update to within float rounding.
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay,
                                  betas=(opt.adam_beta1, opt.adam_beta2), fused=True)
    if optimizer_state is not None:
        parallel.load_optimizer(model, optimizer, optimizer_state, parallel_kind)
    return step, wrapped, optimizer


def _same_cpu_threads(state: dict, device: torch.device) -> None:
    """On a CPU, resume with the intra-op thread count the checkpoint was written with: a CPU
    matrix product sums in an order that depends on it, so a resume at another count (another
    machine, OMP_NUM_THREADS, a launcher's default) drifts from the uninterrupted run."""
    threads = state.get("cpu_threads")
    if device.type != "cpu" or threads is None or threads == torch.get_num_threads():
        return
    print(f"resuming with {threads} CPU threads, as the checkpoint was written (not {torch.get_num_threads()}), "
          f"so that the run stays bit for bit the uninterrupted one", flush=True)
    torch.set_num_threads(threads)


# -- one step ------------------------------------------------------------------------------


def _read(run: Run, feed: BatchFeed, plan: DataPlan, stream: int, step_in_stream: int) -> Sent:
    """Read this rank's batch of `plan`'s step `step_in_stream` of `stream` into `feed`'s next
    slot and start its copy to the device."""
    kind = drafters.of_config(run.drafter_config)
    labels = run.drafter_config.num_drafts + 1  # the block the labels are read for: the anchor and its drafts

    def read(staging):
        batch = read_batch(run.corpus, plan.segments(stream, step_in_stream, run.rank), stream=stream,
                           plan_anchors=run.config.data.anchors_per_seq, seed=run.config.data.seed,
                           block_size=labels, gamma=run.gamma, mask_token_id=run.drafter_config.mask_token_id,
                           staging=staging)
        return kind.training_batch(batch, run.drafter_config)

    return feed.read(read)


def _read_step(run: Run, step: int) -> Sent:
    """This rank's batch of global training step `step`, on its way to the device."""
    epoch_index, step_in_epoch = divmod(step, run.plan.steps_per_epoch)
    return _read(run, run.feed, run.plan, epoch_index, step_in_epoch)


def _receive(run: Run, feed: BatchFeed, sent: Sent):
    """(batch, layout) on the device, for the current stream: the layout's index tensors come
    with the batch (no host-to-device copy that would wait for the device's queue)."""
    batch = feed.receive(sent)
    B = run.config.block_rows
    context_lengths = [length for length, _ in batch.segments]
    num_blocks = [len(anchors) for _, anchors in batch.segments]
    layout = BlockLayout(
        block_size=B, context_lengths=context_lengths, num_blocks=num_blocks, anchors=batch.anchors,
        context_positions=batch.context_positions,
        block_positions=(batch.anchors[:, None] + torch.arange(B, device=batch.anchors.device)[None, :]).reshape(-1),
        context_offsets=np.concatenate([[0], np.cumsum(context_lengths)[:-1]]).astype(int).tolist(),
        block_offsets=np.concatenate([[0], np.cumsum(num_blocks)[:-1]]).astype(int).tolist())
    return batch, layout


def forward_loss(run: Run, batch, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed weighted loss, student argmax [N]): the drafter over all blocks of `batch` at
    once, then the loss of its labelled rows through the frozen LM head (training and eval)."""
    dtype = run.compute_dtype
    with torch.autocast(run.device.type, dtype=dtype, enabled=dtype != torch.float32):
        hidden = run.wrapped(run.head.embed(batch.block_ids), batch.context_features, layout)  # [Q, H]
    rows = hidden[batch.label_rows].to(run.head.lm_head.dtype)  # [N, H]
    return _loss(rows, run.head, batch, run.config.loss, run.model)


def _loss(rows: torch.Tensor, head: TargetHead, batch, config: LossConfig, model: DFlashDrafter):
    """(summed weighted loss, student argmax [N] in token ids) for the labelled rows [N, H],
    logits never formed: the kind's loss operands (train/drafters/), the teacher on the
    operands' head, the distillation loss, and the kind's own heads' loss."""
    kind = drafters.of(model)
    operands = kind.loss_operands(model, rows, head, batch)
    teacher = _teacher(batch, operands.head)
    loss, argmax = _distill(operands, teacher, config)
    extra = kind.extra_loss(model, operands, rows, teacher.ids, teacher.logprobs, teacher.top1, teacher.weights)
    return (loss if extra is None else loss + extra), argmax


@dataclass
class Teacher:
    """The target on a head's rows: top-k ids [N, k] (rows of the head), log-probs [N, k],
    top-1 [N] and the rows' weights [N]."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    top1: torch.Tensor
    weights: torch.Tensor


def _teacher(batch, head: TargetHead) -> Teacher:
    """The batch's teacher in `head`'s rows: a draft vocabulary's head scores the teacher
    remapped to its rows (a row whose teacher lies outside them weighs 0)."""
    if head.draft_ids is None:
        return Teacher(batch.topk_ids, batch.topk_logprobs, _top1(batch), batch.weights)
    ids, logprobs, top1, live = draft_vocab.remap_teacher(batch.topk_ids, batch.topk_logprobs, head)
    return Teacher(ids, logprobs, top1, torch.where(live, batch.weights, 0.0))


def _distill(operands: drafters.LossOperands, teacher: Teacher,
             config: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed weighted loss, argmax [N] in token ids): the fused sparse KL or TV (and CE) of
    the operands' logits against the teacher."""
    rows, weight, frozen = operands.rows, operands.head.lm_head, operands.frozen_columns
    ids, logprobs, top1, weights = teacher.ids, teacher.logprobs, teacher.top1, teacher.weights
    if config.loss == "ce":
        # k = 1 with log-prob 0 on the target's top-1: the tail bucket is empty, the row is CE.
        loss, argmax = sparse_kl_loss(rows, weight, top1[:, None], torch.zeros_like(logprobs[:, :1]), weights,
                                      tail="bucket", reduction="sum", return_argmax=True, weight_grad_from=frozen)
        return loss, operands.head.to_target(argmax)
    ce_weight = config.ce_weight if config.loss in ("kl+ce", "tv+ce") else 0.0
    if config.loss == "0.9tv+0.1ce":
        # 0.9 (tv + ce / 9): the 0.9 rides on the row weights, which the kernel applies in fp32
        # before any rounding (a scale of the returned loss would round a bf16 dX twice).
        weights, ce_weight = 0.9 * weights, 0.1 / 0.9
    loss, argmax = sparse_kl_loss(rows, weight, ids, logprobs, weights, tail="bucket",
                                  divergence="tv" if "tv" in config.loss else "kl", reduction="sum",
                                  ce_targets=top1 if ce_weight else None, ce_weight=ce_weight,
                                  return_argmax=True, weight_grad_from=frozen)
    return loss, operands.head.to_target(argmax)


def _top1(batch) -> torch.Tensor:
    """[N] the target's greedy token at each label row (its most likely cached candidate)."""
    return batch.topk_ids.gather(1, batch.topk_logprobs.argmax(1, keepdim=True))[:, 0]


def _step_figures(run: Run, batch, loss_sum: torch.Tensor, argmax: torch.Tensor,
                  weight_sum: torch.Tensor) -> tuple[float, list[float | None]]:
    """(global weighted mean loss, accuracy per drafting block position: the kind's first to B-1)
    of a step (collective)."""
    B = run.config.block_rows
    first = B - run.drafter_config.num_drafts  # the first block position that drafts
    hit = argmax == _top1(batch)  # [N] bool: greedy draft equals the target's top-1
    correct = torch.bincount(batch.label_positions, weights=hit.double(), minlength=B)
    counted = torch.bincount(batch.label_positions, minlength=B).double()
    figures = _all_reduce(torch.cat([loss_sum.detach().double()[None], correct, counted]), run.world_size)
    loss = float(figures[0] / weight_sum)
    accuracy = [float(c / n) if n > 0 else None
                for c, n in zip(figures[1 + first:B + 1].tolist(), figures[B + 1 + first:].tolist())]
    return loss, accuracy


def _log_step(run: Run, record: dict, always_print: bool) -> None:
    """metrics.jsonl (every step) and, every log_every steps, the console line."""
    run.step_times.append(record["step_time_s"])
    run.logger.step(record)
    if run.is_main and (run.step % run.config.logging.log_every == 0 or run.step == run.total_steps
                        or always_print):
        recent = sorted(run.step_times[-50:])[len(run.step_times[-50:]) // 2]
        print(console_line(record, epochs=run.planned_epochs, total_steps=run.total_steps,
                           eta_s=recent * (run.total_steps - run.step)), flush=True)


def _handle_spike(run: Run, epoch: int, step_in_epoch: int, loss: float, grad_norm: float, reason: str,
                  stopping: bool) -> None:
    """Log a skipped step to spikes.jsonl; raise SpikeStop when the gate says stop."""
    if run.is_main:
        _log_spike(run.run_dir, run.corpus, run.plan, epoch, step_in_epoch, run.step, loss, grad_norm,
                   run.gate, reason)
    if not stopping:
        return
    if run.writer is not None:
        run.writer.wait()
    where = latest_checkpoint(run.run_dir)
    raise SpikeStop(
        f"stopped at step {run.step}: {run.gate.consecutive_skips} steps in a row were skipped as "
        f"spikes (last: {reason}). The batches and their sequences are in "
        f"{run.run_dir / SPIKES_FILE} (open one with `dflash-shards show <cache> <sequence>`); the last "
        f"good checkpoint is {where or 'none (no checkpoint was written)'}. Fix or drop "
        f"those sequences, or raise --spike-factor / --max-consecutive-skips, then rerun "
        f"to resume from that checkpoint."
    )


def _log_spike(run_dir: Path, corpus: Corpus, plan: DataPlan, epoch: int, step_in_epoch: int,
               step: int, loss: float, grad_norm: float, gate: SpikeGate, reason: str) -> None:
    """One line in RUN/spikes.jsonl: the skipped step and the sequences of its global batch."""
    sources = [{**corpus.source(seg.sequence), "anchors": [seg.first, seg.count]}
               for seg in plan.step_segments(epoch, step_in_epoch)]
    line = {"step": step, "epoch_index": epoch + 1, "step_in_epoch": step_in_epoch + 1,
            "loss": _json_float(loss), "grad_norm": _json_float(grad_norm),
            "loss_mean": gate.loss_mean, "grad_norm_mean": gate.grad_norm_mean, "reason": reason,
            "consecutive_skips": gate.consecutive_skips, "sources": sources}
    with open(run_dir / SPIKES_FILE, "a") as f:
        f.write(json.dumps(line) + "\n")


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


# -- checkpoints and evaluation ------------------------------------------------------------


def _save_checkpoint(run: Run) -> None:
    """Hand a snapshot of the state after `run.step` steps to the background writer."""
    snapshot = _snapshot_checkpoint(run)
    if snapshot is not None:
        run.writer.start(snapshot)


def _snapshot_checkpoint(run: Run) -> Snapshot | None:
    """A snapshot of the state after `run.step` steps, for `run.writer.start` (None on
    the ranks that do not write; a collective under FSDP2)."""
    if run.writer is None and run.parallel_kind != "fsdp":
        return None
    model_state, optimizer_state = parallel.full_state(run.model, run.optimizer, run.parallel_kind)  # fsdp: collective
    if run.writer is None:
        return None
    epoch_index, step_in_epoch = divmod(run.step, run.plan.steps_per_epoch)
    return run.writer.snapshot(run.step, model_state, optimizer_state,
                               {"gate": run.gate.state_dict(), "epoch": epoch_index, "step_in_epoch": step_in_epoch,
                                "config": run.config.to_dict(), "cpu_threads": torch.get_num_threads()})


def _drain_checkpoints(run: Run, wait: bool = False) -> None:
    """Log the checkpoints the writer has finished (after waiting for all, when `wait`); a
    failed write raises here."""
    if run.writer is None:
        return
    if wait:
        run.writer.wait()
    else:
        run.writer.check()
    for event in run.writer.pop_finished():
        run.last_checkpoint = event.path
        run.logger.event("checkpoint", **dataclasses.asdict(event))


def _evaluate(run: Run) -> None:
    """Score the held-out stream and log it (collective)."""
    t_eval = time.perf_counter()
    result = evaluate_held_out(run)
    run.logger.event("eval", step=run.step, duration_s=time.perf_counter() - t_eval, **result)
    if run.is_main:
        print(f"held-out step {run.step}: loss {result['loss']:.3g} tau {result['tau']:.2f} "
              f"({result['blocks']} blocks)", flush=True)


@torch.no_grad()
def evaluate_held_out(run: Run) -> dict:
    """Held-out loss, per-position accuracy and teacher-forced acceptance length (collective).

    Scores the first `eval_tokens` block tokens of a fixed stream over the held-out
    sequences (`run.eval_plan`; anchors keyed by EVAL_STREAM, the same every time). A
    block's acceptance is the number of leading positions whose greedy draft equals the
    target's top-1, stopping at the first unlabelled position; tau = 1 + its mean (the bonus
    token counts 1). When the cache holds the target's own greedy continuations this is the
    online greedy acceptance for those anchors.
    """
    B, plan, device = run.config.block_rows, run.eval_plan, run.device
    first = B - run.drafter_config.num_drafts  # the first block position that drafts
    steps = min(plan.steps_per_epoch, math.ceil(run.config.eval.eval_tokens / run.config.data.tokens_per_step))
    was_training = run.wrapped.training
    run.wrapped.eval()
    # [loss sum, weight sum, blocks, accepted, correct per position (B), rows per position (B)]
    totals = torch.zeros(4 + 2 * B, dtype=torch.float64, device=device)
    for step in range(steps):
        sent = _read(run, run.eval_feed, plan, EVAL_STREAM, step)
        batch, layout = _receive(run, run.eval_feed, sent)
        loss_sum, argmax = forward_loss(run, batch, layout)
        hit = argmax == _top1(batch)  # [N] bool
        match = torch.zeros(layout.num_queries, dtype=torch.bool, device=device)  # [Q]
        match[batch.label_rows] = hit
        accepted = match.view(-1, B)[:, first:].long().cumprod(dim=1).sum(dim=1)  # [n_blocks]
        totals += torch.cat([
            torch.stack([loss_sum.double(), batch.weights.sum().double(),
                         torch.tensor(float(accepted.numel()), dtype=torch.float64, device=device),
                         accepted.double().sum()]),
            torch.bincount(batch.label_positions, weights=hit.double(), minlength=B),
            torch.bincount(batch.label_positions, minlength=B).double()])
        run.eval_feed.release(sent)
    run.wrapped.train(was_training)
    totals = _all_reduce(totals, plan.world_size).tolist()
    correct, counted = totals[4:4 + B], totals[4 + B:]
    return {
        "loss": totals[0] / max(totals[1], 1e-30),
        "tau": 1.0 + totals[3] / max(totals[2], 1.0),
        "accuracy": [c / n if n else None for c, n in zip(correct[first:], counted[first:])],
        "blocks": int(totals[2]),
    }


# -- distributed ---------------------------------------------------------------------------


def _init_distributed(device_name: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment (a single process without it)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    if device_name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    if device_name == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                device_id=device if device.type == "cuda" else None)
    return rank, world_size, device


def _compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _all_reduce(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
    return tensor


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()
