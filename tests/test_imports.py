"""kvlib's imports run one way (COURSE.md: runtime -> attention -> model -> ...): no module imports another
that imports it back, directly or through others, not even lazily inside a function.

The graph is read from the source (ast), not from an import: every ``import`` and ``from ... import`` in a
module counts, at the top, inside functions and under ``if``/``try`` alike, since a lazy import that closes
a circle still ties the two modules together. An edge goes to the kvlib module named (``from . import
runtime`` -> kvlib.runtime; ``from .model import Transformer`` -> kvlib.model; a name that is not a
submodule -> the module it is taken from, a package's ``__init__``). A submodule's implicit import of its
parent package is not an edge: Python does that for every submodule.
"""

import ast
from pathlib import Path

import kvlib

ROOT = Path(kvlib.__file__).resolve().parent


def kvlib_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package's __init__.py is the package itself)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("kvlib",) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(kvlib module imported, line) for every import statement in the file, wherever it sits."""
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "kvlib" or alias.name.startswith("kvlib."):
                    found.append((_known_prefix(alias.name, modules), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                base = ".".join(base)
            else:
                base = node.module or ""
            if base != "kvlib" and not base.startswith("kvlib."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in modules else _known_prefix(base, modules), node.lineno))
    return [(target, line) for target, line in found if target and target != name]


def _known_prefix(dotted: str, modules) -> str | None:
    """The longest prefix of ``dotted`` that is a kvlib module (``import kvlib.bench.sweeps`` -> that module)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported kvlib module: the first line importing it}."""
    modules = kvlib_modules(root)
    graph = {}
    for name, path in modules.items():
        edges = {}
        for target, line in imports_of(name, path, modules):
            edges.setdefault(target, line)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a closed path."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_in(component, graph) for component in components]


def _circle_in(component: set[str], graph) -> list[str]:
    """A shortest closed path through the component's first module (breadth-first inside the component)."""
    start = min(component)
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w in component and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle found in {sorted(component)}")  # a component of >1 module always has one


def describe(circle: list[str], graph, root: Path = ROOT) -> str:
    """'a -> b -> a (a.py line 3 imports b; b.py line 9 imports a)'."""
    modules = kvlib_modules(root)
    where = [f"{modules[a].relative_to(root.parent).as_posix()} line {graph[a][b]} imports {b}"
             for a, b in zip(circle, circle[1:])]
    return f"{' -> '.join(circle)} ({'; '.join(where)})"


def test_the_graph_sees_top_level_and_lazy_imports():
    graph = import_graph()
    assert "kvlib.runtime" in graph["kvlib.model"]  # load_tiny's lazy `from . import runtime`
    assert "kvlib.cache" in graph["kvlib.generate"]  # a top-level `from .cache import check_int`
    assert "kvlib.model" in graph["kvlib.pretrained"]
    circle = cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}})
    assert circle == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_a_lazy_import_that_closes_a_circle_is_named(tmp_path):
    """The circle this test was written for (issue 39): model.py imported pretrained.py inside a function,
    pretrained.py imported model.py at its top."""
    root = tmp_path / "kvlib"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("from . import runtime\n")
    (root / "runtime.py").write_text("import os\n")
    (root / "model.py").write_text("from . import runtime\n\n\ndef load():\n    from .pretrained import load\n")
    (root / "pretrained.py").write_text("import numpy\nfrom .model import load\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "a.py").write_text("from ..runtime import os\nimport kvlib.sub.b\n")
    (root / "sub" / "b.py").write_text("from kvlib.sub import a\n")
    graph = import_graph(root)
    assert graph["kvlib"] == {"kvlib.runtime": 1} and graph["kvlib.pretrained"] == {"kvlib.model": 2}
    found = sorted(describe(circle, graph, root) for circle in cycles(graph))
    assert found == ["kvlib.model -> kvlib.pretrained -> kvlib.model (kvlib/model.py line 5 imports kvlib.pretrained; "
                     "kvlib/pretrained.py line 2 imports kvlib.model)",
                     "kvlib.sub.a -> kvlib.sub.b -> kvlib.sub.a (kvlib/sub/a.py line 2 imports kvlib.sub.b; "
                     "kvlib/sub/b.py line 1 imports kvlib.sub.a)"]


def test_no_import_cycle_among_kvlib_modules():
    graph = import_graph()
    found = [describe(circle, graph) for circle in cycles(graph)]
    assert not found, "import cycles among kvlib modules:\n" + "\n".join(found)


def test_checkpoint_model_pretrained_run_one_way():
    """checkpoint -> model -> pretrained: kvlib.checkpoint reads files without the model classes (it imports no
    kvlib module), kvlib.model builds the Transformer from them, kvlib.pretrained gathers both."""
    graph = import_graph()
    assert not graph["kvlib.checkpoint"]
    assert "kvlib.checkpoint" in graph["kvlib.model"] and "kvlib.pretrained" not in graph["kvlib.model"]
    assert {"kvlib.checkpoint", "kvlib.model"} <= set(graph["kvlib.pretrained"])
