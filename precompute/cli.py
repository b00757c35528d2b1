"""`dflash-precompute`: the command line of stage one. Thin: options -> PrecomputeConfig ->
run_precompute -> the summary on stdout (progress and log lines go to stderr)."""

from __future__ import annotations

import json
import os

import click

from dflash.precompute.regenerate_cli import parse_template_kwargs
from dflash.precompute.run import PrecomputeConfig, run_precompute
from dflash.shards.commands import DflashCommand, version_option

# Options that only --regenerate uses: given without it, they have no effect.
_REGENERATE_ONLY = ("max_new_tokens", "temperature", "seed")


def _layer_ids(ctx, param, value: str) -> list[int] | None:
    if value == "auto":
        return None
    try:
        return [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected 'auto' or comma-separated layer ids like 1,9,17, got {value!r}")


@click.command(cls=DflashCommand, context_settings={"show_default": True})
@version_option
@click.option("--target", type=click.Path(path_type=str), required=True,
              help="Hugging Face causal-LM directory.")
@click.option("--data", type=click.Path(path_type=str), multiple=True, required=True,
              help="JSONL, JSON, Parquet or datasets directory; repeat for several.")
@click.option("--out", type=click.Path(path_type=str), required=True, help="Cache directory to write.")
@click.option("--top-k", type=int, default=32, help="Next-token candidates cached per position.")
@click.option("--feature-layers", default="auto", callback=_layer_ids,
              help="'auto' (the DFlash rule) or comma-separated decoder-layer ids.")
@click.option("--num-feature-layers", type=int, default=5, help="Layers the DFlash rule picks.")
@click.option("--feature-codec", type=click.Choice(["bf16", "fp8", "basis-bf16", "basis-fp8"]), default="bf16",
              help="basis-*: r coefficients per token in a basis fitted on the run's first tokens.")
@click.option("--feature-rank", type=int, default=None,
              help="Basis codecs: coefficients per token (default: the target's hidden size).")
@click.option("--basis-sample-tokens", type=int, default=65536,
              help="Basis codecs: tokens of the first records the basis is fitted on.")
@click.option("--topk-codec", type=click.Choice(["packed", "raw"]), default="packed")
@click.option("--max-length", type=int, default=3072, help="Cut longer sequences to this many tokens.")
@click.option("--batch-tokens", type=int, default=16384, help="Padded tokens per forward batch.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
              help="auto: bfloat16 on GPU, float32 on CPU.")
@click.option("--limit", type=int, default=None, help="Read at most this many records.")
@click.option("--regenerate", is_flag=True, help="Replace the assistant replies by the target's own.")
@click.option("--chat-template-kwargs", callback=parse_template_kwargs, default=None,
              help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'.")
@click.option("--chat-template", type=click.Path(path_type=str, dir_okay=False), default=None,
              help="Jinja chat template file to use instead of the tokenizer's.")
@click.option("--max-new-tokens", type=int, default=512, help="Longest regenerated reply.")
@click.option("--temperature", type=float, default=0.0, help="Regeneration temperature (0: greedy).")
@click.option("--seed", type=int, default=0, help="Seed of sampled regeneration.")
@click.option("--nproc", type=int, default=1, help="Local worker processes (one per GPU).")
@click.option("--strict", is_flag=True, help="Make the first bad record an error.")
@click.option("--overwrite", is_flag=True, help="Replace an existing cache at --out.")
@click.option("--trust-remote-code", is_flag=True, help="Run the target repository's own code.")
@click.option("--shard-max-rows", type=int, default=1024, help="Sequences per shard.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def main(as_json: bool, **options) -> None:
    """Run the target over chat data and write the cache stage two trains from."""
    options["data"] = list(options["data"])
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one progress bar: ours
    if not options["regenerate"]:
        ctx = click.get_current_context()
        for name in _REGENERATE_ONLY:
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                click.echo(f"Warning: --{name.replace('_', '-')} has no effect without --regenerate", err=True)
    # ValueError (bad options or inputs) and OSError (a full or missing disk) are one-line
    # errors (DflashCommand).
    config = PrecomputeConfig(**options)
    summary = run_precompute(config)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank returns the summary
        click.echo(json.dumps(summary.to_dict()) if as_json else summary.format())
