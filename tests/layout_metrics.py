"""Architecture figures of the tree, counted from the source by ``ast`` (no import).

Run: ``.venv/bin/python -m tests.layout_metrics`` (prints the figures and the places
they come from); ``tests/unit/test_layout.py`` asserts the bounds issue 52 set.

* **family comparisons**: ``==`` / ``!=`` / ``in`` / ``not in`` comparisons (and
  ``match`` cases) against a string constant naming a trained drafter family or one of
  its objectives (``"eagle"``, ``"medusa1"``, ``("eagle", "hass")``, ...), counted in
  every module outside the families' own folder (``speclab/families/``);
* **import circles**: strongly connected components (more than one module) of the graph
  "module A imports project module B" over every import, at module level or inside a
  function (a lazy import hides a circle, it does not remove it);
* **function-level imports**: ``import`` statements of project modules (``speclab``,
  ``serve_apps``, ``jobs``) inside a function body.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("speclab", "serve_apps", "jobs")
FAMILY_NAMES = frozenset({
    "eagle", "eagle3", "eagle3_talf", "hass", "talf", "medusa", "medusa1", "medusa2",
    "atspeed", "atspeed_s", "atspeed_r", "specdecpp", "mlp_speculator",
})


def modules() -> dict[str, Path]:
    """Every project module by dotted name -> its file."""
    found: dict[str, Path] = {}
    for base, pkg in ((ROOT / "platform", "speclab"), (ROOT, "serve_apps"), (ROOT, "jobs")):
        for path in sorted((base / pkg).rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(mod: str, node: ast.ImportFrom | ast.Import, name: str, is_pkg: bool) -> list[str]:
    """Dotted names a statement in module ``mod`` imports (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = mod.split(".")
        keep = len(parts) - node.level + (1 if is_pkg else 0)
        base = ".".join(parts[:keep] + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it sits inside a function."""
    def walk(node: ast.AST, in_fn: bool):
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, in_fn
            yield from walk(child, fn)
    yield from walk(tree, False)


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, int]]]:
    """(module -> project modules it imports, [(module, line) of function-level imports])."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    lazy: list[tuple[str, int]] = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node, in_fn in _imports(ast.parse(path.read_text())):
            targets = {t for t in _resolve(mod, node, "", is_pkg) if t in mods}
            if not targets:
                continue
            graph[mod] |= targets - {mod}
            if in_fn:
                lazy.append((mod, node.lineno))
    return graph, lazy


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)}
    return set()


def family_comparisons() -> list[tuple[str, int, str]]:
    """[(module, line, names)] of comparisons against family / objective names outside
    ``speclab.families``."""
    hits = []
    for mod, path in modules().items():
        if mod.startswith("speclab.families"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            sides: list[ast.AST] = []
            if isinstance(node, ast.Compare) and any(
                    isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops):
                sides = [node.left, *node.comparators]
            elif isinstance(node, ast.MatchValue):
                sides = [node.value]
            named = set().union(*(_names(s) for s in sides)) if sides else set()
            if named & FAMILY_NAMES:
                hits.append((mod, node.lineno, ",".join(sorted(named & FAMILY_NAMES))))
    return hits


def main() -> None:
    graph, lazy = import_graph()
    comps = circles(graph)
    fam = family_comparisons()
    print(f"family comparisons outside speclab.families: {len(fam)}")
    for mod, line, names in fam:
        print(f"  {mod}:{line}  {names}")
    print(f"import circles: {len(comps)}")
    for comp in comps:
        print(f"  ({len(comp)}) " + " ".join(comp))
    print(f"function-level imports of project modules: {len(lazy)}")
    if "-v" in sys.argv:
        by: dict[str, int] = {}
        for mod, _ in lazy:
            by[mod] = by.get(mod, 0) + 1
        for mod, n in sorted(by.items(), key=lambda kv: -kv[1]):
            print(f"  {n:4d} {mod}")


if __name__ == "__main__":
    main()
