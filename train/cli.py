"""`dflash-train`: the click group. `fit` is here; `eval` and `export` register themselves
from train/evaluate.py and train/export.py through `main.command()` / `main.add_command`.

Commands stay thin: build the config, call one plain function (which tests call directly).
"""

from __future__ import annotations

import click

from dflash.train.config import resolve


@click.group()
def main() -> None:
    """Train, evaluate and export a DFlash drafter from dflash caches."""


@main.command()
@click.option("--cache", "cache", multiple=True, type=click.Path(file_okay=False),
              help="Cache folder (repeat for several; sequences are concatenated in order).")
@click.option("--out", type=click.Path(file_okay=False), help="Run folder; rerunning with it resumes.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True),
              help="TOML file with the same fields; flags override it.")
@click.option("--num-layers", type=int, help="Drafter decoder layers [5].")
@click.option("--block-size", type=int, help="Block size: anchor + predictions [16].")
@click.option("--anchors-per-seq", type=int, help="Blocks per sequence per epoch [512].")
@click.option("--epochs", type=int, help="Epochs [6].")
@click.option("--max-steps", type=int, help="Stop after this many steps (the schedule spans them).")
@click.option("--tokens-per-step", type=int, help="Block tokens per step over all ranks [131072].")
@click.option("--lr", type=float, help="Peak learning rate [6e-4].")
@click.option("--warmup-ratio", type=float, help="Warm-up fraction of the steps [0.04].")
@click.option("--grad-clip", type=float, help="Gradient norm clip [1.0].")
@click.option("--loss", type=click.Choice(["kl", "ce", "kl+ce"]), help="Loss [kl].")
@click.option("--decay-gamma", help="Position-weight decay gamma, or 'auto' [auto].")
@click.option("--seed", type=int, help="Seed [0].")
@click.option("--spike-factor", type=float, help="Skip steps above this x running mean [3.0].")
@click.option("--spike-warmup-steps", type=int, help="Accepted steps before gating applies [50].")
@click.option("--max-consecutive-skips", type=int, help="Stop after this many skips in a row [20].")
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints [1000].")
@click.option("--keep-checkpoints", type=int, help="Checkpoints kept [3].")
@click.option("--eval-every", type=int, help="Steps between held-out evaluations, 0 = never [1000].")
@click.option("--eval-fraction", type=float, help="Fraction of sequences held out [0.01].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="Device [auto].")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), help="Compute dtype [auto].")
@click.option("--parallel", type=click.Choice(["auto", "ddp", "fsdp"]),
              help="Several ranks: DDP, or FSDP2 (shards weights, gradients, optimizer state); auto picks "
                   "FSDP2 on CUDA when the drafter's training state exceeds a quarter of a GPU [auto].")
@click.option("--save-initial", is_flag=True, default=None,
              help="Also checkpoint the untrained drafter as step 0 (a baseline for eval).")
@click.option("--wandb/--no-wandb", default=None, help="Log to Weights & Biases (offline unless configured) [on].")
def fit(config_file, decay_gamma, **options) -> None:
    """Train the drafter from one or more caches (resumes when RUN holds a checkpoint)."""
    from dflash.train.fit import SpikeStop, fit as run_fit

    options["cache"] = list(options["cache"]) or None
    if decay_gamma is not None:
        try:
            options["decay_gamma"] = "auto" if decay_gamma == "auto" else float(decay_gamma)
        except ValueError:
            raise click.BadParameter(f"{decay_gamma!r} is neither 'auto' nor a number",
                                     param_hint="--decay-gamma") from None
    try:
        config = resolve(config_file, options)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    try:
        result = run_fit(config)
    except (SpikeStop, OSError) as error:
        # A full disk or a file-size limit (an OSError naming the file and the cause) is one
        # line, not a traceback.
        raise click.ClickException(str(error)) from None
    click.echo(f"done: {result.step}/{result.total_steps} steps; checkpoint {result.checkpoint}")


# eval and export live with their code (train/evaluate.py, train/export.py).
from dflash.train.evaluate import eval_command  # noqa: E402
from dflash.train.export import export_command  # noqa: E402

main.add_command(eval_command)
main.add_command(export_command)
