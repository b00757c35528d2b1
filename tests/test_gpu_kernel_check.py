"""bench/gpu_kernel_check.py: its logic on CPU under the Triton interpreter at tiny shapes
(so that the prepared GPU script does not fail on a typo), and the real run on a CUDA device
(marked `gpu`: skipped without one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def run_check(args, env, timeout):
    result = subprocess.run([sys.executable, "-m", "bench.gpu_kernel_check", *args, "--json"],
                            capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_gpu_kernel_check_runs_on_cpu():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    report = run_check(["--device", "cpu", "--quick", "--budget-s", "600"], env, 900)
    names = [c["check"] for c in report["checks"]]
    assert report["failed"] == [] and len(names) == 23, names
    assert names[0] == "bf16 triton loss vs fp32 reference (relative)"
    assert sum(name.startswith(("tv:", "0.9tv+0.1ce:")) for name in names) == 8
    timed = [r for r in report["rows"] if "median_ms" in r]
    assert {r["impl"] for r in timed} >= {"triton (defaults)", "triton[programs_per_sm 2]", "triton k=1",
                                          "triton tv", "triton 0.9tv+0.1ce"}
    assert "tv_time_vs_kl_8b" in report["goals"]
    assert all(0 <= r["triton_share"] <= 1 for r in timed if "triton_share" in r)
    assert set(report["goals"]) >= {"time_vs_before_8b", "triton_share_smollm2_defaults", "fastest_smollm2"}


@pytest.mark.gpu
def test_gpu_kernel_check_on_cuda():
    """The whole check on a CUDA device (what bench/gpu_check.sh runs as steps 3-4)."""
    env = {**os.environ}
    env.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter conftest sets
    report = run_check(["--budget-s", "150"], env, 600)
    assert report["failed"] == [] and report["goals"]["extra_mib_8b"] <= 512, report["goals"]
