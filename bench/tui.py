"""How the TUI feels, measured on the real app, the demo model and a real SSD cache folder.

    python -m bench.tui [--json] [--starts N] [--turns N]

Each measurement runs in a fresh process (``python -m bench.tui --child ...``) that runs
``tui.app.MlxkvApp`` headless (``App.run_test``): the whole app, its engine thread, its
store thread and the cache writer, only without a terminal. A frame is the moment the
app hands the terminal an update (``App._display``); headless, Textual skips writing it,
so the probe turns it into the terminal's bytes itself, like a real terminal driver.
Keys go in the way a terminal's input thread sends them (``driver.process_message``
from another thread).

- ``start_to_interactive_s``: the parent's ``time.time()`` right before it starts the
  process -> the first frame that shows a key typed into the first screen (interpreter
  start, imports, first paint, first key; the model loads in the background). The median
  of ``--starts`` fresh processes (the first run pays a cold file cache).
- ``key_latency_p95_ms``: a key typed in the message box every ~40 ms while replies
  stream and for 0.5 s after each (the cache writer persists the new blocks then) ->
  the first frame where the box shows it (also split by phase; ``loop_stall_*``: how
  late the UI's event loop wakes from a 5 ms sleep, i.e. how long it was held up).
- ``token_lag_p95_ms``: the engine thread hands a token to the reply's callback -> the
  first frame whose reply Markdown holds its text (not mid-update).
- ``inspector_10k_refresh_ms``: the cache inspector (``InspectorScreen``, not live) is
  given 10,000 ``CacheEntryInfo`` records (``load_entries``) -> the next frame; sorting,
  filtering and paging through them are timed the same way.

The last line of ``--json`` output is one JSON object; a small table comes before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxkv.engine.blas import preload

preload()  # the system OpenBLAS before mlx.core

ROOT = Path(__file__).resolve().parent.parent
SIZE = (120, 40)
TARGETS = {"start_to_interactive_s": 1.5, "key_latency_p95_ms": 50.0, "token_lag_p95_ms": 100.0}
KEY_PERIOD_S = 0.04
AFTER_REPLY_S = 0.5
DEADLINE_S = 120.0
SETTLE_S = 0.3  # between inspector measurements: each starts from a quiet screen


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ------------------------------------------------------------------------- the probe
class FrameProbe:
    """Wraps ``app._display``: records each frame's time and what the caller samples then,
    and turns headless updates into terminal bytes as a real driver would."""

    def __init__(self, app: Any, sample: Callable[[], Any] = lambda: None) -> None:
        self.app = app
        self.sample = sample
        self.frames: list[tuple[float, Any]] = []
        self._waiters: list[tuple[Callable[[], bool], float, asyncio.Future]] = []
        self._original = app._display

        def display(screen: Any, renderable: Any) -> None:
            self._original(screen, renderable)
            if renderable is None or app._batch_count:
                return
            if app.is_headless:
                try:
                    render = getattr(renderable, "render_segments", None)
                    if render is not None:
                        render(app.console)
                except Exception:  # a probe must never break the app it measures
                    pass
            now = time.perf_counter()
            self.frames.append((now, self.sample()))
            for waiter in list(self._waiters):
                test, since, future = waiter
                if now >= since and not future.done() and test():
                    future.set_result(now)
                    self._waiters.remove(waiter)

        app._display = display

    async def next_frame(self, test: Callable[[], bool] = lambda: True, since: float | None = None,
                         timeout: float = 30.0) -> float:
        """The time of the first frame from ``since`` (now) on at which ``test()`` holds."""
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((test, time.perf_counter() if since is None else since, future))
        self.app.screen.refresh()  # a frame soon even when nothing else changes
        return await asyncio.wait_for(future, timeout)


def _key(app: Any, key: str) -> None:
    """Send a key as the terminal's input thread does (any thread)."""
    from textual import events

    app._driver.process_message(events.Key(key, key if len(key) == 1 else None))


async def _until(test: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f} s")
        await asyncio.sleep(0.01)


