"""The engine thread and generation loop: parity with mlx_lm.stream_generate, sampling,
stop strings, max tokens, cancellation, the prefix-cache seam, import hygiene, BLAS."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from common import T, greedy

from mlxkv.engine.cache.prefix_cache import NullPrefixCache
from mlxkv.engine.engine import Engine, EngineError, Request, TokenEvent
from mlxkv.engine.generate import SamplingParams, StopMatcher, cache_length
from mlxkv.engine.models import ModelNotFoundError

ROOT = Path(__file__).resolve().parent.parent


WORDS = ("the cache keeps every block of the conversation on disk so that a restart "
         "returns instantly; import os, sys; def main(argv): return 0 # mlx engine").split(" ")


def prompts(n: int, seed: int) -> list[str]:
    """Varied prompts of varied lengths (random models repeat under greedy)."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def qwen3_engine(tiny_qwen3):
    with Engine(str(tiny_qwen3)).start() as e:
        yield e


@pytest.fixture(scope="module")
def llama_engine(tiny_llama):
    with Engine(str(tiny_llama)).start() as e:
        yield e


def reference(eng: Engine, tokens: list[int], max_tokens: int, **kwargs) -> list[int]:
    """Token ids from mlx_lm.stream_generate, run on the engine's own thread."""

    def run():
        import mlx.core as mx
        from mlx_lm.generate import stream_generate

        if "seed" in kwargs:
            mx.random.seed(kwargs.pop("seed"))
        out = list(stream_generate(eng.loaded.model, eng.loaded.tokenizer, mx.array(tokens),
                                   max_tokens=max_tokens, **kwargs))
        ids = [r.token for r in out]
        return ids[:-1] if out[-1].finish_reason == "stop" else ids

    return eng.call(run).result(timeout=T)


def encode(eng: Engine, text: str) -> list[int]:
    return eng.call(lambda: list(eng.loaded.tokenizer.encode(text))).result(timeout=T)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_parity_with_mlx_lm(arch, qwen3_engine, llama_engine):
    eng = qwen3_engine if arch == "qwen3" else llama_engine
    texts = prompts(22, seed=7 if arch == "qwen3" else 8)
    seen = set()
    for i, text in enumerate(texts):
        tokens = encode(eng, text)
        max_tokens = 4 + (i * 5) % 23
        # Small prefill chunks on some prompts exercise the chunked prefill too.
        step = 7 if i % 3 == 0 else 2048
        ours = eng.submit(Request(prompt_tokens=tokens, params=greedy(
            max_tokens=max_tokens, prefill_step_size=step))).result(timeout=T)
        ref = reference(eng, tokens, max_tokens, prefill_step_size=step)
        assert ours.tokens == ref, f"prompt {i}: {text!r}"
        assert ours.finish_reason == ("length" if len(ref) == max_tokens else "stop")
        seen.add(tuple(ref))
    assert len(seen) > 1  # the prompts really did lead to different outputs


def test_parity_with_a_prompt_cache(llama_engine):
    """Given a cache holding a prefix, we and stream_generate (fed the same kind of cache
    and the rest of the prompt) produce the same tokens."""
    from mlxkv.engine.generate import Generation

    eng = llama_engine
    texts = prompts(6, seed=11)

    def run(tokens, n_cached):
        import mlx.core as mx
        from mlx_lm.generate import stream_generate
        from mlx_lm.models.cache import make_prompt_cache

        def prefilled():
            cache = make_prompt_cache(eng.loaded.model)
            eng.loaded.model(mx.array(tokens[:n_cached])[None], cache=cache)
            mx.eval([c.state for c in cache])
            return cache

        ours = Generation(eng.loaded.model, eng.loaded.tokenizer, tokens,
                          greedy(max_tokens=12), cache=prefilled(), n_cached=n_cached)
        ours_tokens = [s.token for s in ours if s.token is not None]
        out = list(stream_generate(eng.loaded.model, eng.loaded.tokenizer,
                                   mx.array(tokens[n_cached:]), max_tokens=12,
                                   prompt_cache=prefilled()))
        ref = [r.token for r in out]
        ref = ref[:-1] if out[-1].finish_reason == "stop" else ref
        assert ours.outcome.cached_tokens == n_cached
        # Every token generate_step yielded (EOS included) has had its KV computed.
        eos = 1 if ours.outcome.stop_detail == "eos" else 0
        assert len(ours.outcome.tokens_in_cache) == len(tokens) + len(ours_tokens) + eos
        return ours_tokens, ref

    for text in texts:
        tokens = encode(eng, text + " and more words to make room")
        n_cached = max(1, len(tokens) // 2)
        ours, ref = eng.call(run, tokens, n_cached).result(timeout=T)
        assert ours == ref, text


def test_seeded_sampling_parity_and_reproducible(qwen3_engine):
    eng = qwen3_engine
    tokens = encode(eng, "def main(argv): return the cache")
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=1234)
    a = eng.submit(Request(prompt_tokens=tokens, params=params)).result(timeout=T)
    b = eng.submit(Request(prompt_tokens=tokens, params=params)).result(timeout=T)
    assert a.tokens == b.tokens and a.text == b.text
    assert len(set(a.tokens)) > 5  # really sampled, not a repeated token
    from mlx_lm.sample_utils import make_sampler

    ref = reference(eng, tokens, 40, seed=1234, sampler=make_sampler(1.0, 0.9))
    assert a.tokens == ref
    c = eng.submit(Request(prompt_tokens=tokens, params=SamplingParams(
        max_tokens=40, temperature=1.0, top_p=0.9, seed=99))).result(timeout=T)
    assert c.tokens != a.tokens
    # top-k, min-p and repetition penalty go through mlx-lm's samplers/processors too.
    d = eng.submit(Request(prompt_tokens=tokens, params=SamplingParams(
        max_tokens=20, temperature=0.8, top_k=5, min_p=0.05, repetition_penalty=1.3,
        seed=5))).result(timeout=T)
    assert len(d.tokens) == 20


