"""Draw the import graph of ``nbremote.rpc``: ``python docs/import_graph.py docs/imports.png``.

Every module of the package is a node (grouped by subpackage); every import between two of them is an
edge, drawn by kind: solid at module level, dashed under ``if TYPE_CHECKING:``, dotted inside a
function. Edges that close a circle (both ends in one strongly connected component) are red, and the
circles are printed. Needs Graphviz's ``dot`` for a picture; without it the ``.dot`` file is written.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "nbremote.rpc"
STYLE = {"top": "solid", "type": "dashed", "local": "dotted"}


def modules(package: str = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file, for every module of ``package`` (its ``__init__`` as the package's name)."""
    base = ROOT / package.replace(".", "/")
    found = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(tree: ast.AST) -> Iterator[tuple[str, list[str], str]]:
    """(module, names imported from it, kind) for every import statement, with where it sits."""

    def walk(node: ast.AST, kind: str) -> Iterator[tuple[str, list[str], str]]:
        for child in ast.iter_child_nodes(node):
            inner = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = "local"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "type"
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, [], kind
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                yield child.module, [a.name for a in child.names], kind
            yield from walk(child, inner)

    return walk(tree, "top")


def edges(found: dict[str, Path]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> the strongest kind of import between them (top > type > local)."""
    rank = {"top": 0, "type": 1, "local": 2}
    out: dict[tuple[str, str], str] = {}
    for name, path in found.items():
        for module, names, kind in _imports(ast.parse(path.read_text())):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in found] or [module]
            for target in targets:
                while target not in found and "." in target:  # an attribute of a module: the module
                    target = target.rpartition(".")[0]
                if target in found and target != name:
                    key = (name, target)
                    if key not in out or rank[kind] < rank[out[key]]:
                        out[key] = kind
    return out


def circles(nodes: list[str], graph: dict[tuple[str, str], str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in graph:
        succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
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
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in nodes:
        if v not in index:
            visit(v)
    return found


def dot(found: dict[str, Path], graph: dict[tuple[str, str], str], sccs: list[list[str]], title: str) -> str:
    in_circle = {m: i for i, c in enumerate(sccs) for m in c}
    short = {n: n.removeprefix(PACKAGE + ".") if n != PACKAGE else "rpc (facade)" for n in found}
    groups: dict[str, list[str]] = {}
    for n in found:
        rest = n.removeprefix(PACKAGE).lstrip(".")
        package = found[n].name == "__init__.py"  # a subpackage's __init__ sits in its own box
        group = rest.split(".")[0] if "." in rest or (package and rest) else ""
        groups.setdefault(group, []).append(n)
    lines = ["digraph imports {", f'  label="{title}"; labelloc=t; fontsize=20; rankdir=BT; nodesep=0.15;',
             '  node [shape=box, fontname="Helvetica", fontsize=10, style=filled, fillcolor="#f4f4f4"];',
             '  edge [color="#777777", arrowsize=0.5];']
    for group, names in sorted(groups.items()):
        if group:
            lines.append(f'  subgraph "cluster_{group}" {{ label="{group}"; style=rounded; color="#3366aa";')
        for n in names:
            lines_in = len(found[n].read_text().splitlines())
            colour = ', fillcolor="#ffd6d6"' if n in in_circle else ""
            label = "__init__" if found[n].name == "__init__.py" and group else short[n].split(".")[-1]
            lines.append(f'    "{n}" [label="{label}\\n{lines_in}"{colour}];')
        if group:
            lines.append("  }")
    for (a, b), kind in sorted(graph.items()):
        red = ', color="#cc0000", penwidth=1.6' if a in in_circle and in_circle.get(b) == in_circle[a] else ""
        lines.append(f'  "{a}" -> "{b}" [style={STYLE[kind]}{red}];')
    lines.append("}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the picture to write (.png or .svg), or a .dot file")
    parser.add_argument("--title", default=f"{PACKAGE}: imports (solid: module level, dashed: TYPE_CHECKING, "
                                           "dotted: in a function; red: a circle)")
    args = parser.parse_args()
    found = modules()
    graph = edges(found)
    sccs = circles(list(found), graph)
    print(f"{len(found)} modules, {len(graph)} import edges, {len(sccs)} circle(s)")
    for c in sccs:
        print("  circle:", " <-> ".join(m.removeprefix(PACKAGE + ".") for m in c))
    out = Path(args.out)
    text = dot(found, graph, sccs, args.title)
    if out.suffix == ".dot" or shutil.which("dot") is None:
        out.with_suffix(".dot").write_text(text)
        print(f"wrote {out.with_suffix('.dot')}" + ("" if out.suffix == ".dot" else " (no Graphviz `dot` here)"))
        return 0
    subprocess.run(["dot", f"-T{out.suffix[1:]}", "-Gdpi=110", "-o", str(out)], input=text, text=True, check=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
