"""``mlxkv chat``: a plain line chat. Lines starting with ``/`` are chat commands, answered
here and never sent to the model (``//`` sends a message that starts with ``/``)."""

from __future__ import annotations

import sys
import uuid
from typing import TYPE_CHECKING

from mlxkv.cli.common import (
    Progress,
    fail,
    human_bytes,
    printer,
    sampling_params,
    start_engine,
    stats_line,
    wait_result,
)
from mlxkv.cli.terminal import LineReader

if TYPE_CHECKING:
    from mlxkv.engine.api import CacheStats, EngineAPI, EngineStats
    from mlxkv.engine.settings import Settings

HELP = """chat commands:
  /help          this list
  /clear         forget the conversation (cached state stays for reuse)
  /stats         what the engine and its prefix cache hold
  /quit, /exit   leave (Ctrl-D too); Ctrl-C stops a reply
  //text         send a message that starts with /"""




def format_stats(stats: EngineStats) -> list[str]:
    info = stats.get("model") or {}
    lines = []
    if isinstance(info, dict) and info.get("model"):
        lines.append(f"model: {info['model']} ({info.get('compute_dtype', '?')})")
    if "requests" in stats:
        lines.append(f"requests: {stats['requests']}")
    c: CacheStats = stats.get("cache") or {}
    if not c.get("enabled", False):
        lines.append("prefix cache: off")
        return lines
    lines.append(f"cached tokens served: {c.get('cached_tokens', 0)} of {c.get('prompt_tokens', 0)} "
                 f"prompt tokens ({c.get('ram_hits', 0)} RAM hits, {c.get('ssd_hits', 0)} SSD hits, "
                 f"{c.get('misses', 0)} misses)")
    lines.append(f"RAM tier: {human_bytes(c.get('ram_bytes', 0))} of {human_bytes(c.get('ram_max_bytes', 0))}, "
                 f"{c.get('ram_entries', 0)} entries")
    if c.get("ssd"):
        lines.append(f"SSD tier: {human_bytes(c.get('ssd_bytes', 0))}, {c.get('ssd_blocks', 0)} blocks")
    else:
        reason = c.get("ssd_disabled_reason")
        lines.append("SSD tier: off" + (f" ({reason})" if reason else ""))
    return lines


class Chat:
    def __init__(self, engine: EngineAPI, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.session = ""
        self.messages: list[dict[str, str]] = []
        self.new_conversation()

    def new_conversation(self) -> None:
        if self.session:
            self.engine.close_session(self.session)
        self.session = uuid.uuid4().hex
        self.engine.open_session(self.session)
        self.messages = ([{"role": "system", "content": self.settings.system_prompt}]
                         if self.settings.system_prompt else [])

    def command(self, line: str) -> bool:
        """Answer a chat command; False when the chat should end."""
        word = line.split()[0].lower()
        if word in ("/quit", "/exit", "/q"):
            return False
        if word in ("/help", "/?"):
            print(HELP)
        elif word == "/clear":
            self.new_conversation()
            print("conversation cleared")
        elif word == "/stats":
            for text in format_stats(self.engine.stats()):
                print(text)
        else:
            print(f"unknown command {word}, /help lists them")
        return True

    def ask(self, text: str) -> None:
        from mlxkv.engine.engine import EngineError, Request

        self.messages.append({"role": "user", "content": text})
        try:
            handle = self.engine.submit(
                Request(messages=list(self.messages), params=sampling_params(self.settings),
                        session=self.session),
                callback=printer(sys.stdout, Progress(self.settings.prefill_step_size)))
            result = wait_result(handle)
        except (EngineError, ValueError) as e:  # e.g. the conversation outgrew the context
            self.messages.pop()
            print()  # end the line of whatever reply text was printed
            message = str(e)
            if "--truncate" in message:  # a flag of `generate`; here the way out is /clear
                message = message.split(" (use --truncate")[0] + " (/clear starts a new conversation)"
            fail(message)
            return
        print()
        print(stats_line(result.stats, result.finish_reason))
        self.messages.append({"role": "assistant", "content": result.text})

    def close(self) -> None:
        try:
            self.engine.close_session(self.session)
        except Exception as e:  # leaving must not fail on it
            fail(f"closing the chat session: {e}")


def cmd_chat(settings: Settings) -> int:
    from mlxkv.engine.engine import EngineError

    engine = start_engine(settings)
    try:
        info = engine.info
        print(f"mlxkv chat: {info['model']} ({info['compute_dtype']}, {info['blas']})")
        print("/help lists commands, /quit or Ctrl-D leaves; Ctrl-C stops a reply.")
        chat = Chat(engine, settings)
        reader = LineReader()
        try:
            while True:
                try:
                    line = reader.read("> ")
                except EOFError:
                    print()
                    return 0
                except KeyboardInterrupt:
                    print()
                    continue
                text = line.strip()
                if not text:
                    continue
                if text.startswith("//"):
                    chat.ask(line.lstrip()[1:])
                elif text.startswith("/"):
                    try:
                        if not chat.command(text):
                            return 0
                    except (EngineError, ValueError) as e:
                        fail(str(e))
                else:
                    chat.ask(line)
        finally:
            chat.close()
    finally:
        engine.shutdown()