def test_text_matches_tokenizer_decode(qwen3_engine):
    eng = qwen3_engine
    r = eng.submit(Request(prompt="hello world", params=SamplingParams(
        max_tokens=30, temperature=1.0, seed=3))).result(timeout=T)
    decoded = eng.call(lambda: eng.loaded.tokenizer.decode(r.tokens)).result(timeout=T)
    assert r.text == decoded


def test_stop_matcher_unit():
    m = StopMatcher(["END", "xyz"])
    out = [m.feed(t) for t in ["ab", "cE", "N", "Dmore"]]
    assert "".join(out) == "abc" and m.matched == "END"
    m = StopMatcher(["abcd"])
    assert m.feed("xxab") == "xx" and m.feed("cX") == "abcX" and m.matched is None
    m = StopMatcher(["aab"])
    assert m.feed("aa") == "" and m.feed("aab") == "aa" and m.matched == "aab"
    m = StopMatcher(["ZZ", "Y"])
    assert m.feed("aZYZZ") == "aZ" and m.matched == "Y"  # earliest occurrence wins
    m = StopMatcher(["tail"])
    assert m.feed("ta") == "" and m.flush() == "ta"


def test_stop_string_spanning_tokens(qwen3_engine):
    eng = qwen3_engine
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=42)
    full = eng.submit(Request(prompt="import os", params=params)).result(timeout=T)
    pieces = eng.call(lambda: [eng.loaded.tokenizer.decode([t]) for t in full.tokens]).result(timeout=T)
    # A stop string that starts inside one token's text and ends inside a later one.
    k = next(i for i in range(5, len(pieces) - 2)
             if len(pieces[i]) >= 2 and pieces[i + 1] and len(pieces[i + 2]) >= 1)
    stop = pieces[k][1:] + pieces[k + 1] + pieces[k + 2][:1]
    expected = full.text[: full.text.find(stop)]
    r = eng.submit(Request(prompt="import os", params=SamplingParams(
        max_tokens=60, temperature=1.0, seed=42, stop=(stop,)))).result(timeout=T)
    assert (r.finish_reason, r.finish_detail) == ("stop", stop)
    assert r.text == expected and stop not in r.text


def test_max_tokens(qwen3_engine):
    """Exactly max_tokens tokens, on a prompt and seed that do not reach EOS before."""
    def run(n):
        return qwen3_engine.submit(Request(prompt="abc", params=SamplingParams(
            max_tokens=n, temperature=1.0, top_p=1.0, seed=0))).result(timeout=T)

    longer = run(40)
    assert len(longer.tokens) > 7
    r = run(7)
    assert (r.finish_reason, r.finish_detail) == ("length", None)
    assert len(r.tokens) == r.stats.generated_tokens == 7
    assert r.tokens == longer.tokens[:7]


def test_cancel_mid_stream_from_another_thread(qwen3_engine):
    first = threading.Event()
    handle = qwen3_engine.submit(
        Request(prompt="go on", params=SamplingParams(max_tokens=100_000, temperature=1.0,
                                                      seed=1)),
        callback=lambda ev: isinstance(ev, TokenEvent) and first.set())
    assert first.wait(60)
    threading.Thread(target=handle.cancel).start()
    r = handle.result(timeout=60)
    assert r.finish_reason == "cancelled" and 0 < len(r.tokens) < 100_000
    # The engine keeps serving afterwards.
    assert qwen3_engine.submit(Request(prompt="x", params=SamplingParams(max_tokens=2))
                               ).result(timeout=T).finish_reason in ("length", "stop")


