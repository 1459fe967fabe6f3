"""Command-line flags: generated from the settings table, accepted before or after any
sub-command (``--json`` too), one set of sampling defaults. The parser is checked in
process for every field and position; the behaviours a user sees run as subprocesses."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlxkv.cli.parser import CACHE_VERBS, build_parser
from mlxkv.engine.settings import FIELDS, Settings

ROOT = Path(__file__).resolve().parent.parent

# Where a settings flag may stand: before the command, after it, after a cache verb.
POSITIONS = [
    ("before chat", lambda fl: [*fl, "chat"]),
    ("after chat", lambda fl: ["chat", *fl]),
    ("before generate", lambda fl: [*fl, "generate", "-p", "x"]),
    ("after generate", lambda fl: ["generate", "-p", "x", *fl]),
    ("after config", lambda fl: ["config", *fl]),
    ("before cache", lambda fl: [*fl, "cache", "stats"]),
    ("between cache and verb", lambda fl: ["cache", *fl, "stats"]),
    *[(f"after cache {v}", lambda fl, v=v: ["cache", v, *fl]) for v in CACHE_VERBS],
]


def sample_flag(f) -> tuple[list[str], object]:
    """A command-line setting for field ``f`` and the value the parser must store."""
    if f.is_bool:
        return [f.negative if f.default else f.option], not f.default
    if f.choices:
        return [f.option, f.choices[-1]], f.choices[-1]
    if f.arg_type in (int, float):
        return [f.option, "3"], f.arg_type("3")
    if f.metavar == "SIZE":
        return [f.option, "3GiB"], "3GiB"
    return [f.option, "/some/where"], "/some/where"


def mlxkv(*args, cache_dir, timeout=60, **env):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXKV_CACHE_DIR": str(cache_dir),
                "XDG_CONFIG_HOME": str(ROOT / ".cache" / "no-config"), **env}
    full_env.pop("MLXKV_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "mlxkv", *args], cwd=ROOT,
                          capture_output=True, text=True, env=full_env, timeout=timeout)


# Settings only the config file holds: the [[models]] tables (the command line repeats --model).
CONFIG_ONLY = {"models"}


def test_every_setting_has_a_flag():
    parser_dests = {a.dest for a in build_parser()._actions}
    assert {f.name for f in FIELDS if f.option is None} == CONFIG_ONLY
    for f in FIELDS:
        if f.name in CONFIG_ONLY:
            continue
        assert f.option is not None, f"{f.name} has no command-line flag"
        assert f.name in parser_dests, f.name


@pytest.mark.parametrize("where, place", POSITIONS, ids=[p[0] for p in POSITIONS])
def test_every_setting_flag_works_in_every_position(where, place):
    parser = build_parser()
    for f in FIELDS:
        if f.name in CONFIG_ONLY:
            continue
        flag, value = sample_flag(f)
        args = parser.parse_args(place(flag))
        assert getattr(args, f.name) == value, (where, f.name, vars(args))
        # a flag not given stays out of the namespace, so env and config file can fill it
        others = {g.name for g in FIELDS} - {f.name}
        assert not others & set(vars(args)), (where, f.name, vars(args))


def test_flag_values_become_settings_with_their_flag_as_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no user config file
    parser = build_parser()
    for f in FIELDS:
        if f.name == "model" or f.name in CONFIG_ONLY:
            continue  # a model folder that exists is another test's business
        flag, _ = sample_flag(f)
        args = parser.parse_args(["config", *flag])
        s = Settings.load({f.name: getattr(args, f.name)}, env={})
        assert s.sources[f.name] == f"flag {flag[0]}", (f.name, s.sources[f.name])


def test_a_later_command_does_not_reset_an_earlier_flag():
    parser = build_parser()
    for verb in CACHE_VERBS:
        args = parser.parse_args(["--cache-dir", "/x", "--json", "cache", verb])
        assert (args.cache_dir, args.json) == ("/x", True), verb
        args = parser.parse_args(["cache", verb, "--json", "--cache-dir", "/y"])
        assert (args.cache_dir, args.json) == ("/y", True), verb


def test_off_switches_and_sizes(tmp_path):
    parser = build_parser()
    assert parser.parse_args(["--no-ssd-cache", "chat"]).ssd_cache_bytes == 0
    assert parser.parse_args(["generate", "-p", "x", "--ssd-cache-bytes", "1GiB"]).ssd_cache_bytes == "1GiB"
    r = mlxkv("config", "--json", "--no-ssd-cache", "--no-prefix-cache", cache_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["settings"]
    assert s["ssd_cache_bytes"] == {"value": 0, "source": "flag --no-ssd-cache"}
    assert s["prefix_cache"] == {"value": False, "source": "flag --no-prefix-cache"}
    r = mlxkv("--ssd-cache-bytes", "3GiB", "config", "--json", cache_dir=tmp_path)
    assert json.loads(r.stdout)["settings"]["ssd_cache_bytes"]["value"] == 3 * 1024**3


def test_sampling_defaults_are_one_set(tmp_path, monkeypatch):
    """A request built without the CLI (engine.generate.SamplingParams()) samples as the
    settings' defaults say: one set of defaults, not two that drift apart."""
    from mlxkv.engine.generate import SamplingParams

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    defaults = {f.name: f.default for f in FIELDS}
    params = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    shared = sorted(set(defaults) & set(params))
    assert {"temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"} <= set(shared)
    assert {n: params[n] for n in shared} == {n: defaults[n] for n in shared}
    assert Settings.load({}, env={}).max_tokens == params["max_tokens"]


def _cache_with_one_namespace(root: Path) -> str:
    """A real cache folder holding one saved conversation (written by the block store)."""
    from mlxkv.storage import format as fmt
    from mlxkv.storage.format import SegmentSpec
    from mlxkv.storage.store import BlockStore

    layout = fmt.make_layout([SegmentSpec("l0.k", "float32", (8,), 2, 32),
                              SegmentSpec("l0.v", "float32", (8,), 2, 32)])
    toks = np.arange(100, 100 + 300)
    segs = []
    for s in layout:
        a = (np.arange(s.outer * 300 * s.row_bytes) % 251).astype(np.uint8)
        segs.append((a, s.outer, 300, s.row_bytes))
    BlockStore(root).put_blocks("ns-a", toks, layout, segs, manifest="conversation-1")
    return "ns-a"


def test_cache_dir_before_the_command_is_the_folder_acted_on(tmp_path):
    """`mlxkv --cache-dir X cache clear --yes` clears X, not the default folder."""
    chosen, default = tmp_path / "chosen", tmp_path / "default"
    _cache_with_one_namespace(chosen)
    _cache_with_one_namespace(default)
    r = mlxkv("--cache-dir", str(chosen), "cache", "clear", "--yes", cache_dir=default)
    assert r.returncode == 0, r.stderr
    assert not (chosen / "ns-a").exists()
    assert (default / "ns-a").exists()
    for argv in (["--cache-dir", str(default), "--json", "cache", "stats"],
                 ["cache", "--cache-dir", str(default), "stats", "--json"],
                 ["cache", "stats", "--json", "--cache-dir", str(default)]):
        r = mlxkv(*argv, cache_dir=chosen)
        assert r.returncode == 0, (argv, r.stderr)
        out = json.loads(r.stdout)
        assert out["root"] == str(default) and out["blocks"] == 1, (argv, out)


def test_json_where_it_does_not_apply_is_refused(tmp_path):
    r = mlxkv("chat", "--json", cache_dir=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["mlxkv: error: --json applies to generate, config, "
                                             "cache, models, not to chat"]
