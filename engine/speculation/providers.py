"""Which sources a loaded target gets, which one a request uses, and the per-request
:class:`Speculation` that ``engine.generate.Generation`` runs through the verifier.

``load_providers`` runs on the engine thread at load: prompt lookup and the suffix source
always, the draft model when one is set (the demo model pairs with the demo draft model by
default), MTP when the checkpoint carries MTP weights. A request's source:
``guided_choice`` or a ``grammar`` -> constraints; else its ``spec`` (or the engine's): ``auto`` prefers
MTP, then a draft model, then the suffix source (prompt lookup only where there is no
suffix provider), and adapts (stopping when slower); a named source is used with the same
adaptive length. Each provider keeps a ``policy.SourceMemory`` per sampling regime
(greedy, sampled: exact-match sources accept less when sampling), so a request starts
from what the requests before it learned. Source state that is a KV cache is stored in the
prefix cache under ``f"{namespace}+draft-{provider.checkpoint_namespace()}"``.
Every finished request of the model is handed to every provider (``learn_finished``):
the suffix source's global index learns from it, and is kept beside the prefix cache
(``bind_providers`` -> ``ProposalProvider.attach``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mlxkv.engine.cache.client import CacheClient
from mlxkv.engine.logs import warn_once
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.settings import FIELD_BY_NAME, SPEC_CHOICES, Settings
from mlxkv.engine.side_table import SideTable
from mlxkv.engine.speculation.base import KVState, ProposalProvider, TargetView
from mlxkv.engine.speculation.policy import LengthController, SourceMemory
from mlxkv.engine.speculation.verify import SpecStream

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlxkv.engine.generate import Generation
    from mlxkv.engine.models import LoadedModel

log = logging.getLogger("mlxkv.spec")


class Summarized(Protocol):
    """What :meth:`Speculation.finish` reads of a stream (a ``SpecStream``, or a batch row's
    figures)."""

    def summary(self) -> dict: ...


_TOTALS: SideTable[dict[str, int]] = SideTable()  # each provider's request figures, summed
_MEMORIES: SideTable[dict[str, SourceMemory]] = SideTable()  # each provider's memory per sampling regime
__all__ = ["SPEC_CHOICES", "load_providers", "open_speculation"]
AUTO_ORDER = ("mtp", "draft", "suffix", "ngram")  # what ``auto`` prefers, first available


def _is_demo(loaded: LoadedModel) -> bool:
    from mlxkv.engine.demo import DEMO_MODEL_DIR

    try:
        return Path(loaded.path).resolve() == Path(DEMO_MODEL_DIR).resolve()
    except OSError:
        return False


def load_providers(loaded: LoadedModel, settings: Settings) -> dict[str, ProposalProvider]:
    """The providers of the loaded target (kind -> provider). A ``--draft-model`` that
    cannot pair with the target raises (the user asked for it); the demo draft that pairs
    by default, or MTP weights that do not load, are skipped with a warning."""
    from mlxkv.engine.speculation.constraints import ConstraintProvider
    from mlxkv.engine.speculation.ngram import NgramProvider
    from mlxkv.engine.speculation.suffix import SuffixProvider

    mode = settings.spec
    providers: dict[str, ProposalProvider] = {
        "ngram": NgramProvider(settings.spec_ngram_min, settings.spec_ngram_max),
        "suffix": SuffixProvider(global_tokens=settings.spec_suffix_tokens,
                                 vocab_size=TargetView(loaded.model, loaded.tokenizer).vocab_size),
        "constraint": ConstraintProvider(),
    }
    draft_spec = settings.draft_model
    if draft_spec:
        from mlxkv.engine.speculation.draft import load_draft_provider

        providers["draft"] = load_draft_provider(draft_spec, loaded, settings.dtype)
    elif mode in ("auto", "draft") and _is_demo(loaded):
        from mlxkv.engine.demo import DRAFT_MODEL_DIR
        from mlxkv.engine.speculation.draft import load_draft_provider

        if (Path(DRAFT_MODEL_DIR) / "config.json").is_file():
            try:
                providers["draft"] = load_draft_provider(str(DRAFT_MODEL_DIR), loaded,
                                                         settings.dtype)
            except Exception as e:
                warn_once(log, "demo-draft", "the demo draft model could not be used (%s)", e)
    if mode in ("auto", "mtp"):
        try:
            from mlxkv.engine.speculation import mtp  # noqa: F401
        except ImportError:
            mtp_found = False
        else:
            mtp_found = True
        if mtp_found:
            try:
                provider = mtp.load_mtp_provider(loaded)
            except Exception as e:
                if mode == "mtp":
                    raise
                provider = None
                warn_once(log, "mtp-load", "the model's MTP weights could not be used (%s)", e)
            if provider is not None:
                providers["mtp"] = provider
    return providers


def bind_providers(prefix_cache: CacheClient, namespace: str,
                   providers: dict[str, ProposalProvider]) -> None:
    """Let the prefix cache check restored source states against the source's own model, and
    give every provider the cache and the model's namespace (what it learned is kept
    there)."""
    for p in providers.values():
        if p.model is not None:
            prefix_cache.bind_model(provider_namespace(namespace, p), p.model)
        try:
            p.attach(prefix_cache, namespace)
        except Exception:
            log.exception("speculation %s could not use the prefix cache", p.kind)


def learn_finished(providers: dict[str, ProposalProvider], output: list[int]) -> None:
    """A request of the model finished with ``output`` (any speculation, alone or batched):
    every provider that learns from earlier outputs takes it (engine thread; a failure is
    logged, never raised into the request)."""
    if not output:
        return
    for p in providers.values():
        try:
            p.learn(output)
        except Exception:
            log.exception("speculation %s could not learn a finished request", p.kind)


def spec_stats(providers: dict[str, ProposalProvider]) -> dict:
    """Engine-wide figures per source: requests, rounds, drafted (proposed), accepted, target forwards,
    what its policy learned (``learned``, per sampling regime), and the provider's own
    (``ProposalProvider.figures``: the suffix index's learned replies and tokens)."""
    out = {}
    for kind, p in providers.items():
        totals = {**p.figures(), **(_TOTALS.get(p) or {})}
        if totals.get("drafted"):
            totals["acceptance"] = round(totals["accepted"] / totals["drafted"], 4)
        memories = _MEMORIES.get(p)
        if memories:
            totals["learned"] = {regime: m.as_dict() for regime, m in memories.items()}
        out[kind] = totals
    return out


def source_memory(provider: ProposalProvider, sampled: bool) -> SourceMemory:
    """The provider's memory for greedy or sampled requests (created on first use; lives as
    long as the loaded provider)."""
    memories = _MEMORIES.get(provider)
    if memories is None:
        memories = {}
        _MEMORIES.put(provider, memories)
    return memories.setdefault("sampled" if sampled else "greedy", SourceMemory())


def provider_namespace(namespace: str, provider: ProposalProvider) -> str:
    """Where ``provider``'s KV state is kept in the prefix cache, beside the model's ``namespace``."""
    return f"{namespace}+draft-{provider.checkpoint_namespace()}"


def choose(providers: dict[str, ProposalProvider], mode: str, guided: bool) -> ProposalProvider | None:
    """The provider a request uses (None: plain decoding)."""
    if mode == "off":
        return None
    if guided and "constraint" in providers:
        return providers["constraint"]
    if mode == "auto":
        # Model-free, the suffix source proposes all prompt lookup would (the longest earlier
        # match of the text's end, in the conversation) and what earlier replies of the model
        # wrote; its length controller turns it off where it does not pay.
        for kind in AUTO_ORDER:
            if kind in providers:
                return providers[kind]
        return None
    if mode not in providers:
        warn_once(log, f"missing:{mode}", "speculation %r is not available for this model; decoding without it",
                   mode)
        return None
    return providers[mode]


class Speculation:
    """One request's speculation: its source, its length controller, and the source state it
    restores from and stores to the prefix cache."""

    def __init__(self, provider: ProposalProvider, target: TargetView, params: SamplingParams, *,
                 mode: str = "auto", constraint: Any = None, max_tokens: int | None = None,
                 prefix_cache: CacheClient | None = None, namespace: str = "",
                 session: str | None = None, timed: bool = True, private: bool = False):
        self.provider = provider
        self.target = target
        self.constraint = constraint
        self.source = provider.open(target, params, constraint)
        self.source.private = private
        # Constraints propose only what the output must be: always ask for all of it. A seeded
        # sampled request keeps a fixed length, so its draws do not depend on timings.
        exact = provider.kind == "constraint"
        max_tokens = max_tokens or provider.proposal_tokens
        adaptive = timed and not exact
        memory = source_memory(provider, params.temperature > 0) if adaptive else None
        self.controller = LengthController(initial=max_tokens if exact else min(4, max_tokens),
                                           maximum=max_tokens, adaptive=adaptive,
                                           may_stop=mode == "auto" and not exact, memory=memory)
        self.prefix_cache = prefix_cache
        self.state_namespace = (provider_namespace(namespace, provider)
                                if provider.model is not None and namespace else None)
        self.session = session
        self.restored_tokens = 0

    def restore(self, prompt: list[int]) -> None:
        """Start the source from its cached state of ``prompt``'s prefix, when it has one."""
        if self.prefix_cache is None or self.state_namespace is None:
            return
        try:
            n, cache = self.prefix_cache.lookup(prompt, self.state_namespace, session=self.session)
        except Exception:
            log.exception("source state lookup failed; the source starts from the prompt")
            return
        if cache is not None and n > 0:
            self.source.restore(KVState(list(prompt[:n]), cache))
            self.restored_tokens = n

    def stream(self, gen: Generation, progress: Callable[[int, int], None]) -> SpecStream:
        assert gen.cache is not None  # made by the generation before its stream
        self.restore(gen.prompt_tokens)
        return SpecStream(gen.model, gen.prompt_tokens, gen.n_cached, gen.cache, gen.params, self.source,
                          self.controller, kind=self.provider.kind, target_view=self.target,
                          needs_hidden=self.provider.needs_hidden, on_progress=progress,
                          constraint=self.constraint, eos=gen.tokenizer.eos_token_ids,
                          between_layers=gen.between_layers)

    def finish(self, stream: Summarized, tokens_in_cache: list[int]) -> dict:
        summary = stream.summary()
        summary["restored_draft_tokens"] = self.restored_tokens
        totals = _TOTALS.get(self.provider)
        if totals is None:
            totals = {}
            _TOTALS.put(self.provider, totals)
        for key in ("rounds", "drafted", "accepted", "target_forwards"):
            totals[key] = totals.get(key, 0) + summary[key]
        totals["requests"] = totals.get("requests", 0) + 1
        self.controller.remember(summary.get("rounds", 0) + summary.get("accepted", 0))
        try:
            state = self.source.capture()
            if isinstance(state, KVState) and state.tokens and self.prefix_cache is not None and self.state_namespace:
                import mlx.core as mx

                mx.eval([c.state for c in state.cache])
                self.prefix_cache.store(state.tokens, state.cache, self.state_namespace, session=self.session)
        except Exception:
            log.exception("storing the source state failed")
        finally:
            self.source.close()
        return summary


def open_speculation(providers: dict[str, ProposalProvider] | None, loaded: LoadedModel,
                     params: SamplingParams, *, mode: str | None,
                     settings_mode: str = FIELD_BY_NAME["spec"].default, constraint: Any = None,
                     json_skeleton: Any = None, max_tokens: int | None = None,
                     prefix_cache: CacheClient | None = None, namespace: str = "",
                     session: str | None = None, private: bool = False
                     ) -> tuple[Speculation | None, Any]:
    """(the request's Speculation or None, its constraint or None). ``constraint`` is the
    mask the output must satisfy (``grammar.request_constraint``: ``guided_choice`` or a
    grammar), returned as given; it proposes what it forces. A JSON skeleton only proposes."""
    proposing = constraint
    if constraint is None and json_skeleton:
        from mlxkv.engine.speculation.constraints import JsonSkeleton

        proposing = JsonSkeleton(loaded.tokenizer, json_skeleton)
    if not providers:
        return None, constraint
    mode = mode or settings_mode
    seeded = params.seed is not None and params.temperature > 0
    if seeded and mode == "auto" and proposing is None:
        # A seeded sampled request reproduces plain decoding draw for draw: auto leaves it alone.
        return None, constraint
    provider = choose(providers, mode, proposing is not None)
    if provider is None:
        return None, constraint
    view = TargetView(loaded.model, loaded.tokenizer)
    spec = Speculation(provider, view, params, mode=mode, constraint=proposing, max_tokens=max_tokens,
                       prefix_cache=prefix_cache, namespace=namespace, session=session,
                       timed=not seeded, private=private)
    return spec, constraint
