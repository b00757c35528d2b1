"""Which target a run belongs to: its caches' fingerprint, recorded in RUN/run.json.

Stage one writes the target's weights fingerprint into CACHE/target/target.json
(dflash.common.fingerprint). `fit` refuses caches of different targets and records the
fingerprint in RUN/run.json; `eval` refuses a cache, or an online `--target`, of another
target unless told `--allow-target-mismatch` (then the report carries a warning). A cache
from before the fingerprint existed cannot be checked: a warning says so, nothing refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.common.files import write_json_atomic
from dflash.common.fingerprint import short
from dflash.shards.target_info import TARGET_INFO_FILE, TargetInfo
from dflash.train.run_folder import RUN_INFO_FILE


def cache_fingerprint(cache: Any) -> str | None:
    """The fingerprint CACHE/target/target.json records (None: not recorded)."""
    if not (Path(cache.target_dir) / TARGET_INFO_FILE).is_file():
        return None
    return TargetInfo.load(cache.target_dir).fingerprint


def caches_fingerprint(caches: list[Any]) -> tuple[str | None, list[str]]:
    """(the common fingerprint of `caches`, warnings); ValueError when two caches name
    different targets."""
    found = [(cache, cache_fingerprint(cache)) for cache in caches]
    known = [(cache, fp) for cache, fp in found if fp is not None]
    for cache, fp in known[1:]:
        if fp != known[0][1]:
            raise ValueError(
                f"--cache {cache.path} was built from another target than --cache {known[0][0].path} "
                f"(target fingerprints {short(fp)} and {short(known[0][1])}): train on caches of one target")
    warnings = [f"--cache {cache.path} records no target fingerprint (a synthetic cache, or one built before "
                "dflash-precompute recorded fingerprints): that it comes from the same target cannot be checked"
                for cache, fp in found if fp is None]
    return (known[0][1] if known else None), warnings


def read_run_info(run_dir: str | Path) -> dict[str, Any]:
    """RUN/run.json ({} when the run predates it)."""
    path = Path(run_dir) / RUN_INFO_FILE
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); delete it to record it afresh on resume") from None
    return info if isinstance(info, dict) else {}


def record_run_target(run_dir: str | Path, fingerprint: str | None, caches: list[Any]) -> None:
    """Write RUN/run.json; ValueError when the run was started on another target's caches."""
    path = Path(run_dir) / RUN_INFO_FILE
    saved = read_run_info(run_dir).get("target_fingerprint")
    if saved is not None and fingerprint is not None and saved != fingerprint:
        raise ValueError(
            f"{path}: the run was started on caches of target {short(saved)}; these caches are of "
            f"target {short(fingerprint)}: resume with the run's caches, or train into a new --out")
    write_json_atomic(path, {"target_fingerprint": fingerprint if fingerprint is not None else saved,
                             "caches": [str(Path(c.path).resolve()) for c in caches]}, indent=1)


def check_same_target(what: str, found: str | None, expected: str | None, *, allow: bool) -> str | None:
    """Compare `what`'s fingerprint with the run's: None when they agree, a warning when one is
    unknown or (with `allow`) they differ; ValueError when they differ."""
    if found is None or expected is None:
        missing = "the run" if expected is None else what
        return f"{missing} records no target fingerprint: that {what} is of the run's target is not checked"
    if found == expected:
        return None
    message = (f"{what} is of another target than the run (target fingerprint {short(found)}, the "
               f"run's {short(expected)})")
    if not allow:
        raise ValueError(f"{message}: evaluate against the run's target, or pass --allow-target-mismatch")
    return f"{message}; evaluated anyway (--allow-target-mismatch)"


__all__ = ["RUN_INFO_FILE", "cache_fingerprint", "caches_fingerprint", "check_same_target", "read_run_info",
           "record_run_target"]
