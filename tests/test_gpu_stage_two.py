"""bench/gpu_stage_two.py at tiny shapes on a CPU: the script the GPU check runs, end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_stage_two_runs_on_a_cpu_at_quick_shapes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run([sys.executable, "-m", "bench.gpu_stage_two", "--device", "cpu", "--quick", "--json",
                             "--workdir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failures"] == []
    for name in ("small", "qwen3-8b"):
        shape = report[name]
        assert shape["steps"] == 12 and shape["tokens_per_s"] > 0
        assert shape["gpu_data_wait_fraction"] is None  # no CUDA events on a CPU: absent, not 0
        assert shape["median_data_s"] > 0 and shape["snapshot_to"] == ["cpu"]
        assert shape["mid_checkpoint_block_steps"] is not None
    # Where the profiled steps' time went: on a CPU, aten ops' own CPU time (1 thread), which
    # cannot exceed those steps' wall time; the matrix products are among them.
    profile = report["qwen3-8b"]["profile"]
    assert profile["steps"] == [3, 4] and profile["device_busy_fraction"] is None
    assert profile["host_syncs_per_step"] is None  # counted on CUDA only
    assert profile["ms_per_step"]["matmul"] > 0 and profile["top"]
    assert 0.2 * profile["wall_ms_per_step"] < sum(profile["ms_per_step"].values()) <= profile["wall_ms_per_step"]
    assert "profile" not in report["small"]
    resume = report["kill_and_resume"]
    assert resume["equal"] and resume["problems"] == [] and resume["killed_after_step"] < resume["steps"]
    assert any(line.startswith("PASS kill-and-resume on cpu") for line in report["goals"])
    assert list(tmp_path.iterdir()) == []  # caches and runs cleaned up
