"""One table and one JSON object from the sections of bench/gpu_check.sh.

Each section of the GPU check is a bench script run with `--json`, whose stdout ends with one
JSON object; gpu_check.sh keeps each section's stdout in a log file and its exit status. This
script reads them back and prints:

- one line per check (a dict with "check", "value", "limit" and "ok", wherever it sits in a
  section's JSON: the scripts' `checks` lists), PASS or FAIL. A section's exit status says
  which of its checks are correctness checks: a script exits non-zero on a failed correctness
  check and zero on a missed goal (a speed or memory target), so a FAIL in a section that
  exited 0 is reported as a missed goal, not as a failure;
- the goal lines a section printed itself (lines of its log that start with PASS, FAIL or n/a);
- the section's scalar figures (the numeric leaves of its JSON outside the check lists, lists
  and per-parameter gradient tables, which stay in the section's own log above), so that a
  reading can be copied into bench/RESULTS.md without re-running anything;
- with --json, one JSON object as the last line: {"sections": {name: {"rc", "seconds", "json"}},
  "failed": [...], "goals_missed": [...]}.

Exit status: 1 when a section failed (non-zero exit, or no JSON report), else 0.

    python bench/gpu_report.py --logs DIR [--json]

DIR holds, per section NAME, `NAME.log` (its stdout), `NAME.rc` (its exit status) and
`NAME.seconds` (its wall time). A section whose log has no JSON last line (it crashed, or ran
out of time) is reported as such, with the last lines of its log.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path


def last_json(text: str) -> dict | None:
    """The last line of `text` that parses as a JSON object, or None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def split(node, path: str, checks: list[dict], figures: dict[str, float]) -> None:
    """Walk a section's JSON: dicts with "check" and "ok" go to `checks`, numeric leaves to `figures`."""
    if isinstance(node, dict):
        if "check" in node and "ok" in node:
            checks.append(node)
            return
        for key, value in node.items():
            if "gradient" in str(key):
                continue
            split(value, f"{path}.{key}" if path else str(key), checks, figures)
    elif isinstance(node, list):
        for value in node:  # checks may sit in lists; a list's figures stay in the log
            split(value, "", checks, {})
    elif isinstance(node, bool):
        return
    elif isinstance(node, (int, float)) and math.isfinite(node):
        figures[path] = node


GOAL_LINE = re.compile(r"^\s*(PASS|FAIL|n/a)\s")


def read_section(logs: Path, name: str) -> dict:
    log = (logs / f"{name}.log").read_text(errors="replace") if (logs / f"{name}.log").exists() else ""
    rc_file, s_file = logs / f"{name}.rc", logs / f"{name}.seconds"
    rc = int(rc_file.read_text().strip()) if rc_file.exists() else None
    seconds = float(s_file.read_text().strip()) if s_file.exists() else None
    report = last_json(log)
    checks: list[dict] = []
    figures: dict[str, float] = {}
    if report is not None:
        split(report, "", checks, figures)
    goals = [line.strip() for line in log.splitlines() if GOAL_LINE.match(line)]
    return {"rc": rc, "seconds": seconds, "json": report, "checks": checks, "figures": figures, "goals": goals,
            "tail": log.strip().splitlines()[-5:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logs", required=True, help="the folder gpu_check.sh wrote its section logs to")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    logs = Path(args.logs)
    names = [line.strip() for line in (logs / "sections").read_text().splitlines() if line.strip()]
    sections = {name: read_section(logs, name) for name in names}
    failed, goals_missed = [], []
    print(f"{'section':<14} {'rc':>3} {'s':>6}  check / figure")
    for name, section in sections.items():
        rc = "-" if section["rc"] is None else str(section["rc"])
        seconds = "-" if section["seconds"] is None else f"{section['seconds']:.0f}"
        print(f"{name:<14} {rc:>3} {seconds:>6}")
        if section["json"] is None:
            failed.append(f"{name}: no JSON report (crashed or out of time)")
            for line in section["tail"]:
                print(f"{'':<26}| {line}")
        elif section["rc"] not in (0, None):
            failed.append(f"{name}: exit status {section['rc']}")
        for check in section["checks"]:
            mark = "PASS" if check["ok"] else "FAIL"
            limit = check.get("limit")
            value = check.get("value")
            value = f"{value:.4g}" if isinstance(value, (int, float)) else str(value)
            print(f"{'':<26}{mark} {check['check']}: {value} (limit {limit})")
            if not check["ok"] and section["rc"] == 0:
                goals_missed.append(f"{name}: {check['check']}")
        for line in section["goals"]:
            print(f"{'':<26}{line}")
            if line.startswith("FAIL") and section["rc"] == 0:
                goals_missed.append(f"{name}: {line[4:].strip()}")
        for key, value in section["figures"].items():
            print(f"{'':<26}  {key} = {value:.6g}")
    print(f"gpu_check: {'FAIL: ' + '; '.join(failed) if failed else 'every section ran, no correctness failure'}")
    print(f"gpu_check: goals missed: {'; '.join(goals_missed) if goals_missed else 'none'}")
    if args.json:
        print(json.dumps({"bench": "gpu_check", "sections": {n: {k: s[k] for k in ("rc", "seconds", "json")}
                                                             for n, s in sections.items()},
                          "failed": failed, "goals_missed": goals_missed}))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
