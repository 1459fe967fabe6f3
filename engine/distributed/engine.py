"""The engine under a distributed launch: rank 0 serves, every other rank follows.

:class:`ShardedEngine` is an ``engine.engine.Engine`` with three parts plugged in through
the engine's declared interfaces (``engine.engine.EngineSources``):

* :class:`ShardModel` (a ``ModelSource``): this rank's shard (``sharding.load_shard``)
  and this shard's prefix-cache namespace, with every load bounded by the watchdog;
* a ``CommandSource``: on rank 0, :class:`LeaderCommands` takes requests from the queue
  as usual and sends a heartbeat every quarter of ``--dist-timeout-s`` while idle, and
  tells the others when it stops; on every other rank, :class:`FollowerCommands` serves
  what rank 0 sends instead (storing its own shard's state after each request) and ends
  the loop when rank 0 says so;
* :class:`LockstepTokens` (a ``TokenSource``): a request rank 0 accepted (tokenised and
  looked up as usual) is broadcast and the cached prefix agreed before the prefill; its
  generation runs through :class:`~engine.distributed.lockstep.Lockstep`.

Requests are served one at a time: batching and speculation are off (each would need its
own lock-step). A generation that fails cannot be answered again without the cache as
on one machine (the other ranks are inside the same step): the rank stops with an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from mlxkv.engine.cache.client import CacheArg, CacheClient
from mlxkv.engine.commands import STOP, Command, CommandQueue, wait
from mlxkv.engine.distributed import DistributedError, World
from mlxkv.engine.distributed.lockstep import Lockstep
from mlxkv.engine.distributed.protocol import FLUSH, HEARTBEAT, REQUEST, SHUTDOWN, Channel, agree_prefix
from mlxkv.engine.engine import Engine, EngineError, EngineSources, Event, Request, RequestHandle
from mlxkv.engine.logs import warn_once
from mlxkv.engine.preparing import Job
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.settings import Settings

if TYPE_CHECKING:
    from mlxkv.engine.api import DistributedInfo, EngineStats, FlushReport
    from mlxkv.engine.models import LoadedModel
    from mlxkv.engine.speculation.base import ProposalProvider
    from mlxkv.engine.speculation.providers import Speculation

log = logging.getLogger("mlxkv.distributed")

LOAD_BOUND_FACTOR = 10  # loading waits for the slowest rank's disk: a longer bound
CACHE_CLOSE_S = 5.0  # what a failing rank gives its prefix cache before it exits


def _params_body(params: SamplingParams) -> dict[str, Any]:
    body = dataclasses.asdict(params)
    body["stop"] = list(params.stop)
    return body


class ShardModel:
    """This rank's shard of the model (a ``ModelSource``)."""

    def __init__(self, engine: ShardedEngine, caching: bool):
        self.engine = engine
        self.caching = caching  # every rank must agree on it

    def load(self) -> tuple[LoadedModel, str]:
        from mlxkv.engine.cache.layout import kv_namespace
        from mlxkv.engine.distributed.protocol import handshake
        from mlxkv.engine.distributed.sharding import load_shard, shard_namespace

        world, settings = self.engine.world, self.engine.settings
        world.watchdog.arm("loading the model on every rank", world.timeout_s * LOAD_BOUND_FACTOR)
        loaded = load_shard(settings.model, settings.dtype, settings.full_hash, world,
                            settings.shard)
        mode = loaded.extra["shard"]
        handshake(self.engine.channel, {
            "model": loaded.fingerprint, "compute dtype": loaded.compute_dtype, "sharding": mode,
            "prefix cache": "on" if self.caching else "off"})
        # the prefix cache's probe of the model (one token through it) is a collective too
        world.watchdog.arm("loading the model on every rank", world.timeout_s * LOAD_BOUND_FACTOR)
        namespace = kv_namespace(loaded.fingerprint, loaded.compute_dtype)
        return loaded, shard_namespace(namespace, mode, world.size, world.rank)

    def loading(self) -> AbstractContextManager[None]:
        return self._bounded()

    @contextlib.contextmanager
    def _bounded(self) -> Iterator[None]:
        rank = self.engine.world.rank
        try:
            yield
        except DistributedError:
            raise
        except (ValueError, OSError) as e:
            raise DistributedError(f"rank {rank}: {e}") from e
        except Exception as e:
            raise DistributedError(f"rank {rank}: {type(e).__name__}: {e}") from e
        finally:
            self.engine.world.watchdog.disarm()

    def providers(self, loaded: LoadedModel, settings: Settings) -> dict[str, ProposalProvider]:
        return {}  # no speculation: it would need its own lock-step

    def describe(self, loaded: LoadedModel) -> dict[str, Any]:
        world = self.engine.world
        return {"distributed": {"world": world.size, "rank": world.rank,
                                "shard": loaded.extra["shard"]}}


