"""Every kind's export against SGLang 0.5.23's own model code: the class its `EntryClass` lists
for our architecture, built from our config.json (bench/sglang_source.py runs SGLang's
constructors and `load_weights` on the meta device, downloading its wheel's sources once),
must mean what we trained (block, target layers, mask token, attention, RoPE, activation and
each kind's heads), read no field we lack unless its default means ours (`DEFAULTS`), and take
every tensor of ours with the right shape into a parameter, leaving none of its own unfilled
(its DFlash loader drops unknown names silently). Broken exports fail the same checks.

One row per kind (`ROWS`): a kind added to train/drafters/ adds one row here, naming its config
fields, the SGLang file and algorithm that serve it and the SGLang attributes its heads set
(LiLiCorr: "sglang/srt/models/lilicorr.py", "DFLASH", and e.g. "lilicorr.candidate_topk";
`test_sglangs_lilicorr_model_runs_here` shows the harness building that file's head).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from bench.sglang_source import SGLANG_VERSION, SGLangModel, entry_file, server_source, sglang_model, sglang_sources
from dflash.testing.builders import drafter_config
from dflash.train import drafters
from dflash.train.export import model_card, write_export
from dflash.train.loading import LoadedDrafter
from dflash.train.model import SLIDING_ATTENTION

V = 50
SHAPE = dict(num_hidden_layers=2, vocab_size=V, target_layer_ids=[1, 3], num_target_layers=5, mask_token_id=V - 1)


@dataclass(frozen=True)
class Row:
    """A kind as SGLang serves it."""

    kind: str
    fields: dict[str, Any]
    """The kind's drafter config fields (its heads) beside SHAPE."""
    entry: str
    """SGLang's model file whose EntryClass lists the kind's architecture."""
    algorithm: str
    """`--speculative-algorithm`."""
    heads: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    """SGLang model attribute path -> its value for our drafter config (the kind's heads)."""
    ragged_verify_mode: str = "static"
    """SGLANG_RAGGED_VERIFY_MODE the check runs under (DSpark builds its confidence head unless static)."""


ROWS = {
    "dflash": Row("dflash", {"num_drafts": 3}, "sglang/srt/models/dflash.py", "DFLASH"),
    "dflash-sliding": Row("dflash", {"num_drafts": 3, "layer_types": [SLIDING_ATTENTION, "full_attention"],
                                     "sliding_window": 8}, "sglang/srt/models/dflash.py", "DFLASH"),
    "dspark": Row("dspark", {"num_drafts": 4, "markov_rank": 6, "confidence_head": True},
                  "sglang/srt/models/dspark.py", "DSPARK",
                  {"gamma": lambda c: c.num_drafts, "sample_from_anchor": lambda c: True,
                   "markov_head.markov_rank": lambda c: c.markov_rank,
                   "confidence_head.with_markov": lambda c: c.confidence_head},
                  ragged_verify_mode="compact"),
    "dspark-static": Row("dspark", {"num_drafts": 4, "markov_rank": 6, "confidence_head": False},
                         "sglang/srt/models/dspark.py", "DSPARK",
                         {"gamma": lambda c: c.num_drafts, "markov_head.markov_rank": lambda c: c.markov_rank,
                          "confidence_head": lambda c: None}),
    "dflash2": Row("dflash2", {"num_drafts": 3, "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6,
                               "selector_top_k": 5}, "sglang/srt/models/dflash.py", "DFLASH",
                   {"candidate_selector.top_k": lambda c: c.selector_top_k,
                    "layers.1.attention_conv.taps": lambda c: c.conv_kernel_size,
                    "layers.1.mlp_conv.group_size": lambda c: c.conv_group_size}),
    "lilicorr": Row("lilicorr", {"num_drafts": 3, "lilicorr_candidate_topk": 4, "lilicorr_num_heads": 2,
                                 "lilicorr_factor_dim": 6}, "sglang/srt/models/lilicorr.py", "DFLASH",
                    {"lilicorr.candidate_topk": lambda c: c.lilicorr_candidate_topk,
                     "lilicorr.num_heads": lambda c: c.lilicorr_num_heads,
                     "lilicorr.factor_dim": lambda c: c.lilicorr_factor_dim,
                     "lilicorr.logit_scale": lambda c: c.lilicorr_logit_scale}),
    "lilicorr-conv": Row("lilicorr", {"num_drafts": 3, "lilicorr_candidate_topk": 4, "lilicorr_num_heads": 2,
                                      "lilicorr_factor_dim": 6, "conv_kernel_size": 2, "conv_group_size": 8},
                         "sglang/srt/models/lilicorr.py", "DFLASH",
                         {"lilicorr.candidate_topk": lambda c: c.lilicorr_candidate_topk,
                          "layers.1.attention_conv.taps": lambda c: c.conv_kernel_size,
                          "layers.1.mlp_conv.group_size": lambda c: c.conv_group_size}),
}

