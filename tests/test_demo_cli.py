"""The demo's command line: every DemoConfig field is a flag whose help is the field's own
docstring and default, and given flags reach the config."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from demo.run import DemoConfig, parse_args
from dflash.shards.options import field_docs


def _help(monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", ["demo.run", "--help"])
    with pytest.raises(SystemExit) as exited:
        parse_args()
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_flag_is_explained_by_its_fields_docstring_and_default(monkeypatch, capsys):
    text = " ".join(_help(monkeypatch, capsys).split())
    docs = field_docs(DemoConfig)
    for field in dataclasses.fields(DemoConfig):
        if field.name == "work_dir":
            continue
        doc = docs[field.name]
        assert doc, f"DemoConfig.{field.name} has no docstring"
        shown = ("off" if not field.default else "on") if isinstance(field.default, bool) else str(field.default)
        assert f"--{field.name.replace('_', '-')}" in text
        assert f"{doc} [{shown}]" in text, field.name  # '%' in a docstring survives argparse


def test_given_flags_reach_the_config(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["demo.run", "--max-steps", "50", "--human-conversations", "12",
                                      "--lr", "0.002", "--server", "--work-dir", str(tmp_path)])
    config = parse_args()
    assert (config.max_steps, config.human_conversations, config.lr, config.server) == (50, 12, 0.002, True)
    assert config.work_dir == tmp_path
    assert config.num_conversations == DemoConfig.num_conversations  # the rest keep their defaults
