"""Would verifying a tree of suffix candidates pay here? Measured, not assumed.

A tree verify feeds the best path *and* the runner-up continuations in one forward (a tree
attention mask, per-node positions); it pays when the runner-ups are right often enough to
buy the extra positions. mlx-lm's models take neither a tree mask nor per-node positions,
so the engine verifies the best path. This module answers the question with the two
things it depends on, both measured on the real model in the same run:

- :func:`forward_costs`: the target's forward over W tokens at the real context length,
  against a one-token step (on a CPU the cost grows about linearly past a few tokens);
- :func:`simulate`: the suffix source's rounds over a real greedy reply (its prompt, its
  output, what the global index learned), once proposing the best path and once a tree
  (the best path plus, at its first ``branch_depth`` positions, the runner-up continuation
  with a short path of its own); a node is accepted when it equals the target's token,
  which for greedy decoding is the reply itself.

:func:`tree_vs_path` combines them: tokens per unit of forward cost, the best of each
family over proposal lengths.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from mlxkv.engine.speculation.suffix import ALPHA, MIN_SCORE
from mlxkv.engine.speculation.suffix_index import (
    SuffixIndex,
    continuations,
    prefix_hashes,
    propose_path,
)

WIDTHS = (1, 2, 3, 5, 9, 13, 17, 25)


def forward_costs(model: Any, context: Sequence[int], widths: Sequence[int] = WIDTHS,
                  repeats: int = 3) -> dict[int, float]:
    """Seconds of one forward over ``w`` tokens after ``context`` (its KV cached), per
    width: the median of ``repeats`` interleaved passes (run on the engine thread)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(context)]), cache=cache))
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats):
        for w in widths:
            x = mx.array([list(context[-w:])])
            t0 = time.perf_counter()
            mx.eval(model(x, cache=cache))
            times[w].append(time.perf_counter() - t0)
            for c in cache:
                c.trim(w)
    return {w: statistics.median(ts) for w, ts in times.items()}


def _tree_round(indexes: Sequence[SuffixIndex], context: list[int], truth: Sequence[int], k: int,
                branch_depth: int, branch_len: int, alpha: float, min_score: float) -> tuple[int, int]:
    """(accepted, nodes) of one tree round: the best path of up to ``k`` and, at each of its
    first ``branch_depth`` positions, the runner-up continuation followed by its own path of
    up to ``branch_len - 1`` tokens."""
    path, _ = propose_path(indexes, context, k, alpha=alpha, min_score=min_score)
    nodes = len(path)
    branches: dict[int, list[int]] = {}
    for d in range(min(branch_depth, len(path))):
        ctx = context + path[:d]
        tail = ctx[-indexes[0].window:]
        _, counts = continuations(indexes, indexes[0].keys(prefix_hashes(tail), len(tail)))
        others = sorted((c, t) for t, c in counts.items() if t != path[d])
        if not others:
            continue
        alt = others[-1][1]
        rest, _ = propose_path(indexes, ctx + [alt], branch_len - 1, alpha=alpha, min_score=min_score)
        branches[d] = [alt] + rest
        nodes += len(branches[d])
    accepted = 0
    for d, token in enumerate(path):
        if d < len(truth) and token == truth[d]:
            accepted += 1
            continue
        alt = branches.get(d)
        if alt and d < len(truth) and alt[0] == truth[d]:
            accepted += 1 + next((j for j, t in enumerate(alt[1:]) if d + 1 + j >= len(truth)
                                  or t != truth[d + 1 + j]), len(alt) - 1)
        break
    return accepted, nodes


def simulate(prompt: Sequence[int], output: Sequence[int], learned: Sequence[Sequence[int]], *, k: int,
             branch_depth: int = 0, branch_len: int = 3, alpha: float = ALPHA, min_score: float = MIN_SCORE
             ) -> dict[str, Any]:
    """Rounds of the suffix source over a greedy reply ``output`` to ``prompt`` (with the
    global index holding ``learned``): the widths fed and tokens gained per round. With
    ``branch_depth`` 0 it proposes the best path (what the engine does), else a tree."""
    local, learned_ix = SuffixIndex(), SuffixIndex()
    for seq in learned:
        learned_ix.extend(seq)
        learned_ix.end_sequence()
    local.extend(prompt)
    indexes = (local, learned_ix)
    pos, widths, accepted_total = 0, [], 0
    while pos < len(output) - 1:
        pending = int(output[pos])
        context = local.tokens[-local.window:] + [pending]
        truth = output[pos + 1:]
        if branch_depth:
            accepted, nodes = _tree_round(indexes, context, truth, k, branch_depth, branch_len, alpha, min_score)
        else:
            path, _ = propose_path(indexes, context, k, alpha=alpha, min_score=min_score)
            accepted = next((j for j, t in enumerate(path) if j >= len(truth) or t != truth[j]), len(path))
            nodes = len(path)
        widths.append(1 + nodes)
        accepted_total += accepted
        local.extend([pending] + list(output[pos + 1: pos + 1 + accepted]))
        pos += accepted + 1
    return {"rounds": len(widths), "tokens": pos, "widths": widths, "accepted": accepted_total}


def _cost(costs: dict[int, float], width: int) -> float:
    """A forward's cost at ``width`` from the measured widths (linear between them, and
    past the widest along its last segment)."""
    ws = sorted(costs)
    if width in costs:
        return costs[width]
    lo = max([w for w in ws if w < width], default=ws[0])
    hi = min([w for w in ws if w > width], default=None)
    if hi is None:
        lo, hi = ws[-2], ws[-1]
    return costs[lo] + (costs[hi] - costs[lo]) * (width - lo) / (hi - lo)


def tree_vs_path(costs: dict[int, float], prompt: Sequence[int], output: Sequence[int],
                 learned: Sequence[Sequence[int]], lengths: Sequence[int] = (4, 8, 12, 16)) -> dict[str, Any]:
    """Tokens per second of forward cost for the best path and for trees, each at its best
    proposal length, against plain decoding (one token per one-token forward)."""
    def rate(sim: dict) -> float:
        return sim["tokens"] / sum(_cost(costs, w) for w in sim["widths"]) if sim["widths"] else 0.0

    plain = 1.0 / costs[1]
    path = {k: simulate(prompt, output, learned, k=k) for k in lengths}
    tree = {k: simulate(prompt, output, learned, k=k, branch_depth=2, branch_len=3) for k in lengths}
    best_path = max(path, key=lambda k: rate(path[k]))
    best_tree = max(tree, key=lambda k: rate(tree[k]))
    bp, bt = path[best_path], tree[best_tree]
    return {
        "forward_cost_vs_step": {w: round(c / costs[1], 3) for w, c in sorted(costs.items())},
        "path_length": best_path, "path_speedup": round(rate(bp) / plain, 3),
        "path_tokens_per_forward": round(bp["tokens"] / bp["rounds"], 3),
        "tree_length": best_tree, "tree_speedup": round(rate(bt) / plain, 3),
        "tree_tokens_per_forward": round(bt["tokens"] / bt["rounds"], 3),
        "tree_mean_width": round(statistics.mean(bt["widths"]), 2),
        "path_mean_width": round(statistics.mean(bp["widths"]), 2),
        "tree_vs_path": round(rate(bt) / rate(bp), 3) if rate(bp) else 0.0,
    }
