"""`dflash-train fit`: the training loop, as one function that reads top to bottom.

Each step: run the drafter over all blocks of this rank's batch at once, take the sparse
KL (or CE) of the labelled block positions through the frozen LM head without forming
logits, backpropagate; then read the next step's batch (the plan's segments for that step,
a pure function of epoch and step, copied out of the memory-mapped shards) while the device
still works through this step's kernels; reduce the figures over ranks, let the spike gate
decide, step (or skip), log, and every `checkpoint_every` steps hand a host snapshot to the
background writer. There is nothing running beside the loop except that writer: the
read-ahead is one batch, done by the loop itself. `data_time_s` is the time a step spent
reading rows (the next step's; the first step also reads its own).

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
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.kernels import sparse_kl_loss
from dflash.shards import open_cache
from dflash.train import parallel
from dflash.train.checkpoint import CheckpointWriter, latest_checkpoint, load_checkpoint
from dflash.train.config import FitConfig, check_resume
from dflash.train.data import EVAL_STREAM, Corpus, DataPlan, decay_gamma, held_out_mask, read_batch
from dflash.train.gating import GatingConfig, SpikeGate
from dflash.train.logging import RunLogger, console_line
from dflash.train.model import BlockLayout, DFlashDrafter, DrafterConfig, TargetHead, count_parameters


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


def lr_at(step: int, total_steps: int, warmup_ratio: float, peak: float) -> float:
    """Linear warm-up over round(warmup_ratio * total) steps, then cosine decay to 0."""
    warmup = round(warmup_ratio * total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def fit(config: FitConfig) -> FitResult:
    rank, world_size, device = _init_distributed(config.device)
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
    run_dir = Path(config.out)
    is_main = rank == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    _barrier(world_size)

    # -- data ------------------------------------------------------------------------
    # Row checks on: every row's crc32 (zlib, about 7 GB/s) is verified as it is read, so a
    # flipped bit in the cache is an error naming the shard, never trained on. It costs a small
    # fraction of the data time, itself far under 1% of a step (bench/train_step.py).
    caches = [open_cache(path, check_rows=True) for path in config.cache]
    # The first start counts every sequence's anchors, split over the ranks; a resume reads the
    # index rank 0 stored then.
    corpus = Corpus(caches, index_dir=run_dir, rank=rank, world_size=world_size,
                    combine=lambda counts: _all_reduce(torch.from_numpy(counts).to(device), world_size).cpu().numpy(),
                    progress=is_main)
    spec = corpus.spec
    drafter_config = DrafterConfig.from_target(
        caches[0].target_dir, num_hidden_layers=config.num_layers, block_size=config.block_size,
        mask_token_id=config.mask_token_id)
    if drafter_config.target_layer_ids != spec.layer_ids or drafter_config.hidden_size != spec.hidden_size:
        raise ValueError(
            f"{caches[0].target_dir}/target.json (layers {drafter_config.target_layer_ids}, hidden "
            f"{drafter_config.hidden_size}) disagrees with the cache spec (layers {spec.layer_ids}, "
            f"hidden {spec.hidden_size}): the cache is inconsistent; rebuild it"
        )
    if spec.is_basis:  # fc reads the coefficients; export folds the basis back in
        drafter_config = dataclasses.replace(drafter_config, feature_width=spec.feature_width,
                                             feature_basis_sha256=caches[0].feature_basis_sha256)
    config = dataclasses.replace(config, mask_token_id=drafter_config.mask_token_id)
    gamma = config.decay_gamma or decay_gamma(config.block_size)
    held_out = held_out_mask(len(corpus), config.eval_fraction, config.seed)
    plan = DataPlan(num_eligible=corpus.num_eligible, held_out=held_out, block_size=config.block_size,
                    anchors_per_seq=config.anchors_per_seq, tokens_per_step=config.tokens_per_step,
                    seed=config.seed, world_size=world_size)
    total_steps = config.epochs * plan.steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    planned_epochs = math.ceil(total_steps / plan.steps_per_epoch)  # < epochs when max_steps cuts
    eval_plan = _held_out_plan(corpus, held_out, config, world_size) if config.eval_every else None

    saved_config = run_dir / "config.json"
    if saved_config.exists():
        check_resume(saved_config, config)
    if is_main:
        _write_json(saved_config, config.to_dict())
        _write_json(run_dir / "drafter_config.json", drafter_config.to_dict())

    # -- model, optimizer, gate, resume ----------------------------------------------------
    compute_dtype = _compute_dtype(config.dtype, device)
    torch.manual_seed(config.seed)
    model = DFlashDrafter(drafter_config, attention=config.attention).to(device)  # fp32 master weights
    num_parameters = count_parameters(model)
    head = TargetHead.load(caches[0].target_dir, device=device, dtype=compute_dtype)
    gate = SpikeGate(GatingConfig(factor=config.spike_factor, warmup_steps=config.spike_warmup_steps,
                                  max_consecutive_skips=config.max_consecutive_skips))
    step = 0
    resume_from = latest_checkpoint(run_dir)
    optimizer_state = None
    parallel_kind = parallel.choose(config.parallel, num_parameters, world_size, device)
    if resume_from is not None:
        # Under FSDP2 the full checkpoint stays on the host: each tensor goes to the device
        # only to be sharded (a large drafter's full optimizer state need not fit beside it).
        model_state, optimizer_state, state = load_checkpoint(
            resume_from, "cpu" if parallel_kind == "fsdp" else device)
        model.load_state_dict(model_state)  # full weights, before any sharding
        del model_state
        gate.load_state_dict(state["gate"])
        step = int(state["step"])
    wrapped = parallel.wrap(model, parallel_kind, device, world_size)  # fsdp: shards model in place
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(config.adam_beta1, config.adam_beta2))
    if optimizer_state is not None:
        parallel.load_optimizer(model, optimizer, optimizer_state, parallel_kind)
        del optimizer_state

    writer = CheckpointWriter(run_dir, config.keep_checkpoints) if is_main else None
    # A fresh start (step 0) drops the step lines of an earlier attempt that saved no checkpoint.
    logger = RunLogger(run_dir, enabled=is_main, resume_step=step,
                       wandb_config={**config.to_dict(), "drafter": drafter_config.to_dict()}
                       if config.wandb else None, wandb_project=config.wandb_project)
    logger.event("resume" if resume_from else "start", step=step,
                 checkpoint=str(resume_from) if resume_from else None,
                 total_steps=total_steps, steps_per_epoch=plan.steps_per_epoch,
                 num_sequences=len(corpus), num_train_sequences=int(plan.train_sequences.shape[0]),
                 num_held_out=int(held_out.sum()), parameters=num_parameters, parallel=parallel_kind,
                 held_out_blocks=eval_plan.blocks_per_epoch if eval_plan else 0,
                 world_size=world_size, device=str(device), dtype=str(compute_dtype), gamma=gamma,
                 mask_token_id=drafter_config.mask_token_id)
    last_checkpoint = str(resume_from) if resume_from else None
    step_times: list[float] = []
    B = config.block_size

    def save_checkpoint() -> None:
        if writer is None and parallel_kind != "fsdp":
            return
        model_state, optimizer_state = parallel.full_state(model, optimizer, parallel_kind)  # fsdp: collective
        if writer is None:
            return
        epoch_index, step_in_epoch = divmod(step, plan.steps_per_epoch)
        writer.save(step, model_state, optimizer_state,
                    {"gate": gate.state_dict(), "epoch": epoch_index, "step_in_epoch": step_in_epoch,
                     "config": config.to_dict()})

    def load(at_step: int):
        """This rank's batch and layout of global step `at_step`, on the device."""
        epoch_index, step_in_epoch = divmod(at_step, plan.steps_per_epoch)
        batch = read_batch(corpus, plan.segments(epoch_index, step_in_epoch, rank), stream=epoch_index,
                           plan_anchors=config.anchors_per_seq, seed=config.seed, block_size=B,
                           gamma=gamma, mask_token_id=drafter_config.mask_token_id,
                           pin=device.type == "cuda").to(device)
        return batch, BlockLayout.build(batch.segments, B, device=device)

    # -- the loop ----------------------------------------------------------------------
    pending = None  # the next step's (batch, layout), read while the device computes
    if config.save_initial and step == 0:
        save_checkpoint()
    try:
        while step < total_steps:
            t_start = time.perf_counter()
            epoch, step_in_epoch = divmod(step, plan.steps_per_epoch)
            if pending is None:
                pending = load(step)
            batch, layout = pending
            data_time_s = time.perf_counter() - t_start
            start, stop = plan.step_blocks(step_in_epoch)
            tokens = (stop - start) * B  # global block tokens of this step

            lr = lr_at(step, total_steps, config.warmup_ratio, config.lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Global label weight first, so every rank scales its summed loss the same way.
            weight_sum = _all_reduce(batch.weights.sum().double(), world_size)
            with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
                hidden = wrapped(head.embed(batch.block_ids), batch.context_features, layout)  # [Q, H]
            rows = hidden[batch.label_rows].to(head.lm_head.dtype)  # [N, H]
            loss_sum, argmax = _loss(rows, head.lm_head, batch, config)
            (loss_sum * (world_size / weight_sum).float()).backward()
            # Read the next step's rows now: CUDA kernels run asynchronously, so the read
            # overlaps this step's compute until the first value is needed below (on CPU it is
            # the same read, only earlier). Still no thread and no queue: one batch ahead.
            t_read = time.perf_counter()
            pending = load(step + 1) if step + 1 < total_steps else None
            data_time_s += time.perf_counter() - t_read
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip))

            hit = argmax == _top1(batch)  # [N] bool: greedy draft equals the target's top-1
            correct = torch.bincount(batch.label_positions, weights=hit.double(), minlength=B)
            counted = torch.bincount(batch.label_positions, minlength=B).double()
            figures = _all_reduce(torch.cat([loss_sum.detach().double()[None], correct, counted]), world_size)
            loss = float(figures[0] / weight_sum)
            accuracy = [float(c / n) if n > 0 else None
                        for c, n in zip(figures[2:B + 1].tolist(), figures[B + 2:].tolist())]

            reason = gate.reason_to_skip(loss, grad_norm)
            if reason is None:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            gate.record(loss, grad_norm, skipped=reason is not None)
            step += 1
            stopping = reason is not None and gate.should_stop
            if not stopping and (step % config.checkpoint_every == 0 or step == total_steps):
                save_checkpoint()  # the host snapshot is part of this step's time; the write is not

            step_time_s = time.perf_counter() - t_start
            step_times.append(step_time_s)
            record = {
                "step": step, "epoch": step / plan.steps_per_epoch, "epoch_index": epoch + 1,
                "epoch_fraction": (step_in_epoch + 1) / plan.steps_per_epoch, "loss": loss,
                "accuracy": accuracy, "grad_norm": grad_norm, "lr": lr, "skipped": reason is not None,
                "tokens": tokens, "tokens_per_s": tokens / step_time_s, "data_time_s": data_time_s,
                "step_time_s": step_time_s,
            }
            logger.step(record)
            if is_main and (step % config.log_every == 0 or step == total_steps or reason):
                recent = sorted(step_times[-50:])[len(step_times[-50:]) // 2]
                print(console_line(record, epochs=planned_epochs, total_steps=total_steps,
                                   eta_s=recent * (total_steps - step)), flush=True)

            if reason is not None:
                if is_main:
                    _log_spike(run_dir, corpus, plan, epoch, step_in_epoch, step, loss, grad_norm, gate, reason)
                if stopping:
                    if writer is not None:
                        writer.wait()
                    where = latest_checkpoint(run_dir)
                    raise SpikeStop(
                        f"stopped at step {step}: {gate.consecutive_skips} steps in a row were skipped as "
                        f"spikes (last: {reason}). The batches and their sequences are in "
                        f"{run_dir / 'spikes.jsonl'} (open one with `dflash-shards show <cache> <sequence>`); the last "
                        f"good checkpoint is {where or 'none (no checkpoint was written)'}. Fix or drop "
                        f"those sequences, or raise --spike-factor / --max-consecutive-skips, then rerun "
                        f"to resume from that checkpoint."
                    )

            if config.eval_every and (step % config.eval_every == 0 or step == total_steps) \
                    and eval_plan is not None:
                t_eval = time.perf_counter()
                result = evaluate_held_out(wrapped, head, corpus, eval_plan, config, drafter_config, gamma,
                                           rank, device, compute_dtype)
                logger.event("eval", step=step, duration_s=time.perf_counter() - t_eval, **result)
                if is_main:
                    print(f"held-out step {step}: loss {result['loss']:.3g} tau {result['tau']:.2f} "
                          f"({result['blocks']} blocks)", flush=True)
            if writer is not None:
                writer.check()
                for event in writer.pop_finished():
                    last_checkpoint = event.path
                    logger.event("checkpoint", **dataclasses.asdict(event))
        if writer is not None:
            writer.wait()
            for event in writer.pop_finished():
                last_checkpoint = event.path
                logger.event("checkpoint", **dataclasses.asdict(event))
        logger.event("done", step=step)
    finally:
        logger.close()
    if world_size > 1:
        # Non-zero ranks learn where the last checkpoint is from the run folder.
        _barrier(world_size)
        last = latest_checkpoint(run_dir)
        last_checkpoint = str(last) if last else None
    return FitResult(step=step, checkpoint=last_checkpoint, total_steps=total_steps)


def _loss(rows: torch.Tensor, head_weight: torch.Tensor, batch, config: FitConfig):
    """(summed weighted loss, student argmax [N]) for the labelled rows, logits never formed."""
    top1 = _top1(batch)[:, None]  # [N, 1]
    if config.loss == "ce":
        # k = 1 with log-prob 0 on the target's top-1: the tail bucket is empty, the row is CE.
        return sparse_kl_loss(rows, head_weight, top1, torch.zeros_like(batch.topk_logprobs[:, :1]),
                              batch.weights, tail="bucket", reduction="sum", return_argmax=True)
    ce_weight = config.ce_weight if config.loss == "kl+ce" else 0.0
    return sparse_kl_loss(rows, head_weight, batch.topk_ids, batch.topk_logprobs, batch.weights,
                          tail="bucket", reduction="sum", ce_targets=top1[:, 0] if ce_weight else None,
                          ce_weight=ce_weight, return_argmax=True)


def _held_out_plan(corpus: Corpus, held_out, config: FitConfig, world_size: int) -> DataPlan | None:
    """The plan over the held-out sequences (None when they hold less than a block per rank)."""
    if not held_out.any():
        return None
    try:
        return DataPlan(num_eligible=corpus.num_eligible, held_out=~held_out, block_size=config.block_size,
                        anchors_per_seq=config.anchors_per_seq, tokens_per_step=config.tokens_per_step,
                        seed=config.seed, world_size=world_size)
    except ValueError:
        return None


@torch.no_grad()
def evaluate_held_out(model, head, corpus: Corpus, plan: DataPlan, config: FitConfig,
                      drafter_config: DrafterConfig, gamma: float, rank: int, device: torch.device,
                      compute_dtype: torch.dtype) -> dict:
    """Held-out loss, per-position accuracy and teacher-forced acceptance length (collective).

    Scores the first `eval_tokens` block tokens of a fixed stream over the held-out
    sequences (`plan` over them; anchors keyed by EVAL_STREAM, the same every time). A
    block's acceptance is the number of leading positions whose greedy draft equals the
    target's top-1, stopping at the first unlabelled position; tau = 1 + its mean (the bonus
    token counts 1). When the cache holds the target's own greedy continuations this is the
    online greedy acceptance for those anchors.
    """
    B = config.block_size
    world_size = plan.world_size
    steps = min(plan.steps_per_epoch, math.ceil(config.eval_tokens / config.tokens_per_step))
    was_training = model.training
    model.eval()
    # [loss sum, weight sum, blocks, accepted, correct per position (B), rows per position (B)]
    totals = torch.zeros(4 + 2 * B, dtype=torch.float64, device=device)
    for step in range(steps):
        batch = read_batch(corpus, plan.segments(EVAL_STREAM, step, rank), stream=EVAL_STREAM,
                           plan_anchors=config.anchors_per_seq, seed=config.seed, block_size=B,
                           gamma=gamma, mask_token_id=drafter_config.mask_token_id).to(device)
        layout = BlockLayout.build(batch.segments, B, device=device)
        with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            hidden = model(head.embed(batch.block_ids), batch.context_features, layout)  # [Q, H]
        rows = hidden[batch.label_rows].to(head.lm_head.dtype)  # [N, H]
        loss_sum, argmax = _loss(rows, head.lm_head, batch, config)
        hit = argmax == _top1(batch)  # [N] bool
        match = torch.zeros(layout.num_queries, dtype=torch.bool, device=device)  # [Q]
        match[batch.label_rows] = hit
        accepted = match.view(-1, B)[:, 1:].long().cumprod(dim=1).sum(dim=1)  # [n_blocks]
        totals += torch.cat([
            torch.stack([loss_sum.double(), batch.weights.sum().double(),
                         torch.tensor(float(accepted.numel()), dtype=torch.float64, device=device),
                         accepted.double().sum()]),
            torch.bincount(batch.label_positions, weights=hit.double(), minlength=B),
            torch.bincount(batch.label_positions, minlength=B).double()])
    model.train(was_training)
    totals = _all_reduce(totals, world_size).tolist()
    correct, counted = totals[4:4 + B], totals[4 + B:]
    return {
        "loss": totals[0] / max(totals[1], 1e-30),
        "tau": 1.0 + totals[3] / max(totals[2], 1.0),
        "accuracy": [c / n if n else None for c, n in zip(correct[1:], counted[1:])],
        "blocks": int(totals[2]),
    }


def _top1(batch) -> torch.Tensor:
    """[N] the target's greedy token at each label row (its most likely cached candidate)."""
    return batch.topk_ids.gather(1, batch.topk_logprobs.argmax(1, keepdim=True))[:, 0]


def _log_spike(run_dir: Path, corpus: Corpus, plan: DataPlan, epoch: int, step_in_epoch: int,
               step: int, loss: float, grad_norm: float, gate: SpikeGate, reason: str) -> None:
    """One line in RUN/spikes.jsonl: the skipped step and the sequences of its global batch."""
    sources = [{**corpus.source(seg.sequence), "anchors": [seg.first, seg.count]}
               for seg in plan.step_segments(epoch, step_in_epoch)]
    line = {"step": step, "epoch_index": epoch + 1, "step_in_epoch": step_in_epoch + 1,
            "loss": _json_float(loss), "grad_norm": _json_float(grad_norm),
            "loss_mean": gate.loss_mean, "grad_norm_mean": gate.grad_norm_mean, "reason": reason,
            "consecutive_skips": gate.consecutive_skips, "sources": sources}
    with open(run_dir / "spikes.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


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


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
