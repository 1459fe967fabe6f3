"""The argument parser. Settings flags come from ``engine.settings.FIELDS`` (one table for
flags, environment, config file and ``mlxkv config``), and every settings flag and
``--json`` is accepted before or after any sub-command: each level of the parser gets the
same options with ``default=SUPPRESS``, so a level where a flag is not given leaves the
value another level parsed alone.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from mlxkv import __version__ as VERSION

PROG = "mlxkv"
CACHE_VERBS = ("stats", "ls", "verify", "gc", "flush", "clear")
# Sub-commands that print JSON with --json (the cache verbs all do).
JSON_COMMANDS = ("generate", "config", "cache", "models")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One clear line instead of argparse's usage block.
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


class ModelsAction(argparse.Action):
    """``--model``: the first one given is the model (``settings.model``), and every one is
    kept, in order, in ``model_list`` (what ``mlxkv serve`` serves)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = list(getattr(namespace, "model_list", None) or []) + [values]
        namespace.model_list = given
        setattr(namespace, self.dest, given[0])


def settings_flags() -> Parser:
    """A parent parser with one option per settings field (plus ``--config`` and ``--json``).
    SUPPRESS keeps unset flags out of the namespace so the environment and config file can
    fill them, and so that a sub-command's parser does not overwrite a value given before it."""
    from mlxkv.engine.settings import FIELDS

    p = Parser(add_help=False)
    S = argparse.SUPPRESS
    g = p.add_argument_group("settings (before or after the command; see `mlxkv config`)")
    for f in FIELDS:
        if f.option is None:
            continue
        if f.is_bool:
            g.add_argument(f.option, dest=f.name, action="store_const", const=True, default=S,
                           help=f"{f.help} (default: {'on' if f.default else 'off'})")
            if f.negative is not None:  # always, for a flag of a boolean
                g.add_argument(f.negative, dest=f.name, action="store_const", const=False, default=S,
                               help=f"the opposite of {f.option}")
        elif f.name == "model":  # serve takes several: each one is kept in model_list
            g.add_argument(f.option, dest=f.name, action=ModelsAction, metavar=f.metavar, default=S,
                           help=f.help + "; serve: repeat it to serve several (NAME=SPEC names one)")
        else:
            g.add_argument(f.option, dest=f.name, type=f.arg_type or str,  # str: the text as is
                           choices=f.choices, metavar=f.metavar, default=S, help=f.help)
        if f.off is not None:
            flag, value, text = f.off
            g.add_argument(flag, dest=f.name, action="store_const", const=value, default=S,
                           help=text)
    g.add_argument("--config", default=S, metavar="FILE", help="TOML config file")
    p.add_argument("--json", action="store_true", default=S,
                   help="print JSON (generate, config, cache, models)")
    return p


def build_parser() -> argparse.ArgumentParser:
    common = settings_flags()
    parser = Parser(prog=PROG, parents=[common],
                    description="Local LLM engine on MLX with a tiered prefix cache. "
                                "Without a command: chat.",
                    epilog="Each setting can also be set with MLXKV_<NAME> (e.g. MLXKV_CACHE_DIR) "
                           "or in ~/.config/mlxkv/config.toml; flags win. `mlxkv config` shows "
                           "the effective values and where each came from.")
    parser.add_argument("--version", action="version", version=f"{PROG} {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.add_parser("chat", parents=[common], help="plain terminal chat (/help lists its commands)")
    gen = sub.add_parser("generate", parents=[common], help="generate one reply and exit")
    gen.add_argument("--prompt", "-p", required=True, help="user message ('-' reads stdin)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="no chat template: prompt as is")
    gen.add_argument("--truncate", action="store_true",
                     help="keep the end of a prompt longer than the model's context instead of "
                          "refusing it")
    sub.add_parser("config", parents=[common], help="print the effective settings")
    sub.add_parser("serve", parents=[common],
                   help="OpenAI- and Anthropic-compatible HTTP server (--host, --port, --api-key)")
    sub.add_parser("models", parents=[common],
                   help="list the models on this machine (Hugging Face cache, Ollama, LM Studio, "
                        "--model-dirs) under the names --model takes")
    _add_cache_parser(sub, common)
    return parser


def _add_cache_parser(sub: argparse._SubParsersAction, common: Parser) -> None:
    p = sub.add_parser("cache", parents=[common], help="inspect and maintain the prefix cache on disk")
    verbs = p.add_subparsers(dest="cache_command", metavar="{" + ",".join(CACHE_VERBS) + "}",
                             parser_class=Parser)
    verbs.required = True

    def verb(name: str, text: str, ns: bool = True) -> argparse.ArgumentParser:
        v = verbs.add_parser(name, parents=[common], help=text)
        if ns:
            v.add_argument("--ns", help="only this namespace")
            v.add_argument("--tenant", metavar="NAME",
                           help="only the namespaces of this key of --api-key-file (its requests "
                                "without cache_salt or organisation headers)")
        return v

    verb("stats", "bytes, blocks and tails per namespace", ns=False)
    verb("ls", "namespaces and their saved conversations")
    verb("verify", "read every saved conversation and check every block and manifest; "
                   "exit 1 if anything is damaged")
    g = verb("gc", "remove blocks no saved conversation references")
    g.add_argument("--min-age", type=float, default=60.0,
                   help="keep unreferenced blocks younger than this many seconds (default 60)")
    verb("flush", "clean up after other processes and report what is on disk", ns=False)
    c = verb("clear", "delete cached state")
    c.add_argument("--yes", action="store_true", help="do it (without it, only say what)")
