"""`dflash-regenerate`: the command line of server-side regeneration. Thin: options ->
RegenerateConfig -> run_regenerate -> the summary on stdout (progress goes to stderr).

The options are generated from RegenerateConfig's fields (`dflash.common.options`): each
default and help text lives once, in the field's docstring."""

from __future__ import annotations

import json

import click

from dflash.common.commands import DflashCommand, version_option
from dflash.common.options import config_options, given
from dflash.precompute.regenerate import RegenerateConfig, ServerGone, run_regenerate


@click.command(cls=DflashCommand)
@version_option
@config_options(RegenerateConfig, skip=("backoff_s",))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def main(as_json: bool, **options) -> None:
    """Regenerate the assistant replies of chat data with OpenAI-compatible servers."""
    try:
        summary = run_regenerate(RegenerateConfig(**given(options)))
    except ServerGone as error:
        raise click.ClickException(
            f"{error}. The records written so far are kept: restart the server(s) and rerun the "
            "same command to resume") from None
    click.echo(json.dumps(summary.to_dict()) if as_json else summary.format())


if __name__ == "__main__":
    main()