def test_cancel_before_start_and_shutdown(tiny_qwen3):
    eng = Engine(str(tiny_qwen3)).start()
    gate = threading.Event()
    eng.call(gate.wait)  # occupy the engine thread
    early = eng.submit(Request(prompt="a"))
    early.cancel()
    queued = eng.submit(Request(prompt="b", params=SamplingParams(max_tokens=8)))
    gate.set()
    assert early.result(timeout=60).finish_reason == "cancelled"
    assert early.result(timeout=T).tokens == []
    eng.call(gate.clear).result(timeout=T)
    eng.call(gate.wait)
    pending = eng.submit(Request(prompt="c"))
    eng.shutdown(wait=False)  # asked while the engine thread is still busy
    gate.set()
    eng.shutdown()
    assert queued.result(timeout=60).finish_reason in ("length", "stop")
    fin = pending.result(timeout=60)
    assert fin.finish_reason == "cancelled"
    with pytest.raises(EngineError):
        eng.submit(Request(prompt="d"))


def test_bad_requests_and_models(qwen3_engine, tmp_path):
    from mlxkv.engine.engine import RequestRefused

    for bad in (dict(prompt_tokens=[]), dict(prompt=""), dict(prompt=" \n\t "),
                dict(messages=[]), dict(messages=[{"role": "user", "content": "  "}])):
        with pytest.raises(ValueError, match="the prompt is empty"):
            Request(**bad)
    bad = qwen3_engine.submit(Request(prompt_tokens=[1, 10**9]))
    with pytest.raises(RequestRefused, match="out of range"):
        bad.result(timeout=T)
    with pytest.raises(ValueError):
        Request()
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ModelNotFoundError):
        Engine(str(tmp_path / "missing")).start()


def test_submit_while_the_model_loads(tiny_qwen3, tmp_path):
    eng = Engine(str(tiny_qwen3)).start(wait=False)
    h = eng.submit(Request(prompt="hi", params=SamplingParams(max_tokens=2)))
    assert h.result(timeout=120).tokens
    eng.shutdown()
    bad = Engine(str(tmp_path / "missing")).start(wait=False)
    try:
        h = bad.submit(Request(prompt="hi"))
    except ModelNotFoundError:
        pass  # the load had already failed: submit says why
    else:  # queued before the load failed: the request carries the load error
        with pytest.raises(EngineError, match="model folder not found"):
            h.result(timeout=60)
    with pytest.raises(ModelNotFoundError):
        bad.wait_ready()


class DictPrefixCache(NullPrefixCache):
    """A minimal real prefix cache for the seam test: keeps the last stored state and
    lends it when it is a strict prefix of the next prompt (the rest of the engine's
    CacheClient is NullPrefixCache's)."""

    enabled = True

    def __init__(self):
        self.stored = None
        self.lookups = []

    def lookup(self, tokens, namespace, session=None):
        self.lookups.append((len(tokens), namespace, session))
        if self.stored and len(self.stored[0]) < len(tokens) and \
                tokens[: len(self.stored[0])] == self.stored[0]:
            stored, self.stored = self.stored, None
            return len(stored[0]), stored[1]
        return 0, None

    def store(self, tokens, cache, namespace, session=None, retain_s=None):
        assert cache_length(cache) == len(tokens)
        self.stored = (list(tokens), cache)


def test_prefix_cache_seam(tiny_qwen3):
    pc = DictPrefixCache()
    with Engine(str(tiny_qwen3), prefix_cache=pc).start() as eng:
        tokens = encode(eng, "the cache keeps every block of the conversation")
        params = greedy(max_tokens=8)
        first = eng.submit(Request(prompt_tokens=tokens, params=params, session="s1")).result(timeout=T)
        eng.sync(timeout=T)  # the store runs after the finished event
        stored_tokens = pc.stored[0]
        assert stored_tokens[: len(tokens)] == tokens
        assert stored_tokens[len(tokens):len(tokens) + len(first.tokens)] == first.tokens
        follow = stored_tokens + encode(eng, " and then some more")
        hit = eng.submit(Request(prompt_tokens=follow, params=params, session="s1")).result(timeout=T)
        assert hit.stats.cached_tokens == len(stored_tokens)
        assert pc.lookups[-1][1] == eng.namespace and pc.lookups[-1][2] == "s1"
        eng.sync(timeout=T)
    with Engine(str(tiny_qwen3)).start() as plain:
        miss = plain.submit(Request(prompt_tokens=follow, params=params)).result(timeout=T)
    assert miss.stats.cached_tokens == 0
    assert hit.tokens == miss.tokens  # a cache hit never changes the output


def _run_py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=120)


