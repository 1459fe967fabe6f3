"""Token-by-token grammar enforcement (a request's ``grammar``), with llguidance.

A grammar is llguidance's Lark syntax, which may embed JSON schemas (``%json {...}``): every
token it does not allow is masked, in plain decoding and in the verifier's accept walk
alike, and what it forces next (llguidance's fast-forward tokens) is proposed
through the constraint source, as ``guided_choice``'s choices are, so a constrained reply
speculates without changing a token. EOS is allowed exactly when the grammar accepts, and
once the grammar is complete only EOS is.

llguidance's matcher is stateful: a :class:`GrammarConstraint` keeps it in step with the
output it was last asked about, consuming what is new and rolling back when asked about a
shorter or different output (the verifier walks a window position by position, then the
next round starts from what it kept). Its tokenizer view is built once per tokenizer.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxkv.engine.mlx_lm_compat import hf_tokenizer
from mlxkv.engine.speculation.constraints import GuidedChoice

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # the engine thread builds matchers; the server may check grammars


def ll_tokenizer(tokenizer: Any, n_vocab: int | None = None) -> Any:
    """llguidance's ``LLTokenizer`` for ``tokenizer`` (an mlx-lm ``TokenizerWrapper`` or a
    Hugging Face fast tokenizer), with the engine's EOS ids and ``n_vocab`` token ids where
    the model's logits are wider than the vocabulary. Building one reads the whole
    vocabulary, so it is kept for as long as the tokenizer lives."""
    hf = hf_tokenizer(tokenizer)
    size = len(hf) if hasattr(hf, "__len__") else None
    width = n_vocab if n_vocab is not None and (size is None or n_vocab > size) else None
    with _LOCK:
        per = _TOKENIZERS.get(tokenizer)
        if per is None:
            per = _TOKENIZERS[tokenizer] = {}
        if width not in per:
            import llguidance.hf

            eos = sorted(int(t) for t in (getattr(tokenizer, "eos_token_ids", None) or ()))
            try:
                per[width] = llguidance.hf.from_tokenizer(hf, n_vocab=width, eos_token=eos or None)
            except ValueError as e:
                raise ValueError(f"grammar: this model's tokenizer cannot be used for grammars ({e})") from None
        return per[width]


def check_grammar(tokenizer: Any, grammar: Any) -> None:
    """Raise ValueError naming what is wrong with ``grammar`` (bad Lark, an unsupported JSON
    schema keyword), as llguidance says it; None when it compiles. ``tokenizer`` may be
    None: the grammar is then checked without one (token-level references are checked
    when the request runs)."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError("grammar must be a non-empty string")
    from llguidance import LLMatcher

    ll = ll_tokenizer(tokenizer) if tokenizer is not None else None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, ll)
    if failed:
        raise ValueError(f"grammar: {(messages or ['it does not compile'])[0].strip()}")


