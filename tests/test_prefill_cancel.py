"""Cancellation inside a prefill chunk (``engine.layer_steps``): a chunk evaluated layer by
layer gives bit for bit the KV rows and logits of one evaluation (plain decoding's and the
speculative verifier's prefill alike), a stop between two layers leaves the cache holding
exactly the chunks before it (on dense, sliding-window, hybrid and SSM models), and an
abandoned request frees the engine inside its chunk and keeps what it prefilled."""

from __future__ import annotations

import io
import random
import time

import mlx.core as mx
import pytest
from common import T
from mlx_lm.models.cache import make_prompt_cache
from test_prefix_cache import GEMMA3, MAMBA, QWEN3_NEXT

from mlxkv.engine import cpu_attention, native_ops
from mlxkv.engine.engine import Engine, ProgressEvent, Request
from mlxkv.engine.generate import Cancelled, SamplingParams, head_view, prefill
from mlxkv.engine.mlx_lm_compat import install_attention, install_swiglu
from mlxkv.engine.settings import Settings
from mlxkv.engine.speculation.base import TargetView
from support.modelgen import init_model, tiny_model

QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 32768, "rope_theta": 10000.0, "tie_word_embeddings": True,
         "vocab_size": 512}
MODELS = [QWEN3, GEMMA3, QWEN3_NEXT, MAMBA]
IDS = ["dense", "rotating+kv", "ssm+kv", "ssm-only"]
STEP = 16  # tokens per chunk: 70 tokens are 5 chunks, the sliding window (16) wraps


