"""The layout of the package itself, read from its source with ``ast`` (nothing is imported but
``multiattn`` and its registry; no framework): no import cycle, and no two modules of one name.

Framework-free: it runs in every environment.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set, Tuple

import multiattn
from multiattn._registry import BACKENDS

PACKAGE = Path(multiattn.__file__).resolve().parent
NAME = PACKAGE.name


def _modules() -> Dict[str, Path]:
    """Dotted module name -> file: a package is its ``__init__.py``."""
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _targets(mods: Dict[str, Path], current: str, is_package: bool, node: ast.AST) -> List[str]:
    """The modules of the package that one import statement names (a name imported from a
    module is that module; a submodule imported from a package is the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = current.split(".") if is_package else current.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        if f"{target}.{alias.name}" in mods:
            out.append(f"{target}.{alias.name}")
        elif target in mods:
            out.append(target)
    return out


def import_graph() -> Dict[str, Dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}, module-level
    and function-local imports alike (an import inside a function is a cycle waiting for the
    call that runs it).  The same rules as the project's hook (shared/hooks/import_cycles.py):
    importing a submodule runs its package's ``__init__`` too, which is not counted as an edge."""
    mods = _modules()
    edges: Dict[str, Dict[str, int]] = {m: {} for m in mods}
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(mods, module, is_package, node):
                    if target != module:
                        edges[module].setdefault(target, node.lineno)
    return edges


def strongly_connected(edges: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def shortest_cycle(edges: Dict[str, Dict[str, int]], component: List[str]) -> List[str]:
    """One shortest cycle through the component's first module: [a, b, ..., a]."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v]):
            if w == start:
                return paths[v] + [start]
            if w in inside and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component  # not reached: a component has a cycle through each of its modules


def _describe(edges: Dict[str, Dict[str, int]], cycle: List[str]) -> str:
    mods = _modules()
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        where = mods[a].relative_to(PACKAGE.parent)
        steps.append(f"    {a} imports {b} ({where}:{edges[a][b]})")
    return "\n".join(steps)


def test_the_package_has_no_import_cycle():
    """No set of modules imports each other, counting imports inside functions: a shared piece
    belongs in a leaf module that both sides import (as ``check/results.py`` for check/)."""
    edges = import_graph()
    components = strongly_connected(edges)
    report = [
        f"cycle among {', '.join(c)}; for instance:\n{_describe(edges, shortest_cycle(edges, c))}"
        for c in components
    ]
    assert not components, f"{len(components)} import cycle(s) in {NAME}:\n" + "\n".join(report)


def test_check_results_is_a_leaf():
    """``check/results.py`` (result files, framework versions), which the worker, the runners and
    the reports of check/ all import, imports none of them: of multiattn, only ``_registry``."""
    imported = import_graph()[f"{NAME}.check.results"]
    extra = sorted(set(imported) - {f"{NAME}._registry"})
    assert not extra, "check/results.py must stay a leaf; it imports " + ", ".join(
        f"{m} (line {imported[m]})" for m in extra
    )


# ---------------------------------------------------------------- one name, one module

# The one family of modules allowed to share a name: a framework's backend and its layers
# (``backends/torch.py`` and ``layers/torch.py``): the same name is the same framework, by design.
FRAMEWORK_PACKAGES = (f"{NAME}.backends", f"{NAME}.layers")
EVERYWHERE = ("__init__", "__main__")  # a package's own files, one per package by definition


def name_key(stem: str) -> str:
    """What two names must differ in: lower case, without leading underscores, without one
    trailing "s" (``checks`` and ``check``, ``_registry`` and ``registry`` are one name)."""
    key = stem.lower().lstrip("_")
    return key[:-1] if key.endswith("s") and len(key) > 1 else key


def named_things() -> List[Tuple[str, str, str]]:
    """(key, dotted name, stem) of every module and every package (a folder with __init__.py)."""
    out = []
    for dotted, path in _modules().items():
        if path.name == "__init__.py":  # the package itself, by its folder's name
            stem = dotted.rsplit(".", 1)[-1]
        else:
            stem = path.stem
            if stem in EVERYWHERE:
                continue
        out.append((name_key(stem), dotted, stem))
    return out


def _allowed(members: List[Tuple[str, str]]) -> bool:
    """A framework's modules in backends/ and layers/, each at most once there, named exactly
    as in ``multiattn._registry.BACKENDS``."""
    stems = {stem for _, stem in members}
    if len(stems) != 1 or next(iter(stems)) not in BACKENDS:
        return False
    parents = [dotted.rsplit(".", 1)[0] for dotted, _ in members]
    return all(p in FRAMEWORK_PACKAGES for p in parents) and len(set(parents)) == len(parents)


def test_no_two_modules_share_a_name():
    """Rule: no two modules or packages anywhere in multiattn/ have one name, where a name is
    compared in lower case, without leading underscores and without one trailing "s": so
    ``check/native.py`` and ``layers/native.py`` collide, and so do ``checks.py`` and the
    package ``check/``, or ``_registry.py`` and a ``registry.py``.  A reader (and a traceback,
    a grep, an editor's tab) must be able to tell them apart by name.

    Not counted: ``__init__`` and ``__main__``.  The one allowed family: a backend's module in
    ``backends/`` and its layers in ``layers/``, named exactly as the backend in
    ``multiattn._registry.BACKENDS`` (``backends/torch.py``, ``layers/torch.py``): the same
    name is the same framework, by design.  Such a name anywhere else (``check/torch.py``) is a
    collision."""
    by_key: Dict[str, List[Tuple[str, str]]] = defaultdict(list)
    for key, dotted, stem in named_things():
        by_key[key].append((dotted, stem))
    clashes = {
        key: sorted(dotted for dotted, _ in members)
        for key, members in by_key.items()
        if len(members) > 1 and not _allowed(members)
    }
    assert not clashes, "modules that share a name (rename one of each group):\n" + "\n".join(
        f"    {key!r}: {', '.join(names)}" for key, names in sorted(clashes.items())
    )


# ---------------------------------------------------------------- the rules themselves


def test_the_cycle_finder_finds_a_cycle_through_a_function_local_import():
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 5}}
    assert strongly_connected(edges) == [["a", "b", "c"]]
    assert shortest_cycle(edges, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    source = "def f():\n    from .worker import load\n"
    (node,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    mods = {f"{NAME}.check": Path(), f"{NAME}.check.worker": Path()}
    assert _targets(mods, f"{NAME}.check.native", False, node) == [f"{NAME}.check.worker"]


def test_the_name_rule():
    assert name_key("checks") == name_key("check") == "check"
    assert name_key("_registry") == name_key("registry")
    assert name_key("native") != name_key("native_wrappers")
    assert _allowed([(f"{NAME}.backends.torch", "torch"), (f"{NAME}.layers.torch", "torch")])
    assert not _allowed([(f"{NAME}.backends.torch", "torch"), (f"{NAME}.check.torch", "torch")])
    assert not _allowed([(f"{NAME}.check.native", "native"), (f"{NAME}.layers.native", "native")])


# -- the specialisations: the table of docs/architecture.md, specialise.ORDER and the adapters --


def _offered_by_adapters() -> dict:
    """specialisation -> the backends whose Ops subclass defines it (read from the source:
    no framework is imported)."""
    from multiattn.specialisations import OFFERS

    offered: dict = {name: set() for name in OFFERS}
    for path in sorted((PACKAGE / "backends").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name in offered:
                        offered[item.name].add(path.stem)
    return offered


def _specialisations_table() -> list:
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = text[text.index("## Specialisations") :]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1].strip("`"), cells[2]))
    return rows


def test_the_specialisations_table_matches_the_code():
    import inspect

    from multiattn import specialise
    from multiattn.specialisations import NOT_OFFERED, OFFERS, Specialisations

    from .test_specialisations import OFFERED_BY

    order = [(step, name) for step, names in specialise.ORDER.items() for name in names]
    assert sorted(name for _, name in order) == sorted(OFFERS)
    assert [(step, name) for step, asks in specialise._ASK.items() for name in asks] == order
    rows = _specialisations_table()
    assert [(step, name) for step, name, _ in rows] == order, (
        "docs/architecture.md's table is not ORDER's order"
    )
    adapters = _offered_by_adapters()
    for _, name, offered_by in rows:
        default_offers = "return NOT_OFFERED" not in inspect.getsource(getattr(Specialisations, name))
        if offered_by == "all (the default)":
            assert default_offers and not adapters[name], f"{name}: the table says every backend by default"
        else:
            listed = set(offered_by.split(", "))
            assert not default_offers and listed == adapters[name], (
                f"{name}: the table says {sorted(listed)}, the adapters define it in {sorted(adapters[name])}"
            )
            assert set(OFFERED_BY[name]) == listed, f"{name}: OFFERED_BY of the tests differs"
    assert NOT_OFFERED


STATE_FUNCTIONS = (
    "block_weights", "block_sums", "merge_sums", "merge_many", "finish", "combine", "log_sum_exp",
)  # fmt: skip


def test_the_partial_state_and_its_merge_are_written_once():
    """``multiattn.state`` alone defines the partial state's functions, and no function
    elsewhere takes both an exp and a log (the signature of an lse merge or a log-sum-exp):
    the block loops, the cache's split-K, ``combine_attention`` and the materialised lse all
    call it."""
    found = defaultdict(list)
    merges = []
    for name, path in _modules().items():
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name in STATE_FUNCTIONS + ("_online", "_merged"):
                found[node.name].append(name)
            body = ast.get_source_segment(source, node) or ""
            if name != f"{NAME}.state" and ".exp(" in body and ".log(" in body:
                merges.append(f"{name}.{node.name}")
    assert {fn: found[fn] for fn in STATE_FUNCTIONS} == {fn: [f"{NAME}.state"] for fn in STATE_FUNCTIONS}
    assert not any(found[old] for old in ("_online", "_merged")), dict(found)  # the copies before
    assert merges == [], f"an lse merge outside multiattn.state: {merges}"


def test_one_block_loop_forward_and_backward():
    """The block loop is written once: one forward and one backward (``blockwise.forward``,
    ``blockwise.backward``) run every call in blocks, in the framework's loop primitives or in
    Python's; no other function of the package loops over blocks (``.loop(``) or recomputes a
    block's gradients (``score_gradients``)."""
    loops, gradients = [], []
    for name, path in _modules().items():
        if f"{NAME}.backends." in name:
            continue
        source = path.read_text()
        tree = ast.parse(source)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
                    if inner.func.attr == "loop":
                        loops.append(f"{name}.{node.name}")
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name):
                    if inner.func.id == "score_gradients":
                        gradients.append(f"{name}.{node.name}")
    assert sorted(set(loops)) == [f"{NAME}.blockwise.backward", f"{NAME}.blockwise.forward"], loops
    assert gradients == [f"{NAME}.blockwise.backward"], gradients


def test_one_custom_gradient_wrapper_and_one_mask_of_a_block():
    """The block loop is differentiated through one wrapper (``blockwise.differentiated``,
    the package's one call of ``ops.custom_gradient`` for a loop; the other is the scores'
    product's finite-factor rule, ``state.scores``), and the masks of a block, of the whole
    scores, of a compiled loop's padded block and of a cache's splits are made by
    ``masks.block_visibility`` alone (no other module builds a mask from lengths, and the cache
    makes no positions of its own)."""
    calls = defaultdict(list)
    for name, path in _modules().items():
        if f"{NAME}.backends." in name:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("custom_gradient", "length_mask", "positions"):
                    calls[node.func.attr].append(name)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "block_visibility":
                    calls["block_visibility"].append(name)
    assert sorted(calls["custom_gradient"]) == [f"{NAME}.blockwise", f"{NAME}.state"], dict(calls)
    assert set(calls["length_mask"]) == {f"{NAME}.masks"}, dict(calls)
    assert f"{NAME}.cache" in calls["block_visibility"] and f"{NAME}.cache" not in calls["positions"]