class LeaderCommands:
    """Rank 0's command source: the queue, with heartbeats while idle."""

    def __init__(self, engine: ShardedEngine):
        self.engine = engine
        self.heartbeat_s = max(0.05, engine.world.timeout_s / 4)
        self._told_stop = False

    def next_command(self, commands: CommandQueue) -> Command:
        while True:
            try:
                return commands.get(timeout=self.heartbeat_s)
            except queue.Empty:
                self.engine.channel.send(HEARTBEAT)

    def stopped(self) -> None:
        if not self._told_stop:
            self._told_stop = True
            self.engine.channel.send(SHUTDOWN)


class FollowerCommands:
    """Every other rank's command source: what rank 0 sends, served until it says stop."""

    def __init__(self, engine: ShardedEngine):
        self.engine = engine

    def next_command(self, commands: CommandQueue) -> Command:
        try:
            self._follow()
        except Exception as e:  # a bug here would leave rank 0 waiting: say it and stop
            self.engine.fail(f"{type(e).__name__}: {e}")
        return STOP

    def stopped(self) -> None:
        return None

    def _follow(self) -> None:
        channel, cache = self.engine.channel, self.engine.scheduler.runtime.cache
        while True:
            msg = channel.receive()
            if msg.op == HEARTBEAT:
                continue
            if msg.op == SHUTDOWN:
                return
            if msg.op == FLUSH:
                try:
                    cache.client.flush(msg.arg / 1000 if msg.arg > 0 else None)
                except Exception:
                    log.exception("prefix cache flush failed")
                continue
            if msg.op == REQUEST:
                self._request(msg.tokens, msg.body)

    def _request(self, tokens: list[int], body: dict[str, Any]) -> None:
        from mlxkv.engine.generate import Generation

        engine = self.engine
        scheduler = engine.scheduler
        cache, loaded = scheduler.runtime.cache, scheduler.runtime.loaded
        params = SamplingParams(**{**body["params"], "stop": tuple(body["params"]["stop"])})
        session = body.get("session")
        scheduler.counts.requests += 1
        cache.busy(True)
        n, lent = cache.lookup(tokens, session)
        ram, ssd = cache.tier_split(n)
        n, lent, _, _ = engine.tokens.agree(tokens, n, lent, ram, ssd)
        gen = Generation(loaded.model, loaded.tokenizer, tokens, params, cache=lent,
                         n_cached=n, speculation=Lockstep(engine.channel))
        try:
            for _ in gen:
                pass
        except Exception as e:
            engine.fail(f"a generation failed ({type(e).__name__}: {e}); the ranks can no "
                        "longer stay in step")
        out = gen.outcome
        if cache.enabled and out is not None and out.tokens_in_cache:
            assert gen.cache is not None  # made by the generation when not given
            cache.store(out.tokens_in_cache, gen.cache, session)
        cache.busy(False)


