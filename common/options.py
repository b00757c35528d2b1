"""Command-line options generated from config dataclasses: the one builder of every dflash command.

Each config field's default and one-line docstring exist once, in its dataclass; the flag
(`--name-with-dashes`), its type and its help (`docstring [default]`) are derived here from
the field's type and its metadata:

- `Literal[...]` is a choice (click.Choice); `check_choices`, which every config calls in
  `__post_init__`, refuses a bad one built from Python with the same list; a field whose
  metadata holds `CHOICES` (a function returning them, read when used: a registry's names)
  is a choice likewise;
- `bool` is a switch, `--x/--no-x` (`ONLY_ON`: a plain `--x`);
- `Path` (or a field with `PATH` metadata: "dir", "file" or "any") is a click.Path;
- `list[X]` is a repeatable flag (`SEPARATOR`: one flag, items separated by it);
- `dict` is a JSON object;
- a field whose metadata holds `NONE_WORD` also accepts that word for None;
- a field without a default is a required flag (`ARGUMENT`: a positional argument).

Generated options default to None, meaning "not given": the command keeps only the given
ones (`given`), so the dataclass default applies, and `fit` can layer its TOML file under
the flags. Which fields may change when a run resumes is field metadata too (`RESUMABLE`,
read by `resumable`), for both stages.

Docstrings are read from the class's source with `ast` (`field_docs`), so this works
wherever the .py file is installed; a bytecode-only install gets empty help texts.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import click

# Field metadata keys (`field(default=..., metadata={PATH: "dir", RESUMABLE: True})`).
NONE_WORD = "none_word"
"""This word (flag or TOML) stands for None."""
RESUMABLE = "resumable"
"""True: the field may change between a run and its resumption (bookkeeping, not contents)."""
PATH = "path"
"""The value names a folder ("dir"), a file ("file") or either ("any"; the default of a Path field)."""
EXISTS = "exists"
"""True: the path must exist."""
FLAG = "flag"
"""The flag, when it is not the field's name with dashes (`--server` for `servers`)."""
ONLY_ON = "only_on"
"""True: a bool switched on by a plain `--x`, without `--no-x`."""
ARGUMENT = "argument"
"""True: a positional argument, not an option."""
SEPARATOR = "separator"
"""A list field given as one flag, its items separated by this (`--feature-layers 1,9,17`)."""
METAVAR = "metavar"
"""The value's placeholder in --help (`A:B`)."""
CHOICES = "choices"
"""A function returning the field's choices, called each time they are read (a registry's names)."""