# Fields SGLang reads that our config.json leaves out, and why its default is what we trained.
DEFAULTS = {
    "text_config": "none: the config is its own text config",
    "use_gemma_norm": "false: RMSNorm scales by its weight, not 1 + weight",
    "partial_rotary_factor": "1.0: RoPE over the whole head",
    "rope_is_neox_style": "true: half-split RoPE", "is_neox_style": "true: half-split RoPE",
    "is_causal": "unset: full layers bidirectional, sliding ones causal (our layer rule when --is-causal is unset)",
    "has_embed_tokens": "false: the target's embedding",
    "projector_type": "none: fc and hidden_norm, not Domino's GRU",
    "dflash_config.projector_type": "none: fc and hidden_norm",
    "mask_token": "read only when mask_token_id is absent", "dflash_config.mask_token": "the same",
    "mask_token_id": "the top-level fallback of dflash_config.mask_token_id",
    "target_layer_ids": "the top-level fallback of dflash_config.target_layer_ids",
    "dflash_config.num_target_layers": "falls back to the top-level num_target_layers",
    "dflash_config.attention_sink_bias": "false: no attention sinks",
    "dflash_config.attention_value_scale": "none: values unscaled",
    "dflash_config.output_multiplier": "1.0: unary logits unscaled",
    "dflash_config.final_logit_softcapping": "none: no softcap",
    "dflash_config.conv_kernel_size": "0: no convolutions (DFlash2 writes it)",
    "dflash_config.conv_group_size": "0: no convolutions (DFlash2 writes it)",
    "dflash_config.selector_rank": "0: no candidate selector (DFlash2 writes it)",
    "dflash_config.selector_top_k": "0: no candidate selector (DFlash2 writes it)",
    **{name: "the bundled-in-target DSpark format's prefixed fields; ours are unprefixed"
       for name in ("dspark_config", "dspark_block_size", "dspark_markov_rank", "dspark_markov_head_type",
                    "dspark_noise_token_id", "dspark_target_layer_ids")},
}


@pytest.fixture(scope="module")
def sglang() -> Path:
    try:
        return sglang_sources()
    except OSError as error:
        pytest.skip(f"SGLang {SGLANG_VERSION}'s sources are not here and cannot be downloaded: {error}")


def export(row: Row, tmp_path: Path, **fields: Any) -> tuple[dict, dict[str, tuple[int, ...]], Any]:
    """(config.json, the safetensors' name -> shape, the drafter config) of a tiny drafter of `row`."""
    c = drafter_config(row.kind, **{**SHAPE, **row.fields, **fields})
    out = write_export(drafters.make(c, attention="dense"), tmp_path / f"{row.kind}-export")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    return json.loads((out / "config.json").read_text()), shapes, c


