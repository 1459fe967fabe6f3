"""Agent prompt churn: text an agent injects into its prompts that changes from one
conversation to the next while meaning nothing to a local model.

A prefix cache keyed on tokens reuses a prompt only up to its first differing token. Agents
resend the same long system prompt and tool list with every new conversation, but a line
near the top that carries a per-conversation value (an attribution or billing header) makes
every new conversation miss from that line on. Each rule below removes one such kind of
text from the system text of a request (the ``system`` field and ``system`` entries of
Anthropic Messages; ``system`` and ``developer`` messages of OpenAI chat), before the chat
template renders it, so that a new conversation reuses everything up to its first real
difference.

The rules run only on system text, never on what the user or the model wrote. They are on by
default; ``--no-churn-rules`` (``MLXKV_CHURN_RULES=0``, ``churn_rules = false``) turns them
off and the prompt reaches the model as the client sent it.

Each rule is a function ``str -> str`` in :data:`RULES`, with a docstring saying what it
removes, from which client, and why that text carries no meaning here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# ``x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli;`` and more
# ``key=value;`` fields as later versions add them; Claude Code sends it as a text block of
# its own, so once the blocks are joined nothing may separate it from the next block's text.
_CLAUDE_CODE_BILLING = re.compile(r"x-anthropic-billing-header:(?:[ \t]*[A-Za-z0-9_.-]+=[^;\n]*;)+[ \t]*\n?")


def claude_code_billing_header(text: str) -> str:
    """Claude Code's ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;`` line,
    the first block of its system prompt. The hosted API reads it for billing and removes it;
    the last part of ``cc_version`` is derived from the conversation's first prompt, so two
    new conversations differ at about token 25 of a prompt of thousands. Removed, with its
    line break. (``CLAUDE_CODE_ATTRIBUTION_HEADER=0`` makes Claude Code leave it out.)"""
    return _CLAUDE_CODE_BILLING.sub("", text)


RULES: tuple[Callable[[str], str], ...] = (claude_code_billing_header,)


def normalise(text: str) -> str:
    """``text`` with every rule applied."""
    for rule in RULES:
        text = rule(text)
    return text


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat-template messages with the rules applied to the text of their ``system``
    messages; a system message left empty is dropped (it was nothing but churn)."""
    out = []
    for m in messages:
        if m.get("role") == "system" and isinstance(m.get("content"), str):
            text = normalise(m["content"])
            if text != m["content"]:
                if not text.strip():
                    continue
                m = {**m, "content": text}
        out.append(m)
    return out
