"""8-10. What must be refused: another target's cache, a second writer on a run folder, an
empty input.

8. `wrong-target`: two copies of the training cache recording different target fingerprints
   (random ones, as two targets of one config would). Sub-cases: `fit` on both at once;
   resuming a run with the other target's cache; `eval` of a run on the other target's cache.
   Each must exit with one `Error:` line naming "another target" (no traceback), leave no new
   run folder (the mixed fit) and change nothing in the existing run (the resume); eval with
   `--allow-target-mismatch` must evaluate and carry the warning.
9. `second-writer`: a `fit` runs; a second `fit` on the same --out is launched at a random
   instant (before or after the first step). The second must exit non-zero at once, naming
   the first's pid; the first must finish with the reference run's checkpoint. A third
   sub-case SIGKILLs the holder: the next fit must take the lock over and resume.
10. `empty-input`: `dflash-precompute` on an empty file, a file of blank lines, a file of
   only malformed records, or records every one of which is cut away (prompts longer than
   --max-length). It must exit non-zero with one `Error:` line saying how many records were
   read and rejected and where the reasons are; `dflash-shards verify` on what it left must
   not say "ok".
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from tests.faults.bad_input import BAD_INPUT_KINDS
from tests.faults.workspace import Outcome, Workspace, quiet, same_final_run, wait_for


def _one_line_error(output: str, *needles: str) -> list[str]:
    """Problems unless `output` holds an `Error:` line with every needle and no traceback."""
    problems = []
    if "Traceback" in output:
        problems.append(f"traceback in the output: {output[-600:]}")
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    if len(errors) != 1:
        problems.append(f"expected one 'Error:' line, got {len(errors)}: {output[-600:]}")
    elif not all(needle in errors[0] for needle in needles):
        problems.append(f"the error does not name {needles}: {errors[0][:300]}")
    return problems


def _fingerprinted(ws: Workspace, dest: Path, fingerprint: str) -> Path:
    from dflash.shards.target_info import TargetInfo

    shutil.copytree(ws.training_cache, dest)
    info = TargetInfo.load(dest / "target")
    info.fingerprint = fingerprint
    info.save(dest / "target")
    return dest


def _tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------- wrong target


def trial_wrong_target(ws: Workspace, rng: np.random.Generator, trial: int,
                       case: str | None = None) -> list[Outcome]:
    root = ws.trial_dir("wrong-target", trial)
    a, b = (_fingerprinted(ws, root / name, "st-sample-v1:" + rng.bytes(32).hex()) for name in ("a", "b"))
    cases = ["mixed caches", "resume on another target", "eval on another target"]
    case = cases[int(rng.integers(0, len(cases)))] if case is None else case
    outcome = Outcome(case=case)
    if case == "mixed caches":
        first, second = (a, b) if rng.integers(0, 2) else (b, a)
        args = ws.fit_args(root / "run", max_steps=2)
        args[1] = str(first)
        child = ws.launch("fit", [*args, "--cache", str(second)])
        code = child.wait()
        if code == 0:
            outcome.problems.append("fit trained on caches of two targets")
        outcome.problems += _one_line_error(child.output, "another target", str(second))
        if (root / "run").exists():
            outcome.problems.append("the refused fit left a run folder")
        return [outcome]
    args = ws.fit_args(root / "run", max_steps=2)
    args[1] = str(a)
    child = ws.launch("fit", args)
    if child.wait() != 0:
        return [Outcome(case=case, problems=[f"the first fit failed: {child.output[-600:]}"])]
    if case == "resume on another target":
        # The run's cache folder rebuilt from another target (same path, same config).
        before = _tree(root / "run")
        shutil.copy2(b / "target" / "target.json", a / "target" / "target.json")
        child = ws.launch("fit", args)
        if child.wait() == 0:
            outcome.problems.append("the run resumed on another target's cache")
        outcome.problems += _one_line_error(child.output, "run.json", "target")
        after = _tree(root / "run")
        changed = sorted(k for k in after if before.get(k) != after[k] and k != ".lock")
        if changed:
            outcome.problems.append(f"the refused resume changed {changed}")
        return [outcome]
    from dflash.train.evaluate import EvalConfig, run_eval

    try:
        with quiet():
            run_eval(EvalConfig(run=str(root / "run"), cache=str(b), save=False), show_progress=False)
        outcome.problems.append("eval scored another target's cache")
    except ValueError as error:
        if "another target" not in str(error):
            outcome.problems.append(f"eval refused with another reason: {error}")
    with quiet():
        result = run_eval(EvalConfig(run=str(root / "run"), cache=str(b), save=False, allow_target_mismatch=True),
                          show_progress=False)
    if not any("another target" in w for w in result.get("warnings", [])):
        outcome.problems.append(f"--allow-target-mismatch evaluated without a warning: {result.get('warnings')}")
    return [outcome]


# ----------------------------------------------------------------------------- second writer


def trial_second_writer(ws: Workspace, rng: np.random.Generator, trial: int,
                        case: str | None = None) -> list[Outcome]:
    reference = ws.fit_reference
    root = ws.trial_dir("second-writer", trial)
    run = root / "run"
    cases = ["before the first step", "during training", "after the holder was killed"]
    case = cases[int(rng.integers(0, len(cases)))] if case is None else case
    outcome = Outcome(case=case)
    first = ws.launch("fit", ws.fit_args(run))
    if case == "before the first step":
        ready = wait_for(lambda: (run / ".lock").is_file() and (run / ".lock").stat().st_size > 0, first)
    else:
        steps = int(rng.integers(1, max(2, reference.total_steps // 2)))
        ready = wait_for(lambda: (run / "metrics.jsonl").is_file()
                         and len((run / "metrics.jsonl").read_text().splitlines()) >= steps, first)
    if not ready:
        first.wait()
        return [Outcome(case=case, notes=["the first fit ended before the second started"])]
    holder = first.process.pid
    if case == "after the holder was killed":
        first.kill()
        first.wait()
        again = ws.launch("fit", ws.fit_args(run))
        if again.wait() != 0:
            outcome.problems.append(f"the rerun after the holder died failed: {again.output[-600:]}")
        else:
            outcome.problems += same_final_run(run, reference)
        return [outcome]
    started = time.monotonic()
    second = ws.launch("fit", ws.fit_args(run))
    code = second.wait(120)
    outcome.counts["second writer exit ms"] = int(1000 * (time.monotonic() - started))
    if code == 0:
        outcome.problems.append("a second fit ran on a held run folder")
    outcome.problems += _one_line_error(second.output, f"pid {holder}", "in use")
    if first.wait() != 0:
        outcome.problems.append(f"the holder failed: {first.output[-600:]}")
    else:
        outcome.problems += same_final_run(run, reference)
    return [outcome]


# ----------------------------------------------------------------------------- empty input


def trial_empty_input(ws: Workspace, rng: np.random.Generator, trial: int,
                      case: str | None = None) -> list[Outcome]:
    root = ws.trial_dir("empty-input", trial)
    cases = ["empty file", "blank lines", "only malformed records", "every record cut away"]
    case = cases[int(rng.integers(0, len(cases)))] if case is None else case
    outcome = Outcome(case=case)
    data = root / "input.jsonl"
    extra: list[str] = []
    if case == "empty file":
        data.write_bytes(b"")
    elif case == "blank lines":
        data.write_bytes(b"\n" * int(rng.integers(1, 20)))
    elif case == "only malformed records":
        kinds = [k for k, (verdict, _) in BAD_INPUT_KINDS.items() if verdict == "reject" and k != "deeply nested JSON"]
        lines = [BAD_INPUT_KINDS[kinds[int(rng.integers(0, len(kinds)))]][1](rng)
                 for _ in range(int(rng.integers(1, 8)))]
        data.write_bytes(b"".join(line + b"\n" for line in lines))
    else:
        long = "hello " * int(rng.integers(200, 400))
        records = [{"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"}]}
                   for _ in range(int(rng.integers(1, 6)))]
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        extra = ["--max-length", "64"]
    args = ws.precompute_args(root / "cache")
    args[args.index("--data") + 1] = str(data)
    child = ws.launch("precompute", [*args, *extra])
    if child.wait() == 0:
        outcome.problems.append("dflash-precompute exited 0 without writing a sequence")
    outcome.problems += _one_line_error(child.output, "--data")
    if case != "empty file" and case != "blank lines":
        outcome.problems += [p for p in _one_line_error(child.output, "rejected.jsonl") if p not in outcome.problems]
    if (root / "cache" / "manifest.json").exists():
        from click.testing import CliRunner

        from dflash.shards.cli import main

        verify = CliRunner().invoke(main, ["verify", str(root / "cache")])
        if verify.exit_code == 0 or verify.output.startswith("ok"):
            outcome.problems.append(f"verify passes an empty cache: {verify.output[:200]}")
    return [outcome]
