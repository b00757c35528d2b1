"""`dflash-regenerate`: the command line of server-side regeneration. Thin: options ->
RegenerateConfig -> run_regenerate -> the summary on stdout (progress goes to stderr)."""

from __future__ import annotations

import json

import click

from dflash.precompute.regenerate import RegenerateConfig, ServerGone, run_regenerate
from dflash.shards.commands import DflashCommand, version_option


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


@click.command(cls=DflashCommand, context_settings={"show_default": True})
@version_option
@click.option("--data", type=click.Path(path_type=str), multiple=True, required=True,
              help="JSONL (.jsonl.zst too), JSON, Parquet or datasets directory; repeat for several.")
@click.option("--out", type=click.Path(path_type=str), required=True,
              help="Output .jsonl or .jsonl.zst (rerun the same command to resume).")
@click.option("--server", "servers", multiple=True, required=True,
              help="OpenAI-compatible server URL, e.g. http://127.0.0.1:8000; repeat for several.")
@click.option("--model", default=None, help="Model name to request [the first one the server lists].")
@click.option("--max-new-tokens", type=int, default=512, help="Longest reply.")
@click.option("--temperature", type=float, default=0.0, help="0: greedy.")
@click.option("--top-p", type=float, default=1.0)
@click.option("--seed", type=int, default=0, help="Run seed (each request's seed derives from it).")
@click.option("--concurrency", type=int, default=8, help="Records in flight, over all servers.")
@click.option("--chat-template-kwargs", callback=parse_template_kwargs, default=None,
              help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'.")
@click.option("--chat-template", type=click.Path(path_type=str, dir_okay=False), default=None,
              help="Jinja template file, sent as the request's chat_template (vLLM).")
@click.option("--limit", type=int, default=None, help="Read at most this many records.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, help="Seconds per request.")
@click.option("--max-attempts", type=int, default=5, help="Tries per request while a server is unreachable.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def main(as_json: bool, **options) -> None:
    """Regenerate the assistant replies of chat data with OpenAI-compatible servers."""
    options["data"] = list(options["data"])
    options["servers"] = list(options["servers"])
    try:
        summary = run_regenerate(RegenerateConfig(**options))
    except ServerGone as error:
        raise click.ClickException(
            f"{error}. The records written so far are kept: restart the server(s) and rerun the "
            "same command to resume") from None
    click.echo(json.dumps(summary.to_dict()) if as_json else summary.format())


if __name__ == "__main__":
    main()
