"""An agent's editing session replayed through ``mlxkv serve``, as an agent sends it: the
whole history every turn, the model's own earlier replies in it.

The workflow is the one agents repeat all day: a file read back and rewritten with a
change, a tool call to save it, a second change and a rewrite of the whole file, the same
tool call again, a test run, a failure, the file written once more, the tests run again.
Tool calls are JSON objects in the reply (the text protocol agents use with models that
have no tool-calling template). The content is real: the classes rewritten are this
project's own source (:data:`EPISODES`), read when the trace is built.

Every user message is fixed; every assistant message in the history is what the model
replied at that turn, so the turns the model answers with earlier content (a rewrite of a
file it read or wrote, a tool call it made before) repeat because the model repeats, not
because the trace says so. Greedy decoding makes the replies the same in every server,
so the history is the same for each of them (the first server's replies are used, and
the others' are checked to be equal).

:func:`replay` sends one episode to several servers turn by turn, interleaved (the order
alternates each turn); :func:`speedup` is the decode time of one server over another's on
the turns from ``first_turn`` on (replies are identical, so decode time is the measure).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = ("You are a coding agent working in a Python repository. You call tools by replying "
          "with one JSON object, and you write code in ```python blocks.")
REWRITE_TOKENS = 128  # a turn that rewrites the code
CALL_TOKENS = 48  # a turn that makes a tool call


@dataclass(frozen=True)
class Episode:
    """One session: a class of a project file renamed, then one of its methods."""

    name: str
    path: str  # relative to the repository
    cls: str
    new_cls: str
    method: str
    new_method: str
    tests: str


EPISODES = (
    Episode("ngram", "engine/speculation/ngram.py", "NgramIndex", "PromptIndex", "lookup", "find",
            "tests/test_spec.py"),
    Episode("rows", "engine/speculation/rows.py", "SourceRowGroup", "RowSources", "commit", "accept",
            "tests/test_batch_spec.py"),
)


def class_source(path: Path, name: str) -> str:
    """The source of top-level class ``name`` in ``path`` (up to the next top-level
    statement)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"class {name}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()
                and not lines[i].startswith(("#", ")"))), len(lines))
    return "\n".join(lines[start:end]).rstrip()


def tool_call(tool: str, **args: str) -> str:
    return json.dumps({"tool": tool, "args": args})


def turns(ep: Episode) -> list[tuple[str, int]]:
    """The episode's user messages, each with the most tokens its reply may take."""
    code = class_source(ROOT / ep.path, ep.cls)
    save = tool_call("write_file", path=ep.path)
    test = tool_call("run_tests", path=ep.tests)
    only = "reply with exactly this tool call and nothing else:\n"
    return [
        (f"Here is {ep.path}:\n```python\n{code}\n```\nRepeat this code exactly, with one change: "
         f"rename the class `{ep.cls}` to `{ep.new_cls}`. Write only the code.", REWRITE_TOKENS),
        (f"Save it: {only}{save}", CALL_TOKENS),
        (f"Result of write_file: ok.\nNow also rename the method `{ep.method}` to `{ep.new_method}`. "
         "Write the whole code again.", REWRITE_TOKENS),
        (f"Save it again: {only}{save}", CALL_TOKENS),
        (f"Result of write_file: ok.\nRun the tests: {only}{test}", CALL_TOKENS),
        (f"Result of run_tests: 1 failed: {ep.tests}: NameError: name '{ep.cls}' is not defined.\n"
         "Write the whole code again, exactly as in your last answer.", REWRITE_TOKENS),
        (f"Result of write_file: ok.\nRun the tests again: {only}{test}", CALL_TOKENS),
    ]


