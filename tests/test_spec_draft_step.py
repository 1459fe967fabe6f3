"""The draft model's compiled decode step (engine.speculation.draft_step) gives the logits of the
model's own forward pass, keeps the KVCache it writes usable by everything else (trim,
growth past its capacity, a plain forward after it), and falls back to the forward pass
for caches and architectures it cannot run."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxkv.engine.models import load_model
from mlxkv.engine.speculation.draft_step import DraftModelStep
from support.modelgen import init_model, tiny_model, tiny_model_of_type

GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16,
          "sliding_window_pattern": 2, "max_position_embeddings": 4096}


def logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def chains(model, prompt: list[int], widths: list[int], step=None):
    """Feed ``prompt``, then one input per entry of ``widths`` (that many tokens, the first
    being the last greedy token), through ``step`` or the forward pass; the log-probabilities
    of each input's last position, and the cache."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    out, token = [], prompt[-1]
    for i, w in enumerate(widths):
        x = mx.array([[token] + [(token + 7 * j + i) % 200 + 3 for j in range(1, w)]])
        logits = step(x, cache) if step is not None else model(x, cache=cache)[0, -1:]
        lp = logprobs(logits)
        mx.eval(lp)
        out.append(lp)
        token = int(mx.argmax(lp, axis=-1).item())
    return out, cache


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_compiled_step_is_the_forward_pass(arch):
    model = load_model(str(tiny_model_of_type(arch) if arch == "qwen2" else tiny_model(arch))).model
    step = DraftModelStep(model)
    # 250 + the inputs cross the KVCache's 256-slot buffer: the step that does not fit grows
    # it through the forward pass, the next ones are compiled again (a new trace).
    prompt = [(i * 37) % 250 + 3 for i in range(250)]
    widths = [1, 2, 1, 1, 3, 1, 1, 1, 4, 1, 1, 1]
    want, want_cache = chains(model, prompt, widths)
    got, got_cache = chains(model, prompt, widths, step)
    assert step.enabled is True
    for a, b in zip(got, want):
        assert mx.abs(a - b).max().item() < 1e-4
        assert mx.argmax(a).item() == mx.argmax(b).item()
    n = want_cache[0].offset
    assert n == 250 + sum(widths)
    for a, b in zip(got_cache, want_cache):
        assert a.offset == n and a.keys.shape[2] >= n
        assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-5).item()
        assert mx.allclose(a.values[..., :n, :], b.values[..., :n, :], atol=1e-5).item()
    # trimmed like any KVCache, then fed by the forward pass: still the same model
    for c in got_cache + want_cache:
        c.trim(5)
    x = mx.array([[9, 10]])
    a, b = logprobs(step(x, got_cache)), logprobs(model(x, cache=want_cache)[0, -1:])
    assert mx.abs(a - b).max().item() < 1e-4
    # a cache holding exactly its tokens (as the prefix cache restores one) gets room to a
    # multiple of 256 slots: one trace per capacity, not one per restored length
    restored = []
    for c in got_cache:
        r = KVCache()
        r.state = (c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset)
        restored.append(r)
    x = mx.array([[11]])
    a, b = logprobs(step(x, restored)), logprobs(model(x, cache=want_cache)[0, -1:])
    assert mx.abs(a - b).max().item() < 1e-4
    assert all(r.keys.shape[2] % 256 == 0 and r.offset == want_cache[0].offset for r in restored)


def test_a_sliding_window_cache_takes_the_forward_pass():
    dense = load_model(str(tiny_model("llama")))
    model = init_model({**GEMMA3, "vocab_size": dense.model.args.vocab_size}, seed=4)
    step = DraftModelStep(model)
    prompt = list(range(3, 30))
    want, _ = chains(model, prompt, [1, 1, 2, 1])
    got, _ = chains(model, prompt, [1, 1, 2, 1], step)
    assert step.enabled is None  # never tried: a RotatingKVCache is not a plain KVCache
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


class ReadsOffset(nn.Module):
    """A model that reads its cache's offset as a Python number (some architectures do), which
    the compiled step's array offset cannot give while tracing."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __call__(self, x, cache=None):
        if cache is not None and int(cache[0].offset) < 0:
            raise AssertionError("unreachable")
        return self.inner(x, cache=cache)

    def make_cache(self):
        return make_prompt_cache(self.inner)


def test_an_architecture_the_step_cannot_trace_keeps_the_forward_pass():
    model = ReadsOffset(load_model(str(tiny_model("qwen3"))).model)
    step = DraftModelStep(model)
    prompt = [(i * 11) % 200 + 3 for i in range(40)]
    widths = [1, 2, 1, 1]
    want, want_cache = chains(model, prompt, widths)
    got, got_cache = chains(model, prompt, widths, step)
    assert step.enabled is False
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    n = 40 + sum(widths)
    for a, b in zip(got_cache, want_cache):
        assert a.offset == b.offset == n
        assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