def lookup(model: Any, path: str) -> Any:
    """The attribute at a dotted path ("layers.1.mlp"), "absent" where SGLang built none."""
    for part in path.split("."):
        if model is None:
            return "absent"
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def meaning(sg: SGLangModel, row: Row, c: Any) -> list[str]:
    """Where SGLang's model, built from our config.json, disagrees with the drafter we trained."""
    model, kind = sg.model, drafters.get(row.kind)
    expect = {"block_size": kind.hf_block_size(c), "num_context_features": len(c.target_layer_ids),
              "draft_config.target_layer_ids": list(c.target_layer_ids),
              "draft_config.mask_token_id": c.mask_token_id, "draft_config.num_target_layers": c.num_target_layers,
              "rms_norm_eps": c.rms_norm_eps, "layers.__len__": c.num_hidden_layers}
    for i in range(c.num_hidden_layers):
        window, causal = c.layer_attention(i)
        expect |= {f"layers.{i}.self_attn.attn.kwargs": {
            "num_heads": c.num_attention_heads, "head_dim": c.head_dim, "num_kv_heads": c.num_key_value_heads,
            "sliding_window_size": window - 1 if window else -1,  # SGLang keeps window_left, HF counts the token
            "attn_type": "DECODER" if causal else "ENCODER_ONLY"},
            f"layers.{i}.self_attn.rotary_emb.kwargs": {"rotary_dim": c.head_dim, "base": c.rope_theta,
                                                        "is_neox_style": True, "partial_rotary_factor": 1.0},
            f"layers.{i}.mlp.act_fn": "SiluAndMul"}
    expect |= {path: value(c) for path, value in row.heads.items()}
    found = {}
    for path in expect:
        if path == "layers.__len__":
            found[path] = len(model.layers)
        elif path.endswith(".kwargs"):
            kwargs = lookup(model, path)
            found[path] = {key: getattr(kwargs.get(key), "name", kwargs.get(key)) for key in expect[path]}
        elif path.endswith(".act_fn"):  # SiluAndMul's stand-in; swigluoai would be a partial
            act = lookup(model, path)
            found[path] = "SiluAndMul" if type(act).__name__ == "_Recorded" else repr(act)
        else:
            found[path] = lookup(model, path)
    return [f"{path}: SGLang has {found[path]!r}, we trained {value!r}" for path, value in expect.items()
            if found[path] != value]


def problems(row: Row, sglang: Path, config: dict, shapes: dict[str, tuple[int, ...]], c: Any) -> list[str]:
    """Every way SGLang would serve this export other than as trained; [] when it serves it as trained."""
    try:
        sg = sglang_model(sglang, config, ragged_verify_mode=row.ragged_verify_mode)
    except ValueError as error:  # SGLang's constructor refuses the config
        return [f"SGLang refuses the config: {error}"]
    found = [f"SGLang called {name} (no stand-in)" for name in sg.unstubbed] + meaning(sg, row, c)
    absent = sorted(name for name in sg.config.reads if name.split(".")[0] not in config
                    or "." in name and name.split(".", 1)[1] not in config[name.split(".")[0]])
    found += [f"SGLang reads {name}, which config.json lacks" for name in absent if name not in DEFAULTS]
    report = sg.load(shapes)
    found += [f"SGLang ignores our {name}" for name in report.ignored]
    found += [f"SGLang's {name} gets no tensor" for name in report.unloaded]
    found += report.mismatched + ([f"SGLang's loader refuses: {report.error}"] if report.error else [])
    found += [f"SGLang's loader called {name} (no stand-in)" for name in report.unstubbed]
    return found


@pytest.mark.parametrize("name", ROWS)
def test_sglang_serves_the_export_as_trained(sglang, tmp_path, name):
    row = ROWS[name]
    config, shapes, c = export(row, tmp_path)
    assert problems(row, sglang, config, shapes, c) == []


@pytest.mark.parametrize("name", ROWS)
def test_the_rows_file_lists_the_architecture(sglang, name):
    assert entry_file(sglang, drafters.get(ROWS[name].kind).architecture) == ROWS[name].entry


