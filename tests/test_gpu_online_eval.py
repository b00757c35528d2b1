"""bench/gpu_online_eval.py's logic on CPU (--quick): bf16 and float32 online eval of a random
target, no real mismatch, the bf16 rounding drift within the near-tie bound, the report's
shape; and the full run on a CUDA device (marked `gpu`: skipped without one), where bf16 must
also be no slower per token than float32."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def run_script(*args: str, timeout: int) -> tuple[int, dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_online_eval.py"), *args, "--json"],
                            capture_output=True, text=True, env=env, timeout=timeout)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    return result.returncode, json.loads(result.stdout.strip().splitlines()[-1]), output


def test_gpu_online_eval_runs_on_cpu():
    # One prompt of 12 tokens (quick's default: 2 of 24): the script's paths and its report;
    # the bf16 near-tie logic itself is tests/test_eval_online.py's.
    rc, report, output = run_script("--device", "cpu", "--quick", "--num-prompts", "1", "--max-new-tokens", "12",
                                    timeout=300)
    assert rc == 0, output
    assert [(r["dtype"], r["attention"]) for r in report["rows"]] == [("bfloat16", "decoding"),
                                                                      ("float32", "decoding")]
    assert [c["check"] for c in report["checks"]] == ["no real mismatch: real mismatches, every row (count)",
                                                      "bf16 margin drift, verify vs one-token steps (u|z|)"]
    assert report["failed"] == [] and report["checks"][0]["value"] == 0
    for row in report["rows"]:
        assert row["new_tokens"] == 12 and 1.0 <= row["acceptance_length"] <= 16.0
        assert 0 < row["margin_drift_u"] and row["speculative_ops_per_token"] > row["greedy_ops_per_token"] > 0
        assert row["speculative_ms_per_token"] > 0 and row["greedy_ms_per_token"] > 0
        assert row["num_near_ties"] == sum(m["near_tie"] for m in row["mismatches"])
    assert "PASS no real mismatch" in output


@pytest.mark.gpu
def test_gpu_online_eval_on_cuda():
    """bf16 no slower per token than float32 and no real mismatch, with the pre-fix row."""
    rc, report, output = run_script(timeout=600)
    assert rc == 0 and report["failed"] == [], output
    assert len(report["rows"]) == 3 and report["sdpa_backends"]["verify_decoding"] != "CUDNN_ATTENTION"