def json_grammar(schema: Any) -> str:
    """A grammar whose output is one JSON value valid against ``schema`` (a dict or JSON text)."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return f"start: %json {text}"


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (list slices compare in C: a binary search)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class GrammarConstraint:
    """The output must be a sentence of ``grammar``, then EOS. The duck interface of
    ``constraints.GuidedChoice``: ``allowed``, ``mask``, ``forced``, ``processor``, ``done``,
    ``eos``. ``vocab``: the model's logits width, where it exceeds the tokenizer's."""

    def __init__(self, tokenizer: Any, grammar: str, vocab: int | None = None):
        from llguidance import LLMatcher

        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError("grammar must be a non-empty string")
        ll = ll_tokenizer(tokenizer, vocab)
        self.matcher = LLMatcher(ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error().strip()}")
        self.eos = sorted(int(t) for t in tokenizer.eos_token_ids)
        self.vocab = int(ll.vocab_size)
        self._bitmask = np.full((1, (self.vocab + 31) // 32), -1, dtype=np.int32)
        self._fed: list[int] = []  # the tokens the matcher has consumed, in order

    # keeping the matcher in step -------------------------------------------------------
    def _sync(self, output: Sequence[int]) -> bool:
        """Bring the matcher to ``output``. False when ``output`` leaves the grammar (a
        window's padding in a batch, a token after EOS): the matcher then stands at its
        longest allowed prefix."""
        fed, out = self._fed, list(output)
        n = len(fed)
        common = n if len(out) >= n and out[:n] == fed else _common_prefix(fed, out)
        if common < n:
            if not self.matcher.rollback(n - common):
                self.matcher.reset()
                if common and not self.matcher.consume_tokens(out[:common]):
                    raise RuntimeError(f"grammar matcher: {self.matcher.get_error()}")
            del fed[common:]
        new = out[common:]
        if not new:
            return True
        ok = self.matcher.validate_tokens(new)
        if ok:
            self.matcher.consume_tokens(new[:ok])
            fed.extend(new[:ok])
        return ok == len(new)

    def _words(self, output: Sequence[int]) -> np.ndarray:
        """Allowed tokens after ``output``: llguidance's bitmask as unsigned words (a token's
        bit in its word, lowest ids first), EOS set exactly when the grammar accepts. A
        buffer the next call reuses."""
        from llguidance.numpy import fill_next_token_bitmask

        words = self._bitmask[0].view(np.uint32)
        if self._sync(output):
            fill_next_token_bitmask(self.matcher, self._bitmask, 0)
            accepting = self.matcher.is_accepting()
        else:  # off the grammar: nothing but the end
            words[:] = 0
            accepting = True
        for e in self.eos:
            if e < self.vocab:
                bit = np.uint32(1 << (e & 31))
                words[e >> 5] = words[e >> 5] | bit if accepting else words[e >> 5] & ~bit
        return words

    # the constraint interface ----------------------------------------------------------
    def allowed(self, output: Sequence[int]) -> list[int]:
        """Token ids that may follow ``output`` (prefer :meth:`mask` where a mask is wanted)."""
        bits = np.unpackbits(self._words(output).view(np.uint8), bitorder="little")[: self.vocab]
        return np.flatnonzero(bits).tolist()

    def mask(self, output: Sequence[int], vocab: int) -> Any:
        """An additive mask [vocab] (an mx array) for the token after ``output``: zero where
        the grammar allows it, -inf elsewhere (and beyond the tokenizer's ids). Each byte of
        the bitmask picks its tokens' values from a table: no per-token work in Python."""
        import mlx.core as mx

        row = np.take(_BYTE_ROWS, self._words(output).view(np.uint8), axis=0).reshape(-1)
        if row.shape[0] < vocab:
            row = np.concatenate([row, np.full((vocab - row.shape[0],), -np.inf, dtype=np.float32)])
        return mx.array(row[:vocab])

    def forced(self, output: Sequence[int]) -> list[int]:
        """The tokens the grammar forces after ``output`` (then EOS when they complete it)."""
        if not self._sync(output):
            return []
        if self.matcher.is_stopped():
            return self.eos[:1]
        ff = list(self.matcher.compute_ff_tokens())
        # Consumed here: the verifier's walk along them then starts where they end.
        ok = self.matcher.validate_tokens(ff) if ff else 0
        ff = ff[:ok]
        if ff:
            self.matcher.consume_tokens(ff)
            self._fed.extend(ff)
            if self.matcher.is_stopped():
                ff += self.eos[:1]
        return ff

    def done(self, output: Sequence[int]) -> bool:
        """The grammar is complete after ``output`` (no token but EOS may follow)."""
        return not self._sync(output) or self.matcher.is_stopped()

    def processor(self, history_before_output: int):
        """A logits processor for ``generate_step``: its token history starts with
        ``history_before_output`` prompt tokens, then the output."""

        def mask(tokens: Any, logits: Any) -> Any:
            output = tokens[history_before_output:].tolist() if tokens.size > history_before_output else []
            return logits + self.mask(output, logits.shape[-1])
        return mask


# byte -> the additive mask of its eight tokens (bit set: 0, else -inf), lowest bit first
_BYTE_ROWS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") > 0,
                      np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


def logits_width(model: Any) -> int | None:
    """The model's logits width as its config says it (None when it does not)."""
    args = getattr(getattr(model, "language_model", model), "args", None)
    width = getattr(args, "vocab_size", None)
    return int(width) if isinstance(width, int) and width > 0 else None


def request_constraint(tokenizer: Any, request: Any, vocab: int | None = None) -> Any:
    """The mask ``request``'s output must satisfy: a :class:`GuidedChoice`, a
    :class:`GrammarConstraint` or None. A grammar that does not compile raises ValueError."""
    choices = getattr(request, "guided_choice", None)
    if choices:
        return GuidedChoice(tokenizer, choices)
    grammar = getattr(request, "grammar", None)
    if grammar:
        return GrammarConstraint(tokenizer, grammar, vocab)
    return None
