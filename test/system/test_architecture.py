"""Architecture rules: the import contracts of .importlinter, no import cycle inside tta_core
(between modules, and between packages), paper rooms that import no other room, and a size
limit on functions. Classes have no
size limit: one class per concept, however long, reads better than mixins cut to fit."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import grimp
import pytest
from helpers import ROOT

SIZED_TREES = ("tta_core", "tta_ros", "kernels")
MAX_FUNCTION_LINES = 60


def _lint_imports(*args: str) -> subprocess.CompletedProcess:
    """`lint-imports` from the repo root (it puts the cwd first on sys.path), no cache."""
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    return subprocess.run([exe, "--no-cache", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)


def test_import_contracts_are_kept() -> None:
    proc = _lint_imports()
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_a_broken_contract_fails_lint_imports(tmp_path) -> None:
    """The check can fail: a contract the code certainly breaks is reported by name."""
    name = "methods never use the api (broken on purpose)"
    config = tmp_path / "broken.ini"
    config.write_text("[importlinter]\nroot_packages =\n    tta_core\n\n"
                      "[importlinter:contract:broken]\n"
                      f"name = {name}\ntype = forbidden\n"
                      "source_modules =\n    tta_core.methods\n"
                      "forbidden_modules =\n    tta_core.api\n")
    proc = _lint_imports("--config", str(config))
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert f"{name} BROKEN" in proc.stdout, proc.stdout[-3000:]


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node (iterative DFS)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    work: list[tuple[str, Iterator[str]]] = []  # DFS path: node, its unvisited successors
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        work.append((v, iter(sorted(graph.get(v, ())))))

    for root in sorted(graph):
        if root not in index:
            visit(root)
        while work:
            v, successors = work[-1]
            w = next(successors, None)
            if w is None:  # v is done: close its component if it is the root of one
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while not component or component[-1] != v:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        found.append(sorted(component))
            elif w not in index:
                visit(w)
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return found


def _cycle_through(graph: Mapping[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as [a, b, ..., a] (BFS)."""
    start, members = component[0], set(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def test_cycle_finder_reports_cycles_and_only_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c", "x"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"},
             "f": {"f"}, "x": {"b"}}
    assert strongly_connected(graph) == [["d", "e"], ["a", "b", "c", "x"]]
    assert _cycle_through(graph, ["a", "b", "c", "x"]) == ["a", "b", "c", "a"]
    assert _cycle_through(graph, ["d", "e"]) == ["d", "e", "d"]


def test_no_import_cycles_inside_tta_core() -> None:
    """grimp counts every import, also those inside functions and under TYPE_CHECKING."""
    g = grimp.build_graph("tta_core", cache_dir=None)
    graph = {m: {i for i in g.find_modules_directly_imported_by(m) if i.startswith("tta_core")}
             for m in g.modules if m.startswith("tta_core")}
    cycles = [" -> ".join(_cycle_through(graph, c)) for c in strongly_connected(graph)]
    assert not cycles, "import cycles in tta_core:\n" + "\n".join(cycles)


def package_of(module: str) -> str:
    """The tta_core package a module belongs to: tta_core.<first part> (a top-level module
    such as tta_core.api is a package of its own here)."""
    return ".".join(module.split(".")[:2])


def package_cycles(g: grimp.ImportGraph) -> list[str]:
    """Cycles between tta_core's packages (every module import collapsed onto its
    package), one shortest cycle per strongly connected set of packages."""
    graph: dict[str, set[str]] = {}
    for m in g.modules:
        if not m.startswith("tta_core."):
            continue
        graph.setdefault(package_of(m), set()).update(
            package_of(i) for i in g.find_modules_directly_imported_by(m)
            if i.startswith("tta_core.") and package_of(i) != package_of(m))
    return [" -> ".join(_cycle_through(graph, c)) for c in strongly_connected(graph)]


def test_no_package_cycles_inside_tta_core() -> None:
    cycles = package_cycles(grimp.build_graph("tta_core", cache_dir=None))
    assert not cycles, "package cycles in tta_core:\n" + "\n".join(cycles)


def test_a_deliberate_package_cycle_is_found() -> None:
    """The check can fail: one import from the model zoo into AdaShadow's planner (which
    imports tta_core.model) closes a cycle model -> adashadow -> model."""
    g = grimp.build_graph("tta_core", cache_dir=None)
    g.add_import(importer="tta_core.model.zoo", imported="tta_core.adashadow.planner")
    cycles = package_cycles(g)
    assert any("tta_core.model" in c and "tta_core.adashadow" in c for c in cycles), cycles


PAPER_ROOMS = ("adashadow", "darda", "elasticdnn", "surgeon", "daf")
ROOMS = (*PAPER_ROOMS, "methods")  # the paper rooms and the baselines


def room_imports(g: grimp.ImportGraph) -> list[str]:
    """Each paper room's import of another room or of the baselines, direct or through
    other modules, as 'importer -> ... -> imported' (the shortest chain per pair)."""
    found = []
    for room in PAPER_ROOMS:
        for other in ROOMS:
            if other == room:
                continue
            chain = g.find_shortest_chain(importer=f"tta_core.{room}",
                                          imported=f"tta_core.{other}", as_packages=True)
            if chain:
                found.append(" -> ".join(chain))
    return found


def test_paper_rooms_import_no_other_room_and_no_baseline() -> None:
    """What two rooms share sits below them (runtime, domain, the building blocks)."""
    g = grimp.build_graph("tta_core", cache_dir=None)
    offenders = room_imports(g)
    assert not offenders, "paper room imports another room:\n" + "\n".join(offenders)
    upstream = {m for room in PAPER_ROOMS
                for m in g.find_upstream_modules(f"tta_core.{room}", as_package=True)}
    assert not {package_of(m) for m in upstream} & {f"tta_core.{r}" for r in ROOMS}


def test_a_deliberate_room_import_is_found() -> None:
    """The check can fail: SURGEON importing a baseline, or a lazy import of the DAF room
    deep inside AdaShadow's engine, is reported with its chain."""
    g = grimp.build_graph("tta_core", cache_dir=None)
    g.add_import(importer="tta_core.surgeon.method", imported="tta_core.methods.cotta")
    g.add_import(importer="tta_core.adashadow.engine", imported="tta_core.daf.plans")
    found = room_imports(g)
    assert "tta_core.surgeon.method -> tta_core.methods.cotta" in found, found
    assert "tta_core.adashadow.engine -> tta_core.daf.plans" in found, found


def test_the_registry_and_the_baselines_do_not_import_each_other() -> None:
    """The registry finds the method modules by name; the baselines' package re-exports
    nothing from it (each baseline module imports `register`, downward)."""
    g = grimp.build_graph("tta_core", cache_dir=None)
    assert not g.find_modules_directly_imported_by("tta_core.methods")
    assert not {m for m in g.find_modules_directly_imported_by("tta_core.registry")
                if m.startswith("tta_core")}


def _too_long(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
            yield (f"{path.relative_to(ROOT)}:{node.lineno} function {node.name}: "
                   f"{lines} lines > {MAX_FUNCTION_LINES}")


@pytest.mark.parametrize("tree", SIZED_TREES)
def test_functions_stay_short(tree: str) -> None:
    offenders = [o for p in sorted((ROOT / tree).rglob("*.py")) for o in _too_long(p)]
    assert not offenders, "\n".join(offenders)
