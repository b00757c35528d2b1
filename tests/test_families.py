"""The family matrix: a tiny random target of every model family in dflash.testing.families
through the whole pipeline, as a new user runs it: stage one with `--regenerate` (bf16
features), `fit` (1 layer, block 4, a few steps), `eval` offline and online, `export`.

- Stage one's features are checked directly against transformers: every cached row equals
  `output_hidden_states[layer_id + 1]` of the same sequence's own forward, within the bf16
  codec's rounding (tau equality on random targets is a weak test of layer indexing).
- Online eval is lossless (the target's own greedy output) on every family, past the window
  of the sliding-window ones, and on the hybrid ones (linear-attention layers, whose state the
  loop rolls back exactly: train/target_cache.py).
- Export writes the folder and warns, in one line, for the families whose target the pinned
  vLLM serves no DFlash drafter for (dflash.train.serving.VLLM_REFUSES); the README's
  "Supported targets" table lists every family with the same reasons.
- Served by vLLM (`engine` tests, in the engine venv): bench/engine_check.py's TARGET_MATRIX,
  one case per family its CPU build serves (lossless, step for step equal to dflash's loop) or
  refuses (with the stated reason); the rest have their CPU gap stated (VLLM_CPU_CANNOT).

One pipeline per family (a module-scoped fixture), all in this process; one engine process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.testing.builders import RECORDS, build_family_target, precompute_config, tiny_fit_config, write_jsonl
from dflash.testing.families import FAMILIES, WINDOW
from dflash.train.serving import VLLM_CPU_CANNOT, VLLM_REFUSES, VLLM_VERSION

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
LAYER_IDS = [1, 2]  # of 4 layers: the DFlash rule's range (second to third-to-last) and one more
MAX_NEW_TOKENS = 24  # regenerated replies and online decoding: prompts plus this pass WINDOW


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("records") / "records.jsonl", RECORDS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pipeline(request, records, tmp_path_factory) -> dict:
    """Target, stage one's cache and a fitted run of one family."""
    from dflash.precompute.run import run_precompute
    from dflash.train.fit import fit

    family = FAMILIES[request.param]
    work = tmp_path_factory.mktemp(family.name)
    target = build_family_target(family, work / "target")
    cache = work / "cache"
    run_precompute(precompute_config(target, records, cache, feature_layers=LAYER_IDS, feature_codec="bf16",
                                     regenerate=True, max_new_tokens=MAX_NEW_TOKENS))
    run = work / "run"
    fit(tiny_fit_config(cache, run, max_steps=4, checkpoint_every=4, eval_fraction=0.3, anchors_per_seq=8))
    return {"family": family, "target": target, "cache": cache, "run": run, "work": work}


def test_stage_one_features_are_the_targets_hidden_states(pipeline):
    """Every cached row against `output_hidden_states[layer_id + 1]` of its sequence alone.
    Tolerance: the bf16 codec rounds float32 to 8 significant bits, a relative error of at
    most 2^-9; 2^-8 leaves room for the batched forward's own float32 differences (padding
    changes a matmul's shape), and a wrong layer is off by O(1)."""
    from transformers import AutoModelForCausalLM

    from dflash.shards import open_cache

    cache = open_cache(pipeline["cache"])
    assert cache.spec.layer_ids == LAYER_IDS
    assert cache.spec.regenerated
    model = AutoModelForCausalLM.from_pretrained(pipeline["target"], dtype=torch.float32).eval()
    for i in range(len(cache)):
        seq = cache[i]
        with torch.no_grad():
            out = model(torch.as_tensor(seq.input_ids, dtype=torch.long)[None], output_hidden_states=True)
        expected = torch.stack([out.hidden_states[layer + 1][0] for layer in LAYER_IDS], dim=1).numpy()  # [T, L, H]
        assert seq.features.shape == expected.shape
        np.testing.assert_allclose(seq.features, expected, rtol=2**-8, atol=1e-6, err_msg=f"row {i}")
        # The next layer's output is not the cached one: the check tells layers apart.
        wrong = out.hidden_states[LAYER_IDS[0] + 2][0].numpy()
        assert not np.allclose(seq.features[:, 0], wrong, rtol=2**-4, atol=1e-3)


