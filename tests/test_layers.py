"""The layers of DESIGN.md, read from the source: every import in `offloadpp` (module level and
inside functions), as a graph of modules.

    cli -> bench -> profiling, integrations -> assemble -> runtime -> io, optim -> planner

Each import points down (or stays inside its own package); the runtime never reaches profiling,
integrations, the CLI or the benchmarks; the planner imports neither torch nor anything outside
itself but the standard library and pydantic; the native module is reached only through io and
optim; and there are no circles between packages.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "offloadpp"

# Rank of each part: an import may go to a lower rank or stay within its own part.
RANKS = {
    "offloadpp": 9,  # the package face: initialize() and friends
    "offloadpp.__main__": 9,
    "offloadpp.checkpoint_utils": 9,  # the package face's checkpoint functions (zero_to_fp32's counterpart)
    "offloadpp.cli": 8,
    "offloadpp.bench": 7,
    "offloadpp.profiling": 6,
    "offloadpp.integrations": 6,
    "offloadpp.assemble": 5,
    "offloadpp.runtime": 4,
    "offloadpp.io": 3,
    "offloadpp.optim": 3,
    "offloadpp._C": 2,
    "offloadpp.planner": 1,
    "offloadpp.presets": 1,  # model presets: a leaf the CLI, benchmarks and examples share
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Absolute names of everything `name` imports (modules, or module.attribute)."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself;
            # and pkg itself in any case: a package's face (its __init__) runs first, and is where
            # a name not a submodule comes from
            out.update(f"{mod}.{a.name}" for a in node.names)
            out.add(mod)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods) | {"offloadpp._C"}
    graph = {}
    for name, path in mods.items():
        edges = set()
        for imp in _imports(name, path):
            if not imp.startswith("offloadpp"):
                continue
            while imp not in known and "." in imp:
                imp = imp.rsplit(".", 1)[0]
            if imp in known and imp != name:
                edges.add(imp)
        graph[name] = edges
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_every_module_has_a_layer():
    assert {_part(m) for m in _modules()} <= set(RANKS), "a new part of offloadpp needs a rank here"


def test_imports_point_down():
    bad = [
        f"{m} -> {t}"
        for m, targets in _graph().items()
        for t in targets
        if _part(m) != _part(t) and RANKS[_part(t)] >= RANKS[_part(m)]
    ]
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_runtime_never_imports_what_stands_above_it():
    above = (
        "offloadpp.profiling",
        "offloadpp.integrations",
        "offloadpp.cli",
        "offloadpp.bench",
        "offloadpp.assemble",
    )
    bad = [f"{m} -> {t}" for m, ts in _graph().items() if _part(m) == "offloadpp.runtime" for t in ts
           if _part(t) in above]  # fmt: skip
    assert not bad, bad


def test_native_module_only_through_io_and_optim():
    bad = [
        m
        for m, ts in _graph().items()
        if "offloadpp._C" in ts and _part(m) not in ("offloadpp.io", "offloadpp.optim")
    ]
    assert not bad, f"reach offloadpp._C through offloadpp.io or offloadpp.optim: {bad}"


def test_planner_imports_only_itself_the_stdlib_and_pydantic():
    allowed = set(sys.stdlib_module_names) | {"pydantic", "__future__"}
    for name, path in _modules().items():
        if _part(name) != "offloadpp.planner":
            continue
        for imp in _imports(name, path):
            top = imp.split(".")[0]
            if imp.startswith("offloadpp"):
                assert imp.startswith("offloadpp.planner"), f"{name} imports {imp}"
            elif top:
                assert top in allowed, f"{name} imports {imp}"


def test_no_circles_between_packages():
    parts: dict[str, set[str]] = {}
    for m, ts in _graph().items():
        parts.setdefault(_part(m), set()).update(_part(t) for t in ts if _part(t) != _part(m))

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in parts.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted(p for p in parts if p in reach(p))
    assert not circles, f"packages that import themselves back: {circles}"


def test_modules_import_their_siblings_not_their_package_face():
    """Inside a package, a module imports the sibling it needs, never the package's __init__
    (which imports the module back: an import-order trap)."""
    mods = _modules()
    bad = []
    for m, ts in _graph().items():
        if mods[m].name == "__init__.py":
            continue
        pkg = m.rsplit(".", 1)[0]
        if pkg != "offloadpp" and pkg in ts:
            bad.append(f"{m} -> {pkg}")
    assert not bad, bad


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles_between_modules():
    """No module reaches itself through its imports: every import counts (inside functions and
    under TYPE_CHECKING too: a circle there is still two modules that each need the other), and a
    package's face (its __init__) is a module like any other, so `from offloadpp.io import X`
    inside a module that offloadpp/io/__init__.py imports is a circle."""
    circles = _circles(_graph())
    assert not circles, "modules that import themselves back:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
