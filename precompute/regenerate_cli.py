"""`dflash-regenerate`: the command line of server-side regeneration. Thin: options ->
RegenerateConfig -> run_regenerate -> the summary on stdout (progress goes to stderr).

The options are generated from RegenerateConfig's fields (`dflash.shards.options`): each
default and help text lives once, in the field's docstring."""

from __future__ import annotations

import json

import click

from dflash.precompute.regenerate import RegenerateConfig, ServerGone, run_regenerate
from dflash.shards.commands import DflashCommand, version_option
from dflash.shards.options import config_options, describe, given, help_text, option


def parse_template_kwargs(ctx, param, value: str | None) -> dict:
    """--chat-template-kwargs: a JSON object, e.g. '{"enable_thinking": false}'."""
    if value is None:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise click.BadParameter(f"not JSON ({error.msg}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(f"must be a JSON object like '{{\"enable_thinking\": false}}', got {value!r}")
    return parsed


_FIELDS = {info.name: info for info in describe(RegenerateConfig)}
_PATH = click.Path(path_type=str)
_OVERRIDES = {
    "data": {"type": _PATH, "required": True},
    "out": {"type": _PATH, "required": True},
    "chat_template_kwargs": {"type": str, "callback": parse_template_kwargs, "metavar": "JSON"},
    "chat_template": {"type": click.Path(path_type=str, dir_okay=False)},
}


@click.command(cls=DflashCommand, context_settings={"show_default": True})
@version_option
@config_options(RegenerateConfig, skip=("servers", "timeout_s", "backoff_s", "progress"), overrides=_OVERRIDES)
# Two fields whose flags are not their names: --server (repeated), --timeout.
@click.option("--server", "servers", multiple=True, required=True, help=help_text(_FIELDS["servers"]))
@click.option("--timeout", "timeout_s", type=float, default=None, help=help_text(_FIELDS["timeout_s"]))
@option(_FIELDS["progress"])
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
