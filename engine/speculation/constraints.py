"""Request constraints that know the continuation: ``guided_choice`` (the output is exactly
one of the given strings) and the forced spans of a JSON skeleton.

A constraint proposes the tokens it already knows (the rest of the only choice still
matching, or the part all remaining choices share; a skeleton's literal text) and, for
``guided_choice``, masks every token that no choice allows, in plain decoding and in the
verifier's accept walk alike. It advances only with tokens the target accepted, so
proposing never changes it. Proposals are exact-match: the verifier still decides
every token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mlxkv.engine.arrays import int_list
from mlxkv.engine.speculation.base import Proposal, ProposalProvider, ProposalSource, RequestConstraints

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.engine.speculation.base import TargetView


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


class GuidedChoice:
    """The output must be one of ``choices`` (token sequences as the tokenizer writes each
    string alone), then end (EOS)."""

    def __init__(self, tokenizer: Any, choices: Sequence[str]):
        if not choices:
            raise ValueError("guided_choice needs at least one choice")
        self.choices = [_encode(tokenizer, c) for c in choices]
        if any(not c for c in self.choices):
            raise ValueError("a guided_choice string encodes to no tokens")
        self.eos = sorted(int(t) for t in tokenizer.eos_token_ids)
        vocab = getattr(tokenizer, "vocab_size", None)
        self.vocab = int(vocab) if vocab else None

    def _alive(self, output: Sequence[int]) -> list[list[int]]:
        n = len(output)
        out = list(output)
        return [c for c in self.choices if len(c) >= n and c[:n] == out]

    def allowed(self, output: Sequence[int]) -> list[int]:
        """Tokens that may follow ``output`` (EOS once a choice is complete)."""
        n = len(output)
        alive = self._alive(output)
        allowed = {c[n] for c in alive if len(c) > n}
        if any(len(c) == n for c in alive) or not alive:
            allowed.update(self.eos)
        return sorted(allowed)

    def forced(self, output: Sequence[int]) -> list[int]:
        """What every choice still matching continues with (then EOS when that ends one)."""
        n = len(output)
        alive = self._alive(output)
        if not alive:
            return []
        if len(alive) == 1:
            return alive[0][n:] + self.eos[:1]
        out = []
        for column in zip(*(c[n:] for c in alive)):
            if len(set(column)) != 1:
                break
            out.append(column[0])
        return out

    def processor(self, history_before_output: int):
        """A logits processor for ``generate_step``: its token history starts with
        ``history_before_output`` prompt tokens, then the output."""

        def mask(tokens: mx.array, logits: mx.array) -> mx.array:
            output = int_list(tokens[history_before_output:]) if tokens.size > history_before_output else []
            return logits + mask_row(logits.shape[-1], self.allowed(output))
        return mask


def constraint_mask(constraint: Any, output: Sequence[int], vocab: int):
    """The additive mask [vocab] a constraint puts on the token after ``output``, or None
    (nothing masked): its own ``mask`` where it has one (a grammar fills a bitmask), else
    the row of its ``allowed`` tokens."""
    mask = getattr(constraint, "mask", None)
    if mask is not None:
        return mask(output, vocab)
    allowed = constraint.allowed(output)
    return None if allowed is None else mask_row(vocab, allowed)


def mask_row(vocab: int, allowed: Sequence[int]):
    """An additive mask [V]: 0 at ``allowed``, -inf elsewhere."""
    import mlx.core as mx
    import numpy as np

    row = np.full((vocab,), -np.inf, dtype=np.float32)
    idx = np.asarray([a for a in allowed if 0 <= a < vocab], dtype=np.int64)
    row[idx] = 0.0
    return mx.array(row)


class JsonSkeleton:
    """The literal parts of a JSON document whose values the model writes, e.g.
    ``['{"name": "', '", "age": ', '}']``: the first part is proposed at once, and once
    the output's text ends with the start of a later part (the model closed a value) the
    rest of that part is proposed. Matching is on text, so it does not depend on how the
    model's tokens split the characters. Nothing is masked: the model may write anything."""

    def __init__(self, tokenizer: Any, parts: Sequence[str]):
        self.tokenizer = tokenizer
        self.parts = [p for p in parts if p]
        self._tokens = [_encode(tokenizer, p) for p in self.parts]

    def allowed(self, output: Sequence[int]) -> None:
        return None

    def forced(self, output: Sequence[int]) -> list[int]:
        if not self.parts:
            return []
        if not output:
            return list(self._tokens[0])
        head = self.parts[0]
        if len(output) <= len(self._tokens[0]) + 1:  # still writing the opening part?
            text = self.tokenizer.decode(list(output))
            if len(text) < len(head) and head.startswith(text):
                return _encode(self.tokenizer, head[len(text):])
        tail = self.tokenizer.decode(list(output[-16:]))
        for part in self.parts[1:]:
            for m in range(min(len(part) - 1, len(tail)), 0, -1):
                if tail.endswith(part[:m]):
                    return _encode(self.tokenizer, part[m:])
        return []


class ConstraintSource(ProposalSource):
    """Proposes what the constraint already knows, after the pending token."""

    def __init__(self, constraint: Any):
        self.constraint = constraint
        self.output: list[int] = []  # accepted output so far (the target's committed tokens)
        self.n_prompt = 0

    def prefill(self, prompt_tokens: list[int], processed: int = 0, hidden: mx.array | None = None) -> None:
        self.n_prompt = len(prompt_tokens)

    def propose(self, pending: int, n: int) -> Proposal:
        return Proposal(self.constraint.forced(self.output + [pending])[:n])

    def commit(self, accepted: list[int], hidden: mx.array | None = None) -> None:
        self.output.extend(accepted)


class ConstraintProvider(ProposalProvider):
    kind = "constraint"
    supports_external_tokens = True

    def checkpoint_namespace(self) -> str:
        return "constraint-v1"

    def open(self, target: TargetView, sampling: SamplingParams, constraints: Any = None) -> ConstraintSource:
        if constraints is None:
            raise ValueError("the constraint source needs a constraint")
        return ConstraintSource(constraints)


class RowConstraints(RequestConstraints):
    """:class:`RequestConstraints` over one constraint per row of a batch."""

    def __init__(self, constraints: Sequence[Any]):
        self.constraints = list(constraints)
        self.outputs: list[list[int]] = [[] for _ in self.constraints]

    def propose(self, row: int, max_tokens: int) -> list[int]:
        return self.constraints[row].forced(self.outputs[row])[:max_tokens]

    def allowed(self, row: int, prefix: Sequence[int]) -> Sequence[int] | None:
        return self.constraints[row].allowed(self.outputs[row] + list(prefix))

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        self.outputs[row].extend(tokens)

    def done(self, row: int) -> bool:
        constraint = self.constraints[row]
        if hasattr(constraint, "done"):
            return constraint.done(self.outputs[row])
        allowed = constraint.allowed(self.outputs[row])
        return allowed is not None and set(allowed) <= set(constraint.eos)
