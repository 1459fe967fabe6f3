"""Real agents against ``mlxkv serve`` on the real model: Claude Code (Anthropic Messages) and
Codex CLI (``/v1/responses``), the pinned versions of ``bench.agent_clients``, each in print
mode in one scratch project, through a recording proxy (``bench.agent_proxy``) that keeps
every request and answer. No network: the agents reach only the loopback server.

Claude Code (``claude -p ... --output-format json``, replies capped by
``CLAUDE_CODE_MAX_OUTPUT_TOKENS``):

1. three different prompts as three new conversations (A, B, C);
2. a follow-up inside the last one (``--continue``);
3. the server restarted on the same ``--cache-dir``, then the first prompt again (A').

Codex CLI (``codex exec --json``): a new conversation (X), two more turns in it (``codex exec
resume``), then another new conversation (Y).

Requests: the proxy records all of them. *Main* requests are the agents' generation requests
for the model they were given (``/v1/messages`` for ``smollm2``, ``/v1/responses``); Claude
Code's requests for its "small fast" model (``smollm2-small``), ``count_tokens`` and anything
else are recorded and their statuses reported, and count in no hit figure. Cached tokens are
what the server reported in each answer's usage (``cache_read_input_tokens``,
``input_tokens_details.cached_tokens``).

Figures (targets in brackets):

- ``all_2xx``, ``all_2xx_codex``: every recorded request answered 2xx; ``replies_shown``,
  ``replies_shown_codex``: each run printed the model's reply (the text of its last main
  request's answer), never an API error;
- ``new_conversation_hit_vs_ideal`` [>= 0.95]: for the first main request of conversations B
  and C, cached tokens / the longest common token prefix of its prompt and any earlier main
  request's prompt, both rendered with the billing line removed by ``bench.agent_prompts``'s
  own pattern and the server's churn rules off; the lowest of the two;
- ``in_conversation_hit_fraction`` [>= 0.95]: cached / prompt tokens over the main requests
  that are not the first of their conversation (the follow-up, tool rounds, and the requests
  Claude Code sends itself to continue a reply cut at its output limit);
- ``after_restart_hit_fraction`` [>= 0.95]: cached / prompt tokens of A''s first main request;
  ``hit_ttft_vs_cold`` [each <= 0.1]: for each main request after the restart whose prompt
  was served cold before it (A's first), its time to first token / that cold one's; the
  others, whose earlier twin was itself a hit, are listed as ``hit_ttft_vs_earlier_hit``;
- ``in_conversation_hit_fraction_codex`` [>= 0.95] over X's turns 2 and 3 (and tool rounds),
  ``new_conversation_hit_vs_ideal_codex`` [>= 0.95] for Y's first request.

Time to first token: from the request read in full to the first event that carries generated
text or a tool call (the answer's end when it has none). A cold prefill of Claude Code's
~12,000-token prompt on a 2-core CPU takes minutes: the run has few conversations and short
replies, each agent run is bounded (``--timeout-s``) and so is the whole (``--budget-s``:
steps that would start after it are skipped and reported). ``--quick`` is a smoke run:
Claude Code without its built-in tools (a ~1,800-token prompt), conversations A and B, a
follow-up in B, the restart and A'; Codex X and one resumed turn.

    python -m bench.agents [--json] [--quick] [--only claude|codex] [--keep]

The last line with ``--json`` is one JSON object: the figures above, ``requests`` (every
recorded request: step, route, role, status, prompt/cached/ideal tokens, TTFT, the server's
``x-mlxkv-cache`` header), ``lookups`` (``/stats``'s record of where each prompt parted
from the cache), the load average at start and end, both agents' versions, the model and the
context setting. Exit status 2 when the model or the agents are missing (a message says how
to get them), 1 when a step failed (no reply shown) or was skipped, else 0: a figure that
misses its target is shown as such (``targets_met``), it does not change the status.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.agent_clients import (
    SMALL_MODEL,
    AgentRun,
    AgentsMissing,
    ClaudeCode,
    CodexCli,
    ensure_agents,
)
from bench.agent_prompts import PromptRenderer, best_prefix
from bench.agent_proxy import Exchange, RecordingProxy
from bench.models import RealModelMissing, real_model_file

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as bench.server: one BLAS thread per process

CLAUDE_PROMPTS = ("What is the capital of France? Answer in one word.",
                  "What is 2+2?",  # Claude Code's environment entry follows it: the reply must answer this
                  "Name one primary colour. Answer in one word.")
CLAUDE_FOLLOW_UP = "Thanks. Now say it again in one word."
CODEX_PROMPTS = ("What is the capital of Italy? Answer in one word.",
                 "Name one planet of the solar system. Answer in one word.")
CODEX_FOLLOW_UPS = ("And of Spain? One word.", "And of Portugal? One word.")
TARGETS: dict[str, tuple[str, float]] = {
    "new_conversation_hit_vs_ideal": (">=", 0.95),
    "in_conversation_hit_fraction": (">=", 0.95),
    "after_restart_hit_fraction": (">=", 0.95),
    "hit_ttft_vs_cold_max": ("<=", 0.1),
    "in_conversation_hit_fraction_codex": (">=", 0.95),
    "new_conversation_hit_vs_ideal_codex": (">=", 0.95),
}
GENERATION_ROUTES = ("/v1/messages", "/v1/responses")
REPLY_CHARS = 200  # of each reply, in the JSON


# ------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Step:
    """One agent run: a new conversation, or a turn more in an earlier one."""

    agent: str  # "claude" or "codex"
    conversation: str  # "A", "B", ... (A' is A's prompt after the restart)
    prompt: str
    continues: bool = False
    after_restart: bool = False
    run: AgentRun | None = None
    shown: str | None = None  # the reply the agent printed
    failure: str | None = None  # why the run did not show a reply (None: it did)
    skipped: bool = False
    exchanges: list[Exchange] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.agent} {self.conversation}" + (" (turn)" if self.continues else "")


def plan(quick: bool, only: str | None) -> list[Step]:
    """The steps in order; the server restarts before the first ``after_restart`` one."""
    steps: list[Step] = []
    if only in (None, "claude"):
        prompts = CLAUDE_PROMPTS[:2] if quick else CLAUDE_PROMPTS
        steps += [Step("claude", "ABC"[i], p) for i, p in enumerate(prompts)]
        steps.append(Step("claude", "ABC"[len(prompts) - 1], CLAUDE_FOLLOW_UP, continues=True))
        steps.append(Step("claude", "A'", CLAUDE_PROMPTS[0], after_restart=True))
    if only in (None, "codex"):
        steps.append(Step("codex", "X", CODEX_PROMPTS[0]))
        steps += [Step("codex", "X", p, continues=True) for p in CODEX_FOLLOW_UPS[:1 if quick else 2]]
        if not quick:
            steps.append(Step("codex", "Y", CODEX_PROMPTS[1]))
    return steps


# ------------------------------------------------------------------------- one recorded request
def usage_of(ex: Exchange) -> tuple[int | None, int | None]:
    """(prompt tokens, cached tokens) as the server reported them in the answer."""
    usage: dict[str, Any] | None = None
    if ex.is_sse():
        for e in ex.sse_events():
            data = e.data if isinstance(e.data, dict) else {}
            if e.name == "message_start":
                usage = (data.get("message") or {}).get("usage") or usage
            elif e.name == "message_delta" and data.get("usage"):
                usage = {**(usage or {}), **data["usage"]}  # the full usage, at the end
            elif e.name in ("response.completed", "response.incomplete"):
                usage = (data.get("response") or {}).get("usage") or usage
    else:
        answer = ex.response_json()
        usage = answer.get("usage") if isinstance(answer, dict) else None
    if not usage:
        return None, None
    if "input_tokens_details" in usage:  # Responses: input_tokens counts the cached ones
        return usage.get("input_tokens"), (usage.get("input_tokens_details") or {}).get("cached_tokens")
    cached = usage.get("cache_read_input_tokens") or 0
    prompt = (usage.get("input_tokens") or 0) + cached + (usage.get("cache_creation_input_tokens") or 0)
    return prompt, cached


def _output(e: Any) -> bool:
    """Whether an SSE event carries generated text or a tool call."""
    data = e.data if isinstance(e.data, dict) else {}
    if e.name == "content_block_delta":
        delta = data.get("delta") or {}
        return bool(delta.get("text") or delta.get("partial_json") or delta.get("thinking"))
    if e.name == "content_block_start":
        return (data.get("content_block") or {}).get("type") == "tool_use"
    if e.name == "response.output_text.delta":
        return bool(data.get("delta"))
    if e.name == "response.output_item.added":
        return (data.get("item") or {}).get("type") == "function_call"
    return False


def ttft_of(ex: Exchange) -> float | None:
    """Seconds from the request to the first generated text or tool call (to the answer's end
    when it holds none)."""
    if ex.ended is None:
        return None
    if ex.is_sse():
        first = next((e.at for e in ex.sse_events() if _output(e)), None)
        if first is not None:
            return first - ex.started
    return ex.ended - ex.started


def reply_of(ex: Exchange) -> str | None:
    """The generated text of an answer (Anthropic or Responses, streamed or not)."""
    if ex.is_sse():
        parts = []
        for e in ex.sse_events():
            data = e.data if isinstance(e.data, dict) else {}
            if e.name == "content_block_delta":
                parts.append((data.get("delta") or {}).get("text") or "")
            elif e.name in ("response.completed", "response.incomplete"):
                return _responses_text(data.get("response") or {})
        return "".join(parts)
    answer = ex.response_json()
    if not isinstance(answer, dict):
        return None
    if answer.get("object") == "response":
        return _responses_text(answer)
    return "".join(b.get("text", "") for b in answer.get("content") or () if b.get("type") == "text")


def stop_of(ex: Exchange) -> str | None:
    """Why the answer ended: Anthropic's ``stop_reason``, or a response's status (with the
    reason it is incomplete)."""
    answers = [ex.response_json()]
    if ex.is_sse():
        answers = [e.data.get("delta") if e.name == "message_delta" else e.data.get("response")
                   for e in ex.sse_events() if isinstance(e.data, dict)
                   and e.name in ("message_delta", "response.completed", "response.incomplete", "response.failed")]
    for answer in reversed([a for a in answers if isinstance(a, dict)]):
        if answer.get("stop_reason"):
            return answer["stop_reason"]
        if answer.get("status"):
            why = (answer.get("incomplete_details") or {}).get("reason")
            return answer["status"] + (f" ({why})" if why else "")
    return None


def _responses_text(response: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for o in response.get("output") or () if o.get("type") == "message"
                   for p in o.get("content") or ())


def cache_header(ex: Exchange) -> dict[str, str]:
    """``x-mlxkv-cache: matched=25/4254; tier=ram; outcome=diverged; ...`` as a dict."""
    raw = ex.response_headers.get("x-mlxkv-cache", "")
    return dict(part.strip().split("=", 1) for part in raw.split(";") if "=" in part)


def role_of(ex: Exchange) -> str:
    """``main``, ``small`` (Claude Code's small fast model), ``count_tokens`` or ``other``."""
    if ex.route == "/v1/messages/count_tokens":
        return "count_tokens"
    if ex.route in GENERATION_ROUTES and ex.method == "POST":
        body = ex.json_body()
        return "small" if isinstance(body, dict) and body.get("model") == SMALL_MODEL else "main"
    return "other"


@dataclasses.dataclass
class Row:
    """One recorded request, read."""

    ex: Exchange
    step: Step
    role: str
    turn: int = 0  # main requests: 1 for the first of its conversation, 2 for the next...
    prompt: int | None = None
    cached: int | None = None
    ttft_s: float | None = None
    reply: str | None = None
    stop: str | None = None
    tokens: list[int] | None = None  # the prompt as rendered here (generation requests)
    ideal: int | None = None  # longest common prefix with an earlier generation request's prompt
    twin: Row | None = None  # the earlier request with the longest common prefix

    @property
    def ok(self) -> bool:
        return self.ex.status is not None and 200 <= self.ex.status < 300

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.ex.index, "step": self.step.name, "route": self.ex.route, "role": self.role,
                "model": (self.ex.json_body() or {}).get("model") if self.ex.body else None,
                "status": self.ex.status, "turn": self.turn or None, "prompt_tokens": self.prompt,
                "cached_tokens": self.cached, "ideal_tokens": self.ideal,
                "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 3),
                "x_mlxkv_cache": self.ex.response_headers.get("x-mlxkv-cache"), "error": self.ex.error,
                "stop_reason": self.stop, "reply": None if self.reply is None else self.reply[:REPLY_CHARS]}


