"""The package's layout holds: names written in strings resolve, and modules and classes stay small.

Imports between modules are checked by ``lint-imports`` (the contracts in pyproject.toml, run by
``.ci/run``). What neither mypy nor import-linter can see are the dotted names written in strings: the
bootstrap code a worker kernel runs, the zygote's preload list and ``-m`` argument, the provisioner entry
point, pickled references in notebooks, docstrings that point the reader to a module. A moved module
leaves them dangling, and some fail only at run time in a worker kernel. Every one must resolve.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOTTED = re.compile(r"(?<![\w./-])nbremote(?:\.[A-Za-z_]\w*)+")
# Where dotted names are written: the package, its tests and benchmarks, the docs, notebooks and set-up.
SOURCES = ("nbremote", "tests", "benchmarks", "docs", "notebooks", "binder")
FILES = ("README.md", "pyproject.toml")
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 350


def _texts() -> list[Path]:
    paths = [ROOT / f for f in FILES]
    for top in SOURCES:
        paths += [p for p in sorted((ROOT / top).rglob("*")) if p.is_file()
                  and p.suffix in (".py", ".md", ".ipynb", ".toml", ".txt", ".cfg", ".yml", ".yaml", ".sh", "")
                  and "artifacts" not in p.parts and "__pycache__" not in p.parts]
    return paths


def _resolves(dotted: str) -> bool:
    """A module, or an attribute reached from the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj: object = importlib.import_module(module)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_in_strings_resolves() -> None:
    seen: dict[str, list[str]] = {}
    for path in _texts():
        text = path.read_text(errors="replace")
        for match in DOTTED.finditer(text):
            name = match.group(0).rstrip(".")
            seen.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert len(seen) > 20, "the scan found too few names: is it reading the tree?"
    dangling = {name: sorted(set(where))[:3] for name, where in seen.items() if not _resolves(name)}
    assert not dangling, f"dotted names that name no module or attribute (a module moved?): {dangling}"


def test_the_zygote_entry_point_names_a_provisioner_class() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    target = re.search(r'nbremote-zygote = "([\w.]+):(\w+)"', text)
    assert target is not None, "the zygote provisioner's entry point is missing from pyproject.toml"
    module = importlib.import_module(target.group(1))
    assert isinstance(getattr(module, target.group(2)), type)


def _sizes() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    modules, classes = [], []
    for path in sorted((ROOT / "nbremote").rglob("*.py")):
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        modules.append((len(text.splitlines()), where))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                classes.append((node.end_lineno - node.lineno + 1, f"{where}:{node.name}"))
    return modules, classes


@pytest.mark.parametrize("kind", ["module", "class"])
def test_modules_and_classes_stay_small(kind: str) -> None:
    """STYLE.md: one concept per module; split a module (~450 lines) or class (~350) that grows past it."""
    modules, classes = _sizes()
    found, limit = (modules, MAX_MODULE_LINES) if kind == "module" else (classes, MAX_CLASS_LINES)
    assert found, "no source found"
    too_big = sorted((n, where) for n, where in found if n > limit)
    assert not too_big, f"{kind}s over {limit} lines: {too_big}; split them by job"
