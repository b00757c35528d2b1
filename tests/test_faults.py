"""CI-sized fault trials: one seeded trial of each sub-case of tests/faults/, plus checks that
the harness's own detectors fire on a planted fault (a detector that cannot fail proves
nothing).

The full randomised counts come from `python -m tests.faults --trials 20`. A sub-case that
exposes a bug in the library is marked `xfail(strict=True)` with the finding's name until
the fix lands (then strict xfail fails and the marker goes).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.faults import (
    bad_input,
    corruption,
    disk_full,
    fit_kill,
    harness,
    numeric,
    precompute_kill,
    refusals,
    untrusted,
)
from tests.faults.workspace import (
    FinalNameWatcher,
    Outcome,
    Workspace,
    check_cache_file,
    check_checkpoint,
    compare_caches,
    left_checkpoints,
)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("faults"), seed=0)


pytestmark = pytest.mark.e2e


def rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([0, *key])


def assert_passed(outcomes: list[Outcome]) -> None:
    assert outcomes and all(not o.problems for o in outcomes), [(o.case, o.problems, o.notes) for o in outcomes]


# ----------------------------------------------------------------------------- the detectors


def test_a_partial_shard_under_a_final_name_is_caught(ws, tmp_path):
    reference = ws.precompute_reference.cache
    shard = sorted((reference / "shards").glob("*.arrow"))[1]
    cache = tmp_path / "cache"
    (cache / "shards").mkdir(parents=True)
    rel = Path("shards") / shard.name

    def write_in_halves() -> None:
        data = shard.read_bytes()
        with open(cache / rel, "wb") as f:  # the final name, directly: what writers must not do
            f.write(data[: len(data) // 2])
            f.flush()
            time.sleep(0.3)
            f.write(data[len(data) // 2:])

    with FinalNameWatcher(cache, lambda r: check_cache_file(cache, r, reference)) as watch:
        writer = threading.Thread(target=write_in_halves)
        writer.start()
        writer.join()
    assert any("differs from the uninterrupted run's" in p for p in watch.problems), watch.problems
    assert check_cache_file(cache, rel, reference) is None  # complete in the end


def test_a_half_written_checkpoint_under_a_final_name_is_caught(ws, tmp_path):
    reference = ws.fit_reference.run
    run = tmp_path / "run"
    shutil.copytree(reference / "checkpoints" / "step-00000004", run / "checkpoints" / "step-00000004")
    assert left_checkpoints(run, reference) == []
    optimizer = run / "checkpoints" / "step-00000004" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    assert "does not load" in left_checkpoints(run, reference)[0]


def test_a_half_written_checkpoint_seen_while_a_run_writes_is_caught(ws, tmp_path):
    reference = ws.fit_reference.run
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    source = reference / "checkpoints" / "step-00000004"

    def write_in_halves() -> None:  # a final name first, then its files: what writers must not do
        final = run / "checkpoints" / "step-00000004"
        final.mkdir()
        for path in sorted(source.iterdir()):
            time.sleep(0.1)
            shutil.copyfile(path, final / path.name)

    watch = FinalNameWatcher(run, lambda rel: check_checkpoint(run, rel.name, reference),
                                    checkpoints=True)
    with watch:
        writer = threading.Thread(target=write_in_halves)
        writer.start()
        writer.join()
    assert watch.opened >= 2 and any("misses a file" in p for p in watch.problems), watch.problems
    assert check_checkpoint(run, "step-00000004", reference) is None  # complete in the end


def test_a_different_row_is_caught(ws, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(ws.training_cache, cache)
    assert compare_caches(cache, ws.training_cache) == []
    shutil.rmtree(cache)
    shutil.copytree(ws.foreign_cache, cache)
    assert compare_caches(cache, ws.training_cache)


# ----------------------------------------------------------------------------- the classes


def test_precompute_kill(ws):
    assert_passed(precompute_kill.trial_precompute_kill(ws, rng(0), 0))


@pytest.mark.parametrize("point,step", [
    ("model.safetensors", 4), ("optimizer.pt", 6), ("before-fsync", 8), ("before-rename", 10),
    ("after-rename", 12), ("deleting-old", 8),
    ("before-rename", 2),  # no checkpoint survives: a fresh restart
    ("in-step", 5), ("snapshot", 6),
    ("before-step-line", 4),  # the write done before the step's line: checkpoint 4 must not survive
])
def test_fit_kill_inside_a_checkpoint_write(ws, point, step):
    kill_point = {"step": step, "point": point, "fraction": 0.5}
    trial = fit_kill.KILL_POINTS.index(point) * 100 + step
    assert_passed(fit_kill.trial_fit_kill(ws, rng(1), trial, kill_point=kill_point))


def test_disk_full_in_stage_one(ws):
    assert_passed([disk_full.disk_full_precompute(ws, rng(2), 0)])


def test_disk_full_in_a_checkpoint_write(ws):
    assert_passed([disk_full.disk_full_checkpoint(ws, rng(2), 0)])


CORRUPTIONS = [
    "truncated shard", "missing shard", "bit flips in a shard",
    "bit flip in row data",
    "footer damage",
    "shard from another cache",
]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corruption(ws, tmp_path, kind):
    assert_passed([corruption.corruption_case(ws, rng(3), tmp_path, kind)])


@pytest.mark.parametrize("how", [
    "truncated", "key removed", "checksum changed", "length changed", "shards swapped",
    "byte flip",
    "path changed",
])
def test_manifest_damage(ws, tmp_path, how):
    assert_passed([corruption.corruption_case(ws, rng(4), tmp_path, "manifest damage", manifest_damage=how)])


def test_bad_input(ws):
    assert_passed(bad_input.trial_bad_input(ws, rng(5), 0))


def test_numeric_isolated(ws):
    assert_passed([numeric.numeric_isolated(ws, rng(7), 0)])


def test_numeric_persistent(ws):
    assert_passed([numeric.numeric_persistent(ws, rng(8), 0)])


@pytest.mark.parametrize("kind", untrusted.UNTRUSTED)
def test_untrusted(ws, tmp_path, kind):
    assert_passed([untrusted.untrusted_case(ws, rng(9), tmp_path, kind)])


def test_cli_prints_a_table_and_json(ws, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tests.faults", "--classes", "numeric", "--trials", "1",
                                      "--workdir", str(ws.root / "cli"), "--json"])
    harness.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fault class") and "numeric" in out[2]
    result = json.loads(out[-1])
    assert result["classes"]["numeric"]["trials"] == 1 and result["failures"] == 0


@pytest.mark.parametrize("case", ["mixed caches", "resume on another target", "eval on another target"])
def test_wrong_target(ws, case):
    assert_passed(refusals.trial_wrong_target(ws, rng(10), 0, case=case))


@pytest.mark.parametrize("case", ["before the first step", "after the holder was killed"])
def test_second_writer(ws, case):
    assert_passed(refusals.trial_second_writer(ws, rng(11), 0, case=case))


@pytest.mark.parametrize("case", ["empty file", "only malformed records", "every record cut away"])
def test_empty_input(ws, case):
    assert_passed(refusals.trial_empty_input(ws, rng(12), 0, case=case))
