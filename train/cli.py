"""`dflash-train`: the click group. `fit` is here; `eval` and `export` are defined beside
their code (train/evaluate.py, train/export.py) and added to the group at the end of this file.

Commands stay thin: build the config, call one plain function (which tests call directly).
`fit`'s options are generated from FitConfig's fields (train/config.py), `eval`'s from its
EvalConfig (train/evaluate.py), by dflash.common.options: one flag per field, its help the
field's docstring and default; only the flags given override the config file or defaults.
"""

from __future__ import annotations

import click

from dflash.common.commands import DflashGroup, version_option
from dflash.common.options import apply, flags, given
from dflash.train.config import FitConfig, resolve


@click.group(cls=DflashGroup)
@version_option
def main() -> None:
    """Train, evaluate and export a DFlash drafter from dflash caches.

    A user error (a bad flag, file or input) prints one `Error: ...` line; --debug (before
    the command) or DFLASH_DEBUG=1 shows its traceback.
    """


def _fit_options(command):
    """Decorate `command` with --cache, --out, --config, then one option per config field
    (none required: the config file may give --cache and --out)."""
    config_file = click.option(
        "--config", "config_file", type=click.Path(dir_okay=False, exists=True),
        help="TOML file with the same fields (top level, or in [section] tables); flags override it.")
    block_size = click.option(
        "--block-size", "block_size", type=int, default=None,
        help="Deprecated: use --num-drafts. The drafter's rows per block, as fit took them before; the "
             "--drafter kind converts them to its drafts per verify, and a warning says to what.")
    fields = flags(FitConfig, required=False)
    return apply([*fields[:2], config_file, *fields[2:], block_size], command)


@main.command()
@_fit_options
def fit(config_file, **options) -> None:
    """Train the drafter from one or more caches (resumes when RUN holds a checkpoint)."""
    from dflash.train.fit import SpikeStop, fit as run_fit

    # ValueError (config, inputs, a busy run folder) and OSError (a full disk, a file-size
    # limit) are one-line errors (DflashGroup); so is a stop on persistent spikes.
    config = resolve(config_file, given(options))
    try:
        result = run_fit(config)
    except SpikeStop as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"done: {result.step}/{result.total_steps} steps; checkpoint {result.checkpoint}")


# eval and export live with their code (train/evaluate.py, train/export.py).
from dflash.train.evaluate import eval_command  # noqa: E402
from dflash.train.export import export_command  # noqa: E402

main.add_command(eval_command)
main.add_command(export_command)
