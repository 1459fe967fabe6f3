"""The engine under mlx.launch, for the command line: which engine this rank runs, and on
every rank but 0, following rank 0 to the end. Only this module knows both the engine and
its sharded form, so neither imports the other's maker."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from mlxkv.engine.cache.client import CacheArg
from mlxkv.engine.distributed import COMMANDS, DistributedError, World, join, launched
from mlxkv.engine.engine import Engine
from mlxkv.engine.logs import warn_once
from mlxkv.engine.settings import Settings


def engine_for(settings: Settings, prefix_cache: CacheArg = None) -> Engine:
    """The engine for ``settings``: under a distributed launch this rank's
    ``ShardedEngine``, else ``Engine.from_settings``."""
    world = join(settings.dist_timeout_s) if launched() else None
    if world is not None:
        from mlxkv.engine.distributed.engine import ShardedEngine

        return ShardedEngine.for_world(settings, world, prefix_cache)
    return Engine.from_settings(settings, prefix_cache)


def run_rank(command: str | None, settings: Settings) -> int | None:
    """For the command line, under a distributed launch: None on rank 0 (it goes on as the
    front end) and without a launch; on every other rank, the exit status once it has
    followed rank 0 to the end. Commands other than generate and serve are refused."""
    if not launched():
        if str(settings.sources.get("shard", "")).startswith("flag"):
            warn_once(logging.getLogger("mlxkv.distributed"), "shard-alone",
                      "--shard applies under mlx.launch only; this process runs the whole model")
        return None
    world = join(settings.dist_timeout_s)
    if world is None:
        return None
    if command not in COMMANDS:
        raise DistributedError(
            f"rank {world.rank}: `mlxkv {command or 'chat'}` does not run distributed; under "
            "mlx.launch run `mlxkv generate` or `mlxkv serve`")
    if world.rank == 0:
        return None
    return follow(settings, world)


def follow(settings: Settings, world: World) -> int:
    """Run this rank (not rank 0) until rank 0 stops: the exit status.

    Rank 0 decides when the group stops. Ctrl-C reaches every rank of a launch from a
    terminal: here it is ignored, and rank 0 drains, has every rank flush its cache and
    stops them. SIGTERM (a service stopping, or mlx.launch stopping the ranks because one
    failed) gives rank 0 up to ``--dist-timeout-s`` to say stop, then this rank leaves; the
    engine thread may be inside a collective that never returns, so it leaves at once."""
    deadline: list[float] = []

    def on_term(signum: int, frame: Any) -> None:
        if not deadline:
            deadline.append(time.monotonic() + world.timeout_s)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, on_term)
    from mlxkv.engine.distributed.engine import ShardedEngine

    engine = ShardedEngine.for_world(settings, world)
    engine.start()
    while engine.is_alive():
        engine.join(0.2)
        if deadline and time.monotonic() > deadline[0]:
            sys.stderr.flush()
            os._exit(143)
    return 0
