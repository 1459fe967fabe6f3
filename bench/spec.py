"""Speculative decoding benchmark, side by side with plain decoding in one run (the same
engine, the same prompts, requests interleaved off/on; median of --repeats).

    python -m bench.spec [--tokens 48] [--repeats 2] [--json]

Model: the bench model (``bench.models.bench_model_path()``, random weights). Its draft is
built here from the bench model itself: its first ``--draft-layers`` decoder layers with
the same embeddings, final norm, LM head and tokenizer, saved as a second model folder
(a layer-skip draft; with small random weights most of each token's logits come from the
embeddings, so the truncated model agrees with the full one most of the time).

- ``ngram_speedup``: prompt lookup on input-grounded work. A random-weight model cannot
  be asked to quote, so the prompt is built to hold what it will write: a 600-token source
  file with a small edit, the model's own continuation of it, then the file again with
  another edit; the model continues with a passage that is in the prompt.
  ``ngram_speedup_code_edit`` is the plain case (the file with an edit, then the model's
  free continuation), where a random model quotes nothing.
- ``draft_speedup`` / ``draft_acceptance``: the layer-skip draft, greedy, free-form prompt.
- ``constraint_speedup``: ``guided_choice`` with long choices; plain decoding is masked
  the same way, one token per forward.
- ``auto_freeform_ratio``: ``--spec auto`` against ``off`` on sampled free-form text
  (temperature 1, no seed: drafts are rarely accepted), prompt lookup only.
- ``restored_acceptance_ratio``: a two-turn conversation with the draft; turn 2 runs in a
  new process from the SSD tier (``restored``) and, after it, in the first process
  (``uninterrupted``); the ratio of their acceptance, and both outputs equal a cold run.

Speed-ups are decode throughput with speculation / without. The last line of ``--json``
is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# isort: off
import engine  # noqa: F401  (loads OpenBLAS before mlx.core: keep it first)
# isort: on

ROOT = Path(__file__).resolve().parent.parent
SOURCE_FILE = ROOT / "engine" / "cache" / "prefix_cache.py"
CHOICES = (
    "The prefix cache keeps every conversation's KV state in RAM and on the SSD, keyed by "
    "hash-chained token blocks, so a shared prefix is stored once and checked on every read.",
    "Speculative decoding proposes several tokens at once and lets the model verify them in "
    "one forward pass, keeping exactly the tokens plain decoding would have produced.",
    "Continuous batching decodes several requests together, each row joining between steps "
    "after its own prefix-cache lookup, and leaving with its state stored for the next turn.",
)


def build_layer_draft(target: Path, layers: int) -> Path:
    """A draft model folder: the target's first ``layers`` decoder layers, its embeddings,
    final norm, LM head and tokenizer files (built once, next to the target)."""
    out = target.with_name(f"{target.name}-draft{layers}")
    if (out / "config.json").is_file() and list(out.glob("*.safetensors")):
        return out
    import mlx.core as mx

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in target.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy2(f, tmp / f.name)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    weights: dict[str, Any] = {}
    for f in sorted(target.glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            if k.startswith("model.layers."):
                if int(k.split(".")[2]) >= layers:
                    continue
            weights[k] = v
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    if out.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def _settings(model: Path, cache_dir: Path, **values: Any) -> Any:
    from engine.settings import Settings

    base = {"model": str(model), "cache_dir": str(cache_dir), "block_tokens": 64, "ram_cache_bytes": 4 << 30}
    return Settings.load({**base, **values}, env={})


def _run(eng: Any, request: Any) -> Any:
    return eng.submit(request).result(timeout=3600)


def _side_by_side(eng: Any, make: Any, repeats: int, modes: tuple[str, str], check_same: bool) -> dict:
    """Interleaved runs of ``make(mode)`` in both modes: median decode throughput of each,
    their ratio, and the speculation figures of the last speculative run."""
    tps: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list] = {}
    spec = None
    _run(eng, make(modes[0]))  # warm-up (prefill into the prefix cache, kernels)
    for _ in range(repeats):
        for mode in modes:
            r = _run(eng, make(mode))
            tps[mode].append(r.stats.decode_tps)
            tokens.setdefault(mode, r.tokens)
            if r.stats.spec is not None:
                spec = r.stats.spec
    base, fast = (statistics.median(tps[m]) for m in modes)
    out = {"plain_tps": round(base, 3), "spec_tps": round(fast, 3), "speedup": round(fast / base, 3) if base else 0.0,
           "spec": spec}
    if check_same:
        out["same_output"] = tokens[modes[0]] == tokens[modes[1]]
    return out


def _file_prompt(tok: Any) -> tuple[list[int], list[int]]:
    ids = tok.encode(SOURCE_FILE.read_text())[:600]
    text = tok.decode(ids)
    edited = text.replace("lookup", "find", 1)
    again = text.replace("store", "keep", 1)
    return tok.encode("Repeat this file, with one change:\n" + edited + "\n"), tok.encode(again + "\n")


def _restored_child(args: argparse.Namespace) -> int:
    """Turn 2 of the conversation in a fresh process (prefix cache from the SSD tier only)."""
    from engine.engine import Engine, Request
    from engine.generate import SamplingParams

    job = json.loads(args.restored_child)
    s = _settings(Path(job["model"]), Path(job["cache_dir"]), draft_model=job["draft"], spec="draft")
    with Engine.from_settings(s).start(timeout=600) as eng:
        r = _run(eng, Request(prompt_tokens=job["tokens"], params=SamplingParams(max_tokens=job["max_tokens"]),
                              session="bench-spec"))
    print(json.dumps({"tokens": r.tokens, "spec": r.stats.spec, "cached_tokens": r.stats.cached_tokens,
                      "cached_ssd_tokens": r.stats.cached_ssd_tokens}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--restored-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.restored_child:
        return _restored_child(args)

    from bench.models import bench_model_path
    from engine.engine import Engine, Request
    from engine.generate import SamplingParams

    target = Path(bench_model_path())
    draft = build_layer_draft(target, args.draft_layers)
    n = args.tokens
    greedy = SamplingParams(max_tokens=n)
    results: dict[str, Any] = {"model": target.name, "draft": draft.name, "tokens": n, "repeats": args.repeats}
    work = Path(tempfile.mkdtemp(prefix="mlxkv-bench-spec-"))
    try:
        s = _settings(target, work / "cache", draft_model=str(draft), spec="auto")
        with Engine.from_settings(s).start(timeout=600) as eng:
            tok = eng.loaded.tokenizer
            first, again = _file_prompt(tok)
            # prompt lookup: the code-edit prompt as is, then the quoting prompt
            code = _side_by_side(eng, lambda m: Request(prompt_tokens=first, params=greedy, spec=m), args.repeats,
                                 ("off", "ngram"), True)
            answer = _run(eng, Request(prompt_tokens=first, params=SamplingParams(max_tokens=2 * n), spec="off"))
            quoting = first + answer.tokens + again
            quote = _side_by_side(eng, lambda m: Request(prompt_tokens=quoting, params=greedy, spec=m), args.repeats,
                                  ("off", "ngram"), True)
            # draft model, greedy free-form
            story = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
            drafted = _side_by_side(eng, lambda m: Request(messages=story, params=greedy, spec=m), args.repeats,
                                    ("off", "draft"), True)
            # guided_choice, long choices
            guided = _side_by_side(
                eng, lambda m: Request(prompt="Which sentence describes the prefix cache?\n",
                                       params=SamplingParams(max_tokens=128), spec=m, guided_choice=CHOICES),
                args.repeats, ("off", "auto"), True)
            # restored conversation: turn 1 here, turn 2 in a new process, then here
            turn1 = eng.encode_chat(story)
            r1 = _run(eng, Request(prompt_tokens=turn1, params=greedy, spec="draft", session="bench-spec"))
            eng.cache_flush(timeout=600)
            turn2 = turn1 + r1.tokens + tok.encode("\nGo on, and tell me more about the storm.\n")
            job = {"model": str(target), "cache_dir": str(work / "cache"), "draft": str(draft), "tokens": turn2,
                   "max_tokens": n}
            child = subprocess.run([sys.executable, "-m", "bench.spec", "--restored-child", json.dumps(job)],
                                   cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if child.returncode != 0:
                raise RuntimeError(f"restored run failed: {child.stderr[-2000:]}")
            restored = json.loads(child.stdout.strip().splitlines()[-1])
            uninterrupted = _run(eng, Request(prompt_tokens=turn2, params=greedy, spec="draft", session="bench-spec"))
            cold = _run(eng, Request(prompt_tokens=turn2, params=greedy, spec="off"))
        # auto on sampled free-form text: an engine with prompt lookup only
        s2 = _settings(target, work / "cache2", spec="auto", prefix_cache=False)
        with Engine.from_settings(s2).start(timeout=600) as eng2:
            sampled = SamplingParams(max_tokens=n, temperature=1.0)
            free = _side_by_side(eng2, lambda m: Request(messages=story, params=sampled, spec=m), args.repeats + 1,
                                 ("off", "auto"), False)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ua = uninterrupted.stats.spec["acceptance"]
    ra = restored["spec"]["acceptance"]
    results.update({
        "ngram_speedup": quote["speedup"], "ngram_acceptance": (quote["spec"] or {}).get("acceptance"),
        "ngram_tokens_per_forward": (quote["spec"] or {}).get("tokens_per_forward"),
        "ngram_speedup_code_edit": code["speedup"],
        "ngram_acceptance_code_edit": (code["spec"] or {}).get("acceptance"),
        "draft_speedup": drafted["speedup"], "draft_acceptance": (drafted["spec"] or {}).get("acceptance"),
        "draft_tokens_per_forward": (drafted["spec"] or {}).get("tokens_per_forward"),
        "constraint_speedup": guided["speedup"],
        "auto_freeform_ratio": free["speedup"],
        "auto_freeform_acceptance": (free["spec"] or {}).get("acceptance"),
        "restored_acceptance_ratio": round(ra / ua, 4) if ua else (1.0 if ra == ua else 0.0),
        "restored_acceptance": ra, "uninterrupted_acceptance": ua,
        "restored_draft_tokens": restored["spec"].get("restored_draft_tokens"),
        "restored_cached_ssd_tokens": restored["cached_ssd_tokens"],
        "restored_same_as_cold": restored["tokens"] == cold.tokens == uninterrupted.tokens,
        "lossless": all(x["same_output"] for x in (code, quote, drafted, guided)),
        "detail": {"ngram": quote, "ngram_code_edit": code, "draft": drafted, "constraint": guided,
                   "auto_freeform": free},
    })
    if not args.json:
        for key, value in results.items():
            if key != "detail":
                print(f"{key:28s} {value}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