# What a broken export looks like to the same checks: (row, change, what the check says).
BROKEN = {
    "renamed tensor": ("dflash", lambda config, shapes: shapes.update(
        {"layers.1.mlp.down.weight": shapes.pop("layers.1.mlp.down_proj.weight")}),
        "SGLang ignores our layers.1.mlp.down.weight"),
    "dropped target layers": ("dflash", lambda config, shapes: config["dflash_config"].pop("target_layer_ids"),
                              "draft_config.target_layer_ids: SGLang has None"),
    "dropped mask token": ("dflash", lambda config, shapes: config["dflash_config"].pop("mask_token_id"),
                           "draft_config.mask_token_id: SGLang has None"),
    "dropped block": ("dflash2", lambda config, shapes: [config.pop("block_size"),
                                                         config["dflash_config"].pop("block_size")],
                      "block_size: SGLang has 16, we trained 4"),
    "dropped causal layout": ("dflash-sliding", lambda config, shapes: config.pop("layer_types"),
                              "sliding_window_size': -1"),
    "dropped Markov head type": ("dspark", lambda config, shapes: config.pop("markov_head_type"),
                                 "SGLang refuses the config: DSpark requires markov_head_type"),
    "dropped selector": ("dflash2", lambda config, shapes: config["dflash_config"].pop("selector_rank"),
                         "SGLang refuses the config: DFLASH selector needs rank and top_k together"),
    "dropped convolutions": ("dflash2", lambda config, shapes: [config["dflash_config"].pop("conv_kernel_size"),
                                                                config["dflash_config"].pop("conv_group_size")],
                             "SGLang ignores our layers.0.attention_conv.base_kernel"),
    "dropped confidence head": ("dspark", lambda config, shapes: [shapes.pop("confidence_head.proj.weight"),
                                                                   shapes.pop("confidence_head.proj.bias")],
                                "the checkpoint is missing ['confidence_head.proj.bias'"),
    "swapped Markov matrices": ("dspark", lambda config, shapes: shapes.update(
        {"markov_head.markov_w1.weight": (6, V), "markov_head.markov_w2.weight": (6, V)}),
        "got (6, 50), SGLang's parameter takes (50, 6)"),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_export_fails_the_check(sglang, tmp_path, broken):
    name, change, says = BROKEN[broken]
    row = ROWS[name]
    config, shapes, c = export(row, tmp_path)
    change(config, shapes)
    found = problems(row, sglang, config, shapes, c)
    assert any(says in line for line in found), found


@pytest.mark.parametrize("kind, says", [
    ("dflash", ["SGLang ignores our d2t", "SGLang ignores our lm_head.weight"]),  # it drafts over the whole vocabulary
    ("dspark", ["SGLang ignores our d2t", "SGLang ignores our lm_head.weight",
                "got (20, 6), SGLang's parameter takes (50, 6)"]),  # and markov_w2 over the draft vocabulary
])
def test_sglang_serves_no_draft_vocabulary(sglang, tmp_path, kind, says):
    """What the model card says: a `--draft-vocab` export serves in vLLM only."""
    row = next(r for r in ROWS.values() if r.kind == kind)
    config, shapes, c = export(row, tmp_path, draft_vocab_size=20)
    found = problems(row, sglang, config, shapes, c)
    assert [line for line in found if any(s in line for s in says)] and all(
        any(s in line for s in says) for line in found), found


# SGLang's LiLiCorr geometry fields (its lilicorr_utils.py reads each, without defaults, from dflash_config).
LILICORR = dict(lilicorr_enabled=True, lilicorr_candidate_topk=4, lilicorr_hidden_size=0, lilicorr_num_layers=1,
                lilicorr_num_heads=2, lilicorr_mlp_ratio=2.0, lilicorr_factor_dim=8, lilicorr_vector_eps=1e-6,
                lilicorr_logit_scale=1.0)


@pytest.mark.parametrize("with_head", [True, False])
def test_sglangs_lilicorr_model_runs_here(sglang, tmp_path, with_head):
    """The harness runs SGLang's lilicorr.py too, ready for a LiLiCorr row: a DFlash export
    relabelled `LiLiCorrDraftModel` with the geometry fields builds SGLang's head (rows of the
    block but the anchor, top-k ranks, factor heads) and its loader's own coverage check refuses
    the folder until the head's tensors are there."""
    config, shapes, c = export(ROWS["dflash"], tmp_path)
    config["architectures"] = ["LiLiCorrDraftModel"]
    config["dflash_config"].update(LILICORR)
    sg = sglang_model(sglang, config)
    head = {name: shape for name, shape in sg.parameters().items() if name.startswith("lilicorr.")}
    assert head["lilicorr.slot_embedding"] == (1, 1, c.num_drafts, 1, 32)
    assert head["lilicorr.rank_embedding"] == (1, 1, 1, 4, 32) and head["lilicorr.out_head.weight"] == (8, 32)
    report = sg.load({**shapes, **(head if with_head else {})})
    assert report.ignored == [] and report.unloaded == ([] if with_head else sorted(head))
    assert (report.error is None) if with_head else "LiLiCorr checkpoint is missing 34 head parameters" in report.error


# -- the model card's SGLang command ---------------------------------------------------------


def _string_constants(tree: ast.AST) -> set[str]:
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


@pytest.mark.parametrize("name", ROWS)
def test_the_card_serves_it_with_sglangs_algorithm_and_block(sglang, tmp_path, name):
    """The card's `sglang.launch_server` line names the row's algorithm (an enum member of SGLang's
    spec_info.py) and the block in the flag SGLang resolves it from (its speculative_hook.py):
    DFLASH's --speculative-num-draft-tokens is the verify window, the block's rows (the anchor and
    the drafts); DSPARK's --speculative-dspark-block-size is gamma, the drafts, and SGLang sets the
    verify window to gamma + 1 itself."""
    row = ROWS[name]
    c = drafter_config(row.kind, **{**SHAPE, **row.fields})
    card = model_card(LoadedDrafter(drafters.make(c, attention="dense"), tmp_path, 1, {}), evaluation=None)
    (line,) = [line for line in card.splitlines() if "sglang.launch_server" in line]
    flags = dict(zip(line.split()[::1], line.split()[1:]))
    algorithms = {node.targets[0].id for node in ast.walk(server_source(sglang, "sglang/srt/speculative/spec_info.py"))
                  if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}
    fields = _string_constants(server_source(sglang, "sglang/srt/arg_groups/field_order.py"))
    assert flags["--speculative-algorithm"] == row.algorithm and row.algorithm in algorithms
    assert flags["--speculative-draft-model-path"] == "/path/to/THIS/FOLDER"
    block_flag = "--speculative-dspark-block-size" if row.algorithm == "DSPARK" else "--speculative-num-draft-tokens"
    assert block_flag.removeprefix("--").replace("-", "_") in fields
    # Both equal the config.json's block_size, SGLang's default for the flag.
    assert int(flags[block_flag]) == drafters.get(row.kind).hf_block_size(c)
    assert int(flags[block_flag]) == (c.num_drafts if row.algorithm == "DSPARK" else c.num_drafts + 1)
    hook = (sglang / "sglang/srt/arg_groups/speculative_hook.py").read_text()
    assert "verify_window = int(gamma) + 1" in hook  # DSPARK: num-draft-tokens is gamma + 1, set by SGLang


@pytest.mark.parametrize("handler, says", [
    ("_handle_dflash", "is not supported by"),
    ("_handle_dspark", "DSpark speculative decoding only supports CUDA, NPU or XPU device."),
])
def test_sglang_refuses_these_algorithms_on_a_cpu(sglang, handler, says):
    """Why the cards say "a GPU": SGLang's server resolves each algorithm in speculative_hook.py and
    raises unless the device is CUDA, NPU or XPU (or an out-of-tree platform that claims it)."""
    tree = server_source(sglang, "sglang/srt/arg_groups/speculative_hook.py")
    (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == handler]
    assert any(says in text for text in _string_constants(function))
    assert {"cuda", "xpu"} <= _string_constants(function)