def read_rows(steps: list[Step]) -> list[Row]:
    rows: list[Row] = []
    turns: dict[tuple[str, str], int] = {}
    for step in steps:
        for ex in step.exchanges:
            row = Row(ex, step, role_of(ex))
            if row.role in ("main", "small") and row.ok:
                row.prompt, row.cached = usage_of(ex)
                row.ttft_s, row.reply, row.stop = ttft_of(ex), reply_of(ex), stop_of(ex)
            if row.role == "main":
                key = (step.agent, step.conversation)
                turns[key] = row.turn = turns.get(key, 0) + 1
            rows.append(row)
    return rows


def render(rows: list[Row], model: Path) -> None:
    """Each answered generation request's prompt as tokens, and its ideal reuse: the longest
    prefix it shares with an earlier one (all of which the cache holds)."""
    with PromptRenderer(model) as renderer:
        done: list[Row] = []
        for row in rows:
            body = row.ex.json_body()
            if row.role not in ("main", "small") or not row.ok or not isinstance(body, dict):
                continue
            row.tokens = renderer.tokens(row.ex.route, body)
            best = max(done, key=lambda d: best_prefix(row.tokens, [d.tokens]), default=None)
            row.twin = best
            row.ideal = best_prefix(row.tokens, [best.tokens]) if best else 0
            done.append(row)


