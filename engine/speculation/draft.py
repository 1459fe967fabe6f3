"""A second, smaller mlx-lm model as the source of proposals.

It must share the target's tokenizer (same vocabulary, same ids): a pair whose
vocabularies differ is refused at load with the first difference named. The draft's KV
always holds a prefix of what the target holds: after each round it is trimmed back to
the longest common prefix with the target's committed tokens, and what it lacks is fed
lazily with the next proposal. Its KV is the state it stores with the conversation
(:class:`KVState`), so a restored conversation does not prefill the draft again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxkv.engine.arrays import int_list
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.speculation.base import KVState, Proposal, ProposalProvider, ProposalSource
from mlxkv.engine.speculation.draft_step import DraftModelStep

if TYPE_CHECKING:
    from mlxkv.engine.models import LoadedModel
    from mlxkv.engine.speculation.base import TargetView

SCHEMA = "draft-kv-v1"


class DraftMismatch(ValueError):
    """The draft model cannot draft for this target (different vocabulary, caches that
    cannot be trimmed); the message says what differs."""


def check_pair(target_tokenizer: Any, draft_tokenizer: Any, draft_model: Any, draft_label: str) -> None:
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv != dv:
        only_t = sorted(set(tv) - set(dv))[:3]
        only_d = sorted(set(dv) - set(tv))[:3]
        moved = sorted(k for k in set(tv) & set(dv) if tv[k] != dv[k])[:3]
        detail = (f"{len(tv)} vs {len(dv)} tokens" + (f"; only the model has {only_t}" if only_t else "")
                  + (f"; only the draft has {only_d}" if only_d else "")
                  + (f"; different ids for {moved}" if moved else ""))
        raise DraftMismatch(f"the draft model {draft_label} does not share the model's tokenizer ({detail})")
    if set(target_tokenizer.eos_token_ids) != set(draft_tokenizer.eos_token_ids):
        raise DraftMismatch(f"the draft model {draft_label} has other end-of-sequence tokens than the model")
    from mlx_lm.models.cache import make_prompt_cache

    if not all(hasattr(c, "trim") and c.is_trimmable() for c in make_prompt_cache(draft_model)):
        raise DraftMismatch(f"the draft model {draft_label} keeps state that cannot be trimmed "
                            "(sliding window or recurrent layers); use a plain-attention draft model")


class DraftModelSource(ProposalSource):
    def __init__(self, provider: DraftModelProvider, sampling: SamplingParams | None, vocab: int):
        from mlx_lm.models.cache import make_prompt_cache

        from mlxkv.engine.speculation.sampling import TargetSampler

        self.model = provider.model
        self.step_fn = provider.step
        self.cache = make_prompt_cache(self.model)
        self.fed: list[int] = []  # tokens in the draft's KV
        self._proposed: tuple[list[int], mx.array] | None = None  # fed by the last proposal
        self.target: list[int] = []  # tokens in the target's KV
        self.vocab = vocab
        self.step = max(1, (sampling or SamplingParams()).prefill_step_size)
        # The draft samples without the target's processors: q only has to be what it drew from.
        plain = dataclasses.replace(sampling, repetition_penalty=1.0) if sampling is not None else None
        self.sampler = TargetSampler(plain, []) if plain is not None else None
        self.greedy = plain is None or plain.temperature == 0

    def restore(self, state: Any) -> None:
        if isinstance(state, KVState) and state.cache is not None:
            self.cache, self.fed = state.cache, list(state.tokens)

    def prefill(self, prompt_tokens: list[int], processed: int = 0, hidden: mx.array | None = None) -> None:
        self.target = list(prompt_tokens)
        self._sync()
        self._feed_missing(keep_last=0)

    def _sync(self) -> None:
        """Trim the draft's KV to the longest common prefix with the target's tokens."""
        self._resolve()
        n = 0
        for a, b in zip(self.fed, self.target):
            if a != b:
                break
            n += 1
        if n < len(self.fed):
            for c in self.cache:
                c.trim(len(self.fed) - n)
            del self.fed[n:]

    def _feed_missing(self, keep_last: int) -> mx.array | None:
        """Feed the target's tokens the draft lacks (in chunks), all but ``keep_last``."""
        missing = self.target[len(self.fed): len(self.target) - keep_last]
        logits = None
        for i in range(0, len(missing), self.step):
            chunk = missing[i: i + self.step]
            logits = self.model(mx.array([chunk]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.fed.extend(chunk)
        return logits

    def propose(self, pending: int, n: int) -> Proposal:
        if n <= 0:
            return Proposal([])
        self._sync()
        missing = self.target[len(self.fed):] + [pending]
        x = mx.array([missing])
        tokens, rows = [], []
        for i in range(n):
            logits = self.step_fn(x, self.cache)
            if self.greedy or self.sampler is None:  # (no sampler: greedy)
                y = mx.argmax(logits, axis=-1)
            else:
                q = self.sampler.probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
                y = mx.random.categorical(mx.log(q))  # drawn from exactly the q handed to the verifier
                rows.append(q)
            tokens.append(y)
            if i + 1 < n:
                x = y[None]
        out = mx.concatenate(tokens).astype(mx.int32)
        probs = None
        if rows:
            probs = mx.concatenate(rows, axis=0)
            if probs.shape[-1] != self.vocab:  # embedding tables padded differently
                width = probs.shape[-1]
                probs = (probs[:, : self.vocab] if width > self.vocab
                         else mx.pad(probs, [(0, 0), (0, self.vocab - width)]))
        # Left unevaluated: the verifier runs these steps in one graph with its forward pass.
        self._proposed = (missing, out)
        return Proposal([], probs, lazy=out)

    def _resolve(self) -> None:
        """Record what the last proposal fed the draft (its tokens are evaluated by now)."""
        if self._proposed is not None:
            missing, out = self._proposed
            self._proposed = None
            self.fed.extend(missing + int_list(out)[:-1])

    def commit(self, accepted: list[int], hidden: mx.array | None = None) -> None:
        self.target.extend(accepted)
        self._sync()

    def consume(self, tokens: list[int]) -> None:
        """Target inputs this draft did not propose: fed with the next proposal."""
        self.target.extend(tokens)

    def capture(self) -> Any:
        self._sync()
        return KVState(list(self.fed), self.cache) if self.fed else None

    def close(self) -> None:
        self.cache = []


class DraftModelProvider(ProposalProvider):
    kind = "draft"
    supports_external_tokens = True  # the draft feeds what it lacks lazily
    needs_hidden = False

    def __init__(self, loaded: LoadedModel, target_loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.label = loaded.label
        check_pair(target_loaded.tokenizer, loaded.tokenizer, loaded.model, loaded.label)
        path = Path(loaded.path)
        self.weights_bytes = (path.stat().st_size if path.is_file()  # a GGUF file
                              else sum(p.stat().st_size for p in path.glob("*.safetensors")))
        self.fingerprint = loaded.fingerprint
        self.step = DraftModelStep(loaded.model)  # the draft's decode step, shared by its sources

    def checkpoint_namespace(self) -> str:
        return f"{SCHEMA}-{self.fingerprint}-{self.loaded.compute_dtype}"

    def open(self, target: TargetView, sampling: SamplingParams, constraints: Any = None) -> DraftModelSource:
        return DraftModelSource(self, sampling, int(target.vocab_size))

    def group(self) -> Any:
        from mlxkv.engine.speculation.rows import SourceRowGroup

        return SourceRowGroup()


def load_draft_provider(spec: str, target_loaded: LoadedModel, dtype: str = "auto") -> DraftModelProvider:
    from mlxkv.engine.models import ModelNotFoundError, load_model

    try:
        loaded = load_model(spec, dtype)
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"draft model: {e}") from None
    return DraftModelProvider(loaded, target_loaded)