class LockstepTokens:
    """Every rank generates the same tokens in lock-step (a ``TokenSource``)."""

    def __init__(self, engine: ShardedEngine):
        self.engine = engine
        self.last: dict[str, Any] | None = None  # the last request's agreement

    def agree(self, tokens: list[int], n: int, cache: list | None, ram: int, ssd: int
              ) -> tuple[int, list | None, int, int]:
        """The cached length every rank holds; this rank's cache cut to it."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        trimmable = cache is not None and can_trim_prompt_cache(cache)
        agreed = agree_prefix(self.engine.channel, n, trimmable, ram, ssd)
        used = agreed.used
        self.last = {"prompt_tokens": len(tokens), "used": used,
                     "cached_by_rank": agreed.cached_by_rank,
                     "ram_by_rank": agreed.ram_by_rank, "ssd_by_rank": agreed.ssd_by_rank}
        if used == n:
            return n, cache, ram, ssd
        if used == 0:
            self.engine.scheduler.runtime.cache.release(cache)
            return 0, None, 0, 0
        assert cache is not None  # used > 0: this rank held that many tokens
        trim_prompt_cache(cache, n - used)
        ram = min(ram, used)
        return used, cache, ram, used - ram

    def prepared(self, job: Job) -> Job:
        """Rank 0: send the request to every rank, then agree on its cached prefix."""
        try:
            self.engine.channel.send(REQUEST, job.tokens, {"params": _params_body(job.params),
                                                           "session": job.handle.request.session})
            n, cache, ram, ssd = self.agree(job.tokens, job.n_cached, job.cache, job.ram_tokens,
                                            job.ssd_tokens)
        except Exception as e:  # the other ranks are inside this request's collectives
            self.engine.fail(f"{type(e).__name__}: {e}")
            raise
        return dataclasses.replace(job, n_cached=n, cache=cache, ram_tokens=ram, ssd_tokens=ssd)

    def decoding(self, handle: RequestHandle, speculation: Speculation | None) -> Lockstep:
        if speculation is not None:  # a request that asked for it: off here
            warn_once(log, "request-spec", "speculation is off under a distributed launch")
            try:
                speculation.source.close()
            except Exception:
                pass
        return Lockstep(self.engine.channel)

    def failed(self, exc: BaseException) -> None:
        self.engine.fail(f"a generation failed ({type(exc).__name__}: {exc}); the ranks can "
                         "no longer stay in step")


class ShardedEngine(Engine):
    """One rank's engine (see the module docstring). Build it with :meth:`for_world`."""

    def __init__(self, model: str, *, world: World, prefix_cache: CacheArg = None,
                 **kwargs: Any):
        self.world = world
        self.leader = world.rank == 0
        self.channel = Channel(world, fail=self.fail)
        self.tokens = LockstepTokens(self)
        commands = LeaderCommands(self) if self.leader else FollowerCommands(self)
        sources = EngineSources(model=ShardModel(self, prefix_cache is not None), commands=commands,
                      tokens=self.tokens)
        super().__init__(model, prefix_cache=prefix_cache, max_batch=1, sources=sources, **kwargs)

    @classmethod
    def for_world(cls, settings: Settings, world: World, prefix_cache: CacheArg = None
                  ) -> ShardedEngine:
        """The engine of this rank for ``settings`` (speculation and batching off)."""
        asked = [name for name in ("spec", "max_batch", "draft_model")
                 if str(settings.sources.get(name, "default")) != "default"]
        if asked and world.rank == 0:
            warn_once(log, "one-at-a-time", "under a distributed launch requests are served one "
                      "at a time, without speculation (%s ignored)", ", ".join(sorted(asked)))
        settings = settings.replace(spec="off", draft_model=None, max_batch=1)
        if prefix_cache is None and settings.prefix_cache:
            def prefix_cache(loaded: LoadedModel, namespace: str) -> CacheClient:
                from mlxkv.engine.cache.prefix_cache import PrefixCache

                return PrefixCache.from_settings(settings)
        return cls(settings.model, world=world, prefix_cache=prefix_cache, settings=settings,
                   name=f"mlxkv-engine-rank{world.rank}")

    def fail(self, message: str) -> None:
        """The group is broken (engine thread): give the cache a moment, then exit."""
        cache = self.prefix_cache
        try:
            if cache is not None:
                cache.close(CACHE_CLOSE_S)
        except Exception:
            pass
        self.world.fail(message)

    def submit(self, request: Request, callback: Callable[[Event], None] | None = None
               ) -> RequestHandle:
        if not self.leader:
            raise EngineError(f"rank {self.world.rank} takes its requests from rank 0")
        return super().submit(request, callback)

    # front ends
    def distributed_info(self) -> DistributedInfo:
        """This rank, the group and the last request's cached prefix per rank
        (``cached_by_rank``, ``ram_by_rank``, ``ssd_by_rank``) and the length used."""
        loaded = self.loaded
        shard = loaded.extra.get("shard") if loaded is not None else self.settings.shard
        last = self.tokens.last
        return {"world": self.world.size, "rank": self.world.rank, "shard": shard,
                "last_request": dict(last) if last else None}

    def stats(self, timeout: float | None = 30.0) -> EngineStats:
        figures = super().stats(timeout)
        figures["distributed"] = self.distributed_info()
        return figures

    def cache_flush(self, timeout: float | None = None) -> FlushReport:
        """Persist every rank's dirty states (rank 0 asks the others between requests)."""
        if not self.leader:
            return super().cache_flush(timeout)

        def flush_all() -> FlushReport:
            self.channel.send(FLUSH, arg=int(timeout * 1000) if timeout else 0)
            return self.scheduler.runtime.cache.client.flush(timeout)
        limit = None if timeout is None else timeout + 30.0
        return cast("FlushReport", wait(self.call(flush_all), limit, "cache flush"))
