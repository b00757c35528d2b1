"""bench/gpu_stage_one.py on CPU (--quick): the script the GPU check runs at the issue-41 shape,
run at a tiny shape so that it cannot fail on a typo; and the full run on a CUDA device
(marked `gpu`: skipped without one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_script(*args: str, timeout_s: int) -> dict:
    result = subprocess.run([sys.executable, "-m", "bench.gpu_stage_one", *args, "--json"],
                            capture_output=True, text=True, env=ENV, timeout=timeout_s, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ok correctness" in result.stdout
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_gpu_stage_one_runs_on_cpu(tmp_path):
    report = run_script("--device", "cpu", "--quick", "--work-dir", str(tmp_path), timeout_s=600)
    assert report["failures"] == [] and report["quick"]
    assert report["tokens"] > 1000 and report["forward_s"] > 0 and report["pass_s"] >= report["forward_s"]
    assert {"topk", "crc32", "shard_checksum", "write", "fsync"} <= set(report["host_parts_s"])
    assert not list(tmp_path.iterdir())  # the target and cache are removed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stage_one_on_cuda(tmp_path):
    report = run_script("--budget-s", "20", "--work-dir", str(tmp_path), timeout_s=600)
    assert report["failures"] == [] and report["encode_s"] > 0
