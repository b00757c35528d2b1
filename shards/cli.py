"""`dflash-shards`: look into a cache (info, show, stats) and check it (verify).

Each command is a thin wrapper over a function of dflash.shards.report (or
dflash.shards.verify_cache); `--json` prints that function's result as one JSON object. Each
command's arguments and options are generated from its config dataclass below
(`dflash.common.options`), as every dflash command's are.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from dflash.common.commands import DflashGroup, version_option
from dflash.common.options import ARGUMENT, EXISTS, METAVAR, PATH, config_options, given
from dflash.shards import report
from dflash.shards.layout import REJECTED
from dflash.shards.reader import verify_cache


@dataclass(kw_only=True)
class CacheConfig:
    """`dflash-shards info` and `verify`: the cache."""

    cache: Path = field(metadata={ARGUMENT: True, PATH: "dir", EXISTS: True})
    """A cache folder written by dflash-precompute."""


@dataclass(kw_only=True)
class ShowConfig(CacheConfig):
    """`dflash-shards show`: one sequence of the cache."""

    row: int = field(metadata={ARGUMENT: True})
    """The sequence's index in the cache."""
    positions: str | None = field(default=None, metadata={METAVAR: "A:B"})
    """Positions to print (slice bounds), default all."""
    top: int = 5
    """Candidates printed per position."""


@dataclass(kw_only=True)
class StatsConfig(CacheConfig):
    """`dflash-shards stats`: statistics over the cache."""

    plot: Path | None = field(default=None, metadata={PATH: "file"})
    """Also draw the statistics to this PNG."""
    max_sequences: int = 1000
    """Top-k statistics read this many evenly spaced sequences."""

    def __post_init__(self) -> None:
        if self.max_sequences < 1:
            raise ValueError(f"--max-sequences must be >= 1, got {self.max_sequences}")


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
@config_options(CacheConfig)
@AS_JSON
def info(as_json: bool, **options: Any) -> None:
    """Summary of CACHE from its manifest: target, sizes, codecs, bytes per token."""
    summary = _run(report.cache_info, CacheConfig(**given(options)).cache)
    click.echo(json.dumps(summary) if as_json else report.format_info(summary))


@main.command()
@config_options(ShowConfig)
@AS_JSON
def show(as_json: bool, **options: Any) -> None:
    """Tokens of sequence ROW with the target's top-k, loss mask and tail mass."""
    config = ShowConfig(**given(options))
    shown = _run(report.show_row, config.cache, config.row, positions=config.positions, top=config.top)
    click.echo(json.dumps(shown) if as_json else report.format_show(shown))


@main.command()
@config_options(StatsConfig)
@AS_JSON
def stats(as_json: bool, **options: Any) -> None:
    """Length histogram, top-k mass coverage, entropy, top-1 probability, bytes per token."""
    config = StatsConfig(**given(options))
    if config.plot:
        report.check_plot_path(config.plot)
    result = _run(report.cache_stats, config.cache, max_sequences=config.max_sequences)
    if config.plot:
        _run(report.plot_stats, result, config.plot)
    result.pop("_samples")
    click.echo(json.dumps(result) if as_json else report.format_stats(result))
    if config.plot and not as_json:
        click.echo(f"plot written to {config.plot}")


@main.command()
@config_options(CacheConfig)
@AS_JSON
def verify(as_json: bool, **options: Any) -> None:
    """Recompute checksums, check schemas, decode every row; exit status 1 on any problem."""
    result = verify_cache(CacheConfig(**given(options)).cache)
    if result["ok"] and result["num_sequences"] == 0:  # nothing to train on is a problem, not "ok"
        result["ok"] = False
        result["problems"].append({"shard": None, "problem": (
            f"the cache holds no sequence (every record was rejected or cut away: see {REJECTED}); "
            "re-run dflash-precompute with other --data")})
    click.echo(json.dumps(result) if as_json else report.format_verify(result))
    sys.exit(0 if result["ok"] else 1)
