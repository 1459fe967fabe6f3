"""Import hygiene of the installed package, read from the source (nothing is imported):
every project import names ``mlxkv...`` in full, no two project modules import each other,
directly or around a loop (function-local imports count like any other), the checkout's
folders refuse to be imported under their folder names, no module touches another's private
members, and no class is built from mixins (``support/shape.py`` reads both)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from support.shape import measure, private_reaches

ROOT = Path(__file__).resolve().parent.parent
# repository folder -> installed package name (pyproject.toml's package-dir)
PACKAGES = {"mlxkv": "mlxkv", "engine": "mlxkv.engine", "storage": "mlxkv.storage", "cli": "mlxkv.cli",
            "server": "mlxkv.server", "tui": "mlxkv.tui"}


def project_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((name, *parts))] = path
    mods["mlxkv.storage._blocks"] = ROOT / "storage" / "_blocks.pyx"
    return mods


def imports_of(path: Path, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules ``module`` imports anywhere in its body."""
    out: set[str] = set()
    if path.suffix != ".py":
        return out
    tree = ast.parse(path.read_text(), str(path))
    base = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                prefix = ".".join(anchor + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            # the deepest project module the name reaches (a from-import may name a class)
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = project_modules()
    known = set(mods)
    return {m: imports_of(p, m, p.name == "__init__.py", known) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def parent_packages(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycle_between_project_modules():
    g = graph()
    # Importing a.b.c runs a/__init__ and a.b/__init__ first; an edge to a parent package
    # is not a loop of the module's own making, so only module-to-module edges count.
    g = {m: {d for d in deps if d not in parent_packages(m)} for m, deps in g.items()}
    found = cycles(g)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_a_cycle_is_found_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_project_import_uses_the_full_name():
    bare = tuple(f for f in PACKAGES if f != "mlxkv")
    offenders = []
    for path in [p for folder in (*PACKAGES, "tests", "bench", "support") for p in (ROOT / folder).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] in bare]
    assert not offenders, offenders


def test_a_subpackage_folder_imported_by_its_folder_name_is_refused():
    for folder, name in PACKAGES.items():
        if folder == "mlxkv":
            continue
        r = subprocess.run([sys.executable, "-c", f"import {folder}"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and f"ImportError: import {name}, not {folder}" in r.stderr, r.stderr


def test_no_class_is_built_from_mixins():
    assert measure().mixins == []


def test_no_module_touches_another_modules_private_members():
    assert measure().private_reaches == []


def test_a_reach_into_another_module_is_found(tmp_path):
    """The rule's own check: each kind of reach is reported, a module's own names are not."""
    path = ROOT / "engine" / "made_up_for_the_test.py"
    source = (
        "from mlxkv.engine.other import _helper\n"
        "from mlxkv.engine import _kernels\n"  # the package's own compiled module: allowed
        "class A:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def f(self, row, model):\n"
        "        row.handle._emit(self._mine)\n"
        "        return getattr(model, '_stash', None)\n")
    found = list(private_reaches(path, ast.parse(source)))
    assert sorted(f.split(" ", 1)[1] for f in found) == sorted([
        "imports mlxkv.engine.other._helper", "._emit", "getattr(..., '_stash')"]), found
    assert not Path(path).exists()  # nothing was written
