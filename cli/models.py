"""``mlxkv models``: the models already on this machine (the Hugging Face cache, Ollama's
store, LM Studio's folders, the ``model_dirs`` folders), each under the name ``--model``
takes, with whether it loads and, when not, why (:mod:`mlxkv.engine.model_stores`)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from mlxkv.cli.common import human_bytes

if TYPE_CHECKING:
    from mlxkv.engine.model_stores import FoundModel
    from mlxkv.engine.settings import Settings

COLUMNS = ("NAME", "STORE", "FORMAT", "SIZE", "ARCH", "QUANT", "CONTEXT", "LOADS")


def _row(m: FoundModel) -> tuple[str, ...]:
    return (m.name, m.store, m.format, human_bytes(m.size_bytes), m.architecture or "-",
            m.quantization or "-", str(m.context_tokens) if m.context_tokens else "-",
            "yes" if m.loadable else f"no: {m.why_not}")


def table(models: list[FoundModel]) -> list[str]:
    """The lines of the table: one row per model, columns as wide as their widest cell
    (the last one, the reason a model does not load, unpadded)."""
    rows = [COLUMNS, *(_row(m) for m in models)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows]


def cmd_models(args: argparse.Namespace, settings: Settings) -> int:
    """Print the table (``--json``: a list of objects, every field); exit status 0 also
    when nothing is found, saying where it looked."""
    from mlxkv.engine.model_stores import find_models, search_dirs

    model_dirs = settings.model_dirs or ()
    models = find_models(model_dirs)
    if getattr(args, "json", False):
        print(json.dumps([m.as_dict() for m in models]))
        return 0
    if not models:
        where = ", ".join(f"{path} ({store})" for store, path in search_dirs(model_dirs))
        print(f"no models found; looked in {where}")
        return 0
    for line in table(models):
        print(line)
    return 0
