"""The prefix cache's answer to "why did it miss" (``PrefixCache.explain``: the stored state
closest to a prompt and where the prompt parts from it, from RAM and, after a restart, from
the SSD tier's manifests) and retention hints (``store(..., retain_s=)``): under RAM
pressure a state without a hint is evicted before one with it, until the hint runs out;
a manual pin stays; the SSD tier evicts hinted files last. A clock passed in stands for
time, so nothing sleeps."""

from __future__ import annotations

import numpy as np
import pytest
from test_prefix_cache import pc_at, prompt, run


@pytest.fixture(scope="module")
def llama(tiny_llama):
    from mlx_lm import load

    model, _ = load(str(tiny_llama))
    return model


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(pc, model, tokens, ns="ns", **kw):
    _, _, cache = run(model, tokens, n_new=0)
    pc.store(tokens, cache, ns, **kw)


def room_for_two(model, tokens, clock: Clock):
    """A RAM-only cache on ``clock`` that holds two states like ``tokens``, not three."""
    probe = pc_at(None, ram_bytes=1 << 30)
    stored(probe, model, tokens)
    one = probe.ram.nbytes
    probe.close()
    return pc_at(None, ram_bytes=int(2.5 * one), clock=clock)


# ----------------------------------------------------------------------------- explain
def test_explain_names_the_closest_state_and_where_the_prompt_parts(llama, tmp_path):
    base = prompt(90, 1)
    a = base[:70] + prompt(20, 2)  # shares 70 tokens with the prompt
    b = base[:40] + prompt(30, 3)  # shares 40
    pc = pc_at(tmp_path)
    stored(pc, llama, a, session="chat-a")
    stored(pc, llama, b)
    ask = base[:70] + prompt(25, 4)
    assert ask[70] != a[70]
    n, cache = pc.lookup(ask, "ns")
    d = pc.explain(ask, "ns")
    assert n == 70 and d.shared == 70 and d.tokens == len(a) and d.tier == "ram"
    assert d.label == "chat-a" and list(d.next_tokens) == a[70:86]
    assert d.entry == next(e.id for e in pc.entries() if e.tokens == len(a))
    assert pc.explain(prompt(30, 9), "ns") is None  # nothing starts like it
    assert pc.explain(a + [7, 8], "ns").shared == len(a)  # it goes on past a state's end
    pc.release(cache)
    pc.close(30)
    # a new process: RAM is empty, the SSD tier's manifests know the states' tokens
    pc2 = pc_at(tmp_path)
    d2 = pc2.explain(ask, "ns")
    assert (d2.entry, d2.shared, d2.tier) == (d.entry, 70, "ssd") and d2.label == d.entry[:12]
    pc2.delete(d.entry)
    assert pc2.explain(ask, "ns").shared == 40  # only b is left
    pc2.close()


# ----------------------------------------------------------------------------- retention
def test_under_pressure_a_hinted_state_outlives_unhinted_ones_until_its_hint_ends(llama):
    clock = Clock()
    t = [prompt(40, s) for s in range(10, 16)]
    pc = room_for_two(llama, t[0], clock)
    stored(pc, llama, t[0], retain_s=300)  # the oldest, but hinted for 5 minutes
    stored(pc, llama, t[1])
    stored(pc, llama, t[2])  # over the cap: t[1] goes, not the older t[0]
    assert [e.tokens.tolist() for e in pc.ram.entries.values()] == [t[0], t[2]]
    [info] = [i for i in pc.entries() if i.retained_s > 0]
    assert info.retained_s == 300 and not info.pinned and pc.stats()["retained"] == 1
    clock.now += 301  # the hint ran out: t[0] is the least recently used entry again
    stored(pc, llama, t[3])
    assert [e.tokens.tolist() for e in pc.ram.entries.values()] == [t[2], t[3]]
    assert all(i.retained_s == 0 for i in pc.entries())
    pc.close()


def test_a_manual_pin_outlasts_hints_and_stays_until_unpinned(llama):
    clock = Clock()
    t = [prompt(40, s) for s in range(20, 26)]
    pc = room_for_two(llama, t[0], clock)
    stored(pc, llama, t[0])
    pinned = next(iter(pc.entries())).id
    assert pc.pin(pinned)
    stored(pc, llama, t[1], retain_s=60)
    stored(pc, llama, t[2], retain_s=60)  # over the cap: a hinted one goes, the pin stays
    kept = [e.tokens.tolist() for e in pc.ram.entries.values()]
    assert t[0] in kept and len(kept) == 2
    clock.now += 3600  # hours later: the pin has no end of its own
    stored(pc, llama, t[3])
    assert t[0] in [e.tokens.tolist() for e in pc.ram.entries.values()]
    pc.close()


def test_a_hinted_state_is_not_superseded_by_its_continuation(llama):
    """A conversation goes on from a hinted state: the longer state does not replace the
    hinted one (it stays an entry of its own until its hint ends)."""
    clock = Clock()
    pc = pc_at(None, clock=clock)
    first = prompt(40, 30)
    stored(pc, llama, first, retain_s=300)
    longer = first + prompt(10, 31)
    stored(pc, llama, longer)
    assert sorted(len(e.tokens) for e in pc.ram.entries.values()) == [40, 50]
    pc.close()


def test_the_ssd_tier_evicts_hinted_files_last(tmp_path):
    """The block store's LRU eviction takes files a retention hint holds only after all
    others, and like any other once the hint has ended."""
    from test_store import F32, make_kv, segs

    from mlxkv.storage.store import BlockStore

    store = BlockStore(tmp_path / "store", block_tokens=8)
    now = [0.0]
    store.retain_clock = lambda: now[0]

    def put(seed: int) -> bytes:
        toks = np.array(prompt(8, seed), dtype=np.uint32)
        store.put_blocks("ns", toks, F32, segs(F32, make_kv(F32, toks, 8)), tail=False)
        [key] = store.chain_keys("ns", toks)
        return key

    keys = [put(s) for s in range(4)]  # written (and used) oldest first
    store.retain("ns", [keys[0]], ttl_s=60)

    def left() -> set[bytes]:
        return {k for k in keys if store.lookup("ns", np.array(prompt(8, keys.index(k)),
                                                                dtype=np.uint32)).n_tokens}
    one = store.stats()["bytes"] // 4
    store.evict(max_bytes=2 * one)  # the two oldest without a hint go: 1 and 2
    assert left() == {keys[0], keys[3]}
    now[0] = 61.0  # the hint ended: the oldest is just the oldest
    store.evict(max_bytes=one)
    assert left() == {keys[3]}
    store.close()
