"""`dflash-precompute`: the command line of stage one. Thin: options -> PrecomputeConfig ->
run_precompute -> the summary on stdout (progress and log lines go to stderr).

The options are generated from PrecomputeConfig's fields (`dflash.common.options`): each
default and help text lives once, in the field's docstring."""

from __future__ import annotations

import json
import os

import click

from dflash.common.commands import DflashCommand, version_option
from dflash.common.options import config_options, given
from dflash.precompute.config import PrecomputeConfig
from dflash.precompute.run import run_precompute

# Options that only --regenerate uses: given without it, they have no effect.
_REGENERATE_ONLY = ("max_new_tokens", "temperature", "seed")


@click.command(cls=DflashCommand)
@version_option
@config_options(PrecomputeConfig, skip=("dist_timeout_s",))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def main(as_json: bool, **options) -> None:
    """Run the target over chat data and write the cache stage two trains from."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one progress bar: ours
    if not options["regenerate"]:
        ctx = click.get_current_context()
        for name in _REGENERATE_ONLY:
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                click.echo(f"Warning: --{name.replace('_', '-')} has no effect without --regenerate", err=True)
    # ValueError (bad options or inputs) and OSError (a full or missing disk) are one-line
    # errors (DflashCommand).
    config = PrecomputeConfig(**given(options))
    summary = run_precompute(config)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank returns the summary
        click.echo(json.dumps(summary.to_dict()) if as_json else summary.format())
