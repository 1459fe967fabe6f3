"""The agents ``bench.agents`` drives: Claude Code and Codex CLI, pinned versions from the npm
registry in the git-ignored ``.cache/agents`` (``make agents`` installs them; the benchmark
does too when they are missing and npm is there), each run non-interactively in a scratch
home with no network: every address but the loopback server goes to a proxy port nothing
listens on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AGENTS_DIR = ROOT / ".cache" / "agents"
BIN = AGENTS_DIR / "node_modules" / ".bin"
CLAUDE = ("@anthropic-ai/claude-code", "2.1.332", "claude")  # npm package, pinned version, command
CODEX = ("@openai/codex", "0.171.0", "codex")
PINS = (CLAUDE, CODEX)
MAIN_MODEL = "smollm2"  # the names the agents ask for (the server serves one model, echoes the name)
SMALL_MODEL = "smollm2-small"  # Claude Code's "small fast" model, so its side requests stand apart


class AgentsMissing(RuntimeError):
    """An agent is not installed at its pinned version and could not be installed."""


def installed_version(command: str) -> str | None:
    """The version ``.cache/agents``'s ``command --version`` prints (None: not runnable)."""
    exe = BIN / command
    if not exe.exists() or shutil.which("node") is None:
        return None
    try:
        r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "DISABLE_AUTOUPDATER": "1"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = r.stdout.split()
    # "2.1.332 (Claude Code)", "codex-cli 0.171.0"
    return next((w for w in words if w[:1].isdigit()), None) if r.returncode == 0 else None


def ensure_agents(install: bool = True) -> dict[str, str]:
    """The pinned agents' versions, installing them with npm (exact pins) when one is missing
    or another version; :class:`AgentsMissing` says what to do when that cannot be done."""
    versions = {cmd: installed_version(cmd) for _, _, cmd in PINS}
    wrong = [(pkg, pin) for pkg, pin, cmd in PINS if versions[cmd] != pin]
    if not wrong:
        return {cmd: v for cmd, v in versions.items() if v}
    specs = " ".join(f"{pkg}@{pin}" for pkg, pin in wrong)
    if not install:
        raise AgentsMissing(f"not installed in {AGENTS_DIR}: {specs} (run `make agents`)")
    if shutil.which("npm") is None or shutil.which("node") is None:
        raise AgentsMissing(f"npm and node are needed to install {specs} into {AGENTS_DIR} "
                            "(install Node.js 20+, then run `make agents`)")
    AGENTS_DIR.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["npm", "install", "-q", "--no-audit", "--no-fund", "--save-exact", "--prefix",
                        str(AGENTS_DIR), *(f"{pkg}@{pin}" for pkg, pin in wrong)],
                       capture_output=True, text=True, timeout=1800)
    versions = {cmd: installed_version(cmd) for _, _, cmd in PINS}
    still = [f"{pkg}@{pin} (found {versions[cmd] or 'none'})" for pkg, pin, cmd in PINS if versions[cmd] != pin]
    if r.returncode != 0 or still:
        raise AgentsMissing(f"npm install into {AGENTS_DIR} failed ({r.returncode}): "
                            f"{', '.join(still) or specs}; {r.stderr.strip()[-500:]}")
    return {cmd: v for cmd, v in versions.items() if v}


def offline_env(home: Path) -> dict[str, str]:
    """A minimal environment with ``home`` as HOME and every proxy pointed at a closed port,
    loopback excepted: whatever an agent tries to reach beyond the server fails at once."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "TERM": "dumb", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = dead
    return env


@dataclasses.dataclass
class AgentRun:
    """One agent process: its exit, what it printed, and how long it took."""

    command: list[str]
    returncode: int | None  # None: killed at the time limit
    stdout: str
    stderr: str
    wall_s: float

    def tail(self) -> str:
        return (self.stderr.strip() or self.stdout.strip())[-600:]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> AgentRun:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
        return AgentRun(cmd, r.returncode, r.stdout, r.stderr, time.perf_counter() - t0)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return AgentRun(cmd, None, out, err + f"\n(killed after {timeout:.0f} s)", time.perf_counter() - t0)


# ------------------------------------------------------------------------- Claude Code
class ClaudeCode:
    """``claude -p PROMPT --output-format json`` against ``base_url`` (Anthropic Messages),
    replies capped at ``max_output_tokens``; ``tools=False`` runs it without its built-in
    tools (a prompt a third as long, for a quick run)."""

    def __init__(self, home: Path, base_url: str, max_output_tokens: int, tools: bool = True):
        self.env = {**offline_env(home), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "x",
                    "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
                    "ANTHROPIC_SMALL_FAST_MODEL": SMALL_MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": SMALL_MODEL,
                    # a cold prefill of its prompt takes minutes on a CPU: the SDK's 10 min is too short
                    "API_TIMEOUT_MS": str(3600 * 1000)}
        self.tools = tools

    def run(self, project: Path, prompt: str, timeout: float, resume: bool = False) -> AgentRun:
        cmd = [str(BIN / "claude"), "-p", prompt, "--output-format", "json", "--model", MAIN_MODEL]
        if resume:
            cmd.append("--continue")  # the most recent conversation in this folder
        if not self.tools:
            cmd += ["--tools", ""]
        return _run(cmd, project, self.env, timeout)

    @staticmethod
    def result(run: AgentRun) -> dict[str, Any] | None:
        """The JSON object ``--output-format json`` printed (None: it printed none)."""
        for line in reversed(run.stdout.strip().splitlines()):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict) and value.get("type") == "result":
                return value
        return None


# ------------------------------------------------------------------------- Codex CLI
CODEX_INSTRUCTIONS = "You are a helpful assistant. Answer briefly.\n"


class CodexCli:
    """``codex exec --json`` against ``base_url`` (``/v1/responses``) in a private
    ``CODEX_HOME``: a local provider, a one-line base prompt instead of Codex's several
    thousand tokens, its optional prompt sections and tools off (the README's set-up for a
    small model on a CPU)."""

    def __init__(self, home: Path, base_url: str):
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        (home / "instructions.md").write_text(CODEX_INSTRUCTIONS)
        (home / "config.toml").write_text(f"""\
model = "{MAIN_MODEL}"
model_provider = "mlxkv"
model_instructions_file = "{home / 'instructions.md'}"
model_context_window = 8192
include_permissions_instructions = false
include_apps_instructions = false
include_environment_context = false
web_search = "disabled"
check_for_update_on_startup = false

[agents]
enabled = false

[features]
goals = false

[analytics]
enabled = false

[model_providers.mlxkv]
name = "mlxkv"
base_url = "{base_url}/v1"
wire_api = "responses"
stream_idle_timeout_ms = {3600 * 1000}
""")
        self.env = {**offline_env(home), "CODEX_HOME": str(home)}

    def run(self, project: Path, prompt: str, timeout: float, thread: str | None = None) -> AgentRun:
        cmd = [str(BIN / "codex"), "exec", "--json", "--skip-git-repo-check", "--color", "never"]
        cmd += ["resume", thread, prompt] if thread else [prompt]
        return _run(cmd, project, self.env, timeout)

    @staticmethod
    def events(run: AgentRun) -> list[dict[str, Any]]:
        out = []
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    @classmethod
    def thread(cls, run: AgentRun) -> str | None:
        return next((e.get("thread_id") for e in cls.events(run) if e.get("type") == "thread.started"), None)

    @classmethod
    def reply(cls, run: AgentRun) -> str | None:
        """The last agent message Codex printed (None: none)."""
        texts = [e["item"].get("text") for e in cls.events(run)
                 if e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "agent_message"]
        return texts[-1] if texts else None
