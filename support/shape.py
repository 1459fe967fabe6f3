"""The codebase's shape, read from the source (nothing is imported): how often product code
says ``Any``, probes objects with ``getattr``/``hasattr``, uses mixins, reaches into another
module's private members, and how many functions and docstrings run long.

``tests/test_imports.py`` holds the rules (no mixin, no private member of another module);
the other figures are reported for review::

    python -m support.shape [--list]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "storage", "cli", "server", "tui", "mlxkv")
LONG_FUNCTION = 80  # lines
LONG_DOCSTRING = 25  # lines
# The one module that reads mlx-lm's private state (checked against its released versions).
PRIVATE_API_MODULE = "engine/mlx_lm_compat.py"
# Underscored names that are documented API of the standard library, namedtuples or PyInstaller.
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_field_defaults", "_make", "_exit", "_getframe",
                      "_current_frames", "_name_", "_value_", "_missing_", "_generate_next_value_",
                      "_MEIPASS", "_SubParsersAction"}


def product_files() -> list[Path]:
    return sorted(p for folder in PRODUCT for p in (ROOT / folder).rglob("*.py")
                  if "demo/model" not in p.as_posix())


@dataclass
class Shape:
    files: int = 0
    lines: int = 0
    any_uses: int = 0
    probes: list[str] = field(default_factory=list)  # getattr / hasattr calls
    mixins: list[str] = field(default_factory=list)
    private_reaches: list[str] = field(default_factory=list)
    long_functions: list[str] = field(default_factory=list)
    long_docstrings: list[str] = field(default_factory=list)


def own_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: its functions, classes and globals, and the
    attributes its code assigns (``x._name = ...``, class-level ``_name = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
                    elif isinstance(sub, ast.Name):
                        names.add(sub.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return {n for n in names if n.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
        and name not in PUBLIC_UNDERSCORED


def private_reaches(path: Path, tree: ast.AST) -> Iterator[str]:
    """Where a module imports another's private name or reads a private attribute that it
    does not define itself."""
    rel = path.relative_to(ROOT).as_posix()
    own = own_private_names(tree)
    folder = path.parent.relative_to(ROOT).parts
    package = ".".join(("mlxkv", *folder)) if folder[0] != "mlxkv" else ".".join(folder)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlxkv"):
            for a in node.names:
                # a package's own private module (``from mlxkv.storage import _blocks``, its
                # compiled kernel) is its business: only a name from another module counts
                extension = node.module == package
                if _private(a.name) and not extension:
                    yield f"{rel}:{node.lineno} imports {node.module}.{a.name}"
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            if rel == PRIVATE_API_MODULE:
                continue
            yield f"{rel}:{node.lineno} .{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr") and len(node.args) >= 2:
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _private(arg.value) \
                    and arg.value not in own and rel != PRIVATE_API_MODULE:
                yield f"{rel}:{node.lineno} {node.func.id}(..., {arg.value!r})"


def measure() -> Shape:
    shape = Shape()
    for path in product_files():
        text = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(text, rel)
        shape.files += 1
        shape.lines += text.count("\n")
        shape.any_uses += len(re.findall(r"\bAny\b", text))
        shape.private_reaches += list(private_reaches(path, tree))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "getattr", "hasattr"):
                shape.probes.append(f"{rel}:{node.lineno} {node.func.id}")
            elif isinstance(node, ast.ClassDef):
                if node.name.endswith("Mixin") or any(
                        isinstance(b, ast.Name) and b.id.endswith(("Mixin", "Actions")) for b in node.bases):
                    shape.mixins.append(f"{rel}:{node.lineno} {node.name}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > LONG_FUNCTION:
                    shape.long_functions.append(f"{rel}:{node.lineno} {node.name} ({length} lines)")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node, clean=False)
                if doc is not None and doc.count("\n") + 1 >= LONG_DOCSTRING:
                    where = getattr(node, "name", "module")
                    shape.long_docstrings.append(f"{rel} {where} ({doc.count(chr(10)) + 1} lines)")
    return shape


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m support.shape", description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="list each finding, not only the counts")
    args = ap.parse_args(argv)
    s = measure()
    rows = [("product files / lines", f"{s.files} / {s.lines}"), ("Any", s.any_uses),
            ("getattr/hasattr calls", len(s.probes)), ("mixins", len(s.mixins)),
            ("private members of another module", len(s.private_reaches)),
            (f"functions over {LONG_FUNCTION} lines", len(s.long_functions)),
            (f"docstrings of {LONG_DOCSTRING}+ lines", len(s.long_docstrings))]
    for name, value in rows:
        print(f"{name:40s} {value}")
    if args.list:
        for title, items in (("mixins", s.mixins), ("private members of another module", s.private_reaches),
                             ("long functions", s.long_functions), ("long docstrings", s.long_docstrings)):
            print(f"\n{title}:")
            for item in items:
                print(f"  {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
