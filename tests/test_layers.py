"""The package's layers: the import graph of dsv_ext has no circles, imports point down the layers and
the library never imports the application (this is the import-graph check of docs/DEVELOPING.md);
old module paths still work.

(a) Every dsv_ext/**/*.py is read with ``ast`` (imports anywhere in a file count, also those inside
    functions: a lazy import is still a dependency), relative imports are resolved, and the graph
    of module -> imported module must have no cycle and no edge from the library (everything
    outside dsv_ext/app) into dsv_ext.app. An import of a dsv_ext name that is no module file (an
    old path served by dsv_ext/_compat.py, a typo) fails too: inside the package only the new
    paths are used. Every module belongs to a layer of ``LAYERS``; an import may point down or
    within its layer only.
(b) Every old path in ``dsv_ext._compat.MOVED`` imports with a DeprecationWarning and gives the
    same module object (same classes and functions) as the new path.
(c) ``python -m dsv_ext.train --help`` (old path) and ``python -m dsv_ext.app.train --help`` exit 0.
"""
import ast
import importlib
import os
import subprocess
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "dsv_ext")
APP = "dsv_ext.app"

# The layers of docs/DEVELOPING.md, bottom up; a module is in the layer of the longest prefix of its
# name listed here. Imports point down or within a layer.
LAYERS = [
    ("ops", ["dsv_ext", "dsv_ext._compat", "dsv_ext.ops", "dsv_ext.reference", "dsv_ext._buildcheck",
             "dsv_ext.config", "dsv_ext.grouping", "dsv_ext.recall"]),
    ("functional cores", ["dsv_ext.functional"]),
    ("modules", ["dsv_ext.modules"]),
    # the installation report (python -m dsv_ext.info) reads the dispatcher's calibration tables
    ("drivers", ["dsv_ext.control", "dsv_ext.adopt", "dsv_ext.parallel", "dsv_ext.info", "dsv_ext.__main__"]),
    ("application", [APP]),
]

# Known exceptions to the rules, each with its reason (none today: keep it that way). An entry
# whose edge no longer exists fails the test.
KNOWN_UPWARD_EDGES = {}
KNOWN_CIRCLE_EDGES = {}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def _sources():
    out = {}
    for folder, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                out[_module_name(path)] = path
    return out


SOURCES = _sources()


def _is_package(name: str) -> bool:
    return SOURCES.get(name, "").endswith("__init__.py")


def _graph():
    """{module: {imported module: (file, line)}} and a list of problems (imports of names that
    are no module of the package)."""
    edges, bad = {}, []
    for mod, path in sorted(SOURCES.items()):
        tree = ast.parse(open(path).read(), path)
        out = edges.setdefault(mod, {})
        pkg = mod if _is_package(mod) else mod.rpartition(".")[0]
        where = lambda node: (os.path.relpath(path, ROOT), node.lineno)  # noqa: E731
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    base_parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [(base, a.name) for a in node.names]
            for base, name in targets:
                if base != "dsv_ext" and not base.startswith("dsv_ext."):
                    continue
                if name is not None and f"{base}.{name}" in SOURCES:
                    target = f"{base}.{name}"  # from package import submodule
                elif base in SOURCES:
                    target = base
                else:
                    bad.append(f"{where(node)[0]}:{node.lineno} imports {base}, which is no module of "
                               "the package (an old path? use the new one)")
                    continue
                if target != mod:
                    out.setdefault(target, where(node))
    return edges, bad