def _settings(workdir: Path) -> Any:
    from mlxkv.engine.settings import Settings

    return Settings.load({"cache_dir": str(workdir / "cache")}, env={})


# ------------------------------------------------------------------------- child phases
async def _first_key(app: Any, probe: FrameProbe, t0_wall: float) -> dict:
    prompt = app.chat.prompt
    await _until(lambda: app.focused is prompt, "the message box to take the focus", 30)
    sent = time.perf_counter()
    threading.Thread(target=_key, args=(app, "h"), daemon=True).start()
    shown = await probe.next_frame(lambda: prompt.text.endswith("h"), since=sent)
    wall = time.time() - (time.perf_counter() - shown)
    out = {"start_to_interactive_s": wall - t0_wall,
           "first_key_ms": (shown - sent) * 1e3}
    prompt.clear()
    return out


async def _live(app: Any, turns: int) -> dict:
    """Replies stream while keys are typed; token and key times matched to frames."""
    from mlxkv.engine.demo import SAMPLE_QUESTIONS
    from mlxkv.tui.bridge import ReplyStream

    chat, bridge = app.chat, app.bridge
    await _until(bridge.ready.is_set, "the model to load")
    if bridge.error:
        raise RuntimeError(f"the model did not load: {bridge.error}")
    produced: list[tuple[float, int, int]] = []  # (time, reply id, text length so far)
    lengths: dict[int, int] = {}
    original = ReplyStream.on_event

    def on_event(stream: ReplyStream, event: Any) -> None:
        if type(event).__name__ == "TokenEvent" and event.text:
            lengths[stream.rid] = lengths.get(stream.rid, 0) + len(event.text)
            produced.append((time.perf_counter(), stream.rid, lengths[stream.rid]))
        original(stream, event)

    ReplyStream.on_event = on_event
    watched: dict[str, Any] = {"rid": None, "view": None, "shown": 0}
    prompt = chat.prompt

    def sample() -> tuple[int | None, int, int]:
        p = chat.pending
        if p is not None and p.view is not None:
            watched["rid"], watched["view"] = p.stream.rid, p.view
        view = watched["view"]
        # A view just mounted may not have composed its children yet: nothing shown then.
        body = next(iter(view.query(".body")), None) if view is not None and view.is_attached else None
        if body is not None and not body.lock.is_locked:  # mid-append the new blocks are not laid out yet
            watched["shown"] = len(body.source)
        return watched["rid"], watched["shown"], len(prompt.text)

    probe = FrameProbe(app, sample)
    keys: list[tuple[float, int]] = []  # (time sent, prompt length it makes)
    typing = threading.Event()
    streaming = threading.Event()  # a reply is being generated (else: after it, the writer persists)
    stop = threading.Event()
    base = [0]

    def typist() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            if typing.is_set():
                base[0] += 1
                keys.append((time.perf_counter(), base[0], streaming.is_set()))
                _key(app, rng.choice("abcdefghij"))
            time.sleep(KEY_PERIOD_S * rng.uniform(0.75, 1.25))

    stalls: list[float] = []  # how late a 5 ms sleep of the UI's event loop wakes up

    async def watch_loop() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            stalls.append((time.perf_counter() - t - 0.005) * 1e3)

    watcher = asyncio.get_running_loop().create_task(watch_loop())
    thread = threading.Thread(target=typist, name="bench-typist", daemon=True)
    thread.start()
    replies: list[dict] = []
    try:
        for turn in range(turns):
            question = SAMPLE_QUESTIONS[turn % len(SAMPLE_QUESTIONS)]
            if turn and turn % len(SAMPLE_QUESTIONS) == 0:
                await chat.new_conversation()
            await chat.send(question)
            p = chat.pending
            if p is None:
                raise RuntimeError("the chat did not start a reply")
            prompt.focus()
            base[0] = len(prompt.text)
            streaming.set()
            typing.set()
            await _until(lambda p=p: chat.pending is not p, "the reply to finish")
            streaming.clear()
            await asyncio.sleep(AFTER_REPLY_S)  # keys go on while the writer persists
            typing.clear()
            await asyncio.sleep(0.2)  # the last keys reach the screen
            prompt.clear()
            replies.append(dict(app.metrics.last_stats or {}))
    finally:
        stop.set()
        thread.join(5)
        await watcher
        ReplyStream.on_event = original
        app._display = probe._original

    frames = probe.frames
    token_lags, missed_tokens = [], 0
    for t, rid, length in produced:
        hit = next((ft for ft, (frid, shown, _) in frames if ft >= t and frid == rid and shown >= length), None)
        if hit is None:
            missed_tokens += 1
        else:
            token_lags.append((hit - t) * 1e3)
    key_lags, missed_keys, phase = [], 0, {True: [], False: []}
    # the box is cleared after each turn, so lengths restart; a key shows before that clear
    for t, length, during in keys:
        hit = next((ft for ft, (_, _, n) in frames if ft >= t and n >= length), None)
        if hit is None:
            missed_keys += 1
        else:
            key_lags.append((hit - t) * 1e3)
            phase[during].append((hit - t) * 1e3)
    gen = [r.get("generated_tokens", 0) for r in replies]
    return {
        "token_lag_p50_ms": _p(token_lags, 0.5), "token_lag_p95_ms": _p(token_lags, 0.95),
        "token_lag_max_ms": max(token_lags, default=None), "tokens": len(produced),
        "tokens_not_matched": missed_tokens,
        "key_latency_p50_ms": _p(key_lags, 0.5), "key_latency_p95_ms": _p(key_lags, 0.95),
        "key_latency_max_ms": max(key_lags, default=None), "keys": len(keys), "keys_not_matched": missed_keys,
        "key_latency_streaming_p95_ms": _p(phase[True], 0.95), "keys_streaming": len(phase[True]),
        "key_latency_after_reply_p95_ms": _p(phase[False], 0.95),
        "loop_stall_p99_ms": _p(stalls, 0.99), "loop_stall_max_ms": max(stalls, default=None),
        "replies": len(replies), "reply_tokens_mean": statistics.mean(gen) if gen else None,
        "decode_tps_mean": statistics.mean(r.get("decode_tps", 0.0) for r in replies) if replies else None,
        "frames": len(frames),
        "app_token_lag_p95_ms": _p([x * 1e3 for x in app.metrics.token_lag_s], 0.95),
    }


