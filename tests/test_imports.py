"""Import hygiene of the installed package, read from the source (nothing is imported):
every project import names ``mlxkv...`` in full, and the checkout's folders refuse to be
imported under their folder names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# repository folder -> installed package name (pyproject.toml's package-dir)
PACKAGES = {"mlxkv": "mlxkv", "engine": "mlxkv.engine", "storage": "mlxkv.storage", "cli": "mlxkv.cli",
            "server": "mlxkv.server", "tui": "mlxkv.tui"}


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
