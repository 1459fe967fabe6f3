"""The ideal cache reuse of ``bench.agents``, computed apart from the server's own churn rules.

Two new conversations of an agent share a long prompt (its system prompt and tools) up to the
user's first words, except for text the agent makes different in every conversation (Claude
Code's ``x-anthropic-billing-header`` line, at the top). The ideal a prefix cache can reach on
the second conversation is the longest common token prefix of the two prompts once that
line is left out. Here the line is removed by this module's own pattern, and the prompts are
rendered to tokens by the server's request path (the same route functions, the same chat
template) with its churn rules switched off: the figure checks the server's rule, it does
not reuse it.
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# A whole line that starts with Claude Code's billing header, wherever it stands in system text.
BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)


def remove_billing_line(text: str) -> str:
    return BILLING_LINE.sub("", text)


def _strip_content(content: Any) -> Any:
    if isinstance(content, str):
        return remove_billing_line(content)
    if isinstance(content, list):
        return [{**b, "text": remove_billing_line(b["text"])}
                if isinstance(b, dict) and isinstance(b.get("text"), str) else b for b in content]
    return content


def without_volatile(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of an Anthropic Messages body with the billing line removed from its system
    text: the ``system`` field and ``system`` entries of ``messages`` (never from what the
    user or the model wrote)."""
    out = copy.deepcopy(body)
    if "system" in out:
        out["system"] = _strip_content(out["system"])
    for m in out.get("messages") or ():
        if isinstance(m, dict) and m.get("role") == "system":
            m["content"] = _strip_content(m.get("content"))
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def best_prefix(tokens: Sequence[int], earlier: Sequence[Sequence[int]]) -> int:
    """The longest prefix ``tokens`` shares with any of ``earlier`` (0 when none)."""
    return max((common_prefix(tokens, e) for e in earlier), default=0)


class PromptRenderer:
    """The token ids ``mlxkv serve`` would prefill for a request body, through the routes' own
    request reading and the model's chat template, with the churn rules off. Loads the model
    in this process (an engine without a prefix cache): use it as a context manager, while
    no server competes for the CPU."""

    def __init__(self, model: Path, timeout: float = 600.0):
        self.model, self.timeout = model, timeout
        self._engine: Any = None
        self._ctx: Any = None

    def __enter__(self) -> PromptRenderer:
        from mlxkv.engine.engine import Engine
        from mlxkv.server.context import Context, ServerConfig

        self._engine = Engine(str(self.model)).start(timeout=self.timeout)
        self._ctx = Context(self._engine, ServerConfig(churn_rules=False))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._engine.shutdown()

    def _encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return list(self._engine.encode_chat(messages, self.timeout, tools))

    def anthropic(self, body: dict[str, Any], remove_volatile: bool = True) -> list[int]:
        """A ``/v1/messages`` (or ``count_tokens``) body's prompt, the billing line removed
        here (unless ``remove_volatile`` is false: the prompt as the client sent it)."""
        from mlxkv.server.anthropic_api import claude_prompt

        prompt = asyncio.run(claude_prompt(without_volatile(body) if remove_volatile else body, self._ctx))
        return self._encode(prompt.messages, prompt.tools)

    def responses(self, body: dict[str, Any]) -> list[int]:
        """A ``/v1/responses`` body's prompt (the whole conversation is in its ``input``)."""
        from mlxkv.server.responses_api import engine_request, read_ask

        request = asyncio.run(engine_request(read_ask(body, self._ctx), self._ctx, None))
        return self._encode(request.messages, request.tools)

    def tokens(self, route: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt of a generation request on ``route`` (None for other routes)."""
        if route in ("/v1/messages", "/v1/messages/count_tokens"):
            return self.anthropic(body)
        if route == "/v1/responses":
            return self.responses(body)
        return None