@dataclass(frozen=True)
class FieldInfo:
    """One leaf field as the command line shows it."""

    name: str
    type: Any
    """The resolved annotation (`int`, `float | None`, `Literal[...]`, `list[str]`, ...)."""
    default: Any
    """The default value (dataclasses.MISSING when the field is required)."""
    doc: str
    """The field's docstring on one line ('' when the source cannot be read)."""
    none_word: str | None
    """The word that stands for None (flag or TOML), if any."""
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The field's metadata (the keys above)."""

    @property
    def flag(self) -> str:
        """The flag, e.g. `--max-length`."""
        return self.metadata.get(FLAG) or "--" + self.name.replace("_", "-")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring on one line}: the string literal under each annotated field, in
    `cls` and the dataclasses it derives from."""
    docs: dict[str, str] = {}
    for owner in reversed(cls.__mro__[:-1]):
        try:
            source = textwrap.dedent(inspect.getsource(owner))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_info(cls: type, spec: dataclasses.Field) -> FieldInfo:
    """The FieldInfo of one field `spec` of dataclass `cls`."""
    default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    return FieldInfo(name=spec.name, type=typing.get_type_hints(cls)[spec.name], default=default,
                     doc=field_docs(cls).get(spec.name, ""), none_word=spec.metadata.get(NONE_WORD),
                     metadata=spec.metadata)


def describe(cls: type, *, skip: Iterable[str] = ()) -> list[FieldInfo]:
    """Every init field of dataclass `cls` in declaration order, less `skip`; a field whose
    type is a dataclass (a component, as FitConfig's) gives its own fields in its place."""
    skipped, hints = set(skip), typing.get_type_hints(cls)
    infos: list[FieldInfo] = []
    for spec in dataclasses.fields(cls):
        if not spec.init or spec.name in skipped:
            continue
        if dataclasses.is_dataclass(hints[spec.name]):
            infos.extend(describe(hints[spec.name], skip=skipped))
        else:
            infos.append(field_info(cls, spec))
    return infos


def resumable(cls: type) -> frozenset[str]:
    """The fields of `cls` (components' included) that may change when a run resumes."""
    return frozenset(info.name for info in describe(cls) if info.metadata.get(RESUMABLE))


def _base(kind: Any) -> Any:
    """`X | None` -> X."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


def choices(info: FieldInfo) -> tuple[str, ...] | None:
    """The choices of a `Literal[...]` field (or `Literal[...] | None`), or of a field with
    `CHOICES` metadata, else None."""
    if info.metadata.get(CHOICES) is not None:
        return tuple(info.metadata[CHOICES]())
    kind = _base(info.type)
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def check_choices(config: Any) -> None:
    """ValueError when a `Literal[...]` field of `config` (its own, not its components') holds
    none of its choices: the one check of every choice built from Python (click's Choice,
    generated from the same Literal, refuses a bad flag first)."""
    for info in _literal_fields(type(config)):
        value = getattr(config, info.name)
        if value is not None and value not in choices(info):
            raise ValueError(f"{info.flag} must be one of {', '.join(choices(info))}, got {value!r}")


@functools.cache
def _literal_fields(cls: type) -> tuple[FieldInfo, ...]:
    return tuple(field_info(cls, spec) for spec in dataclasses.fields(cls)
                 if choices(field_info(cls, spec)) is not None)


def apply_none_words(config: Any) -> None:
    """Set to None each field of `config` that holds its none word (`feature_layers="auto"`)."""
    for spec in dataclasses.fields(config):
        word = spec.metadata.get(NONE_WORD)
        if word is not None and getattr(config, spec.name) == word:
            setattr(config, spec.name, None)


class OrNone(click.ParamType):
    """A number, or the field's none word (kept as the word: the caller maps it to None after
    any config file, so that the flag overrides a value given there)."""

    def __init__(self, base: type, word: str) -> None:
        self.base, self.word = base, word
        self.name = f"{base.__name__}|{word}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == self.word or isinstance(value, self.base):
            return value
        try:
            return self.base(value)
        except ValueError:
            self.fail(f"{value!r} is neither {self.word!r} nor a number", param, ctx)


class Separated(click.ParamType):
    """A list in one flag, items separated by `separator` (empty items skipped), or the none word."""

    def __init__(self, base: type, separator: str, word: str | None) -> None:
        self.base, self.separator, self.word = base, separator, word
        self.name = f"{base.__name__}{separator}..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or value == self.word:
            return value
        try:
            return [self.base(part) for part in value.split(self.separator) if part.strip()]
        except ValueError:
            either = f"{self.word!r} or " if self.word else ""
            self.fail(f"expected {either}{self.base.__name__} values separated by {self.separator!r} "
                      f"(e.g. 1{self.separator}9{self.separator}17), got {value!r}", param, ctx)


class JsonObject(click.ParamType):
    """A JSON object, e.g. '{"enable_thinking": false}'."""

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            self.fail(f"not JSON ({error.msg}): {value!r}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"must be a JSON object like '{{\"enable_thinking\": false}}', got {value!r}", param, ctx)
        return parsed


class RegistryChoice(click.Choice):
    """click.Choice over `names()`, read each time the choices are (a kind registered after
    the command was built is one)."""

    def __init__(self, names: Callable[[], Iterable[str]]) -> None:
        self.names = names
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.names())


def help_text(info: FieldInfo) -> str:
    """The field's docstring with its default in brackets (none shown for a None default
    without a none word)."""
    default = info.default
    if default is dataclasses.MISSING or (default is None and info.none_word is None):
        shown = ""
    elif default is None:
        shown = info.none_word
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, list) and info.metadata.get(SEPARATOR):  # as the flag takes it
        shown = info.metadata[SEPARATOR].join(map(str, default))
    else:
        shown = str(default)
    return f"{info.doc} [{shown}]" if shown else info.doc


def _click_type(info: FieldInfo, kind: Any) -> Any:
    """The click type of one value of the field (`kind`: its type less None and list)."""
    path = info.metadata.get(PATH) or ("any" if kind is Path else None)
    if path is not None:
        assert path in ("dir", "file", "any"), f"{info.name}: {PATH} must be dir, file or any, got {path!r}"
        return click.Path(file_okay=path != "dir", dir_okay=path != "file", exists=bool(info.metadata.get(EXISTS)))
    if info.metadata.get(CHOICES) is not None:
        return RegistryChoice(info.metadata[CHOICES])
    if typing.get_origin(kind) is Literal:
        return click.Choice(typing.get_args(kind))
    if kind is dict or typing.get_origin(kind) is dict:
        return JsonObject()
    if info.none_word is not None:
        return OrNone(kind, info.none_word)
    return kind


def option(info: FieldInfo, *, required: bool = False) -> Callable:
    """The click option (or argument) of one config field: typed, help with default.

    required: a field without a default is a required flag (False where a config file may
    give it instead)."""
    kind = _base(info.type)
    meta = info.metadata
    if meta.get(ARGUMENT):
        return click.argument(info.name, type=_click_type(info, kind))
    kwargs: dict[str, Any] = {"default": None, "help": help_text(info)}
    if meta.get(METAVAR):
        kwargs["metavar"] = meta[METAVAR]
    if required and info.default is dataclasses.MISSING:
        kwargs["required"] = True
    if kind is bool:
        if meta.get(ONLY_ON):
            return click.option(info.flag, info.name, is_flag=True, **kwargs)
        return click.option(f"{info.flag}/--no-{info.flag[2:]}", info.name, **kwargs)
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        if meta.get(SEPARATOR):
            kwargs["type"] = Separated(item, meta[SEPARATOR], info.none_word)
        else:
            kwargs.update(type=_click_type(info, item), multiple=True, default=())
    else:
        kwargs["type"] = _click_type(info, kind)
    return click.option(info.flag, info.name, **kwargs)


def flags(cls: type, *, skip: Iterable[str] = (), required: bool = True) -> list[Callable]:
    """One click decorator per field of `cls` (components' fields included), less `skip`, in
    field order; `required` as for `option`."""
    return [option(info, required=required) for info in describe(cls, skip=skip)]


def apply(decorators: Iterable[Callable], command: Callable) -> Callable:
    """`command` decorated by `decorators`, listed in their order."""
    for add in reversed(list(decorators)):  # the first decorator applied is listed last
        command = add(command)
    return command


def config_options(cls: type, *, skip: Iterable[str] = (), required: bool = True) -> Callable:
    """A decorator adding one option per field of `cls` (less `skip`), in field order."""
    decorators = flags(cls, skip=skip, required=required)
    return functools.partial(apply, decorators)


def given(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options the user gave: None (not given) and empty `multiple` tuples dropped,
    other tuples as lists."""
    return {name: list(value) if isinstance(value, tuple) else value
            for name, value in options.items() if value is not None and value != ()}


__all__ = ["ARGUMENT", "CHOICES", "EXISTS", "FLAG", "FieldInfo", "JsonObject", "METAVAR", "NONE_WORD", "ONLY_ON",
           "OrNone", "PATH", "RESUMABLE", "RegistryChoice", "SEPARATOR", "Separated", "apply", "apply_none_words",
           "check_choices", "choices", "config_options", "describe", "field_docs", "field_info", "flags", "given",
           "help_text", "option", "resumable"]
