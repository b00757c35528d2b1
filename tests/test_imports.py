"""The import graph, read from the source (no module is imported): every `import` and
`from ... import` statement under every folder the package installs (common/, shards/,
kernels/, precompute/, train/, testing/: pyproject.toml's package-dir table) and under bench/
and demo/, at module level, inside functions and under `if TYPE_CHECKING:` alike, since a lazy
import that hides a loop is still a loop.

Checked: no cycle among the modules of each of those folders; the layer rule, which reads
common <- shards <- {precompute, train}, with testing above both stages (common knows no torch
and no other dflash package; shards no torch and only common; kernels no other dflash package;
precompute and train never import each other, nor testing); nothing outside tests/ imports
`tests`; bench and demo import each other in at most one direction.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder in the repository -> the import name of its modules' package
FOLDERS = {
    "common": "dflash.common",
    "shards": "dflash.shards",
    "kernels": "dflash.kernels",
    "precompute": "dflash.precompute",
    "train": "dflash.train",
    "testing": "dflash.testing",
    "bench": "bench",
    "demo": "demo",
}
PACKAGES = list(FOLDERS.values())


def _module_name(folder: str, path: Path) -> str:
    parts = [FOLDERS[folder], *path.relative_to(ROOT / folder).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _scan() -> tuple[set[str], dict[str, set[str]]]:
    """(every module of the scanned folders, module -> every name it imports), a name being
    either one of those modules or an outside module's full dotted name."""
    sources = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            sources[_module_name(folder, path)] = path
    modules = set(sources)
    imports: dict[str, set[str]] = {}
    for module, path in sources.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, node.module] if node.module else anchor)
                else:
                    base = node.module
                # `from pkg import sub` imports the module pkg.sub; any other name comes from
                # pkg itself (its __init__, when pkg is a package). Parent packages, which
                # Python initialises first, are not counted as imports.
                submodules = {f"{base}.{a.name}" for a in node.names} & modules
                names.update(submodules)
                if len(submodules) < len(node.names):
                    names.add(base)
        imports[module] = names
    return modules, imports


MODULES, IMPORTS = _scan()


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _package_graph(package: str) -> dict[str, list[str]]:
    """module -> the modules of the same package it imports."""
    return {
        m: sorted(n for n in IMPORTS[m] if n in MODULES and _in(n, package))
        for m in sorted(MODULES)
        if _in(m, package)
    }


def _loops(graph: dict[str, list[str]]) -> list[str]:
    """The strongly connected components (Tarjan) of `graph` that hold a loop, each written as
    one loop through its first module and, when the component is larger than that loop, all
    its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    loops = []
    for component in components:
        loop = _loop_through(graph, set(component))
        line = " -> ".join(loop)
        if len(component) > len(loop) - 1:
            line += f"  (the loops join {', '.join(component)})"
        loops.append(line)
    return loops


def _loop_through(graph: dict[str, list[str]], component: set[str]) -> list[str]:
    """One loop inside a strongly connected component, from its first module back to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    return [*paths[v], start]
                if w in component and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no loop through {sorted(component)}")


def test_scan_sees_every_kind_of_import():
    """The scan finds lazy and type-only imports too: stage one's run imports torch.distributed
    only inside functions, its pipeline the target module only under TYPE_CHECKING, and a
    package's __init__ re-exports its submodules."""
    assert "torch.distributed" in IMPORTS["dflash.precompute.run"]
    assert "dflash.precompute.target" in IMPORTS["dflash.precompute.pipeline"]
    assert "dflash.shards.reader" in IMPORTS["dflash.shards"]
    assert "dflash.kernels.reference" in IMPORTS["dflash.kernels.loss"]  # a relative import
    assert len(MODULES) > 50


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": ["b"], "b": ["c"], "c": []}, []),
        ({"a": ["b"], "b": ["a"], "c": ["a"]}, ["a -> b -> a"]),
        ({"a": ["a"]}, ["a -> a"]),
        ({"a": ["b"], "b": ["c", "a"], "c": ["b"]}, ["a -> b -> a  (the loops join a, b, c)"]),
    ],
    ids=["none", "two", "self", "joined"],
)
def test_loop_finder(graph, expected):
    assert _loops(graph) == expected


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_loop_inside_package(package):
    loops = _loops(_package_graph(package))
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_every_installed_folder_is_scanned():
    """The scan covers each folder pyproject.toml installs as a dflash package, so a new one
    cannot escape the loop and layer checks."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {folder: name for name, folder in table.items()} == {
        f: n for f, n in FOLDERS.items() if n.startswith("dflash.")}


ABOVE_SHARDS = ["dflash.kernels", "dflash.precompute", "dflash.train", "dflash.testing"]
LAYER_RULES = [
    ("dflash.common", ["torch", "triton", "dflash.shards", *ABOVE_SHARDS]),
    ("dflash.shards", ["torch", "triton", *ABOVE_SHARDS]),
    ("dflash.kernels", ["dflash.common", "dflash.shards", "dflash.precompute", "dflash.train", "dflash.testing"]),
    ("dflash.precompute", ["dflash.train", "dflash.testing"]),
    ("dflash.train", ["dflash.precompute", "dflash.testing"]),
]


@pytest.mark.parametrize(("package", "forbidden"), LAYER_RULES, ids=[r[0] for r in LAYER_RULES])
def test_layer_rule(package, forbidden):
    """What a package may not import (everything outside the repository's own packages is free,
    and none of them imports bench, demo or tests)."""
    forbidden = [*forbidden, "bench", "demo", "tests"]
    wrong = sorted(
        f"{m} imports {n}"
        for m in MODULES
        if _in(m, package)
        for n in IMPORTS[m]
        if any(_in(n, f) for f in forbidden)
    )
    assert not wrong, "\n".join(wrong)


def test_nothing_outside_tests_imports_tests():
    wrong = sorted(f"{m} imports {n}" for m in MODULES for n in IMPORTS[m] if _in(n, "tests"))
    assert not wrong, "\n".join(wrong)


def test_bench_and_demo_import_each_other_one_way_at_most():
    def uses(a: str, b: str) -> list[str]:
        return sorted(f"{m} imports {n}" for m in MODULES if _in(m, a) for n in IMPORTS[m] if _in(n, b))

    bench_to_demo, demo_to_bench = uses("bench", "demo"), uses("demo", "bench")
    assert not (bench_to_demo and demo_to_bench), "\n".join(bench_to_demo + demo_to_bench)
