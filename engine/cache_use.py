"""How a request uses the prefix cache: the lookup before the prefill, the store after the
answer, the loan given back, the states dropped when they failed, and the cache told when
requests are being served. A cache's failure never fails a request: it is logged, and the
request is computed without the cache.
"""

from __future__ import annotations

import logging
from typing import Any

from mlxkv.engine.cache.client import CacheClient
from mlxkv.engine.cache.info import scoped_namespace
from mlxkv.engine.logs import warn_once

log = logging.getLogger("mlxkv.engine")


class CacheUse:
    """The engine's side of its :class:`CacheClient` for one model's ``namespace``
    (engine thread only)."""

    def __init__(self, client: CacheClient, namespace: str):
        self.client = client
        self.namespace = namespace
        self.enabled = client.enabled  # False: NullPrefixCache, nothing worth storing
        self._busy = False  # what the cache was last told

    def namespace_of(self, scope: str | None) -> str:
        """The namespace of a request of cache scope ``scope`` (``Request.cache_scope``)."""
        return scoped_namespace(self.namespace, scope)

    def lookup(self, tokens: list[int], session: str | None, scope: str | None = None
               ) -> tuple[int, list | None]:
        """(cached tokens, the KV cache holding them) for the prompt, or (0, None)."""
        try:
            n, cache = self.client.lookup(tokens, self.namespace_of(scope), session=session)
        except Exception:
            log.exception("prefix cache lookup failed; computing the whole prompt")
            return 0, None
        if cache is None or n <= 0:
            return 0, None
        if n >= len(tokens):  # the seam promises n <= len - 1; never trust it blindly
            log.error("prefix cache returned %d cached tokens for a %d-token prompt", n,
                      len(tokens))
            return 0, None
        return n, cache

    def tier_split(self, cached: int) -> tuple[int, int]:
        """(RAM, SSD) shares of the ``cached`` tokens the last lookup served."""
        last = self.client.last or {}
        if cached <= 0 or last.get("cached_tokens") != cached:
            return 0, 0
        return int(last.get("ram_tokens", 0)), int(last.get("ssd_tokens", 0))

    def release(self, cache: list | None) -> None:
        """Give back a cache lent by the lookup that will not be stored."""
        if cache is None:
            return
        try:
            self.client.release(cache)
        except Exception:
            log.exception("prefix cache release failed")

    def drop(self, tokens: list[int], exc: BaseException, scope: str | None = None) -> None:
        """A generation that started from cached tokens of ``tokens`` failed with ``exc``:
        drop every cached state that would seed this prompt again."""
        try:
            self.client.invalidate(tokens, self.namespace_of(scope))
        except Exception:
            log.exception("prefix cache invalidate failed")
        first = (str(exc).splitlines() or [""])[0][:200]
        warn_once(log, f"retry:{type(exc).__name__}",
                   "a cached prompt prefix could not be used (%s: %s); it was dropped and the "
                   "prompt computed again without it", type(exc).__name__, first)

    def busy(self, active: bool) -> None:
        """Tell the cache whether a request is being served (its writer yields to decoding
        meanwhile); only changes are told."""
        if active == self._busy:
            return
        self._busy = active
        try:
            self.client.busy(active)
        except Exception:
            log.exception("prefix cache busy() failed")

    def explain(self, tokens: list[int], scope: str | None = None) -> Any:
        """The stored state closest to the prompt and where the prompt parts from it (see
        ``CacheClient.explain``); None when there is none or the cache failed (logged)."""
        try:
            return self.client.explain(tokens, self.namespace_of(scope))
        except Exception:
            log.exception("prefix cache explain failed")
            return None

    def store(self, tokens: list[int], cache: list, session: str | None,
              retain_s: float | None = None, scope: str | None = None) -> None:
        """Hand the KV state of ``tokens`` to the cache, once the request is answered
        (``retain_s``: the request's retention hint); a failure is logged, never raised
        into the request."""
        try:
            import mlx.core as mx

            mx.eval([c.state for c in cache])
            self.client.store(tokens, cache, self.namespace_of(scope), session=session, retain_s=retain_s)
        except Exception:
            log.exception("prefix cache store failed")

    def close(self, timeout: float) -> None:
        try:
            self.client.close(timeout)
        except Exception:
            log.exception("prefix cache close failed")
