"""The demo's command line: given flags reach DemoConfig, the rest keep their defaults, and
--work-dir defaults to DFLASH_DEMO_DIR. (Every flag's help and choices: tests/test_commands.py.)"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

import demo.run
from demo.run import REPO, DemoConfig


def _config(monkeypatch, args: list[str]) -> DemoConfig:
    seen = []
    monkeypatch.setattr(demo.run, "run_demo", seen.append)
    result = CliRunner().invoke(demo.run.main, args)
    assert result.exit_code == 0, result.output
    return seen[0]


def test_given_flags_reach_the_config(monkeypatch, tmp_path):
    config = _config(monkeypatch, ["--max-steps", "50", "--human-conversations", "12", "--lr", "0.002",
                                   "--server", "--work-dir", str(tmp_path)])
    assert (config.max_steps, config.human_conversations, config.lr, config.server) == (50, 12, 0.002, True)
    assert config.work_dir == tmp_path
    assert config.num_conversations == DemoConfig.num_conversations  # the rest keep their defaults
    assert (config.vllm_server, config.engine_check) == (False, False)


def test_work_dir_defaults_to_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_DEMO_DIR", str(tmp_path / "elsewhere"))
    assert _config(monkeypatch, []).work_dir == tmp_path / "elsewhere"
    monkeypatch.delenv("DFLASH_DEMO_DIR")
    assert _config(monkeypatch, []).work_dir == Path(REPO) / ".demo"


def test_out_of_domain_refuses_a_folder_without_a_finished_demo(tmp_path):
    import demo.out_of_domain

    result = CliRunner().invoke(demo.out_of_domain.main, ["--work-dir", str(tmp_path), "--seeds", "0,1"])
    assert result.exit_code == 1
    assert f"{tmp_path}: no finished demo here" in result.output


def test_out_of_domain_refuses_a_suite_without_demo_prompts(tmp_path):
    import demo.out_of_domain

    result = CliRunner().invoke(demo.out_of_domain.main, ["--work-dir", str(tmp_path), "--suites", "mbpp"])
    assert result.exit_code == 1 and "--suites mbpp: no prompts written for the demo" in result.output
