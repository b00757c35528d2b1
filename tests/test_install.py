"""A regular (non-editable) install imports as dflash.* from outside the repository and puts
no top-level `kernels`, `train`, `shards` or `precompute` module on the path."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
COLLIDING = {"kernels", "kernel", "train", "shards", "precompute", "common", "testing"}


@pytest.fixture(scope="module")
def scratch_venv(tmp_path_factory) -> Path:
    """A fresh venv with only dflash installed from a wheel (dependencies come from the
    running environment through a .pth file, so the test needs no network)."""
    root = tmp_path_factory.mktemp("install")
    wheel_dir = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheel_dir), str(REPO)],
        check=True, cwd=root,
    )
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    (wheel,) = wheel_dir.glob("dflash-*.whl")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel],
                   check=True)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_regular_install_imports_from_outside_repo(scratch_venv, tmp_path):
    python = scratch_venv / "bin" / "python"
    code = (
        "import dflash.common, dflash.shards, dflash.kernels.loss, dflash.precompute, dflash.train\n"
        "for m in (dflash.common, dflash.shards, dflash.kernels.loss, dflash.precompute, dflash.train):\n"
        "    print(m.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True,
                         cwd=tmp_path, env=env).stdout.split()
    assert len(out) == 5
    for path in out:
        assert str(scratch_venv) in path, f"{path} was not imported from the scratch install"


def test_regular_install_adds_no_colliding_top_level_module(scratch_venv):
    python = scratch_venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    top_level = {p.name.removesuffix(".py") for p in site.iterdir()}
    assert "dflash" in top_level
    assert not COLLIDING & top_level
    assert not (site / "dflash" / "__init__.py").exists()  # dflash is a namespace package


def test_editable_install_resolves_to_repository_folders():
    import dflash.shards
    assert Path(dflash.shards.__file__).resolve().parent == REPO / "shards"


def test_repository_root_does_not_shadow_pypi_kernels():
    """From the repository root (on sys.path under `python -m` and pytest) `import kernels` is
    the PyPI package transformers imports (its hub_kernels integration), not a folder of ours."""
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(spec.origin if spec else 'absent')\n")
    where = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                           cwd=REPO).stdout.strip()
    assert where == "absent" or Path(where).parent.parent != REPO, (
        f"`import kernels` from the repository root finds the repository's own folder {where}")


def test_installed_regular_kernels_wins_over_the_repository_folder(tmp_path):
    """The repository's kernels/ has no __init__.py, so with the root first on sys.path it is
    only a namespace portion, and a regular package `kernels` later on the path (an installed
    PyPI `kernels`; here a stand-in right after the root, so the check holds where PyPI's is
    absent) is what `import kernels` gives; dflash.kernels still imports."""
    stand_in = tmp_path / "site" / "kernels"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("WHO = 'installed'\n")
    code = ("import sys\n"
            f"sys.path[:0] = [{str(REPO)!r}, {str(tmp_path / 'site')!r}]\n"
            "import kernels\n"
            "from dflash.kernels.loss import sparse_kl_loss\n"
            "print(kernels.WHO, callable(sparse_kl_loss))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""}).stdout.strip()
    assert out == "installed True"

