"""Grouped rows: the :class:`ProposalRowGroup` of a batch, one :class:`ProposalSource` per row.

Each row keeps its own source (an n-gram index, a draft model's KV), so rows join and
leave between rounds without touching the others; proposals are ragged (the verifier
right-pads them to the widest). ``consume`` hands a row target inputs it did not propose
(constraint-forced tokens, a new user turn of a kept conversation): the sources here take
them in without a re-prefill (prompt lookup indexes them, a draft model feeds them with
its next proposal).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxkv.engine.arrays import int_list
from mlxkv.engine.speculation.base import Proposal, ProposalRowGroup, ProposalSource, RequestConstraints


class SourceRowGroup(ProposalRowGroup):
    def __init__(self, constraints: RequestConstraints | None = None) -> None:
        self.rows: list[ProposalSource] = []
        self.constraints = constraints

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, rows: Sequence[ProposalSource]) -> None:
        self.rows.extend(rows)

    def filter_rows(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def propose(self, pending: Sequence[int], depth: int) -> list[list[int]]:
        return [p.tokens for p in self.proposals(pending, depth)]

    def proposals(self, pending: Sequence[int], depth: int,
                  limits: Sequence[int] | None = None) -> list[Proposal]:
        """Each row's :class:`Proposal` (tokens filled in, with the proposal distribution of
        sources that sample), at most ``limits[i]`` (else ``depth``) tokens. Tokens a source
        left unevaluated (a draft model's steps) are evaluated together, in one graph."""
        if len(pending) != len(self.rows):
            raise ValueError(f"{len(pending)} pending tokens for {len(self.rows)} rows")
        out: list[Proposal] = []
        for i, (row, token) in enumerate(zip(self.rows, pending)):
            n = depth if limits is None else min(depth, int(limits[i]))
            forced = self.constraints.propose(i, n) if self.constraints is not None and n > 0 else []
            if forced:
                out.append(Proposal(list(forced)[:n]))
            else:
                out.append(row.propose(int(token), n) if n > 0 else Proposal([]))
        lazy = [p.lazy for p in out if p.lazy is not None]
        if lazy:
            import mlx.core as mx

            mx.eval(lazy)
            for p in out:
                if p.lazy is not None:
                    p.tokens, p.lazy = [int(t) for t in int_list(p.lazy)], None
        for p in out:
            if len(p.tokens) > depth:
                p.tokens = list(p.tokens[:depth])
        return out

    def commit(self, accepted: Sequence[Sequence[int]]) -> None:
        for i, (row, toks) in enumerate(zip(self.rows, accepted)):
            row.commit(list(toks))
            if self.constraints is not None:
                self.constraints.commit(i, list(toks))

    def capture(self, row: int) -> Any:
        return self.rows[row].capture()

    def consume(self, tokens: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
        for row, toks, n in zip(self.rows, tokens, lengths):
            taken = list(toks)[:n]
            if not taken:
                continue
            consume = getattr(row, "consume", None)
            if consume is None:
                raise TypeError(f"{type(row).__name__} cannot take in tokens it did not propose; "
                                "prefill it again")
            consume(taken)
