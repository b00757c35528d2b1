"""`dflash-shards`: look into a cache (info, show, stats) and check it (verify).

Each command is a thin wrapper over a function of dflash.shards.report (or
dflash.shards.verify_cache); `--json` prints that function's result as one JSON object.
"""

from __future__ import annotations

import json
import sys

import click

from dflash.shards import report
from dflash.shards.commands import DflashGroup, version_option
from dflash.shards.layout import REJECTED
from dflash.shards.reader import verify_cache

CACHE = click.argument("cache", type=click.Path(exists=True, file_okay=False))
AS_JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


def _run(function, *args, **kwargs):
    """Call `function`, turning an out-of-range row into a clean CLI error (ValueError and
    OSError are the group's: one line)."""
    try:
        return function(*args, **kwargs)
    except IndexError as error:
        raise click.ClickException(str(error)) from error


@click.group(cls=DflashGroup)
@version_option
def main() -> None:
    """Inspect and verify dflash target caches (see FORMAT.md in dflash.shards)."""


@main.command()
@CACHE
@AS_JSON
def info(cache: str, as_json: bool) -> None:
    """Summary of CACHE from its manifest: target, sizes, codecs, bytes per token."""
    summary = _run(report.cache_info, cache)
    click.echo(json.dumps(summary) if as_json else report.format_info(summary))


@main.command()
@CACHE
@click.argument("row", type=int)
@click.option("--positions", metavar="A:B", help="Positions to print (slice bounds), default all.")
@click.option("--top", default=5, show_default=True, help="Candidates printed per position.")
@AS_JSON
def show(cache: str, row: int, positions: str | None, top: int, as_json: bool) -> None:
    """Tokens of sequence ROW with the target's top-k, loss mask and tail mass."""
    shown = _run(report.show_row, cache, row, positions=positions, top=top)
    click.echo(json.dumps(shown) if as_json else report.format_show(shown))


@main.command()
@CACHE
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Also draw the statistics to this PNG.")
@click.option("--max-sequences", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Top-k statistics read this many evenly spaced sequences.")
@AS_JSON
def stats(cache: str, plot_path: str | None, max_sequences: int, as_json: bool) -> None:
    """Length histogram, top-k mass coverage, entropy, top-1 probability, bytes per token."""
    if plot_path:
        report.check_plot_path(plot_path)
    result = _run(report.cache_stats, cache, max_sequences=max_sequences)
    if plot_path:
        _run(report.plot_stats, result, plot_path)
    result.pop("_samples")
    click.echo(json.dumps(result) if as_json else report.format_stats(result))
    if plot_path and not as_json:
        click.echo(f"plot written to {plot_path}")


@main.command()
@CACHE
@AS_JSON
def verify(cache: str, as_json: bool) -> None:
    """Recompute checksums, check schemas, decode every row; exit status 1 on any problem."""
    result = verify_cache(cache)
    if result["ok"] and result["num_sequences"] == 0:  # nothing to train on is a problem, not "ok"
        result["ok"] = False
        result["problems"].append({"shard": None, "problem": (
            f"the cache holds no sequence (every record was rejected or cut away: see {REJECTED}); "
            "re-run dflash-precompute with other --data")})
    click.echo(json.dumps(result) if as_json else report.format_verify(result))
    sys.exit(0 if result["ok"] else 1)