def entry_records(n: int, seed: int = 1) -> list:
    """``n`` cache entries of a plausible mix (kinds, tiers, sizes, sessions)."""
    from mlxkv.engine.cache.info import CacheEntryInfo

    rng = random.Random(seed)
    now = time.time()
    out = []
    for i in range(n):
        tokens = rng.randint(16, 32768)
        blocks = max(1, tokens // 256)
        size = tokens * rng.choice((4096, 8192, 36864))
        shared = rng.randint(0, size) if rng.random() < 0.4 else 0
        out.append(CacheEntryInfo(
            id=f"{rng.getrandbits(64):016x}", ns=rng.choice(("demo-3m·float32", "qwen3-4b·bfloat16")),
            kind=rng.choice(("conversation", "conversation", "prefix", "checkpoint")), tokens=tokens,
            blocks=blocks, bytes=size, unique_bytes=size - shared, shared_bytes=shared,
            tier=rng.choice(("ram", "ssd", "both")), pinned=rng.random() < 0.05,
            last_used=now - rng.uniform(0, 86400 * 7), hits=rng.randint(0, 50),
            session=f"mlxkv-chat-{i}" if rng.random() < 0.7 else None))
    return out


async def _inspector(app: Any, n: int) -> dict:
    from mlxkv.tui.inspector import InspectorScreen

    records = entry_records(n)
    screen = InspectorScreen(app.bridge, live=False)
    await app.push_screen(screen)
    await _until(lambda: app.screen is screen and screen.table.size.height > 0, "the inspector", 30)
    table = screen.table
    probe = FrameProbe(app)
    out: dict[str, Any] = {}
    try:
        t = time.perf_counter()
        screen.load_entries(records)
        out["inspector_10k_refresh_ms"] = (await probe.next_frame(since=t) - t) * 1e3
        for label, key in (("sort", "s"), ("sort_again", "s")):
            await asyncio.sleep(SETTLE_S)
            before = table.sort_key
            t = time.perf_counter()
            _key(app, key)
            out[f"inspector_10k_{label}_ms"] = (await probe.next_frame(
                lambda before=before: table.sort_key != before, since=t) - t) * 1e3
        await asyncio.sleep(SETTLE_S)
        t = time.perf_counter()
        _key(app, "pagedown")
        out["inspector_10k_page_ms"] = (await probe.next_frame(since=t) - t) * 1e3
        _key(app, "slash")
        await _until(lambda: app.focused is not table, "the filter box", 10)
        for label, ch in (("filter_1", "c"), ("filter_2", "o")):
            await asyncio.sleep(SETTLE_S)
            rows = table.row_count
            t = time.perf_counter()
            _key(app, ch)
            out[f"inspector_10k_{label}_ms"] = (await probe.next_frame(
                lambda rows=rows: table.row_count != rows, since=t) - t) * 1e3
        out["inspector_rows_after_filter"] = table.row_count
    finally:
        app._display = probe._original
    app.pop_screen()
    return out


async def _child(args: argparse.Namespace) -> dict:
    from mlxkv.tui.app import MlxkvApp

    workdir = Path(args.workdir)
    os.environ["MLXKV_DATA_DIR"] = str(workdir / "data")
    os.environ["XDG_CONFIG_HOME"] = str(workdir / "config")
    app = MlxkvApp(_settings(workdir))
    out: dict[str, Any] = {}
    async with app.run_test(headless=True, size=SIZE) as pilot:
        probe = FrameProbe(app)
        out.update(await _first_key(app, probe, args.t0))
        app._display = probe._original
        if args.child == "all":
            out.update(await _live(app, args.turns))
            out.update(await _inspector(app, args.entries))
        await pilot.pause()
    return out


# ------------------------------------------------------------------------- the parent
def _run_child(mode: str, workdir: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "bench.tui", "--child", mode, "--workdir", str(workdir),
           "--turns", str(args.turns), "--entries", str(args.entries)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    proc = subprocess.run([*cmd, "--t0", repr(t0)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench child {mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tui", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    ap.add_argument("--starts", type=int, default=3, help="fresh processes for start-up (median)")
    ap.add_argument("--turns", type=int, default=8, help="replies streamed while typing")
    ap.add_argument("--entries", type=int, default=10_000, help="inspector entries")
    ap.add_argument("--child", choices=("start", "all"), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(_child(args))), flush=True)
        return 0

    results: dict[str, Any] = {}
    starts: list[float] = []
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-tui-") as tmp:
        for i in range(max(1, args.starts)):
            workdir = Path(tmp) / f"run{i}"
            workdir.mkdir()
            r = _run_child("all" if i == 0 else "start", workdir, args)
            starts.append(r["start_to_interactive_s"])
            if i == 0:
                results.update(r)
    results["start_to_interactive_s"] = statistics.median(starts)
    results["start_to_interactive_runs_s"] = [round(s, 3) for s in starts]
    results["load_average"] = [round(x, 2) for x in os.getloadavg()]
    results["cpus"] = os.cpu_count()

    rows = [("start_to_interactive_s", "s"), ("key_latency_p95_ms", "ms"), ("token_lag_p95_ms", "ms"),
            ("inspector_10k_refresh_ms", "ms"), ("inspector_10k_sort_ms", "ms"),
            ("inspector_10k_filter_1_ms", "ms"), ("inspector_10k_page_ms", "ms")]
    print(f"{'measure':<28} {'value':>10}  {'target':>8}")
    for name, unit in rows:
        value = results.get(name)
        target = TARGETS.get(name)
        shown = "–" if value is None else f"{value:.3f} {unit}" if unit == "s" else f"{value:.1f} {unit}"
        print(f"{name:<28} {shown:>10}  {'≤ ' + str(target) if target else '':>8}")
    print(f"({results.get('tokens')} tokens in {results.get('replies')} replies, {results.get('keys')} keys; "
          f"load average {results['load_average']} on {results['cpus']} CPUs)")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