def test_engine_and_storage_import_without_textual():
    """In a fresh interpreter: every module of ``storage`` (each one, not just the lazy
    package) imports without mlx, and the engine's light modules without mlx, mlx-lm,
    transformers or Textual."""
    r = _run_py("import pkgutil, sys, mlxkv.storage as storage\n"
                "mods = [m.name for m in pkgutil.walk_packages(storage.__path__, 'mlxkv.storage.')]\n"
                "assert 'mlxkv.storage.store' in mods and 'mlxkv.storage._blocks' in mods, mods\n"
                "for name in mods:\n"
                "    __import__(name)\n"
                "heavy = lambda *tops: sorted(m for m in sys.modules if m.split('.')[0] in tops)\n"
                "bad = heavy('mlx', 'textual')\n"
                "assert not bad, bad\n"
                "import mlxkv.engine.engine, mlxkv.engine.requests, mlxkv.engine.generate, mlxkv.engine.models\n"
                "import mlxkv.engine.settings, mlxkv.engine.blas, mlxkv.engine.demo\n"
                "bad = heavy('textual', 'mlx', 'mlx_lm', 'transformers')\n"
                "assert not bad, bad\n"
                "print('ok', len(mods))")
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr


def test_openblas_really_bound():
    from mlxkv.engine.blas import blas_info, find_openblas

    if find_openblas() is None:
        pytest.skip("no system OpenBLAS on this machine")
    assert blas_info()["active"]
    code = ("import mlxkv.engine.blas as b; b.preload(); import mlx.core as mx; "
            "mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))")
    on = _run_py(code, LD_DEBUG="bindings")
    off = _run_py(code, LD_DEBUG="bindings", MLXKV_BLAS="off")
    bind = [ln for ln in on.stderr.splitlines() if "`cblas_sgemm'" in ln and "libmlx" in ln]
    assert bind and "openblas" in bind[0], on.stderr[-2000:]
    bind_off = [ln for ln in off.stderr.splitlines() if "`cblas_sgemm'" in ln and "libmlx" in ln]
    assert bind_off and "openblas" not in bind_off[0]
    info = _run_py("import mlxkv.engine.blas as b; b.preload(); print(b.blas_info()['name'])", MLXKV_BLAS="off")
    assert info.stdout.strip().startswith("reference")


def test_an_interactive_front_end_leaves_a_core_to_the_ui():
    """blas.leave_a_core() gives OpenBLAS one thread fewer than the machine's cores, unless
    the user chose OPENBLAS_NUM_THREADS; in a fresh process, with the real library."""
    from mlxkv.engine.blas import find_openblas

    if find_openblas() is None:
        pytest.skip("no system OpenBLAS on this machine")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    code = ("import os, mlxkv.engine.blas as b\n"
            "b.preload()\n"
            "assert b.leave_a_core()\n"
            "print(b.blas_info()['threads'], os.cpu_count())")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "MLXKV_BLAS": "auto"}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    threads, cores = map(int, r.stdout.split())
    assert threads == max(1, cores - 1)
    chosen = _run_py("import mlxkv.engine.blas as b; b.preload(); print(b.leave_a_core())", OPENBLAS_NUM_THREADS="2")
    assert chosen.returncode == 0 and chosen.stdout.strip() == "False", chosen.stderr[-2000:]


def test_openblas_kernels_follow_the_cpus_instruction_set():
    """OpenBLAS gives a CPU model it has no entry for (a virtual machine's generic Xeon) its
    slowest kernels; preload names the family the CPU's flags support instead, unless the
    user chose one; in a fresh process, with the real library."""
    from mlxkv.engine.blas import core_for_flags, find_openblas

    avx512 = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
    assert core_for_flags(avx512) == "SkylakeX"
    assert core_for_flags({"avx", "avx2", "fma"}) == "Haswell"
    assert core_for_flags({"sse2", "sse4_2"}) is None
    assert core_for_flags(avx512 - {"avx512dq"}) == "Haswell"
    if find_openblas() is None:
        pytest.skip("no system OpenBLAS on this machine")
    code = "import mlxkv.engine.blas as b; b.preload(); i = b.blas_info(); print(i['core'], '|', i['core_source'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    core, source = (s.strip() for s in r.stdout.split("|"))
    with open("/proc/cpuinfo") as fh:
        flags = next((set(ln.split(":")[1].split()) for ln in fh if ln.startswith("flags")), set())
    wanted = core_for_flags(flags)
    if wanted is not None:
        assert (core, source) == (wanted, "the CPU's flags")
    chosen = _run_py(code, OPENBLAS_CORETYPE="Haswell")
    assert chosen.stdout.split("|")[0].strip() == "Haswell" and "OPENBLAS_CORETYPE" in chosen.stdout
