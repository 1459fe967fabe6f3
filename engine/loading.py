"""Loading, on the engine thread: the model (from a :class:`ModelSource`), its speculation
providers and its prefix cache, bound together into the :class:`Runtime` every part of
the engine thread works with. :class:`LocalModel` loads the whole model in this process;
a sharded engine plugs in its own source (this rank's shard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mlxkv.engine.cache.client import CacheArg, CacheClient
from mlxkv.engine.cache_use import CacheUse
from mlxkv.engine.requests import EngineError, EngineEvent, LoadEvent
from mlxkv.engine.settings import Settings

if TYPE_CHECKING:
    from mlxkv.engine.models import LoadedModel
    from mlxkv.engine.speculation.base import ProposalProvider

LOAD_STAGES = ("model", "prefix cache", "ready")


class ModelSource(Protocol):
    """Where the engine's model comes from."""

    def load(self) -> tuple[LoadedModel, str]:
        """The model and its prefix-cache namespace."""

    def loading(self) -> AbstractContextManager[None]:
        """The whole load (model, providers, prefix cache) runs inside this."""

    def providers(self, loaded: LoadedModel, settings: Settings) -> dict[str, ProposalProvider]:
        """The speculation providers of ``loaded`` (kind -> provider)."""

    def describe(self, loaded: LoadedModel) -> dict[str, Any]:
        """What ``Engine.info`` adds for this source."""


class LocalModel:
    """The whole model, loaded in this process (``engine.models.load_model``)."""

    def __init__(self, spec: str, dtype: str, full_hash: bool, dequantize: str):
        self.spec, self.dtype, self.full_hash = spec, dtype, full_hash
        self.dequantize = dequantize

    def load(self) -> tuple[LoadedModel, str]:
        from mlxkv.engine.cache.layout import kv_namespace
        from mlxkv.engine.models import load_model

        loaded = load_model(self.spec, self.dtype, self.full_hash, dequantize=self.dequantize)
        return loaded, kv_namespace(loaded.fingerprint, loaded.compute_dtype)

    def loading(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def providers(self, loaded: LoadedModel, settings: Settings) -> dict[str, ProposalProvider]:
        from mlxkv.engine.speculation.providers import load_providers

        return load_providers(loaded, settings)

    def describe(self, loaded: LoadedModel) -> dict[str, Any]:
        return {}


@dataclasses.dataclass
class Runtime:
    """A loaded model with what serves it: touch its arrays on the engine thread only."""

    loaded: LoadedModel
    namespace: str
    providers: dict[str, ProposalProvider]
    cache: CacheUse
    batchable: bool  # the model's caches can decode in a batch
    info: dict[str, Any]
    load_s: float


def ready_event() -> LoadEvent:
    """The last stage's event: the engine is ready (sent once it can serve)."""
    total = len(LOAD_STAGES) - 1
    return LoadEvent(LOAD_STAGES[total], total, total)


def open_cache(arg: CacheArg, loaded: LoadedModel, namespace: str) -> CacheClient:
    """The prefix cache ``Engine(prefix_cache=arg)`` asked for: none, a cache, or a
    factory ``(loaded, namespace) -> cache`` called now."""
    from mlxkv.engine.cache.prefix_cache import NullPrefixCache

    client = NullPrefixCache() if arg is None else arg(loaded, namespace) if callable(arg) else arg
    if not isinstance(client, CacheClient):
        raise TypeError(f"the prefix cache ({type(client).__name__}) does not implement "
                        "engine.cache.client.CacheClient")
    return client


def use_chat_template(tokenizer: Any, path: str) -> None:
    """The template in the file at ``path`` replaces the model's own chat template."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EngineError(f"--chat-template {path}: {e}") from None
    if not text.strip():
        raise EngineError(f"--chat-template {path}: the file is empty")
    tokenizer.chat_template = text
    tokenizer.has_chat_template = True


def load_runtime(source: ModelSource, settings: Settings, prefix_cache: CacheArg,
                 publish: Callable[[EngineEvent], None],
                 cache_event: Callable[[dict], None]) -> Runtime:
    """Load everything (sending the :class:`LoadEvent` s of every stage but the last, which
    :func:`ready_event` is); the cache's events also go to ``cache_event``."""
    from mlxkv.engine import cpu_attention
    from mlxkv.engine.blas import describe
    from mlxkv.engine.mlx_lm_compat import install_attention, install_swiglu
    from mlxkv.engine.speculation.providers import bind_providers

    started = time.perf_counter()
    total = len(LOAD_STAGES) - 1
    with source.loading():
        publish(LoadEvent(LOAD_STAGES[0], 0, total))
        loaded, namespace = source.load()
        if settings.cpu_attention:  # this thread (the engine's) computes with the model
            install_attention(loaded.model)
            install_swiglu(loaded.model)
            cpu_attention.use_on_this_thread()
        loaded.context_limit = settings.context_tokens
        if settings.chat_template:
            use_chat_template(loaded.tokenizer, settings.chat_template)
        providers = source.providers(loaded, settings)
        publish(LoadEvent(LOAD_STAGES[1], 1, total))
        client = open_cache(prefix_cache, loaded, namespace)
        client.bind_model(namespace, loaded.model)  # restored states are checked against it
        bind_providers(client, namespace, providers)
        previous = client.on_event

        def on_event(data: dict) -> None:
            if previous is not None:
                previous(data)
            cache_event(data)
        client.on_event = on_event
        load_s = time.perf_counter() - started
        info = {
            "model": loaded.label, "spec": loaded.spec, "path": str(loaded.path),
            "fingerprint": loaded.fingerprint, "namespace": namespace,
            "weights_dtype": loaded.weights_dtype, "compute_dtype": loaded.compute_dtype,
            "blas": describe(), "model_type": loaded.config.get("model_type"),
            "context_tokens": loaded.context_tokens, "load_s": load_s,
            "speculation": sorted(providers), **source.describe(loaded),
        }
        from mlx_lm.models.cache import make_prompt_cache

        from mlxkv.engine.batch import batchable_cache
        from mlxkv.engine.generate import head_view

        batchable = batchable_cache(make_prompt_cache(loaded.model), loaded.model)
        head_view(loaded.model)  # decided while loading (by bind_model's probe when a cache is bound)
    return Runtime(loaded, namespace, providers, CacheUse(client, namespace), batchable, info,
                   load_s)