def _cycles(edges):
    """Strongly connected components with more than one module (Tarjan), each with one circle
    through it as a list of modules."""
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    circles = []
    for comp in comps:  # a shortest circle back to comp[0], by breadth-first search inside comp
        start, members = comp[0], set(comp)
        prev, frontier, found = {start: None}, [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(edges.get(v, {})):
                    if w == start:
                        found = v
                        break
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path, v = [], found
        while v is not None:
            path.append(v)
            v = prev[v]
        circles.append(path[::-1] + [start])
    return circles


def _describe(path, edges):
    return " -> ".join(path) + "  (" + "; ".join(
        f"{a} -> {b} at {edges[a][b][0]}:{edges[a][b][1]}" for a, b in zip(path, path[1:])) + ")"


def _knots(edges):
    """The circles of ``edges``, each described with the file and line of every import on it."""
    return [_describe(c, edges) for c in _cycles(edges)]


def test_import_graph_has_no_circles_and_the_library_never_imports_the_app():
    edges, bad = _graph()
    assert not bad, "\n".join(bad)
    assert len(edges) > 30 and APP in edges and "dsv_ext.ops" in edges, sorted(edges)

    up = [f"{a} -> {b} at {f}:{line}" for a, out in sorted(edges.items()) for b, (f, line) in sorted(out.items())
          if not (a == APP or a.startswith(APP + ".")) and (b == APP or b.startswith(APP + "."))]
    assert not up, "the library imports the application (dsv_ext.app): " + "; ".join(up)

    stale = [f"{a} -> {b}" for a, b in KNOWN_CIRCLE_EDGES if b not in edges.get(a, {})]
    assert not stale, f"KNOWN_CIRCLE_EDGES lists edges that no longer exist (remove them): {stale}"
    pruned = {a: {b: w for b, w in out.items() if (a, b) not in KNOWN_CIRCLE_EDGES}
              for a, out in edges.items()}
    circles = _knots(pruned)
    assert not circles, "import circles in dsv_ext (one circle per knot shown):\n" + "\n".join(circles)


def _layer(mod: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and (best is None or len(pre) > best[1]):
                best = (i, len(pre))
    return -1 if best is None else best[0]


def test_imports_point_down_the_layers():
    edges, _ = _graph()
    unplaced = sorted(m for m in edges if _layer(m) < 0)
    assert not unplaced, f"modules in no layer (add them to LAYERS and docs/DEVELOPING.md): {unplaced}"
    stale = [f"{a} -> {b}" for a, b in KNOWN_UPWARD_EDGES if b not in edges.get(a, {})]
    assert not stale, f"KNOWN_UPWARD_EDGES lists edges that no longer exist (remove them): {stale}"
    up = [f"{a} ({LAYERS[_layer(a)][0]}) -> {b} ({LAYERS[_layer(b)][0]}) at {f}:{line}"
          for a, out in sorted(edges.items()) for b, (f, line) in sorted(out.items())
          if _layer(b) > _layer(a) and (a, b) not in KNOWN_UPWARD_EDGES]
    assert not up, "imports pointing up the layers:\n" + "\n".join(up)


def test_cycle_search_finds_a_circle():
    """The checker itself: a made-up graph with a circle of three and a self-contained tail."""
    w = ("f.py", 1)
    edges = {"a": {"b": w}, "b": {"c": w}, "c": {"a": w, "d": w}, "d": {}}
    assert _cycles(edges) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b": w}, "b": {}}) == []
    assert "a -> b at f.py:1" in _describe(["a", "b", "c", "a"], edges)


def test_known_app_layer_imports_are_seen():
    """The graph sees relative imports inside functions (compare -> seeds, train -> checkpoint) and
    absolute ones (the DiT -> the library's attention)."""
    edges, _ = _graph()
    assert "dsv_ext.app.seeds" in edges["dsv_ext.app.compare"]
    assert "dsv_ext.app.checkpoint" in edges["dsv_ext.app.train"]
    assert any(b.startswith("dsv_ext.") and not b.startswith(APP) for b in edges["dsv_ext.app.models.dit"])
    assert "dsv_ext.app.common" in edges["dsv_ext.app.sample"]
    assert "dsv_ext.app.train" not in edges["dsv_ext.app.sample"]
    assert "dsv_ext.app.train" not in edges["dsv_ext.app.evaluate"]


MOVED = sorted(importlib.import_module("dsv_ext._compat").MOVED.items())


@pytest.mark.parametrize("old,new", MOVED, ids=[o for o, _ in MOVED])
def test_old_path_imports_with_a_warning(old, new):
    # a fresh import of the old name: forget it (and its old submodules) first
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == old or k.startswith(old + ".")}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mod = importlib.import_module(old)
        assert any(issubclass(w.category, DeprecationWarning) and old in str(w.message) and new in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
        target = importlib.import_module(new)
        assert mod is target, f"{old} gave {mod!r}, not {new}"
        assert target.__name__ == new and target.__spec__.name == new
        public = [n for n in getattr(target, "__all__", []) if hasattr(target, n)]
        assert all(getattr(mod, n) is getattr(target, n) for n in public)
    finally:
        for k, v in saved.items():
            sys.modules.setdefault(k, v)


def test_old_package_submodule_is_not_loaded_twice():
    """dsv_ext.models.dit (an old package's submodule) is the module of the new path, not a second
    copy found as a file in the new package's folder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import dsv_ext.models.dit as old_dit
    from dsv_ext.app.models import dit
    assert old_dit is dit and dit.__name__ == "dsv_ext.app.models.dit"
    assert sys.modules["dsv_ext.models.dit"] is dit
    import dsv_ext
    from dsv_ext.app import models
    assert dsv_ext.models is models and dsv_ext.models.VideoDiT is dit.VideoDiT


@pytest.mark.parametrize("module,warns", [("dsv_ext.train", True), ("dsv_ext.app.train", False)])
def test_train_command_help(module, warns):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="always::DeprecationWarning")
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "usage: python -m dsv_ext.app.train" in r.stdout and "--config" in r.stdout
    said = "python -m dsv_ext.train is deprecated; use python -m dsv_ext.app.train" in r.stderr
    assert said == warns, r.stderr
