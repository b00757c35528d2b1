"""What every dflash command line shares: user errors as one line, `-h`, `--version`, `--debug`.

`DflashCommand` and `DflashGroup` are click classes (`@click.command(cls=DflashCommand)`,
`@click.group(cls=DflashGroup)`). A ValueError or OSError raised while a command runs is a
user error (bad options, inputs, files, a full disk): it is printed as one `Error: ...` line,
exit status 1. Anything else is a bug and keeps its traceback. `--debug` (on the command, or
on the group before the subcommand) or DFLASH_DEBUG=1 shows the traceback of a user error too.
Ctrl-C ends with "Aborted!" (click's), after whatever the command printed on its way out.

Lives in dflash.common because every package's command line imports it (precompute and train
never import each other); it needs only click.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import click

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}
DEBUG_ENV = "DFLASH_DEBUG"
USER_ERRORS = (ValueError, OSError)


def dflash_version() -> str:
    try:
        return version("dflash")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def debugging(ctx: click.Context | None = None) -> bool:
    """Whether user errors show their traceback (--debug anywhere on the command line, or DFLASH_DEBUG)."""
    if os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
        return True
    while ctx is not None:
        if ctx.meta.get("dflash.debug"):
            return True
        ctx = ctx.parent
    return False


def one_line(error: BaseException) -> str:
    """The error's message on one line (OSError without a message: its class and file name)."""
    text = str(error)
    if isinstance(error, OSError) and error.strerror and error.filename and str(error.filename) not in text:
        text = f"{error.filename}: {error.strerror}"
    if not text:
        text = type(error).__name__
    return " ".join(text.split())


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta["dflash.debug"] = True


class _UserErrors:
    """Mixin: the shared options, and ValueError/OSError turned into click's one-line Error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = kwargs.setdefault("context_settings", {})
        for key, value in CONTEXT_SETTINGS.items():
            settings.setdefault(key, value)
        super().__init__(*args, **kwargs)
        self.params.append(click.Option(
            ["--debug"], is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
            help=f"Show the traceback of an error (also: {DEBUG_ENV}=1)."))

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except USER_ERRORS as error:
            if debugging(ctx):
                raise
            raise click.ClickException(one_line(error)) from None


class DflashCommand(_UserErrors, click.Command):
    """A stand-alone command or a group's subcommand (see the module docstring)."""


class DflashGroup(_UserErrors, click.Group):
    """A command group; its subcommands are DflashCommands unless they say otherwise."""

    command_class = DflashCommand


def version_option(command: Any) -> Any:
    """`--version`: the installed dflash's version."""
    return click.version_option(dflash_version(), "--version", prog_name="dflash",
                                message="%(prog)s %(version)s")(command)


__all__ = ["CONTEXT_SETTINGS", "DEBUG_ENV", "DflashCommand", "DflashGroup", "USER_ERRORS", "debugging",
           "dflash_version", "one_line", "version_option"]