def test_fit_then_offline_eval_then_export(pipeline):
    from click.testing import CliRunner

    from dflash.train.cli import main
    from dflash.train.evaluate import EvalConfig, run_eval

    family, run = pipeline["family"], pipeline["run"]
    offline = run_eval(EvalConfig(run=str(run), device="cpu"), show_progress=False)
    assert offline["num_sequences"] >= 1 and offline["acceptance_length"] >= 1.0
    out = pipeline["work"] / f"dflash-{family.name}"
    result = CliRunner().invoke(main, ["export", "--run", str(run), "--out", str(out), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == LAYER_IDS
    if family.model_type in VLLM_REFUSES:  # one line naming the family and the reason, and the card says it
        assert result.stderr.splitlines() == [
            f"Warning: the target is a {family.model_type} model, for which vLLM {VLLM_VERSION} serves no DFlash "
            f"drafter: {VLLM_REFUSES[family.model_type]}"]
        assert VLLM_REFUSES[family.model_type] in (out / "README.md").read_text()
    else:
        assert result.stderr == ""


def test_online_eval_is_lossless(pipeline, records):
    from dflash.train.evaluate import EvalConfig, run_eval

    family = pipeline["family"]
    config = EvalConfig(run=str(pipeline["run"]), online=True, target=str(pipeline["target"]), prompts=str(records),
                        limit=2, max_new_tokens=MAX_NEW_TOKENS, device="cpu", dtype="float32", save=False)
    online = run_eval(config, show_progress=False)["online"]
    assert online["lossless"] is True
    assert online["num_verifications"] > 0 and online["acceptance_length"] >= 1.0
    if family.sliding:  # the sequences pass the window: the verify's crops act on sliding layers
        assert all(p["prompt_tokens"] + p["new_tokens"] > WINDOW for p in online["per_prompt"])


def test_readme_lists_every_family_with_the_serving_tables_reasons():
    """README's "Supported targets" table: a row for every family (by model_type), marked as the
    serving tables and the engine check say: refused by vLLM ("no"), GPU only, CPU-checked (a
    target family bench/engine_check.py serves), or served but not checked here."""
    from bench.engine_check import FAMILIES as ENGINE_FAMILIES, TARGET_MATRIX

    engine_checked = {FAMILIES[family.arch].model_type for family in [*ENGINE_FAMILIES.values(),
                                                                      *TARGET_MATRIX.values()]}
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Supported targets", 1)[1].split("\n## ", 1)[0]
    rows = {name: line for line in table.splitlines() if line.startswith("| ")
            for name in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1])}
    for family in FAMILIES.values():
        assert family.model_type in rows, f"README's Supported targets lacks {family.model_type}"
        served = rows[family.model_type].rstrip(" |").rsplit("|", 1)[1].strip()
        if family.model_type in VLLM_REFUSES:
            assert served.startswith("no:"), served
        elif family.model_type in VLLM_CPU_CANNOT:
            assert served.startswith("GPU only:"), served
        elif family.model_type in engine_checked:
            assert served.startswith("CPU-checked"), served
        else:
            assert served == "yes, not CPU-checked in the suite", served


# --------------------------------------------------------------------------- served by vLLM


def test_every_family_is_engine_checked_or_its_gap_stated():
    """Each family is in the engine check (its drafter kinds, or TARGET_MATRIX: served, or
    refused with the stated reason), or vLLM's CPU build cannot run it, for a stated reason."""
    from bench.engine_check import FAMILIES as ENGINE_FAMILIES, TARGET_MATRIX

    checked = {family.arch for family in [*ENGINE_FAMILIES.values(), *TARGET_MATRIX.values()]}
    for name, family in FAMILIES.items():
        assert (name in checked) != (family.model_type in VLLM_CPU_CANNOT), name
    for family in TARGET_MATRIX.values():
        refused = FAMILIES[family.arch].model_type in VLLM_REFUSES
        assert (family.refused_by is not None) == refused, family.name
        if refused:
            assert family.refused_by in VLLM_REFUSES[FAMILIES[family.arch].model_type]


