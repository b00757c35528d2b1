"""bench/gpu_train_check.py's logic on CPU (--quick): the same checks the GPU run makes,
minus the CUDA-only ones, so that the prepared GPU script does not fail on a typo; and the
full run on a CUDA device (marked `gpu`: skipped without one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_gpu_train_check_runs_on_cpu(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_train_check.py"), "--device", "cpu",
                             "--quick", "--json", "--workdir", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    names = [c["check"] for c in report["checks"]]
    assert report["failed"] == [] and len(names) == 8, names
    assert names[0] == "dense fp32 vs float64 dense: forward (relative)"
    assert names[2] == "flex fp32 vs float64 dense: forward (relative)"
    grads = report["attention"]["main"]["errors"]["dense"]["gradients"]
    assert "layers.0.self_attn.q_proj.weight" in grads and max(grads.values()) < 1e-4
    loss = report["fit"]["reference"]["loss"]
    assert len(loss) == 6 and all(v == v for v in loss)
    assert (tmp_path / "reference" / "checkpoints" / "step-00000006").is_dir()


@pytest.mark.gpu
def test_gpu_train_check_on_cuda(tmp_path):
    """The full check on a CUDA device: Flex Attention against the dense path, and a short bf16
    fit with Flex and the Triton loss against a CPU fp32 reference (what bench/gpu_check.sh
    runs as its step 5)."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    env.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter conftest sets
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_train_check.py"), "--device", "cuda",
                             "--json", "--workdir", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed"] == [] and report["checks"], report