def _chat(url: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    from bench.server import stream_chat

    r = stream_chat(url, messages, max_tokens, timeout=3600)
    t = r["timings"] or {}
    tps = t.get("decode_tps") or 0.0
    # the first token comes with the prefill; the rest are the decode (as the engine counts)
    r["decode_s"] = (r["tokens"] - 1) / tps if tps and r["tokens"] > 1 else 0.0
    r["spec"] = t.get("spec")
    return r


def replay(urls: dict[str, str], ep: Episode, log: Any = None) -> list[dict[str, dict]]:
    """Every turn of ``ep`` sent to every server (name -> base URL), interleaved: one
    ``{server: reply}`` per turn. The first server's replies make the history."""
    names = list(urls)
    history: list[dict] = [{"role": "system", "content": SYSTEM}]
    out = []
    for i, (user, max_tokens) in enumerate(turns(ep)):
        history.append({"role": "user", "content": user})
        order = names if i % 2 == 0 else names[::-1]
        got = {name: _chat(urls[name], history, max_tokens) for name in order}
        out.append({name: got[name] for name in names})
        history.append({"role": "assistant", "content": got[names[0]]["text"]})
        if log is not None:
            log(f"agent trace {ep.name} turn {i + 1}: " + ", ".join(
                f"{n} {got[n]['tokens']} tokens in {got[n]['decode_s']:.1f} s" for n in names))
    return out


def speedup(turns_out: Sequence[dict[str, dict]], base: str, fast: str, first_turn: int = 3) -> dict[str, Any]:
    """``base``'s decode time over ``fast``'s on the turns from ``first_turn`` (1-based) on,
    with ``fast``'s acceptance there, and whether every reply was the same."""
    measured = turns_out[first_turn - 1:]
    slow = sum(t[base]["decode_s"] for t in measured)
    quick = sum(t[fast]["decode_s"] for t in measured)
    specs = [t[fast]["spec"] or {} for t in measured]
    drafted = sum(s.get("drafted", 0) for s in specs)
    accepted = sum(s.get("accepted", 0) for s in specs)
    forwards = sum(s.get("target_forwards", 0) for s in specs)
    tokens = sum(t[fast]["tokens"] for t in measured)
    return {"speedup": round(slow / quick, 3) if quick else 0.0,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "tokens_per_forward": round(tokens / forwards, 3) if forwards else None,
            "tokens": tokens, "turns": len(measured),
            "same_output": all(t[fast]["text"] == t[base]["text"] for t in turns_out),
            "by_turn": [round(t[base]["decode_s"] / t[fast]["decode_s"], 3) if t[fast]["decode_s"] else None
                        for t in turns_out],
            "replies": [t[base]["text"][:120] for t in turns_out]}


def measure(model: Path, work: Path, log: Any) -> dict[str, Any]:
    """The trace against plain decoding, through servers on loopback, and after a restart.

    A plain server (``--spec off``) and a suffix server (``--spec suffix``, its own cache
    folder) answer episode 1, then episode 2, turn by turn interleaved. Between the two
    both flush their caches (the suffix server's learned index is written) and their
    folders are copied: a new suffix server process on its copy answers episode 2 again,
    against a new plain server process on the plain one's copy. So the live and the
    restarted suffix server know exactly the same (episode 1), each is compared with a
    plain server as warm as itself (a new process traces its compiled decode step for each
    context size it meets and restores its prompts from the SSD tier, whichever decoding it
    runs), and ``restart_ratio`` is the restarted pair's speed-up over the live pair's on
    episode 2."""
    import shutil

    from bench.server import Served, http_client

    httpx = http_client()
    for d in ("plain", "suffix", "restarted", "plain-restarted"):
        (work / d).mkdir(parents=True, exist_ok=True)
    plain = Served("mlxkv", model, work / "plain", extra=("--spec", "off"))
    live = Served("mlxkv", model, work / "suffix", extra=("--spec", "suffix"))
    restarted = Served("mlxkv", model, work / "restarted", extra=("--spec", "suffix"))
    plain_again = Served("mlxkv", model, work / "plain-restarted", extra=("--spec", "off"))
    try:
        log("agent trace: starting the plain and the suffix server")
        plain.start()
        live.start()
        urls = {"plain": plain.url, "suffix": live.url}
        first = replay(urls, EPISODES[0], log)
        for server, copy in ((live, "restarted"), (plain, "plain-restarted")):
            r = httpx.post(server.url + "/admin/cache/flush", timeout=600)
            if r.status_code != 200:
                raise RuntimeError(f"flush failed: HTTP {r.status_code}")
            shutil.copytree(server.cache_dir / "kv", work / copy / "kv")
        second = replay(urls, EPISODES[1], log)
        live.stop()
        plain.stop()
        log("agent trace: new suffix and plain server processes on the copied cache folders")
        restarted.start()
        plain_again.start()
        again = replay({"plain": plain_again.url, "suffix": restarted.url}, EPISODES[1], log)
    finally:
        for s in (plain, live, restarted, plain_again):
            if s.proc is not None:
                s.stop()
    trace = speedup(first, "plain", "suffix")
    both = speedup([*first, *second], "plain", "suffix", first_turn=1)
    measured = [*first[2:], *second[2:]]
    whole = speedup(measured, "plain", "suffix", first_turn=1)
    live_b, restarted_b = speedup(second, "plain", "suffix"), speedup(again, "plain", "suffix")
    return {
        "speedup": whole["speedup"], "acceptance": whole["acceptance"],
        "tokens_per_forward": whole["tokens_per_forward"], "tokens": whole["tokens"],
        "restart_ratio": round(restarted_b["speedup"] / live_b["speedup"], 3) if live_b["speedup"] else 0.0,
        "restart_speedup": restarted_b["speedup"], "restart_acceptance": restarted_b["acceptance"],
        "restart_live_speedup": live_b["speedup"], "restart_live_acceptance": live_b["acceptance"],
        "lossless": both["same_output"] and restarted_b["same_output"],
        "episodes": {EPISODES[0].name: trace, EPISODES[1].name: live_b, f"{EPISODES[1].name}-restarted": restarted_b},
        "all_turns_speedup": both["speedup"],
    }
