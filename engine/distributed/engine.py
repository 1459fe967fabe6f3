"""The engine under a distributed launch: rank 0 serves, every other rank follows.

:class:`ShardedEngine` is an ``engine.engine.Engine`` whose model is this rank's shard
(``sharding.load_shard``) and whose prefix-cache namespace is this shard's. On rank 0 it
is the engine front ends know: requests are accepted, tokenised and looked up as usual,
then broadcast before the prefill (``_prepare``); generation runs through
:class:`~engine.distributed.lockstep.Lockstep`; while idle it sends a heartbeat every
quarter of ``--dist-timeout-s``, and when it stops it tells the others. On every other
rank the engine thread runs :meth:`ShardedEngine._follow` instead of the request queue:
it serves what rank 0 sends, stores its own shard's state after each request, and ends
when rank 0 says so.

Requests are served one at a time: batching and speculation are off (each would need its
own lock-step). A generation that fails cannot be answered again without the cache as
on one machine (the other ranks are inside the same step): the rank stops with an error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

from mlxkv.engine.distributed import DistributedError, World
from mlxkv.engine.distributed.lockstep import Lockstep
from mlxkv.engine.distributed.protocol import FLUSH, HEARTBEAT, REQUEST, SHUTDOWN, Channel, agree_prefix
from mlxkv.engine.engine import _STOP, Engine, EngineError, RequestHandle, _Retry
from mlxkv.engine.logs import warn_once

log = logging.getLogger("mlxkv.distributed")

LOAD_BOUND_FACTOR = 10  # loading waits for the slowest rank's disk: a longer bound
CACHE_CLOSE_S = 5.0  # what a failing rank gives its prefix cache before it exits


def _params_body(params: Any) -> dict[str, Any]:
    body = dataclasses.asdict(params)
    body["stop"] = list(params.stop)
    return body


class ShardedEngine(Engine):
    """One rank's engine (see the module docstring). Build it with :meth:`for_world`."""

    def __init__(self, model: str, *, world: World, shard: str = "auto", **kwargs: Any):
        kwargs["max_batch"] = 1
        super().__init__(model, **kwargs)
        self.world = world
        self.shard = shard
        self.leader = world.rank == 0
        self.channel = Channel(world, fail=self._fail)
        self._heartbeat_s = max(0.05, world.timeout_s / 4)
        self._told_stop = False
        self._last: dict[str, Any] | None = None  # the last request's agreement

    @classmethod
    def for_world(cls, settings: Any, world: World, prefix_cache: Any = None) -> ShardedEngine:
        """The engine of this rank for ``settings`` (speculation and batching off)."""
        asked = [name for name in ("spec", "max_batch", "draft_model")
                 if str(getattr(settings, "sources", {}).get(name, "default")) != "default"]
        if asked and world.rank == 0:
            warn_once(log, "one-at-a-time", "under a distributed launch requests are served one "
                      "at a time, without speculation (%s ignored)", ", ".join(sorted(asked)))
        if hasattr(settings, "replace"):
            settings = settings.replace(spec="off", draft_model=None, max_batch=1)
        if prefix_cache is None and getattr(settings, "prefix_cache", True):
            def prefix_cache(loaded: Any, namespace: str) -> Any:
                from mlxkv.engine.cache.prefix_cache import PrefixCache

                return PrefixCache.from_settings(settings)
        return cls(settings.model, world=world, shard=getattr(settings, "shard", "auto"),
                   dtype=getattr(settings, "dtype", "auto"), prefix_cache=prefix_cache,
                   full_hash=getattr(settings, "full_hash", False), settings=settings,
                   max_queue=getattr(settings, "max_queue", 64),
                   name=f"mlxkv-engine-rank{world.rank}")

    # ------------------------------------------------------------------ failures
    def _fail(self, message: str) -> None:
        """The group is broken (engine thread): give the cache a moment, then exit."""
        try:
            close = getattr(self.prefix_cache, "close", None)
            if close is not None:
                close(CACHE_CLOSE_S)
        except Exception:
            pass
        self.world.fail(message)

    # ------------------------------------------------------------------ loading
    def _load_model(self) -> tuple[Any, str]:
        from mlxkv.engine.cache.layout import kv_namespace
        from mlxkv.engine.distributed.protocol import handshake
        from mlxkv.engine.distributed.sharding import load_shard, shard_namespace

        self.world.watchdog.arm("loading the model on every rank",
                                self.world.timeout_s * LOAD_BOUND_FACTOR)
        loaded = load_shard(self.model_spec, self.dtype, self.full_hash, self.world, self.shard)
        mode = loaded.extra["shard"]
        handshake(self.channel, {
            "model": loaded.fingerprint, "compute dtype": loaded.compute_dtype, "sharding": mode,
            "prefix cache": "on" if self._prefix_arg is not None else "off"})
        # the prefix cache's probe of the model (one token through it) is a collective too
        self.world.watchdog.arm("loading the model on every rank",
                                self.world.timeout_s * LOAD_BOUND_FACTOR)
        namespace = kv_namespace(loaded.fingerprint, loaded.compute_dtype)
        return loaded, shard_namespace(namespace, mode, self.world.size, self.world.rank)

    def _load(self) -> None:
        try:
            super()._load()
        except DistributedError:
            raise
        except (ValueError, OSError) as e:
            raise DistributedError(f"rank {self.world.rank}: {e}") from e
        except Exception as e:
            raise DistributedError(f"rank {self.world.rank}: {type(e).__name__}: {e}") from e
        finally:
            self.world.watchdog.disarm()
        self.spec_providers = {}
        self.info["distributed"] = {"world": self.world.size, "rank": self.world.rank,
                                    "shard": self.loaded.extra["shard"]}

    # ------------------------------------------------------------------ the command loop
    def _next_command(self) -> Any:
        if not self.leader:
            try:
                self._follow()
            except Exception as e:  # a bug here would leave rank 0 waiting: say it and stop
                self._fail(f"{type(e).__name__}: {e}")
            return _STOP
        while True:
            try:
                return self._queue.get(timeout=self._heartbeat_s)
            except queue.Empty:
                self.channel.send(HEARTBEAT)

    def _stopped(self) -> None:
        if self.leader and not self._told_stop:
            self._told_stop = True
            self.channel.send(SHUTDOWN)

    def submit(self, request: Any, callback: Any = None) -> RequestHandle:
        if not self.leader:
            raise EngineError(f"rank {self.world.rank} takes its requests from rank 0")
        return super().submit(request, callback)

    # ------------------------------------------------------------------ one request
    def _agree(self, tokens: list[int], n: int, cache: Any, ram: int, ssd: int
               ) -> tuple[int, Any, int, int]:
        """The cached length every rank holds; this rank's cache cut to it."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        trimmable = cache is not None and can_trim_prompt_cache(cache)
        agreed = agree_prefix(self.channel, n, trimmable, ram, ssd)
        used = agreed.used
        self._last = {"prompt_tokens": len(tokens), "used": used,
                      "cached_by_rank": agreed.cached_by_rank,
                      "ram_by_rank": agreed.ram_by_rank, "ssd_by_rank": agreed.ssd_by_rank}
        if used == n:
            return n, cache, ram, ssd
        if used == 0:
            self._release(cache)
            return 0, None, 0, 0
        trim_prompt_cache(cache, n - used)
        ram = min(ram, used)
        return used, cache, ram, used - ram

    def _prepare(self, handle: RequestHandle, start: float) -> Any:
        job = super()._prepare(handle, start)  # tokenised, fitted, looked up here
        if job is None:  # refused: the other ranks never hear of it
            return None
        try:
            self.channel.send(REQUEST, job.tokens, {"params": _params_body(job.params),
                                                    "session": handle.request.session})
            n, cache, ram, ssd = self._agree(job.tokens, job.n_cached, job.cache, job.ram_tokens,
                                             job.ssd_tokens)
        except Exception as e:  # the other ranks are inside this request's collectives
            self._fail(f"{type(e).__name__}: {e}")
            raise
        return dataclasses.replace(job, n_cached=n, cache=cache, ram_tokens=ram, ssd_tokens=ssd)

    def _decoding(self, handle: RequestHandle, speculation: Any) -> Any:
        if speculation is not None:  # a request that asked for it: off here
            warn_once(log, "request-spec", "speculation is off under a distributed launch")
            try:
                speculation.source.close()
            except Exception:
                pass
        return Lockstep(self.channel)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._generate(*args, **kwargs)
        except Exception as e:
            cause = e.__cause__ if isinstance(e, _Retry) and e.__cause__ is not None else e
            self._fail(f"a generation failed ({type(cause).__name__}: {cause}); the ranks can no "
                       "longer stay in step")
            raise

    # ------------------------------------------------------------------ other ranks
    def _follow(self) -> None:
        """Serve what rank 0 sends until it says stop (every rank but 0)."""
        while True:
            msg = self.channel.receive()
            if msg.op == HEARTBEAT:
                continue
            if msg.op == SHUTDOWN:
                return
            if msg.op == FLUSH:
                try:
                    self.prefix_cache.flush(msg.arg / 1000 if msg.arg > 0 else None)
                except Exception:
                    log.exception("prefix cache flush failed")
                continue
            if msg.op == REQUEST:
                self._follow_request(msg.tokens, msg.body)

    def _follow_request(self, tokens: list[int], body: dict[str, Any]) -> None:

        from mlxkv.engine.generate import Generation, SamplingParams

        params = SamplingParams(**{**body["params"], "stop": tuple(body["params"]["stop"])})
        session = body.get("session")
        self._counts["requests"] += 1
        self._busy(True)
        n, cache = self._lookup(tokens, session)
        ram, ssd = self._tier_split(n)
        n, cache, _, _ = self._agree(tokens, n, cache, ram, ssd)
        gen = Generation(self.loaded.model, self.loaded.tokenizer, tokens, params, cache=cache,
                         n_cached=n, speculation=Lockstep(self.channel))
        try:
            for _ in gen:
                pass
        except Exception as e:
            self._fail(f"a generation failed ({type(e).__name__}: {e}); the ranks can no longer "
                       "stay in step")
        out = gen.outcome
        if self._caching and out is not None and out.tokens_in_cache:
            self._store_state(out.tokens_in_cache, gen.cache, session)
        self._busy(False)

    # ------------------------------------------------------------------ front ends
    def distributed_info(self) -> dict[str, Any]:
        """This rank, the group and the last request's cached prefix per rank
        (``cached_by_rank``, ``ram_by_rank``, ``ssd_by_rank``) and the length used."""
        shard = self.loaded.extra.get("shard") if self.loaded is not None else self.shard
        return {"world": self.world.size, "rank": self.world.rank, "shard": shard,
                "last_request": dict(self._last) if self._last else None}

    def stats(self, timeout: float | None = 30.0) -> dict[str, Any]:
        figures = super().stats(timeout)
        figures["distributed"] = self.distributed_info()
        return figures

    def cache_flush(self, timeout: float | None = None) -> dict:
        """Persist every rank's dirty states (rank 0 asks the others between requests)."""
        if not self.leader:
            return super().cache_flush(timeout)

        def flush_all() -> dict:
            self.channel.send(FLUSH, arg=int(timeout * 1000) if timeout else 0)
            return self.prefix_cache.flush(timeout)
        wait = None if timeout is None else timeout + 30.0
        return self._wait(self.call(flush_all), wait, "cache flush")


def follow(settings: Any, world: World) -> int:
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
    engine = ShardedEngine.for_world(settings, world)
    engine.start()
    while engine._thread.is_alive():
        engine._thread.join(0.2)
        if deadline and time.monotonic() > deadline[0]:
            sys.stderr.flush()
            os._exit(143)
    return 0