@pytest.fixture(scope="module")
def engine_matrix(tmp_path_factory, engine_venv) -> dict[str, dict]:
    """bench/engine_check.py's TARGET_MATRIX in one engine process: per family, the target
    alone and with its drafter, or (the families vLLM refuses) the drafter alone."""
    from bench.engine_check import TARGET_MATRIX, EngineCheckConfig, format_report, run_engine_check

    config = EngineCheckConfig(work=tmp_path_factory.mktemp("engine-matrix"), engine_venv=engine_venv,
                               families=tuple(TARGET_MATRIX), broken=())
    try:
        result = run_engine_check(config)
    except RuntimeError as error:
        if str(error).startswith("the engine process exited"):
            pytest.skip(f"vLLM cannot run here: {str(error).splitlines()[0]}")
        raise
    print(format_report(result))
    return {row["name"]: row for row in result["cases"]}


def _matrix(refused: bool) -> list[str]:
    from bench.engine_check import TARGET_MATRIX

    return [f"dflash-{f.name}-{f.dtype}" for f in TARGET_MATRIX.values() if (f.refused_by is not None) == refused]


# Families whose target slides on every layer: vLLM runs their drafter with the target's window
# (dflash.train.serving.VLLM_ALL_SLIDING_WINDOWS_THE_DRAFTER), so past it the accepted counts
# differ from dflash's, while the output stays lossless.
DRAFTER_WINDOWED_BY_VLLM = {"dflash-mistral-sliding-b4-float32"}


@pytest.mark.engine
@pytest.mark.parametrize("name", _matrix(refused=False))
def test_vllm_serves_the_familys_drafter_as_dflash_decodes(engine_matrix, name):
    """Rendering, lossless, and vLLM's accepted count at every step equal to dflash's loop's."""
    row = engine_matrix[name]
    if name in DRAFTER_WINDOWED_BY_VLLM:  # lossless and rendered alike; only the counts differ
        assert row["failures"] and all("accepted drafts differ" in f for f in row["failures"]), row["failures"]
        return
    assert row["failures"] == []
    assert row["dflash"]["acceptance_length"] > 1.05  # drafts are accepted: the steps have counts to compare
    if not row["near_ties"]:
        assert row["vllm"] == row["dflash"]


@pytest.mark.engine
@pytest.mark.parametrize("name", _matrix(refused=True))
def test_vllm_refuses_the_familys_drafter_for_the_stated_reason(engine_matrix, name):
    row = engine_matrix[name]
    assert row["failures"] == [] and row["refused"]


@pytest.mark.engine
def test_the_engine_venv_imports_qwen3_5s_module_or_lacks_only_torchvision(engine_venv):
    """vLLM's Qwen3.5 module (vllm.model_executor.models.qwen3_5, Qwen3.5 and Qwen3.6) imports
    transformers' Qwen2-VL image processor, which imports torchvision; bench/engine_venv.sh
    leaves torchvision out (the registry's builds are CUDA ones, which do not load beside
    torch's CPU build). The import either works, or fails on torchvision alone: then
    dflash.train.serving says so; a change either way fails here, to be written down."""
    import subprocess

    proc = subprocess.run([str(engine_venv / "bin" / "python"), "-c", "import vllm.model_executor.models.qwen3_5"],
                          capture_output=True, text=True, timeout=600, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"})
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    lacks_torchvision = "torchvision" in VLLM_CPU_CANNOT["qwen3_5_text"]
    if lacks_torchvision:
        assert proc.returncode != 0 and last == "ModuleNotFoundError: No module named 'torchvision'", last
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
