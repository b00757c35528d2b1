"""The demo's command line: given flags reach DemoConfig, the rest keep their defaults, and
--work-dir defaults to DFLASH_DEMO_DIR. (Every flag's help and choices: tests/test_commands.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import demo.run
from demo import REPO
from demo.run import DemoConfig


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


def _flag(command: list[str], name: str) -> str:
    assert command.count(name) == 1, (name, command)
    return command[command.index(name) + 1]


@pytest.mark.parametrize("args, device", [([], "auto"), (["--device", "cpu"], "cpu"), (["--device", "cuda"], "cuda")])
def test_every_command_takes_the_demo_device_and_stays_float32(monkeypatch, tmp_path, args, device):
    """By default every command picks the GPU when there is one (`--device auto`); the flag
    overrides it; the drafter trains and the target decodes in float32 either way (the lossless
    check compares greedy ids)."""
    config = _config(monkeypatch, [*args, "--work-dir", str(tmp_path)])
    target, data, cache, run_dir = (tmp_path / name for name in ("target", "data.jsonl", "cache", "run"))
    precompute = demo.run.precompute_command(config, target=target, data=data, out=cache, regenerate=True)
    human = demo.run.precompute_command(config, target=target, data=data, out=tmp_path / "h", regenerate=False,
                                        basis=cache)
    fit = demo.run.fit_command(config, caches=[cache], run_dir=run_dir)
    offline = demo.run.eval_command(config, run_dir=run_dir, cache=cache, checkpoint=run_dir / "step-1")
    online = demo.run.eval_command(config, run_dir=run_dir, cache=cache, checkpoint=run_dir / "step-1",
                                   online=(target, data))
    assert [_flag(c, "--device") for c in (precompute, human, fit, offline, online)] == [device] * 5
    assert (_flag(fit, "--dtype"), _flag(online, "--dtype")) == ("float32", "float32")
    assert "--dtype" not in offline  # offline scoring reads the cache: no target dtype to choose
    assert _flag(precompute, "--max-new-tokens") == str(config.max_new_tokens) and "--regenerate" in precompute
    assert "--regenerate" not in human and _flag(human, "--feature-basis") == str(cache)
    assert (_flag(online, "--target"), _flag(online, "--prompts")) == (str(target), str(data))
    assert _flag(online, "--limit") == str(config.online_prompts)
    assert _flag(fit, "--drafter") == config.drafter and _flag(fit, "--num-drafts") == "3"  # dspark's block of 3 rows


@pytest.mark.parametrize("args, gpu, native, dtype", [
    ([], False, True, "bfloat16"),  # a CPU with AVX512-BF16 or AMX
    ([], False, False, "float32"),  # a CPU that would emulate bfloat16
    ([], True, False, "bfloat16"),  # the GPU that --device auto picks
    (["--device", "cpu"], True, False, "float32"),  # a GPU the flag leaves aside
    (["--device", "cuda"], False, False, "bfloat16"),
    (["--stage-one-dtype", "float32"], True, True, "float32"),  # the flag wins
    (["--stage-one-dtype", "bfloat16", "--device", "cpu"], False, False, "bfloat16"),
])
def test_stage_one_runs_in_bfloat16_where_the_device_computes_it(monkeypatch, tmp_path, args, gpu, native, dtype):
    """Both caches come from the target at one precision (the second is encoded in the first's
    basis); training and the online check stay float32 whatever stage one used."""
    monkeypatch.setattr(demo.run.torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(demo.run, "native_bfloat16", lambda: native)
    config = _config(monkeypatch, [*args, "--work-dir", str(tmp_path)])
    target, data, cache = tmp_path / "target", tmp_path / "data.jsonl", tmp_path / "cache"
    commands = [demo.run.precompute_command(config, target=target, data=data, out=cache, regenerate=True),
                demo.run.precompute_command(config, target=target, data=data, out=tmp_path / "h", regenerate=False,
                                            basis=cache)]
    assert [_flag(c, "--dtype") for c in commands] == [dtype, dtype]
    fit = demo.run.fit_command(config, caches=[cache], run_dir=tmp_path / "run")
    online = demo.run.eval_command(config, run_dir=tmp_path / "run", cache=cache, checkpoint=tmp_path / "s",
                                   online=(target, data))
    assert (_flag(fit, "--dtype"), _flag(online, "--dtype")) == ("float32", "float32")


def test_the_demo_refuses_an_unknown_device(monkeypatch):
    result = CliRunner().invoke(demo.run.main, ["--device", "tpu"])
    assert result.exit_code != 0 and "tpu" in result.output
