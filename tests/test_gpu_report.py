"""bench/gpu_report.py: the GPU check's one table reads every section's JSON back correctly."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_report import last_json, read_section

REPO = Path(__file__).resolve().parents[1]


def write_section(logs: Path, name: str, lines: list[str], rc: int, seconds: float) -> None:
    (logs / f"{name}.log").write_text("\n".join(lines) + "\n")
    (logs / f"{name}.rc").write_text(f"{rc}\n")
    (logs / f"{name}.seconds").write_text(f"{seconds}\n")
    with (logs / "sections").open("a") as f:
        f.write(name + "\n")


def test_last_json_skips_trailing_text_and_non_objects():
    text = 'noise\n{"a": 1}\n[1, 2]\n{broken\n'
    assert last_json(text) == {"a": 1}
    assert last_json("no json here") is None


def test_read_section_splits_checks_from_figures(tmp_path):
    report = {"bench": "x", "tokens_per_s": 1234.5, "flag": True,
              "shape": {"mfu": 0.41, "checks": [{"check": "wait <= 5%", "value": 0.02, "limit": 0.05, "ok": True}]}}
    write_section(tmp_path, "stage_two", ["started", json.dumps(report)], rc=0, seconds=12)
    section = read_section(tmp_path, "stage_two")
    assert section["rc"] == 0 and section["seconds"] == 12.0
    assert section["figures"] == {"tokens_per_s": 1234.5, "shape.mfu": 0.41}
    assert [c["check"] for c in section["checks"]] == ["wait <= 5%"]


@pytest.mark.parametrize(("rc", "lines", "failed", "missed"), [
    (0, [json.dumps({"checks": [{"check": "mfu", "value": 0.3, "limit": 0.5, "ok": False}]})], 0, 1),
    (1, [json.dumps({"checks": [{"check": "parity", "value": 1.0, "limit": 1e-4, "ok": False}]})], 1, 0),
    (124, ["Traceback ...", "killed"], 1, 0),
    (0, ["PASS goal: wall <= 1.3 x forward (1.1 x)", "FAIL goal: forward >= 35% of 790 TFLOP/s (20%)", "{}"], 0, 1),
])
def test_report_tells_failures_from_missed_goals(tmp_path, rc, lines, failed, missed):
    write_section(tmp_path, "sec", lines, rc=rc, seconds=3)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_report.py"), "--logs", str(tmp_path), "--json"],
                         capture_output=True, text=True)
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert (len(summary["failed"]), len(summary["goals_missed"])) == (failed, missed)
    assert run.returncode == (1 if failed else 0)