# ------------------------------------------------------------------------- the figures
def _fraction(pairs: list[tuple[int | None, int | None]]) -> float | None:
    pairs = [(c, p) for c, p in pairs if c is not None and p]
    return round(sum(c for c, _ in pairs) / sum(p for _, p in pairs), 4) if pairs else None


def agent_figures(rows: list[Row], steps: list[Step], agent: str) -> dict[str, Any]:
    """The figures of one agent's rows (keys without the agent suffix)."""
    mine = [r for r in rows if r.step.agent == agent]
    runs = [s for s in steps if s.agent == agent and not s.skipped]
    main = [r for r in mine if r.role == "main" and r.ok]
    statuses: dict[str, dict[str, int]] = {}
    for r in mine:
        key = f"{r.ex.method} {r.ex.route} ({r.role})"
        statuses.setdefault(key, {})
        statuses[key][str(r.ex.status)] = statuses[key].get(str(r.ex.status), 0) + 1
    first_of_agent = next((r.step.conversation for r in main), None)
    new = [r for r in main if r.turn == 1 and r.step.conversation != first_of_agent
           and not r.step.after_restart and r.ideal]
    new_hits = [{"conversation": r.step.conversation, "prompt_tokens": r.prompt, "cached_tokens": r.cached,
                 "ideal_tokens": r.ideal, "ratio": round(r.cached / r.ideal, 4) if r.cached is not None else None}
                for r in new]
    later = [r for r in main if r.turn >= 2]
    restart = [r for r in main if r.step.after_restart]
    # each request after the restart beside the earlier one with the same prompt
    pairs = [(r, r.twin) for r in restart if r.twin is not None and r.ttft_s and r.twin.ttft_s
             and not r.twin.step.after_restart]
    hits = [{"index": r.ex.index, "earlier_index": e.ex.index, "same_prompt": e.tokens == r.tokens,
             "cached_tokens": r.cached, "ttft_s": round(r.ttft_s, 3), "earlier_ttft_s": round(e.ttft_s, 3),
             "earlier_cached_tokens": e.cached, "ratio": round(r.ttft_s / e.ttft_s, 4)} for r, e in pairs]
    ratios = [h["ratio"] for h in new_hits if h["ratio"] is not None]
    out: dict[str, Any] = {
        "request_count": len(mine), "main_request_count": len(main), "statuses": statuses,
        "all_2xx": bool(mine) and all(r.ok for r in mine),
        "replies_shown": bool(runs) and all(s.failure is None for s in runs),
        "new_conversation_hit_vs_ideal": min(ratios) if ratios else None,
        "new_conversation_hits": new_hits,
        "in_conversation_hit_fraction": _fraction([(r.cached, r.prompt) for r in later]),
        "in_conversation_requests": [r.ex.index for r in later],
    }
    if restart:
        out["after_restart_hit_fraction"] = _fraction([(restart[0].cached, restart[0].prompt)])
        # against a cold prefill of the same prompt (the earlier one found nothing cached); the
        # others (Claude Code's own retries of a cut reply, say) were hits already
        out["hit_ttft_vs_cold"] = [h for h in hits if h["earlier_cached_tokens"] == 0]
        out["hit_ttft_vs_earlier_hit"] = [h for h in hits if h["earlier_cached_tokens"]]
        out["hit_ttft_vs_cold_max"] = max((h["ratio"] for h in out["hit_ttft_vs_cold"]), default=None)
    return out


