"""Data parallelism for `dflash-train fit`: DDP, or FSDP2 when the drafter is large.

Under DDP every rank holds the whole drafter, its gradients and AdamW's two moments: 16
bytes per parameter in float32. A DFlash drafter for a Qwen3-8B target (5 layers, hidden
4096) has about 1B parameters, 16 GB per GPU, which DDP carries easily; one for a 70B target
(hidden 8192, intermediate 28672) has about 4.5B, 72 GB, which it does not. FSDP2
(`torch.distributed.fsdp.fully_shard`, one unit per decoder layer plus the root for `fc`,
the norms) shards parameters, gradients and optimizer state over the ranks and gathers each
layer's parameters only while it runs.

`--parallel auto` picks FSDP2 on CUDA when those 16 bytes per parameter would take more than
a quarter of one GPU's memory, DDP otherwise (and on CPU); `ddp` and `fsdp` force one.

Checkpoints are the same under both: full (unsharded) model weights and an optimizer state
in `torch.optim.Optimizer.state_dict()` form, written by rank 0. Under FSDP2 every rank
takes part in gathering them (`full_state`), and a checkpoint written under either mode (or
any world size) resumes under the other. The full weights are loaded before sharding, so a
rank briefly holds the whole drafter once at start-up.

Numerics: float32 parameters are gathered as they are (no FSDP mixed-precision policy), and
the compute dtype comes from the same autocast as under DDP. Gathering in bfloat16 would
halve the all-gather traffic at the cost of differing from DDP; not done.
"""

from __future__ import annotations

import torch
from torch import nn

BYTES_PER_PARAMETER = 16  # float32 weight + gradient + AdamW exp_avg + exp_avg_sq
FSDP_MEMORY_SHARE = 0.25  # auto: FSDP2 when the training state would exceed this share of a GPU


def choose(mode: str, num_parameters: int, world_size: int, device: torch.device) -> str:
    """"none" (one rank), "ddp" or "fsdp" for `--parallel mode` (RuntimeConfig.parallel's
    choices, checked there)."""
    if world_size == 1:
        return "none"
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "ddp"
    total = torch.cuda.get_device_properties(device).total_memory
    return "fsdp" if BYTES_PER_PARAMETER * num_parameters > FSDP_MEMORY_SHARE * total else "ddp"


def wrap(model: nn.Module, kind: str, device: torch.device, world_size: int) -> nn.Module:
    """The module the training loop calls. "fsdp" shards `model` in place (its parameters
    become DTensors; build the optimizer after this call) and returns it."""
    if kind == "none":
        return model
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, kind: str) -> tuple[dict, dict]:
    """(model state, optimizer state) as one unsharded module and optimizer would give them,
    on the CPU under FSDP2. A collective under FSDP2: every rank calls it; rank 0's copy is
    the one to save (the others get empty dicts)."""
    if kind != "fsdp":
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    if not optim:
        return weights, {}
    ids = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return weights, {
        "state": {ids[name]: value for name, value in optim["state"].items()},
        "param_groups": [{**group, "params": [ids[name] for name in group["params"]]}
                         for group in optim["param_groups"]],
    }


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, kind: str) -> None:
    """Load an optimizer state of `full_state`'s form into the (possibly sharded) optimizer.
    Every rank passes the same full state."""
    if kind != "fsdp":
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, _ in model.named_parameters()]
    by_name = {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                         for group in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, optim_state_dict=by_name,
                             options=StateDictOptions(full_state_dict=True))


__all__ = ["choose", "full_state", "load_optimizer", "wrap"]
