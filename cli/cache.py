"""``mlxkv cache {stats,ls,verify,gc,flush,clear}``: inspect and maintain the SSD tier
(saved conversations, and what speculation learned: the suffix index of each model).

Works on the cache folder alone (no model, no mlx). The parser is in ``cli/parser.py``
(every settings flag, ``--cache-dir`` included, and ``--json`` are accepted before or after
``cache`` and its verb); ``run_cache_command(args, settings)`` runs one verb.

A running engine flushes its own dirty state on exit (and on request in the TUI); the
``flush`` command here makes what other processes left behind consistent (removes their
temp files, rebuilds the index) and reports what is on disk. A folder that cannot be used
(read-only, a file, not an mlxkv cache) is one ``mlxkv: error:`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxkv.cli.common import fail, human_bytes
from mlxkv.storage import CacheFolderError

if TYPE_CHECKING:
    from mlxkv.engine.settings import Settings
    from mlxkv.storage.keys import Restore
    from mlxkv.storage.store import BlockStore

MANIFEST_DIR = "manifests"


def _open_store(root: str) -> BlockStore:
    from mlxkv.storage.store import BlockStore

    if not os.path.lexists(root):  # looking must not create it
        raise FileNotFoundError(f"no cache folder at {root} (nothing cached yet, or pass "
                                f"--cache-dir)")
    store = BlockStore(root)
    store.scan()
    bt = _block_tokens(store)
    if bt is not None and bt != store.block_tokens:
        store = BlockStore(root, block_tokens=bt)
        store.scan()
    return store


def _block_tokens(store: BlockStore) -> int | None:
    """The block size the folder was written with (it is not recorded there): the one
    whose chain key of a saved conversation's first block matches its manifest."""
    from mlxkv.storage.store import BlockStore

    for ns in sorted(store.stats()["namespaces"]):
        for man in store.manifests(ns):
            k, n = len(man.block_keys), len(man.tokens)
            if k == 0:
                continue
            first = man.block_keys[0]
            if store.chain_keys(ns, man.tokens[: store.block_tokens])[:1] == [first]:
                return store.block_tokens
            # k full blocks of bt tokens in n tokens: n // (k + 1) < bt <= n // k
            for bt in range(n // (k + 1) + 1, n // k + 1):
                if BlockStore(store.root, block_tokens=bt).chain_keys(
                        ns, man.tokens[:bt])[:1] == [first]:
                    return bt
    return None


def _tenant_mark(args: argparse.Namespace, settings: Settings) -> str | None:
    """What the namespaces of ``--tenant NAME`` end with (or hold before a draft's mark):
    its key's scope in the model namespaces (``engine.cache.info.scoped_namespace``)."""
    name = getattr(args, "tenant", None)
    if name is None:
        return None
    from mlxkv.engine.cache.info import scoped_namespace
    from mlxkv.server.tenants import Keys, key_scope

    if not settings.api_key_file:
        raise ValueError("--tenant names a key of --api-key-file: give the key file too")
    keys = {k.name: k for k in Keys.from_file(settings.api_key_file).keys}
    if name not in keys:
        raise ValueError(f"--tenant {name}: no such key in {settings.api_key_file} "
                         f"(have: {', '.join(keys)})")
    return scoped_namespace("", key_scope(keys[name]))


def _namespaces(store: BlockStore, only: str | None, tenant: str | None = None) -> list[str]:
    """Namespaces with indexed files, or only saved conversations (whose blocks are gone);
    ``tenant``: only those of the tenant whose scope mark this is (:func:`_tenant_mark`)."""
    from mlxkv.storage.store import check_namespace

    found = set(store.stats()["namespaces"]) | {f.ns for f in store.learned_files()}
    for de in os.scandir(store.root):
        try:
            if de.is_dir() and de.name not in found and check_namespace(de.name) and \
                    _manifest_files(store, de.name):
                found.add(de.name)
        except ValueError:  # not a namespace folder
            continue
    names: list[str] = sorted(found)
    if tenant is not None:
        names = [n for n in names if n.endswith(tenant) or f"{tenant}_draft-" in n]
    if only is not None:
        if only not in names:
            raise KeyError(f"namespace {only!r} is not in {store.root} (have: "
                           f"{', '.join(names) or 'none'})")
        return [only]
    return names


def _manifest_files(store: BlockStore, ns: str) -> list[str]:
    d = os.path.join(store.root, ns, MANIFEST_DIR)
    try:
        return sorted(de.path for de in os.scandir(d) if de.name.endswith(".man"))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _verify(store: BlockStore, ns: str) -> dict[str, Any]:
    """Restore every saved conversation of ``ns`` into scratch buffers (every block and
    checkpoint is checked against its content hash; a corrupt one is removed)."""
    out: dict[str, Any] = {"conversations": 0, "ok": 0, "corrupt": 0, "missing": 0, "tokens": 0}
    for man in store.manifests(ns):
        out["conversations"] += 1
        n = len(man.tokens)
        got: list[Restore | None] = []  # None: a part that is not there
        m = store.lookup(ns, man.tokens)
        blocks = None
        if m.n_tokens and m.layout is not None:
            blocks = store.get_blocks(ns, man.tokens, m.layout, _scratch(m.layout, m.n_tokens),
                                      n_tokens=m)
            got.append(blocks)
        if man.extra_keys:  # a checkpoint (rotating window / SSM state) at exactly n
            cm = store.lookup_checkpoint(ns, man.tokens)
            if cm.n_tokens == n and cm.layout is not None:
                got.append(store.get_checkpoint(ns, cm, cm.layout, _scratch(cm.layout, 1)))
            else:
                got.append(None)
        elif blocks is None or blocks.n_tokens < n:
            got.append(None)
        corrupt = sum(r.corrupt for r in got if r is not None)
        out["corrupt"] += corrupt
        out["tokens"] += max([r.n_tokens for r in got if r is not None] or [0])
        if not corrupt:
            out["missing" if any(r is None or r.missing for r in got) else "ok"] += 1
    bad = store.damaged_manifests(ns)
    out["manifests_damaged"] = len(bad)
    out["damaged_manifests"] = bad  # path -> reason
    return out


def _learned(store: BlockStore, ns: str | None = None, remove: bool = False) -> dict[str, dict[str, Any]]:
    """The learned files (what speculation learned: the suffix index) per namespace: name ->
    bytes and, read and verified, sequences and tokens, or the reason it cannot be used
    (``remove``: a damaged one is deleted, as ``verify`` deletes a corrupt block)."""
    from mlxkv.storage.learned import LearnedDamaged

    out: dict[str, dict[str, Any]] = {}
    for f in store.learned_files(ns):
        info: dict[str, Any] = {"bytes": f.nbytes, "modified": f.mtime}
        try:
            got = store.get_learned(f.ns, f.name, remove=remove)
        except LearnedDamaged as exc:
            info.update(damaged=exc.reason, removed=exc.removed)
        else:
            if got is not None:
                info.update(schema=got.schema, sequences=len(got.sequences), tokens=got.tokens)
        out.setdefault(f.ns, {})[f.name] = info
    return out


def _learned_line(name: str, info: dict[str, Any]) -> str:
    if "damaged" in info:
        what = "removed" if info.get("removed") else "cannot be used"
        return f"{name} index: damaged, {what} ({info['damaged']})"
    return (f"{name} index: {info.get('tokens', 0)} tokens learned from "
            f"{info.get('sequences', 0)} replies ({human_bytes(info['bytes'])})")


def _scratch(layout: Any, rows: int) -> list:
    import numpy as np

    return [(np.empty(s.outer * rows * s.row_bytes, np.uint8), s.outer, rows, s.row_bytes)
            for s in layout]


def _clear(store: BlockStore, ns: str) -> bool:
    """Delete everything of ``ns`` (manifests, damaged ones too, blocks, tails,
    checkpoints, then our empty folders) under the folder's exclusive lock; a file another
    process wrote meanwhile, or one that is not ours, is left alone. True if the folder is
    gone."""
    return bool(store.clear(ns)["folder_removed"])


def run_cache_command(args: argparse.Namespace, settings: Settings) -> int:
    """Run one ``mlxkv cache`` verb on ``settings.cache_dir``; returns the exit status."""
    try:
        return _run(args, os.path.expanduser(settings.cache_dir), _tenant_mark(args, settings))
    except KeyError as exc:  # a namespace that is not there
        return fail(exc.args[0] if exc.args else str(exc))
    except (FileNotFoundError, ValueError, CacheFolderError) as exc:
        return fail(str(exc))
    except OSError as exc:  # the last resort: what failed, where
        where = f" ({exc.filename})" if exc.filename else ""
        return fail(f"cache folder {settings.cache_dir}: {exc.strerror or exc}{where}")




@dataclass
class _VerbCall:
    """What a verb works on: the open store, the parsed flags, the folder, the tenant's
    namespaces only (None: all), ``--ns``, and whether the answer is JSON."""

    store: BlockStore
    args: argparse.Namespace
    root: str
    tenant: str | None
    ns_only: str | None
    as_json: bool

    def namespaces(self) -> list[str]:
        return _namespaces(self.store, self.ns_only, self.tenant)


def _run(args: argparse.Namespace, root: str, tenant: str | None = None) -> int:
    verb = _VERBS.get(args.cache_command)
    if verb is None:  # pragma: no cover - argparse restricts the choices
        raise ValueError(f"unknown cache command {args.cache_command!r}")
    call = _VerbCall(_open_store(root), args, root, tenant, getattr(args, "ns", None), getattr(args, "json", False))
    res, status = verb(call)
    if call.as_json:
        print(json.dumps(res))
    return status


def _stats(call: _VerbCall) -> tuple[dict[str, Any], int]:
    st = call.store.stats()
    res = {k: st[k] for k in ("root", "bytes", "blocks", "tails", "namespaces",
                              "kernel", "skipped_unknown_version")}
    learned = _learned(call.store)
    res["learned"] = learned
    if not call.as_json:
        print(f"{st['root']}: {human_bytes(st['bytes'])} in {st['blocks']} blocks and "
              f"{st['tails']} tails ({st['kernel']} kernel)")
        for ns in sorted(set(st["namespaces"]) | set(learned)):
            v = st["namespaces"].get(ns)
            if v is not None:
                print(f"  {ns}: {human_bytes(v['bytes'])}, {v['blocks']} blocks, "
                      f"{v['tails']} tails")
            else:
                print(f"  {ns}: no blocks")
            for name, info in sorted(learned.get(ns, {}).items()):
                print(f"    {_learned_line(name, info)}")
        for path, why in st["skipped_unknown_version"].items():
            print(f"  skipped {path}: {why}")
    return res, 0


def _ls(call: _VerbCall) -> tuple[dict[str, Any], int]:
    store = call.store
    res: dict[str, list[dict[str, Any]]] = {}
    for ns in call.namespaces():
        mans = sorted(store.manifests(ns), key=lambda m: m.created)
        res[ns] = [{"kind": "conversation", "name": m.name, "tokens": len(m.tokens),
                    "blocks": len(m.block_keys), "checkpoint": bool(m.extra_keys),
                    "cached_tokens": store.lookup_checkpoint(ns, m.tokens).n_tokens
                    if m.extra_keys else store.longest_prefix(ns, m.tokens),
                    "created": m.created} for m in mans]
        learned = _learned(store, ns).get(ns, {})
        for name, info in sorted(learned.items()):  # listed after the conversations
            res[ns].append({"kind": "learned", "name": name, **info})
        if not call.as_json:
            print(f"{ns}: {len(mans)} conversations")
            for m in res[ns][:len(mans)]:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(m["created"]))
                print(f"  {m['name']:<24} {m['tokens']:>8} tokens "
                      f"({m['cached_tokens']} on disk)  {when}")
            for name, info in sorted(learned.items()):
                print(f"  {_learned_line(name, info)}")
    return res, 0