def figures(rows: list[Row], steps: list[Step]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for agent, suffix in (("claude", ""), ("codex", "_codex")):
        if any(s.agent == agent for s in steps):
            out.update({k + suffix: v for k, v in agent_figures(rows, steps, agent).items()})
    out["targets_met"] = {k: _meets(out[k], *TARGETS[k]) for k in TARGETS if k in out}
    for k in ("all_2xx", "replies_shown", "all_2xx_codex", "replies_shown_codex"):
        if k in out:
            out["targets_met"][k] = out[k] is True
    return out


def _meets(value: Any, op: str, bound: float) -> bool | None:
    if value is None:
        return None
    return value >= bound if op == ">=" else value <= bound


# ------------------------------------------------------------------------- the run
class Server:
    """``mlxkv serve`` on the real model behind the recording proxy; restarts keep the cache
    folder, and ``/stats``'s lookups are kept from each server before it stops."""

    def __init__(self, model: Path, scratch: Path, proxy: RecordingProxy, context_tokens: int,
                 max_tokens_limit: int):
        from bench.server import Served

        self.make = lambda: Served("mlxkv", model, scratch, extra=(
            "--context-tokens", str(context_tokens), "--max-tokens-limit", str(max_tokens_limit),
            "--lookup-history", "256"))
        self.proxy, self.served, self.lookups = proxy, None, []

    def start(self) -> None:
        self.served = self.make().start(timeout=600)
        self.proxy.upstream = self.served.url

    def stop(self) -> None:
        if self.served is None:
            return
        try:
            with urllib.request.urlopen(self.served.url + "/stats", timeout=60) as r:
                self.lookups += json.loads(r.read()).get("lookups") or []
        except OSError:
            pass
        self.served.stop()
        self.served = None

    def restart(self) -> None:
        self.stop()
        self.start()


def run_step(step: Step, claude: ClaudeCode | None, codex: CodexCli | None, project: Path,
             proxy: RecordingProxy, threads: dict[str, str], timeout: float) -> None:
    proxy.label = step.name
    first = len(proxy.exchanges)
    if step.agent == "claude":
        step.run = claude.run(project, step.prompt, timeout, resume=step.continues)
        result = ClaudeCode.result(step.run)
        step.shown = (result or {}).get("result")
        if step.run.returncode != 0 or result is None or result.get("is_error"):
            step.failure = f"exit {step.run.returncode}: {step.shown or step.run.tail()}"
    else:
        step.run = codex.run(project, step.prompt, timeout, threads.get(step.conversation) if step.continues else None)
        thread = CodexCli.thread(step.run)
        if thread:
            threads.setdefault(step.conversation, thread)
        step.shown = CodexCli.reply(step.run)
        if step.run.returncode != 0 or step.shown is None:
            step.failure = f"exit {step.run.returncode}: {step.run.tail()}"
    step.exchanges = proxy.since(first)


def check_replies(rows: list[Row], steps: list[Step]) -> None:
    """A run that exited well shows the model's reply: the text of its last main request's
    answer (an API error shown as the reply, or another text, is a failure)."""
    for step in steps:
        if step.failure is not None or step.skipped:
            continue
        last = [r for r in rows if r.step is step and r.role == "main"]
        written = last[-1].reply if last else None
        if written is None or (step.shown or "").strip() != written.strip():
            step.failure = f"printed {step.shown!r}, the model wrote {written!r}"


def load() -> float:
    return round(os.getloadavg()[0], 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = real_model_file()
    versions = ensure_agents(install=not args.no_install)
    scratch = Path(tempfile.mkdtemp(prefix="mlxkv-agents-"))
    project, steps = scratch / "project", plan(args.quick, args.only)
    project.mkdir()
    result: dict[str, Any] = {"model": model.name, "context_tokens": args.context_tokens,
                              "max_output_tokens": args.max_output_tokens, "quick": args.quick,
                              "claude_code_version": versions.get("claude"), "codex_version": versions.get("codex"),
                              "load_start": load()}
    t0 = time.monotonic()
    threads: dict[str, str] = {}
    try:
        with RecordingProxy() as proxy:
            server = Server(model, scratch, proxy, args.context_tokens, args.max_output_tokens * 4)
            claude = ClaudeCode(scratch / "claude-home", proxy.url, args.max_output_tokens, tools=not args.quick)
            codex = CodexCli(scratch / "codex-home", proxy.url)
            server.start()
            try:
                for step in steps:
                    if time.monotonic() - t0 > args.budget_s:
                        step.skipped = True
                        continue
                    if step.after_restart and not any(s.after_restart and s.run for s in steps):
                        server.restart()
                    run_step(step, claude, codex, project, proxy, threads, args.timeout_s)
                    print(f"  {step.name}: {step.run.wall_s:.0f} s: {step.prompt!r} -> {(step.shown or '')[:120]!r}"
                          + (f", FAILED: {step.failure}" if step.failure else ""), file=sys.stderr, flush=True)
            finally:
                server.stop()
        if args.keep:  # everything that went through the proxy, to read a figure's causes
            with open(scratch / "exchanges.jsonl", "w") as fh:
                for ex in proxy.exchanges:
                    fh.write(json.dumps(ex.as_dict()) + "\n")
        rows = read_rows(steps)
        render(rows, model)
        check_replies(rows, steps)
        result.update(figures(rows, steps))
        result["steps"] = [{"step": s.name, "prompt": s.prompt, "wall_s": round(s.run.wall_s, 1) if s.run else None,
                            "shown": s.shown, "failure": s.failure, "skipped": s.skipped} for s in steps]
        result["requests"] = [r.as_dict() for r in rows]
        result["lookups"] = server.lookups
        result["skipped_steps"] = [s.name for s in steps if s.skipped]
        result["failed_steps"] = {s.name: s.failure for s in steps if s.failure}
        result["wall_s"] = round(time.monotonic() - t0, 1)
        result["load_end"] = load()
        return result
    finally:
        if args.keep:
            print(f"scratch kept: {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def print_table(result: dict[str, Any]) -> None:
    print(f"agents against mlxkv serve: {result['model']}, --context-tokens {result['context_tokens']}, "
          f"replies <= {result['max_output_tokens']} tokens; Claude Code {result['claude_code_version']}, "
          f"Codex {result['codex_version']}; load {result['load_start']} -> {result['load_end']}, "
          f"{result['wall_s']:.0f} s")
    head = ("#", "step", "route", "role", "status", "prompt", "cached", "ideal", "ttft_s", "x-mlxkv-cache")
    rows = [head] + [(str(r["index"]), r["step"], r["route"], r["role"], _fmt(r["status"]), _fmt(r["prompt_tokens"]),
                      _fmt(r["cached_tokens"]), _fmt(r["ideal_tokens"]), _fmt(r["ttft_s"]), r["x_mlxkv_cache"] or "")
                     for r in result["requests"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    print()
    for key, met in result["targets_met"].items():
        op, bound = TARGETS.get(key, ("==", True))
        verdict = {True: "ok", False: "MISSED", None: "not measured"}[met]
        print(f"{key:<38} {_fmt(result[key]):>8}   {op} {bound}   {verdict}")
    for key in ("hit_ttft_vs_cold", "new_conversation_hits", "new_conversation_hits_codex"):
        if result.get(key):
            print(f"{key}: {json.dumps(result[key])}")
    for step in result["steps"]:
        if step["failure"]:
            print(f"{step['step']}: FAILED: {step['failure']}")
        elif not step["skipped"]:
            print(f"{step['step']}: {step['wall_s']:.0f} s, printed {step['shown']!r}")
    if result["skipped_steps"]:
        print(f"skipped (--budget-s spent): {', '.join(result['skipped_steps'])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agents", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--quick", action="store_true", help="a smoke run (Claude Code without its tools, fewer turns)")
    p.add_argument("--only", choices=("claude", "codex"), help="run one agent")
    p.add_argument("--context-tokens", type=int, default=16384, help="the server's --context-tokens")
    p.add_argument("--max-output-tokens", type=int, default=48, help="reply cap (CLAUDE_CODE_MAX_OUTPUT_TOKENS; "
                   "the server's --max-tokens-limit is 4x, for Codex, which sends none)")
    p.add_argument("--timeout-s", type=float, default=None, help="bound of one agent run (default 1800, quick 900)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="steps that would start after this many seconds are skipped (default 5400, quick 1800)")
    p.add_argument("--no-install", action="store_true", help="do not npm-install missing agents")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (server logs, cache, agent homes)")
    args = p.parse_args(argv)
    args.timeout_s = args.timeout_s or (900.0 if args.quick else 1800.0)
    args.budget_s = args.budget_s or (1800.0 if args.quick else 5400.0)
    try:
        result = run(args)
    except AgentsMissing as e:
        print(f"bench.agents: {e}", file=sys.stderr)
        return 2
    except RealModelMissing:
        print("bench.agents: the real model is missing: run `make fixtures` to fetch it", file=sys.stderr)
        return 2
    print_table(result)
    if args.json:
        print(json.dumps(result))
    return 1 if result["failed_steps"] or result["skipped_steps"] else 0


if __name__ == "__main__":
    sys.exit(main())