def prompt(n: int = 70, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def arrays(cache: list) -> list[mx.array]:
    """What a cache holds: the rows inside its offset for token-indexed layers, every
    array of the others."""
    out: list[mx.array] = []

    def walk(x):
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
    for c in cache:
        if type(c).__name__ == "KVCache":
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        else:
            walk(c.state)
    return out


def same(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and bool(mx.array_equal(x, y))
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("config", MODELS, ids=IDS)
def test_layer_by_layer_is_bit_for_bit_the_same(config):
    model = init_model(config, seed=1, scale=0.1)
    toks = prompt()
    whole = make_prompt_cache(model)
    logits, _ = prefill(model, toks, whole, STEP, lambda done: None)
    seen: list[tuple[int, int, int, int]] = []
    stepped = make_prompt_cache(model)
    logits2, _ = prefill(model, toks, stepped, STEP, lambda done: None,
                         between_layers=lambda *at: seen.append(at))
    mx.eval(logits, logits2)
    assert bool(mx.array_equal(logits, logits2)) and same(arrays(whole), arrays(stepped))
    # every layer of every chunk (the last one too), in order; a model without a head view
    # (its logits are not the head on the last hidden state) feeds its last token alone
    fed = len(toks) if head_view(model) is not None else len(toks) - 1
    chunks = [(d, min(STEP, fed - d)) for d in range(0, fed, STEP)]
    if fed < len(toks):
        chunks.append((fed, 1))
    layers = len(whole)
    assert seen == [(d, n, i, layers) for d, n in chunks for i in range(1, layers + 1)]


def test_the_verifiers_prefill_with_hidden_rows_is_the_same():
    """The speculative verifier's prefill (a TargetView reading every position's hidden
    state) gives the same logits, hidden rows and cache layer by layer."""
    model = init_model(QWEN3, seed=2, scale=0.1)
    view = TargetView(model, None)
    toks = prompt(50)
    a, b = make_prompt_cache(model), make_prompt_cache(model)
    la, ha = prefill(model, toks, a, STEP, lambda d: None, view=view)
    lb, hb = prefill(model, toks, b, STEP, lambda d: None, view=view,
                     between_layers=lambda *at: None)
    mx.eval(la, ha, lb, hb)
    assert bool(mx.array_equal(la, lb)) and bool(mx.array_equal(ha, hb))
    assert same(arrays(a), arrays(b))


@pytest.mark.parametrize("config", MODELS, ids=IDS)
def test_a_stop_between_layers_keeps_exactly_the_chunks_before(config):
    model = init_model(config, seed=1, scale=0.1)
    toks = prompt()
    stopped = make_prompt_cache(model)

    def stop_in_third_chunk(done: int, chunk: int, layer: int, layers: int) -> None:
        if done == 2 * STEP and layer == 1:
            raise Cancelled

    with pytest.raises(Cancelled):
        prefill(model, toks, stopped, STEP, lambda d: None, between_layers=stop_in_third_chunk)

    def stop_after_two_chunks(done: int) -> None:  # how a cancel between chunks stops
        if done == 2 * STEP:
            raise Cancelled
    two = make_prompt_cache(model)
    with pytest.raises(Cancelled):
        prefill(model, toks, two, STEP, stop_after_two_chunks)
    assert same(arrays(stopped), arrays(two))
    # and the stopped cache goes on exactly as one that never ran the third chunk
    la, _ = prefill(model, toks[2 * STEP:], stopped, STEP, lambda d: None)
    lb, _ = prefill(model, toks[2 * STEP:], two, STEP, lambda d: None)
    mx.eval(la, lb)
    assert bool(mx.array_equal(la, lb))


def test_a_stop_inside_the_first_chunk_leaves_a_cached_prefix_as_it_was():
    """A lent cache (a prefix from the prefix cache) stopped inside the first new chunk
    holds the prefix again, its buffers unchanged where it matters."""
    model = init_model(QWEN3, seed=4, scale=0.1)
    toks = prompt(60)
    cache = make_prompt_cache(model)
    prefill(model, toks[:20], cache, STEP, lambda d: None)
    mx.eval([c.state for c in cache])
    before = [mx.array(a) for a in arrays(cache)]
    mx.eval(before)

    def stop(done: int, chunk: int, layer: int, layers: int) -> None:
        if layer == 2:
            raise Cancelled
    with pytest.raises(Cancelled):
        prefill(model, toks[20:], cache, STEP, lambda d: None, between_layers=stop)
    assert all(c.offset == 20 for c in cache) and same(arrays(cache), before)


@pytest.mark.skipif(native_ops.native() is None, reason="the CPU primitives are not built (make ext)")
@pytest.mark.parametrize("kind", ["one prompt", "a padded batch"])
def test_under_the_engines_cpu_kernels_a_chunk_computes_only_when_evaluated(kind):
    """On the engine thread a prompt chunk's attention and SwiGLU take the engine's own
    operations; building the chunk's forward pass computes none of them (each is a node of
    the graph, every layer's), so evaluating it layer by layer runs one layer at a time and
    a cancel stops between two, not after the whole chunk. A batch of left-padded prompts
    (mlx-lm's mask array) too."""
    from mlx_lm.models.cache import BatchKVCache

    model = init_model(QWEN3, seed=1, scale=0.1)
    install_attention(model)
    install_swiglu(model)
    cpu_attention.use_on_this_thread()
    try:
        if kind == "one prompt":
            cache, tokens = make_prompt_cache(model), mx.array([prompt(40)])
        else:
            cache = [BatchKVCache(left_padding=[0, 9]) for _ in model.layers]
            tokens = mx.array([prompt(40), [0] * 9 + prompt(31, seed=4)])
        out = model(tokens, cache=cache)
        graph = io.StringIO()
        mx.export_to_dot(graph, out, *[a for c in cache for a in (c.keys, c.values)])
    finally:
        cpu_attention.use_on_this_thread(False)
    layers = QWEN3["num_hidden_layers"]
    assert graph.getvalue().count("Swiglu") == layers
    assert graph.getvalue().count("ChunkAttention") == layers


# ------------------------------------------------------------------------ the engine
# a fifth of a second per 1,024-token chunk on a 2-core CPU, in 8 layers: a cancel has layers left
SLOW = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=8)
CHUNK = 1024


@pytest.fixture(scope="module")
def slow_model():
    return tiny_model("qwen3", **SLOW)


@pytest.mark.parametrize("spec", ["off", "ngram"], ids=["plain", "speculative"])
def test_an_abandoned_prefill_frees_the_engine_inside_its_chunk_and_keeps_what_it_did(
        slow_model, tmp_path, spec):
    """A long prompt is cancelled while its second chunk computes: it ends inside that
    chunk (its last progress is the first chunk's), the engine answers the next request,
    and that request (the same prompt) finds the first chunk in the cache. The same with
    the speculative verifier's prefill."""
    settings = Settings.defaults(model=str(slow_model), cache_dir=str(tmp_path / "cache"),
                                 prefill_step_size=CHUNK, spec=spec, block_tokens=64)
    toks = prompt(2 * CHUNK + 100, seed=9)
    params = SamplingParams(max_tokens=1, temperature=0.0, prefill_step_size=CHUNK)
    with Engine.from_settings(settings).start(timeout=T) as eng:
        h = eng.submit(Request(prompt_tokens=toks, params=params))
        cancelled_at = ended_at = 0.0
        events = []
        for ev in h.events(timeout=T):
            events.append(ev)
            if isinstance(ev, ProgressEvent) and ev.done == CHUNK and not cancelled_at:
                h.cancel()  # as the second chunk starts
                cancelled_at = time.monotonic()
        ended_at = time.monotonic()
        progress = [e.done for e in events if isinstance(e, ProgressEvent)]
        assert h.finished.reason == "cancelled" and not h.tokens
        assert progress == [0, CHUNK], progress  # it never finished the second chunk
        again = eng.submit(Request(prompt_tokens=toks, params=params)).result(timeout=T)
        assert again.stats.cached_tokens == CHUNK  # the first chunk, kept when it was cancelled
        assert eng.stats(timeout=T)["cancelled"] == 1
    print(f"cancel -> end of the request: {ended_at - cancelled_at:.2f} s")


def cancel_inside_the_pass(eng: Engine, a, b) -> dict:
    """Cancel ``a`` and ``b`` just after their batched pass started; check that both end
    cancelled inside it (neither one's progress moves again, no token) and return the
    engine's stats."""
    time.sleep(0.05)
    a.cancel()
    b.cancel()
    later = {h: [e.done for e in h.events(timeout=T) if isinstance(e, ProgressEvent)] for h in (a, b)}
    assert a.finished.reason == b.finished.reason == "cancelled"
    assert not a.tokens and not b.tokens
    assert later[a] == [] and later[b] == [], later  # the pass never ended
    return eng.stats(timeout=T)


@pytest.mark.parametrize("first_left", [CHUNK + 100, 500], ids=["even", "right-padded"])
def test_a_batched_prefill_whose_rows_are_all_cancelled_stops_inside_its_pass(slow_model, tmp_path, first_left):
    """A long prompt that moved into a batch (another request came while it prefilled)
    prefills there beside the newcomer, in passes of a whole chunk. Both are cancelled while
    that pass computes: it stops between layers (neither row's progress moves again), both
    end as cancelled, and the engine answers the next request. The half pass is rolled
    back and never stored (the newcomer's prompt is not in the cache), and what came before
    it is (the long prompt's first chunk). Also when the long prompt's part of the pass is
    shorter than the newcomer's (mlx-lm right-pads it for the pass)."""
    settings = Settings.defaults(model=str(slow_model), cache_dir=str(tmp_path / "cache"),
                                 prefill_step_size=CHUNK, spec="off", block_tokens=64)
    first, second = prompt(CHUNK + first_left, seed=9), prompt(2 * CHUNK + 100, seed=10)
    params = SamplingParams(max_tokens=1, temperature=0.0, prefill_step_size=CHUNK)
    with Engine.from_settings(settings).start(timeout=T) as eng:
        a = eng.submit(Request(prompt_tokens=first, params=params))
        b = None
        for ev in a.events(timeout=T):
            if isinstance(ev, ProgressEvent) and ev.done == 0 and b is None:
                b = eng.submit(Request(prompt_tokens=second, params=params))  # A joins it at CHUNK
            if isinstance(ev, ProgressEvent) and ev.done == CHUNK:
                break
        assert b is not None
        for ev in b.events(timeout=T):  # B's first progress: its first pass (and A's second) starts
            if isinstance(ev, ProgressEvent):
                assert ev.done == 0
                break
        stats = cancel_inside_the_pass(eng, a, b)
        assert stats["cancelled"] == 2 and stats["batched"] >= 1
        again = eng.submit(Request(prompt_tokens=second, params=params)).result(timeout=T)
        assert again.finish_reason == "length" and len(again.tokens) == 1
        assert again.stats.cached_tokens == 0  # nothing of B's half pass was stored
        again = eng.submit(Request(prompt_tokens=first, params=params)).result(timeout=T)
        assert again.stats.cached_tokens == CHUNK  # A's chunk before the pass was


def test_fresh_rows_cancelled_in_their_first_batched_pass_end_cleanly(slow_model, tmp_path):
    """Two long prompts that arrive together prefill as a batch from nothing. Both are
    cancelled inside that first pass: the pass rolls back to empty layers, both end as
    cancelled without being answered again alone (no retries), nothing is stored, and
    the engine answers the next request."""
    import threading

    settings = Settings.defaults(model=str(slow_model), cache_dir=str(tmp_path / "cache"),
                                 prefill_step_size=CHUNK, spec="off", block_tokens=64)
    prompts = prompt(2 * CHUNK + 100, seed=11), prompt(2 * CHUNK + 50, seed=12)
    params = SamplingParams(max_tokens=1, temperature=0.0, prefill_step_size=CHUNK)
    with Engine.from_settings(settings).start(timeout=T) as eng:
        gate = threading.Event()
        busy = eng.call(gate.wait, T)  # both wait together, then start as one batch
        a, b = (eng.submit(Request(prompt_tokens=p, params=params)) for p in prompts)
        gate.set()
        busy.result(timeout=T)
        for h in (a, b):  # each one's first progress: the batch's first pass starts
            for ev in h.events(timeout=T):
                if isinstance(ev, ProgressEvent):
                    assert ev.done == 0
                    break
        stats = cancel_inside_the_pass(eng, a, b)
        assert stats["cancelled"] == 2 and stats["batched"] >= 1 and stats["retries"] == 0, stats
        again = eng.submit(Request(prompt_tokens=prompts[0], params=params)).result(timeout=T)
        assert again.finish_reason == "length" and again.stats.cached_tokens == 0


def test_the_last_layer_of_the_last_chunk_is_not_thrown_away():
    """A stop asked for after the prompt's last layer is done leaves the prefill whole:
    the chunk is finished, and the request ends at its first token as before."""
    model_path = tiny_model("qwen3")
    from mlx_lm import load

    from mlxkv.engine.generate import Generation

    model, tok = load(str(model_path))
    assert head_view(model) is not None
    stop = [False]

    def on_layer(done: int, chunk: int, layer: int, layers: int) -> None:
        stop[0] = stop[0] or (done + chunk == 20 and layer == layers)
    gen = Generation(model, tok, prompt(20), SamplingParams(max_tokens=5, temperature=0.0,
                                                            prefill_step_size=8),
                     should_stop=lambda: stop[0], on_layer=on_layer)
    steps = [s for s in gen if s.token is not None]
    assert gen.outcome.finish_reason == "cancelled" and len(steps) == 1
    assert gen.outcome.tokens_in_cache[:20] == prompt(20)