def _verify_all(call: _VerbCall) -> tuple[dict[str, Any], int]:
    res = {ns: _verify(call.store, ns) for ns in call.namespaces()}
    for ns, v in res.items():
        learned = _learned(call.store, ns, remove=True).get(ns, {})
        v["learned_damaged"] = {name: info["damaged"] for name, info in learned.items()
                                if "damaged" in info}
    bad = sum(v["corrupt"] + v["missing"] + v["manifests_damaged"] + len(v["learned_damaged"])
              for v in res.values())
    if not call.as_json:
        for ns, v in res.items():
            print(f"{ns}: {v['ok']}/{v['conversations']} conversations intact, "
                  f"{v['corrupt']} corrupt blocks removed, {v['missing']} incomplete, "
                  f"{v['manifests_damaged']} damaged manifests")
            for path, why in v["damaged_manifests"].items():
                print(f"  damaged manifest (left in place): {path}: {why}")
            for name, why in v["learned_damaged"].items():
                print(f"  damaged {name} index: {why}")
        print("damaged: see above" if bad else "all intact")
    return res, 1 if bad else 0


def _gc(call: _VerbCall) -> tuple[dict[str, Any], int]:
    names: list[str | None] = list(call.namespaces()) if call.ns_only or call.tenant else [None]
    res: dict[str, Any] = {"removed": 0, "bytes": 0, "unreadable_manifests": {}}
    for ns in names:
        r = call.store.gc(ns, min_age_s=call.args.min_age)
        res["removed"] += r["removed"]
        res["bytes"] += r["bytes"]
        res["unreadable_manifests"].update(r.get("unreadable_manifests", {}))
    if not call.as_json:
        print(f"removed {res['removed']} unreferenced blocks ({human_bytes(res['bytes'])})")
    for path, why in res["unreadable_manifests"].items():
        print(f"mlxkv: warning: kept everything of the namespace of {path}: this manifest "
              f"cannot be read ({why}); see `mlxkv cache verify`", file=sys.stderr)
    return res, 0


def _flush(call: _VerbCall) -> tuple[dict[str, Any], int]:
    rep = call.store.scan()
    res = {"on_disk_bytes": call.store.stats()["bytes"], **rep}
    if not call.as_json:
        print(f"{call.root}: {rep['blocks']} blocks and {rep['tails']} tails on disk, "
              f"{rep['tmp_removed']} temp files and {rep['bad_removed']} damaged files "
              f"removed")
    return res, 0


def _clear_all(call: _VerbCall) -> tuple[dict[str, Any], int]:
    names = call.namespaces()
    res: dict[str, Any] = {"namespaces": names, "deleted": bool(call.args.yes)}
    if call.args.yes:
        res["left"] = [ns for ns in names if not _clear(call.store, ns)]
    if not call.as_json:
        what = ", ".join(names) or "nothing"
        print(f"deleted {what}" if call.args.yes else f"would delete {what} (add --yes)")
        for ns in res.get("left", []):
            print(f"  {ns}: files this version does not know (or new ones) were kept")
    return res, 0


_VERBS: dict[str, Callable[[_VerbCall], tuple[dict[str, Any], int]]] = {
    "stats": _stats, "ls": _ls, "verify": _verify_all, "gc": _gc, "flush": _flush, "clear": _clear_all}
