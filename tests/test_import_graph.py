"""No import cycles in lik: the graph of every import statement in ``src/lik`` (module level, inside functions and
under ``TYPE_CHECKING``) is acyclic, and every module imports in a fresh interpreter, in either order."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lik

SOURCE = Path(lik.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module under ``src/lik``: dotted name -> (file, is a package)."""
    modules = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)
    return modules


def _targets(node: ast.Import | ast.ImportFrom, module: str, package: bool, modules: dict) -> set[str]:
    """The lik modules an import statement loads (``from x import y`` loads ``x.y`` when that is a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [source] + [f"{source}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:  # an attribute, not a module: the module that defines it
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the lik modules it imports anywhere in its source. A module's own ancestor packages are left out:
    Python has begun importing them before the module runs, so an edge to one cannot start a cycle of its own."""
    modules = _modules()
    graph = {}
    for module, (path, package) in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(node, module, package, modules)
        graph[module] = {t for t in edges if t != module and not module.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_sees_a_function_level_cycle():
    # The finder itself: a cycle closed by an import inside a function, as measure / ceilings once had, is found.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = "def f():\n    from .ceilings import matmul\n"
    tree = ast.parse(source)
    modules = {"lik.bench.measure": None, "lik.bench.ceilings": None, "lik.bench": None}
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert _targets(node, "lik.bench.measure", False, modules) == {"lik.bench.ceilings"}


def test_graph_reads_the_known_edges():
    graph = import_graph()
    assert "lik.bench.measure" in graph["lik.bench.ceilings"]
    assert "lik.ops.maxsim.function" in graph["lik.retrieval.exact"]
    assert "lik" not in graph["lik.bench.measure"]  # an ancestor package: no edge


def test_lik_has_no_import_cycle():
    assert cycles(import_graph()) == []


_IMPORT_ALL = """
import importlib, sys
names = sys.argv[1:]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_every_module_imports_in_a_fresh_interpreter(order):
    names = sorted(m for m in _modules() if not m.endswith("__main__"))
    if order == "reversed":
        names.reverse()
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *names], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(len(names))
