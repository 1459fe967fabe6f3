"""Grammar engines for token-by-token enforcement, measured on the real model's tokenizer,
and what a grammar costs and wins in the engine, in one run.

    python -m bench.grammar [--json] [--reps 4] [--mask-repeats 5] [--decode-tokens 32]

The real model (SmolLM2-135M-Instruct, ``support.real_model``) is loaded by an mlxkv
``Engine``; its tokenizer (49,152 ids) is the one every grammar engine below is given.

1. Per engine (llguidance, xgrammar, outlines-core; one that is not installed is reported
   as missing), for three JSON schemas (a tool call's arguments: nested objects, an array
   of objects, enums, bounds, required, no extra properties; a string with a pattern;
   numbers with bounds): the tokenizer set-up once (``setup_ms``), the schema's compile
   time (``compile_ms``), the first mask (``first_mask_us``: llguidance builds its lexer
   lazily) and the mean and p95 cost of one token mask (``mask_mean_us``,
   ``mask_p95_us``) while a valid instance of the schema, encoded by the tokenizer, is
   consumed token by token with the mask computed before each (``--mask-repeats`` times).
   xgrammar 0.2.8 imports torch at module level for type names and tensor helpers only;
   its matcher fills a bitmask through DLPack, so where torch is absent the bench stands a
   module of placeholder names in for it during the import and hands it numpy arrays.
2. Coverage: per JSON Schema keyword, a small schema using it, a valid and an invalid
   instance: ``enforced`` (compiles, the valid instance passes, the invalid one is
   refused), ``ignored`` (compiles, the invalid one passes too), ``refused: <message>``
   (the schema does not compile) or ``wrong`` (the valid one is refused).
3. In the engine (llguidance, ``engine.speculation.grammar``): the mask the engine applies
   (bitmask filled, turned into an additive row, evaluated: ``grammar_mask_mean_us``),
   the real model's plain decode step (``decode_step_ms``: the engine's greedy decode of
   ``--decode-tokens`` tokens after a ~256-token prompt, spec off, median of ``--reps``),
   and ``grammar_mask_cost_vs_step`` (mask / step; goal <= 0.05).
4. ``constrained_json_speedup``: a tool call decoded greedily under its schema's grammar,
   spec off against spec on (the grammar's forced tokens drafted through the constraint
   source), ``--reps`` interleaved pairs, the median of the paired decode-time ratios;
   goal >= 1.5. ``constrained_json_lossless``: every pair gave the same tokens. The
   schema's ``x-guidance`` fixes the whitespace (``", "`` and ``": "``, as ``json.dumps``
   writes JSON), so what is not the model's choice is forced.

The last line of ``--json`` is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from typing import Any

# isort: off
from bench.models import real_model_file
from mlxkv.engine.blas import blas_info, describe, preload

preload()  # the system OpenBLAS before mlx.core
# isort: on

CHOSEN = "llguidance"

TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "search_flights"},
        "arguments": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "enum": ["SFO", "JFK", "LHR", "CDG", "NRT"]},
                "destination": {"type": "string", "enum": ["SFO", "JFK", "LHR", "CDG", "NRT"]},
                "passengers": {
                    "type": "array", "minItems": 1, "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                       "seat": {"enum": ["window", "aisle", "middle"]}},
                        "required": ["name", "age", "seat"], "additionalProperties": False}},
                "cabin": {"enum": ["economy", "premium_economy", "business", "first"]},
                "nonstop": {"type": "boolean"}},
            "required": ["origin", "destination", "passengers", "cabin", "nonstop"],
            "additionalProperties": False}},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, tuple[dict, Any]] = {
    "tool_call": (TOOL_CALL, {"name": "search_flights", "arguments": {
        "origin": "SFO", "destination": "JFK",
        "passengers": [{"name": "Ada Lovelace", "age": 36, "seat": "window"},
                       {"name": "Charles Babbage", "age": 41, "seat": "aisle"}],
        "cabin": "business", "nonstop": True}}),
    "pattern": ({"type": "object", "properties": {
        "email": {"type": "string", "pattern": "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$"},
        "order": {"type": "string", "pattern": "^ORD-[0-9]{6}-[A-Z]{2}$"}},
        "required": ["email", "order"], "additionalProperties": False},
        {"email": "ada.lovelace@example.org", "order": "ORD-004217-GB"}),
    "bounded_numbers": ({"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        "required": ["lat", "lon", "count", "ratio"], "additionalProperties": False},
        {"lat": 48.8566, "lon": 2.3522, "count": 12, "ratio": 0.25}),
}
_OBJ_A = {"type": "object", "properties": {"a": {"type": "integer"}}}
# keyword -> (schema, a valid instance, an invalid one)
COVERAGE: dict[str, tuple[dict, Any, Any]] = {
    "type": ({"type": "integer"}, 5, "a"),
    "properties": (_OBJ_A, {"a": 1}, {"a": "x"}),
    "required": ({**_OBJ_A, "required": ["a"]}, {"a": 1}, {}),
    "additionalProperties false": ({**_OBJ_A, "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    "enum": ({"enum": ["red", "green"]}, "red", "blue"),
    "const": ({"const": "yes"}, "yes", "no"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, 5, True),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "s"),
    "allOf": ({"allOf": [{**_OBJ_A, "required": ["a"]},
                         {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
              {"a": 1, "b": "x"}, {"a": 1}),
    "$ref/$defs": ({"$defs": {"p": {"type": "integer"}}, "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"]}, {"a": 1}, {"a": "x"}),
    "items": ({"type": "array", "items": {"type": "integer"}}, [1, 2], ["a"]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
                    [1, "a"], ["a", 1]),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
                          [1], [1, 2, 3]),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "ab", "abcd"),
    "pattern": ({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, "ab-12", "ab-1x"),
    "format": ({"type": "string", "format": "date"}, "2024-05-01", "yesterday"),
    "minimum/maximum": ({"type": "integer", "minimum": 1, "maximum": 7}, 3, 9),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, -1),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, 7),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "not": ({"not": {"type": "string"}}, 5, "a"),
    "if/then/else": ({**_OBJ_A, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
                     {"a": 2}, {"a": 1}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x-": {"type": "integer"}},
                           "additionalProperties": False}, {"x-a": 1}, {"y": 1}),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
}
CONTEXT = (
    "The prefix cache keeps every conversation's KV state in blocks of tokens, chained by "
    "hash, so that a prompt which shares its beginning with an earlier one is served from "
    "memory instead of being computed again. Blocks live in RAM first and move to the SSD "
    "tier when RAM is full; every block is verified when it is read back. ")
TOOL_MESSAGES = [
    {"role": "system", "content": "You call tools. Answer with one JSON object: the tool's name and its arguments."},
    {"role": "user", "content": "Find nonstop business-class flights from SFO to JFK for Ada Lovelace (36, "
                                "window seat) and Charles Babbage (41, aisle seat)."}]
WHITESPACE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _bit(words: Any, token: int) -> bool:
    return bool((int(words[token // 32]) >> (token % 32)) & 1)


# ------------------------------------------------------------------------- engines
class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lln

        self.version = llguidance.__version__
        self._llg, self._lln = llguidance, lln
        self.tok = llguidance.hf.from_tokenizer(tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids))
        self.vocab = self.tok.vocab_size

    def compile(self, schema: dict) -> Any:
        g = self._llg.LLMatcher.grammar_from_json_schema(schema)
        m = self._llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m: Any, words: Any) -> None:
        self._lln.fill_next_token_bitmask(m, words, 0)

    def consume(self, m: Any, token: int) -> None:
        if not m.consume_token(token):
            raise ValueError(m.get_error())


def _import_xgrammar() -> Any:
    """xgrammar, with a stand-in for torch's names during its import where torch is absent."""
    try:
        import xgrammar

        return xgrammar
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
    import transformers  # noqa: F401  (both look for torch when first imported: before the stand-in)
    import tvm_ffi  # noqa: F401

    class Placeholder:
        pass

    stand_in = types.ModuleType("torch")
    stand_in.__getattr__ = lambda name: Placeholder  # type: ignore[method-assign]
    stand_in.nn = types.SimpleNamespace(functional=None)
    stand_in.tensor = stand_in.full = lambda *a, **k: None
    for name in [n for n in sys.modules if n == "xgrammar" or n.startswith("xgrammar.")]:
        del sys.modules[name]
    sys.modules["torch"] = stand_in
    try:
        import xgrammar
    finally:
        del sys.modules["torch"]
    return xgrammar


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any):
        from importlib.metadata import version

        xgr = _import_xgrammar()
        self.version = version("xgrammar")
        hf = tokenizer._tokenizer
        self.vocab = len(hf)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab,
                                                  stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._xgr = xgr

    def compile(self, schema: dict) -> Any:
        return self._xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def fill(self, m: Any, words: Any) -> None:
        m.fill_next_token_bitmask(words, 0)

    def consume(self, m: Any, token: int) -> None:
        if not m.accept_token(token):
            raise ValueError("token refused")


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer: Any):
        from importlib.metadata import version

        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.version = version("outlines-core")
        self._oc, self._regex = outlines_core, build_regex_from_schema
        hf = tokenizer._tokenizer
        self.vocab = len(hf)
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}  # byte-level BPE alphabet
        special = set(hf.all_special_ids)
        table: dict[bytes, list[int]] = {}
        for i, t in enumerate(hf.convert_ids_to_tokens(list(range(self.vocab)))):
            if i not in special:
                table.setdefault(bytes(byte_of[c] for c in t), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(min(tokenizer.eos_token_ids), table)

    def compile(self, schema: dict) -> Any:
        return self._oc.Guide(self._oc.Index(self._regex(json.dumps(schema)), self.vocabulary))

    def fill(self, m: Any, words: Any) -> None:
        row = words[0]
        m.write_mask_into(row.ctypes.data, row.size, 4)

    def consume(self, m: Any, token: int) -> None:
        m.advance(token, return_tokens=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE token spelling)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


ENGINES = (Llguidance, Xgrammar, OutlinesCore)


# ------------------------------------------------------------------------- measuring
def _encode(tokenizer: Any, value: Any) -> list[int]:
    return list(tokenizer.encode(json.dumps(value), add_special_tokens=False))


def walk(engine: Any, m: Any, tokens: list[int], eos: int, timings: list[float] | None = None) -> bool:
    """Consume ``tokens`` with the mask computed before each (and once more for EOS); False
    when the mask refuses a token or EOS at the end."""
    import numpy as np

    words = np.zeros((1, (engine.vocab + 31) // 32), dtype=np.int32)
    for t in [*tokens, eos]:
        t0 = time.perf_counter()
        engine.fill(m, words)
        if timings is not None:
            timings.append(time.perf_counter() - t0)
        if not _bit(words[0], t):
            return False
        if t != eos:
            engine.consume(m, t)
    return True


def p95(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def measure_engine(cls: type, tokenizer: Any, repeats: int) -> dict:
    t0 = time.perf_counter()
    try:
        engine = cls(tokenizer)
    except ImportError as e:
        return {"missing": f"{type(e).__name__}: {e}"}
    out: dict[str, Any] = {"version": engine.version, "setup_ms": round(1e3 * (time.perf_counter() - t0), 1)}
    eos = min(tokenizer.eos_token_ids)
    for name, (schema, instance) in SCHEMAS.items():
        tokens = _encode(tokenizer, instance)
        compile_s, first, masks, ok = [], [], [], True
        for _ in range(repeats):
            t0 = time.perf_counter()
            try:
                m = engine.compile(schema)
            except Exception as e:
                out[name] = {"refused": str(e).splitlines()[0][:160]}
                break
            compile_s.append(time.perf_counter() - t0)
            timings: list[float] = []
            ok = walk(engine, m, tokens, eos, timings) and ok
            first.append(timings[0])
            masks.extend(timings[1:])
        else:
            out[name] = {"compile_ms": round(1e3 * statistics.median(compile_s), 3),
                         "first_mask_us": round(1e6 * statistics.median(first), 1),
                         "mask_mean_us": round(1e6 * statistics.fmean(masks), 1),
                         "mask_p95_us": round(1e6 * p95(masks), 1),
                         "tokens": len(tokens), "instance_accepted": ok}
    out["coverage"] = coverage(engine, tokenizer)
    return out


def coverage(engine: Any, tokenizer: Any) -> dict[str, str]:
    eos = min(tokenizer.eos_token_ids)
    out = {}
    for keyword, (schema, good, bad) in COVERAGE.items():
        try:
            m = engine.compile(schema)
        except Exception as e:
            out[keyword] = "refused: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            continue
        try:
            passes = walk(engine, m, _encode(tokenizer, good), eos)
            refused = not walk(engine, engine.compile(schema), _encode(tokenizer, bad), eos)
        except Exception:  # a matcher that raises on a token it had allowed
            passes, refused = False, True
        out[keyword] = "wrong" if not passes else "enforced" if refused else "ignored"
    return out


def engine_mask_cost(tokenizer: Any, vocab: int, repeats: int) -> dict:
    """The mask the engine applies (``GrammarConstraint.mask``, evaluated) along each
    schema's instance."""
    import mlx.core as mx

    from mlxkv.engine.speculation.grammar import GrammarConstraint, json_grammar

    timings = []
    for schema, instance in SCHEMAS.values():
        tokens = _encode(tokenizer, instance)
        for _ in range(repeats):
            c = GrammarConstraint(tokenizer, json_grammar(schema), vocab)
            for n in range(len(tokens) + 1):
                t0 = time.perf_counter()
                mx.eval(c.mask(tokens[:n], vocab))
                timings.append(time.perf_counter() - t0)
    return {"grammar_mask_mean_us": round(1e6 * statistics.fmean(timings), 1),
            "grammar_mask_p95_us": round(1e6 * p95(timings), 1)}


# ------------------------------------------------------------------------- the engine
def _decode_s(result: Any) -> float:
    s = result.stats
    return (s.generated_tokens - 1) / s.decode_tps if s.decode_tps else 0.0


def decode_step(eng: Any, tokenizer: Any, n: int, reps: int) -> float:
    """The engine's plain greedy decode step after a ~256-token prompt (seconds, median)."""
    from mlxkv.engine.engine import Request
    from mlxkv.engine.generate import SamplingParams

    prompt = (tokenizer.encode(CONTEXT * 6, add_special_tokens=False))[:256]
    steps = []
    for _ in range(reps + 1):  # the first warms the compiled step
        r = eng.submit(Request(prompt_tokens=prompt, spec="off", params=SamplingParams(
            max_tokens=n, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0))).result(timeout=600)
        steps.append(_decode_s(r) / max(r.stats.generated_tokens - 1, 1))
    return statistics.median(steps[1:])


def constrained_speedup(eng: Any, reps: int) -> dict:
    from mlxkv.engine.engine import Request
    from mlxkv.engine.generate import SamplingParams
    from mlxkv.engine.speculation.grammar import json_grammar

    grammar = json_grammar({**TOOL_CALL, "x-guidance": WHITESPACE})
    params = SamplingParams(max_tokens=160, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)

    def run(spec: str | None) -> Any:
        return eng.submit(Request(messages=TOOL_MESSAGES, params=params, grammar=grammar,
                                  spec=spec)).result(timeout=600)

    run("off"), run(None)  # warm both paths
    off, on, ratios, same, spec = [], [], [], True, []
    for i in range(reps):
        pair = {}
        for mode in (("off", None) if i % 2 == 0 else (None, "off")):
            pair[mode] = run(mode)
        a, b = pair["off"], pair[None]
        same = same and a.tokens == b.tokens
        off.append(_decode_s(a))
        on.append(_decode_s(b))
        ratios.append(off[-1] / on[-1])
        spec.append(b.stats.spec)
    last = pair[None]
    drafted = sum(s["drafted"] for s in spec)
    accepted = sum(s["accepted"] for s in spec)
    return {"constrained_json_speedup": round(statistics.median(ratios), 3),
            "constrained_json_lossless": same,
            "constrained_json_tokens": len(last.tokens),
            "constrained_json_text": last.text,
            "constrained_json_valid": _valid(last.text),
            "constrained_json_off_decode_ms": round(1e3 * statistics.median(off), 1),
            "constrained_json_on_decode_ms": round(1e3 * statistics.median(on), 1),
            "constrained_json_acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "constrained_json_tokens_per_forward": round(
                statistics.fmean(s["tokens_per_forward"] for s in spec), 3),
            "constrained_json_ratios": [round(r, 3) for r in ratios]}


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(value, dict) and set(value) == {"name", "arguments"}
    try:
        jsonschema.validate(value, TOOL_CALL)
    except jsonschema.ValidationError:
        return False
    return True


# ------------------------------------------------------------------------- report
def _table(engines: dict) -> None:
    names = [n for n in engines if "missing" not in engines[n]]
    for n, e in engines.items():
        if "missing" in e:
            print(f"{n}: not installed ({e['missing']})")
    print(f"\n{'schema':16s} {'engine':14s} {'compile ms':>10s} {'1st mask us':>11s} {'mask us':>8s} "
          f"{'p95 us':>8s} {'tokens':>6s}")
    for schema in SCHEMAS:
        for n in names:
            row = engines[n].get(schema, {})
            if "refused" in row:
                print(f"{schema:16s} {n:14s} refused: {row['refused']}")
                continue
            print(f"{schema:16s} {n:14s} {row['compile_ms']:10.3f} {row['first_mask_us']:11.1f} "
                  f"{row['mask_mean_us']:8.1f} {row['mask_p95_us']:8.1f} {row['tokens']:6d}"
                  + ("" if row["instance_accepted"] else "  (instance refused)"))
    print(f"\n{'keyword':28s} " + " ".join(f"{n:14s}" for n in names))
    for keyword in COVERAGE:
        cells = [engines[n]["coverage"][keyword] for n in names]
        print(f"{keyword:28s} " + " ".join(f"{c.split(':')[0]:14s}" for c in cells))
    for n in names:
        for keyword, c in engines[n]["coverage"].items():
            if c.startswith("refused"):
                print(f"  {n} / {keyword}: {c[len('refused: '):]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--reps", type=int, default=4, help="interleaved off/on pairs and decode-step runs")
    ap.add_argument("--mask-repeats", type=int, default=5, help="walks of each schema's instance per engine")
    ap.add_argument("--decode-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    real = real_model_file()
    print(f"BLAS: {describe()}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}; "
          f"cores: {os.cpu_count()}; load average: {os.getloadavg()[0]:.1f}", flush=True)
    from mlxkv.engine.engine import Engine
    from mlxkv.engine.settings import Settings

    result: dict[str, Any] = {"blas": blas_info()["name"], "real_model": str(real),
                              "load_average_start": os.getloadavg()[0]}
    settings = Settings.load({"model": str(real), "prefix_cache": False}, env={})
    with Engine.from_settings(settings).start(timeout=600) as eng:
        tokenizer = eng.call(lambda: eng.loaded.tokenizer).result(60)
        from mlxkv.engine.speculation.grammar import logits_width

        vocab = eng.call(lambda: logits_width(eng.loaded.model)).result(60) or len(tokenizer._tokenizer)
        engines = {cls.name: measure_engine(cls, tokenizer, args.mask_repeats) for cls in ENGINES}
        result["grammar_engines"] = engines
        result["grammar_chosen"] = CHOSEN
        _table(engines)
        result.update(engine_mask_cost(tokenizer, vocab, args.mask_repeats))
        step = decode_step(eng, tokenizer, args.decode_tokens, args.reps)
        result["decode_step_ms"] = round(1e3 * step, 2)
        result["grammar_mask_cost_vs_step"] = round(result["grammar_mask_mean_us"] * 1e-6 / step, 5)
        print(f"\nengine mask ({CHOSEN}, bitmask -> additive row, evaluated): "
              f"{result['grammar_mask_mean_us']} us mean, {result['grammar_mask_p95_us']} us p95; "
              f"plain decode step {result['decode_step_ms']} ms; "
              f"grammar_mask_cost_vs_step {result['grammar_mask_cost_vs_step']} (goal <= 0.05)", flush=True)
        result.update(constrained_speedup(eng, args.reps))
    print(f"constrained_json_speedup {result['constrained_json_speedup']} (goal >= 1.5; pairs "
          f"{result['constrained_json_ratios']}), lossless {result['constrained_json_lossless']}, "
          f"valid {result['constrained_json_valid']}, {result['constrained_json_tokens']} tokens, "
          f"acceptance {result['constrained_json_acceptance']}, tokens/forward "
          f"{result['constrained_json_tokens_per_forward']}; decode off "
          f"{result['constrained_json_off_decode_ms']} ms, on {result['constrained_json_on_decode_ms']} ms")
    print(f"reply: {result['constrained_json_text']}")
    result["load_average_end"] = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    print(f"load average at the end: {result['load_average_end']:.1f} ({cores} cores: above "
          f"~{cores} the machine was shared and the ratios are noisy)")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
