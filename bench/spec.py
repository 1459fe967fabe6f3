"""Speculative decoding benchmark, side by side with plain decoding in one run (the same
engine, the same prompts, requests interleaved off/on; median of --repeats).

    python -m bench.spec [--tokens 48] [--copy-tokens 128] [--repeats 2] [--json]
                         [--no-real | --real-only] [--no-trace]

Models, all built offline here (random weights unless said):
- the copy model (``bench.models.copy_model_path()``): the bench model's shape, tokenizer
  and cost per token, with constructed weights that continue their input where it went
  before (previous-token heads and an induction head): a target that does input-grounded
  work, which a random-weight model never does;
- the bench model (``bench.models.bench_model_path()``), and its layer-skip draft: its
  first ``--draft-layers`` layers with the same embeddings, norm, head and tokenizer;
- the bench pair: a bench-shaped target whose layers from ``--draft-layers`` on write
  updates scaled by ``--upper-scale`` (o_proj and down_proj), with its own layer-skip
  draft. With random weights the upper layers of the plain bench model decide most
  tokens, so its truncation rarely agrees with it; the pair agrees most of the time, as a
  trained model and a good draft do, at the bench model's size and cost;
- the demo model and demo draft model (trained, ``engine/demo``).

Figures (speed-ups = decode throughput with speculation / without):
- ``ngram_*``: prompt lookup (``--spec ngram``) on the copy model, ``--copy-tokens`` per
  request, two tasks: ``ngram_file_edit_*`` repeats a 600-token source file with a small
  edit (the prompt holds the file, the request, and the answer so far up to and including
  the edit: the model writes the rest, prompt lookup re-synchronises after the edit);
  ``ngram_quote_*`` answers a question with a quote from a document in the system prompt
  (the answer so far opens the quote with its first words). ``ngram_speedup`` and the
  other ``ngram_*`` figures are those of the slower task; ``ngram_auto_*``: ``--spec auto``
  on the same tasks (it now picks the suffix source and adapts; the keys keep their names).
  ``ngram_random_target_*``: the file edit on the random bench model, which never copies
  (what prompt lookup cannot do);
  ``demo_quote_ngram_*``: the demo model answering with quotes from a document in its
  system prompt (input-grounded on a trained model);
- ``draft_*``: the demo pair (trained), the demo model answering each of its first three
  questions (``3 * --repeats`` interleaved runs each, at least 6: a reply decodes in
  ~0.2 s, so one run is noisy); the geometric mean of the three speed-ups, acceptance
  pooled (``draft_speedup_by_question`` beside it);
  ``bench_pair_draft_*``: the bench pair, greedy free-form; ``draft_layer_skip_*``: the
  bench model with its own truncation;
- ``constraint_speedup``: ``guided_choice`` with long choices on the bench model (plain
  decoding is masked the same way, one token per forward);
- ``auto_freeform_ratio``: ``--spec auto`` against ``off`` on sampled free-form text
  (temperature 1, no seed: drafts are rarely accepted), the suffix source under auto;
- ``restored_acceptance_ratio``: a two-turn conversation on the bench pair with its draft;
  turn 2 runs in a new process from the SSD tier, then in the first process; the ratio
  of their acceptance position for position (the restored run's acceptance over the
  uninterrupted run's at the positions the restored run drafted: the new process's
  policy has no memory of earlier requests and picks other lengths, and acceptance falls
  along the window; the plain ratio is ``restored_acceptance_plain_ratio``), and
  ``restored_same_as_cold`` that both equal a cold run.

Then the real model (SmolLM2-135M-Instruct, ``support.real_model``), its GGUF file loaded
as a user loads it (only mlxkv runs here: speculation against plain decoding), greedy
unless said, ``--real-tokens`` (>= 128) decoded per request:
- ``ngram_file_edit_real_*`` and ``suffix_edit_*``: prompt lookup and the suffix source
  against ``off``, the instruct model asked through its chat template to repeat ~60 lines
  of ``engine/cache/prefix_cache.py`` (from ``PrefixCache.lookup``, whole methods) with the
  method renamed ``find``, its answer so far the fence and ``def find(`` (as the copy
  model's task: the edit written, the model copies the rest); with acceptance and tokens
  per forward. 60 lines, not more: asked to repeat ~150, the 135M model loses the code
  within a few lines (greedy, it wrote a comment line of ``1.1.1...``; with the answer
  started, a short function of its own), which measures repetition, not an edit. Every
  finished request teaches the suffix source's global index, so before each of its runs
  here that index is emptied: ``suffix_edit_*`` is a first edit of the file (the request's
  own text only). ``suffix_edit_learned_*``: the same edit again with its earlier replies
  learned (an agent rewriting what it wrote);
- ``suffix_tree_vs_path``: whether verifying a tree of candidates would pay
  (``bench/suffix_tree.py``): the real model's forward cost by width
  (``forward_cost_vs_step_real``) and the suffix source's rounds over two real greedy
  replies, the edit's (the best path is nearly always right) and a story's (it often is
  not), the best path against the best path plus runner-ups, each at its best length; the
  better of the two replies' tree/path ratios (``_edit`` and ``_story`` beside it;
  ``suffix_path_speedup_model`` / ``suffix_tree_speedup_model``: the edit's modelled tokens
  per second of forward cost over plain decoding's);
- ``suffix_agent_trace_*``: an agent's editing session (``bench/agent_trace.py``) replayed
  through ``mlxkv serve`` over loopback, a plain and a suffix server answering each turn
  interleaved, the history resent every turn with the model's own replies in it; the
  decode time of the plain server over the suffix server's on turns 3 and later of both
  episodes, with acceptance and tokens per forward. ``suffix_restart_ratio``: episode 2
  answered by a new suffix server process started on a copy of the first one's cache
  folder (taken after episode 1, so both know the same) against a new plain server process
  (as cold as it), its speed-up over the live pair's on episode 2
  (``suffix_restart_speedup`` / ``suffix_restart_live_speedup``).
  ``--no-trace`` skips it;
- ``auto_freeform_ratio_real``: ``auto`` against ``off`` on sampled free-form text
  (temperature 1, no prefix cache);
- ``constraint_speedup_real``: ``guided_choice`` with the long choices, ``auto`` against
  ``off``;
- ``lossless_real``: greedy outputs equal across the modes of every greedy task (the
  agent trace's replies included: ``lossless_agent_trace``).
``real_model`` names the file; ``--no-real`` skips the pass.

The last line of ``--json`` is one JSON object with every figure.
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
import time
from pathlib import Path
from typing import Any

# isort: off
from bench.models import add_real_flag, real_model_file
from mlxkv.engine.blas import preload

preload()  # the system OpenBLAS before mlx.core
# isort: on

ROOT = Path(__file__).resolve().parent.parent
# The text of the file-edit tasks: a frozen copy of an earlier engine/cache/prefix_cache.py,
# not the live file, so that the figures stay comparable while the code changes.
SOURCE_FILE = Path(__file__).resolve().parent / "file_edit_source.txt"
DEMO_QUESTIONS = 3  # the demo pair answers the first three demo questions
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


def build_bench_pair(target: Path, draft_layers: int, upper_scale: float) -> tuple[Path, Path]:
    """A bench-shaped target whose decoder layers from ``draft_layers`` on write updates
    scaled by ``upper_scale`` (their o_proj and down_proj), and its first ``draft_layers``
    layers as the draft: a pair that agrees most of the time, as a trained model and its
    layer-skip draft do, at the bench model's size and cost."""
    out = target.with_name(f"{target.name}-pair{draft_layers}-s{upper_scale:g}")
    if not ((out / "config.json").is_file() and list(out.glob("*.safetensors"))):
        import mlx.core as mx

        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(target, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
        weights: dict[str, Any] = {}
        for f in sorted(target.glob("*.safetensors")):
            for k, v in mx.load(str(f)).items():
                if k.startswith("model.layers.") and int(k.split(".")[2]) >= draft_layers and (
                        k.endswith("o_proj.weight") or k.endswith("down_proj.weight")):
                    v = v * upper_scale
                weights[k] = v
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        if out.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, out)
    return out, build_layer_draft(out, draft_layers)


def _settings(model: Path, cache_dir: Path, **values: Any) -> Any:
    from mlxkv.engine.settings import Settings

    base = {"model": str(model), "cache_dir": str(cache_dir), "block_tokens": 64, "ram_cache_bytes": 4 << 30}
    return Settings.load({**base, **values}, env={})


def _run(eng: Any, request: Any) -> Any:
    return eng.submit(request).result(timeout=3600)


def _side_by_side(eng: Any, make: Any, repeats: int, modes: tuple[str, ...], check_same: bool,
                  before: Any = None) -> dict:
    """Interleaved runs of ``make(mode)`` in every mode: median decode throughput of each,
    the ratio of the second mode's to the first's (and, with more modes, of each), and the
    speculation figures of the second mode's last run (of each mode's, under ``by_mode``).
    ``before(mode)``, when given, runs before every request."""
    tps: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list] = {}
    specs: dict[str, Any] = {}
    for mode in modes:  # warm-up (prefill into the prefix cache, kernels, the draft's KV)
        if before is not None:
            before(mode)
        _run(eng, make(mode))
    for rep in range(repeats):
        # the order alternates (ABBA...): a drift of the machine's speed over the run falls
        # on both modes alike
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            if before is not None:
                before(mode)
            c0 = time.process_time()
            r = _run(eng, make(mode))
            cpu[mode].append(len(r.tokens) / max(time.process_time() - c0, 1e-9))
            tps[mode].append(r.stats.decode_tps)
            tokens.setdefault(mode, r.tokens)
            if r.stats.spec is not None:
                specs[mode] = r.stats.spec
    med = {m: statistics.median(tps[m]) for m in modes}
    cmed = {m: statistics.median(cpu[m]) for m in modes}
    base, fast = modes[0], modes[1]
    # Tokens per CPU-second of the whole process (prefill included): less sensitive to other
    # processes sharing the machine than wall-clock throughput.
    out = {"plain_tps": round(med[base], 3), "spec_tps": round(med[fast], 3),
           "speedup": round(med[fast] / med[base], 3) if med[base] else 0.0,
           "cpu_speedup": round(cmed[fast] / cmed[base], 3) if cmed[base] else 0.0,
           # the median of the ratios of runs side by side (each pair ran within seconds)
           "paired_speedup": round(statistics.median(f / b for f, b in zip(tps[fast], tps[base]) if b), 3),
           "spec": specs.get(fast)}
    if len(modes) > 2:
        out["by_mode"] = {m: {"tps": round(med[m], 3), "speedup": round(med[m] / med[base], 3) if med[base] else 0.0,
                              "cpu_speedup": round(cmed[m] / cmed[base], 3) if cmed[base] else 0.0,
                              "spec": specs.get(m)} for m in modes[1:]}
    if check_same:
        out["same_output"] = all(tokens[m] == tokens[base] for m in modes)
    return out


def _constraint_task(eng: Any, reps: int, **prompt: Any) -> dict:
    """guided_choice (long choices): auto (constraint drafts) against off."""
    from mlxkv.engine.engine import Request
    from mlxkv.engine.generate import SamplingParams

    params = SamplingParams(max_tokens=128)
    return _side_by_side(eng, lambda m: Request(**prompt, params=params, spec=m, guided_choice=CHOICES),
                         reps, ("off", "auto"), True)


def _freeform_task(eng: Any, story: list[dict], n: int, reps: int) -> dict:
    """auto against off on sampled free-form text (outputs differ: no lossless check).
    Where auto barely speculates the two modes run the same steps, and one run's speed swings
    by ~10% on a shared machine: at least 6 pairs, so the median is the modes' difference."""
    from mlxkv.engine.engine import Request
    from mlxkv.engine.generate import SamplingParams

    sampled = SamplingParams(max_tokens=n, temperature=1.0)
    return _side_by_side(eng, lambda m: Request(messages=story, params=sampled, spec=m), max(reps + 1, 6),
                         ("off", "auto"), False)


def _file_edit_prompt(tok: Any) -> list[int]:
    """A 600-token source file in a fence, the request to repeat it with one change, and the
    answer so far: the fence again and the file up to just past the change (the copy model
    copies, it cannot decide to edit; with the change and the word after it written, it
    finds its place again from the tokens around it, as prompt lookup does)."""
    text = tok.decode(tok.encode(SOURCE_FILE.read_text())[:600])
    at = text.index("lookup")
    after = text[at + len("lookup"):]
    return tok.encode("Here is a file:\n```python\n" + text + "\n```\nRepeat this file, with one change: "
                      "rename the lookup method to find.\n```python\n" + text[:at] + "find" + after[:7])


def _quote_prompt(tok: Any) -> list[int]:
    """A question about a document in the system prompt, and the answer so far: the opening
    words of the quote that answers it."""
    from support.demo.facts import FACTS

    doc = "\n".join(f["a"][0] for f in FACTS[:8])
    messages = [{"role": "system", "content": "Answer with quotes from this document:\n" + doc},
                {"role": "user", "content": FACTS[3]["q"][0]}]
    head = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    opening = " ".join(FACTS[3]["a"][0].split()[:3])
    return tok.encode(head + 'The document says: "' + opening)


def _real_file_edit_messages(lines: int = 60) -> list[dict]:
    """A chat asking to repeat about ``lines`` lines of the prefix cache's source (whole
    methods, from ``PrefixCache.lookup``) with the method renamed ``find``."""
    src = SOURCE_FILE.read_text().splitlines()
    start = next(i for i, line in enumerate(src) if line.startswith("    def lookup(") and "list | None" in line)
    ends = [i for i in range(start + 1, len(src)) if src[i].startswith(("    def ", "    @"))]
    end = max([e for e in ends if e - start <= lines] or [min(len(src), start + lines)])
    code = "\n".join(src[start:end]).rstrip()
    return [{"role": "user", "content": "Here is part of a Python class:\n```python\n" + code + "\n```\n"
             "Repeat this code exactly, with one change: rename the method `lookup` to `find`. "
             "Write only the code."}]


def _real_pass(args: argparse.Namespace, real: Path, work: Path) -> dict:
    """The speculation figures on the real model's GGUF file (see the docstring)."""
    from bench import agent_trace
    from bench.suffix_tree import forward_costs, tree_vs_path
    from mlxkv.engine.engine import Engine, Request
    from mlxkv.engine.generate import SamplingParams

    reps, n = args.repeats, max(args.real_tokens, 128)
    greedy = SamplingParams(max_tokens=n)
    story = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    detail: dict[str, Any] = {}
    with Engine.from_settings(_settings(real, work / "r0")).start(timeout=600) as eng:
        tok = eng.loaded.tokenizer
        edit = tok.encode(tok.apply_chat_template(_real_file_edit_messages(), add_generation_prompt=True,
                                                  tokenize=False) + "```python\n    def find(")
        suffix = eng.spec_providers["suffix"]

        def make(m: str) -> Any:
            return Request(prompt_tokens=edit, params=greedy, spec=m)

        def forget(mode: str) -> None:
            # a first edit of this file: the suffix source knows the request's own text only
            # (every request teaches its global index, the plain and prompt-lookup runs too)
            if mode == "suffix":
                eng.call(suffix.clear).result(timeout=60)

        detail["file_edit"] = _side_by_side(eng, make, reps, ("off", "ngram", "suffix"), True, before=forget)
        plain = _run(eng, make("off"))
        detail["file_edit"]["decoded_tokens"] = len(plain.tokens)
        detail["file_edit"]["reply_head"] = tok.decode(plain.tokens[:48])
        detail["file_edit"]["prompt_tokens"] = len(edit)
        # the same edit again, its earlier replies learned (an agent rewriting a file it wrote)
        detail["suffix_edit_learned"] = _side_by_side(eng, make, reps, ("off", "suffix"), True)
        costs = eng.call(forward_costs, eng.loaded.model, edit).result(timeout=3600)
        # where the best path is right nearly always (the edit) and where it often is not
        # (a story, greedy): a tree can only gain where the path fails
        story_tokens = tok.encode(tok.apply_chat_template(story, add_generation_prompt=True, tokenize=False))
        told = _run(eng, Request(prompt_tokens=story_tokens, params=greedy, spec="off"))
        detail["suffix_tree"] = {"edit": tree_vs_path(costs, edit, plain.tokens, []),
                                 "story": tree_vs_path(costs, story_tokens, told.tokens, [])}
        detail["constraint"] = _constraint_task(
            eng, reps, messages=[{"role": "user", "content": "Which sentence describes the prefix cache?"}])
    with Engine.from_settings(_settings(real, work / "r1", prefix_cache=False)).start(timeout=600) as eng:
        detail["auto_freeform"] = _freeform_task(eng, story, n, reps)
    trace = None
    if not args.no_trace:
        trace = agent_trace.measure(real, work / "trace", lambda msg: print(f"bench.spec: {msg}", file=sys.stderr,
                                                                            flush=True))
        detail["agent_trace"] = trace
    edit_run = detail["file_edit"]
    out: dict[str, Any] = {"real_model": str(real), "real_model_note": "mlxkv only, on the GGUF file",
                           "real_tokens": n}
    out.update(_figures("ngram_file_edit_real_", edit_run))
    out.update(_figures("suffix_edit_", edit_run["by_mode"]["suffix"]))
    out.update(_figures("suffix_edit_learned_", detail["suffix_edit_learned"]))
    out["file_edit_real_decoded_tokens"] = edit_run["decoded_tokens"]
    tree = detail["suffix_tree"]
    out.update({"suffix_tree_vs_path": max(t["tree_vs_path"] for t in tree.values()),
                "suffix_tree_vs_path_edit": tree["edit"]["tree_vs_path"],
                "suffix_tree_vs_path_story": tree["story"]["tree_vs_path"],
                "suffix_tree_speedup_model": tree["edit"]["tree_speedup"],
                "suffix_path_speedup_model": tree["edit"]["path_speedup"],
                "forward_cost_vs_step_real": tree["edit"]["forward_cost_vs_step"]})
    if trace is not None:
        out.update({"suffix_agent_trace_speedup": trace["speedup"],
                    "suffix_agent_trace_acceptance": trace["acceptance"],
                    "suffix_agent_trace_tokens_per_forward": trace["tokens_per_forward"],
                    "suffix_restart_ratio": trace["restart_ratio"],
                    "suffix_restart_speedup": trace["restart_speedup"],
                    "suffix_restart_live_speedup": trace["restart_live_speedup"],
                    "lossless_agent_trace": trace["lossless"]})
    out.update({
        "constraint_speedup_real": detail["constraint"]["speedup"],
        "constraint_cpu_speedup_real": detail["constraint"]["cpu_speedup"],
        "auto_freeform_ratio_real": detail["auto_freeform"]["speedup"],
        "auto_freeform_cpu_ratio_real": detail["auto_freeform"]["cpu_speedup"],
        "lossless_real": all(d.get("same_output", True) for d in detail.values()
                             if isinstance(d, dict)) and (trace is None or trace["lossless"]),
        "detail_real": detail})
    return out


def _restored_child(args: argparse.Namespace) -> int:
    """Turn 2 of the conversation in a fresh process (prefix cache from the SSD tier only)."""
    from mlxkv.engine.engine import Engine, Request
    from mlxkv.engine.generate import SamplingParams

    job = json.loads(args.restored_child)
    s = _settings(Path(job["model"]), Path(job["cache_dir"]), draft_model=job["draft"], spec="draft")
    with Engine.from_settings(s).start(timeout=600) as eng:
        r = _run(eng, Request(prompt_tokens=job["tokens"], params=SamplingParams(max_tokens=job["max_tokens"]),
                              session="bench-spec"))
    print(json.dumps({"tokens": r.tokens, "spec": r.stats.spec, "cached_tokens": r.stats.cached_tokens,
                      "cached_ssd_tokens": r.stats.cached_ssd_tokens}))
    return 0


def _demo_draft_figures(runs: list[dict]) -> dict:
    """``draft_*`` over the demo questions: the geometric mean of their speed-ups, acceptance
    and tokens per forward pooled over each question's last speculative run."""
    def gmean(xs: list[float]) -> float:
        return round(statistics.geometric_mean(xs), 3) if all(x > 0 for x in xs) else 0.0

    specs = [run.get("spec") or {} for run in runs]
    drafted, accepted = sum(s.get("drafted", 0) for s in specs), sum(s.get("accepted", 0) for s in specs)
    forwards = sum(s.get("target_forwards", 0) for s in specs)
    tokens = sum(s.get("tokens_per_forward", 0) * s.get("target_forwards", 0) for s in specs)
    return {"draft_speedup": gmean([run["speedup"] for run in runs]),
            "draft_cpu_speedup": gmean([run["cpu_speedup"] for run in runs]),
            "draft_acceptance": round(accepted / drafted, 4) if drafted else None,
            "draft_tokens_per_forward": round(tokens / forwards, 4) if forwards else None,
            "draft_speedup_by_question": [run["speedup"] for run in runs]}


def _matched_acceptance_ratio(restored: dict, uninterrupted: dict) -> float:
    """The restored run's acceptance over the acceptance the uninterrupted run shows at the
    same draft positions (each position weighted by how often the restored run drafted it).
    Acceptance falls with the position in the window, and the two runs' policies pick
    different lengths (the first process remembers earlier requests, the new one does not),
    so the plain ratio of acceptances measures their lengths as much as the draft state."""
    drafted = restored.get("drafted_by_position") or []
    mine, theirs = restored["acceptance_by_position"], uninterrupted["acceptance_by_position"]
    n = min(len(drafted), len(theirs))
    want = sum(drafted[i] * theirs[i] for i in range(n))
    got = sum(drafted[i] * mine[i] for i in range(n))
    return round(got / want, 4) if want else (1.0 if got == want else 0.0)


def _figures(prefix: str, run: dict) -> dict:
    spec = run.get("spec") or {}
    return {f"{prefix}speedup": run["speedup"], f"{prefix}cpu_speedup": run["cpu_speedup"],
            f"{prefix}acceptance": spec.get("acceptance"),
            f"{prefix}tokens_per_forward": spec.get("tokens_per_forward")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--copy-tokens", type=int, default=128,
                    help="tokens generated per request on the copy model (prompt lookup's tasks)")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--upper-scale", type=float, default=0.02,
                    help="the bench pair's target: scale of the updates its upper layers write")
    ap.add_argument("--real-tokens", type=int, default=128,
                    help="tokens generated per request on the real model (at least 128)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-trace", action="store_true",
                    help="skip the agent trace replayed through servers on the real model")
    ap.add_argument("--real-only", action="store_true", help="only the pass on the real model")
    ap.add_argument("--restored-child", help=argparse.SUPPRESS)
    add_real_flag(ap)
    args = ap.parse_args(argv)
    if args.restored_child:
        return _restored_child(args)
    real = None if args.no_real else real_model_file()  # fails before the synthetic pass
    if args.real_only:
        return _report(_only_real(args, real), args)

    from bench.models import bench_model_path, copy_model_path
    from mlxkv.engine.engine import Engine, Request
    from mlxkv.engine.generate import SamplingParams
    from mlxkv.engine.settings import DEMO_MODEL
    from support.demo.facts import FACTS

    bench = Path(bench_model_path())
    copier = Path(copy_model_path())
    skip_draft = build_layer_draft(bench, args.draft_layers)
    pair_target, pair_draft = build_bench_pair(bench, args.draft_layers, args.upper_scale)
    n, reps = args.tokens, args.repeats
    greedy = SamplingParams(max_tokens=n)
    story = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    results: dict[str, Any] = {"model": bench.name, "copy_model": copier.name, "tokens": n,
                               "copy_tokens": args.copy_tokens, "repeats": reps}
    detail: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="mlxkv-bench-spec-"))
    try:
        # 0. the copy model: prompt lookup on input-grounded work (off, ngram, auto)
        with Engine.from_settings(_settings(copier, work / "c0")).start(timeout=600) as eng:
            copy_params = SamplingParams(max_tokens=args.copy_tokens)
            for task, prompt in (("file_edit", _file_edit_prompt(eng.loaded.tokenizer)),
                                 ("quote", _quote_prompt(eng.loaded.tokenizer))):
                detail[f"ngram_{task}"] = _side_by_side(
                    eng, lambda m, p=prompt: Request(prompt_tokens=p, params=copy_params, spec=m),
                    reps, ("off", "ngram", "auto"), True)
        # 1. the bench model: prompt lookup on a code edit, its layer-skip draft, guided_choice
        with Engine.from_settings(_settings(bench, work / "c1", draft_model=str(skip_draft))).start(timeout=600) as eng:
            first = _file_edit_prompt(eng.loaded.tokenizer)
            detail["ngram_random_target"] = _side_by_side(
                eng, lambda m: Request(prompt_tokens=first, params=greedy, spec=m), reps, ("off", "ngram"), True)
            detail["draft_layer_skip"] = _side_by_side(eng, lambda m: Request(messages=story, params=greedy, spec=m),
                                                       reps, ("off", "draft"), True)
            detail["constraint"] = _constraint_task(eng, reps, prompt="Which sentence describes the prefix cache?\n")
        # 2. auto against off on sampled free-form text (the suffix source under auto, no cache)
        with Engine.from_settings(_settings(bench, work / "c2", prefix_cache=False)).start(timeout=600) as eng:
            detail["auto_freeform"] = _freeform_task(eng, story, n, reps)
        # 3. the bench pair: draft speed-up, then a conversation restored in a new process
        with Engine.from_settings(_settings(pair_target, work / "c3", draft_model=str(pair_draft))).start(
                timeout=600) as eng:
            detail["draft"] = _side_by_side(eng, lambda m: Request(messages=story, params=greedy, spec=m),
                                            reps, ("off", "draft"), True)
            tok = eng.loaded.tokenizer
            turn1 = tok.encode("The lighthouse keeper kept a log of every ship.\n" * 8)
            r1 = _run(eng, Request(prompt_tokens=turn1, params=greedy, spec="draft", session="bench-spec"))
            eng.cache_flush(timeout=600)
            turn2 = turn1 + r1.tokens + tok.encode("\nGo on, and tell me more about the storm.\n")
            job = {"model": str(pair_target), "cache_dir": str(work / "c3"), "draft": str(pair_draft),
                   "tokens": turn2, "max_tokens": n}
            child = subprocess.run([sys.executable, "-m", "bench.spec", "--restored-child", json.dumps(job)],
                                   cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if child.returncode != 0:
                raise RuntimeError(f"restored run failed: {child.stderr[-2000:]}")
            restored = json.loads(child.stdout.strip().splitlines()[-1])
            uninterrupted = _run(eng, Request(prompt_tokens=turn2, params=greedy, spec="draft", session="bench-spec"))
            cold = _run(eng, Request(prompt_tokens=turn2, params=greedy, spec="off"))
        # 4. the demo pair (trained): quoting a document with prompt lookup, and its draft model
        with Engine.from_settings(_settings(DEMO_MODEL, work / "c4")).start(timeout=600) as eng:
            doc = "\n".join(f["a"][0] for f in FACTS)
            quote = [{"role": "system", "content": "Answer with quotes from this document:\n" + doc},
                     {"role": "user", "content": FACTS[3]["q"][0]}]
            long = SamplingParams(max_tokens=96)
            detail["demo_quote_ngram"] = _side_by_side(eng, lambda m: Request(messages=quote, params=long, spec=m),
                                                       reps + 2, ("off", "ngram"), True)
            for q in range(DEMO_QUESTIONS):
                ask = [{"role": "user", "content": FACTS[q]["q"][0]}]
                detail[f"demo_draft_q{q}"] = _side_by_side(
                    eng, lambda m, a=ask: Request(messages=a, params=long, spec=m), max(6, 3 * reps),
                    ("off", "draft"), True)
        real_figures = _real_pass(args, real, work) if real is not None else {}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ua = uninterrupted.stats.spec["acceptance"]
    ra = restored["spec"]["acceptance"]
    copy_tasks = {task: detail[f"ngram_{task}"] for task in ("file_edit", "quote")}
    slower = min(copy_tasks, key=lambda t: copy_tasks[t]["speedup"])
    results.update(_figures("ngram_", copy_tasks[slower]))
    results["ngram_slower_task"] = slower
    for task, run in copy_tasks.items():
        results.update(_figures(f"ngram_{task}_", run))
        auto = run["by_mode"]["auto"]
        results[f"ngram_auto_{task}_speedup"] = auto["speedup"]
        results[f"ngram_auto_{task}_acceptance"] = (auto["spec"] or {}).get("acceptance")
    results["ngram_auto_speedup"] = min(run["by_mode"]["auto"]["speedup"] for run in copy_tasks.values())
    results.update(_figures("ngram_random_target_", detail["ngram_random_target"]))
    results.update(_demo_draft_figures([detail[f"demo_draft_q{q}"] for q in range(DEMO_QUESTIONS)]))
    results.update(_figures("bench_pair_draft_", detail["draft"]))
    results.update(_figures("draft_layer_skip_", detail["draft_layer_skip"]))
    results.update(_figures("demo_quote_ngram_", detail["demo_quote_ngram"]))
    results.update({
        "constraint_speedup": detail["constraint"]["speedup"],
        "constraint_cpu_speedup": detail["constraint"]["cpu_speedup"],
        "auto_freeform_ratio": detail["auto_freeform"]["speedup"],
        "auto_freeform_cpu_ratio": detail["auto_freeform"]["cpu_speedup"],
        "restored_acceptance_ratio": _matched_acceptance_ratio(restored["spec"], uninterrupted.stats.spec),
        "restored_acceptance_plain_ratio": round(ra / ua, 4) if ua else (1.0 if ra == ua else 0.0),
        "restored_acceptance": ra, "uninterrupted_acceptance": ua,
        "restored_acceptance_by_position": restored["spec"]["acceptance_by_position"],
        "uninterrupted_acceptance_by_position": uninterrupted.stats.spec["acceptance_by_position"],
        "restored_draft_tokens": restored["spec"].get("restored_draft_tokens"),
        "restored_cached_ssd_tokens": restored["cached_ssd_tokens"],
        "restored_same_as_cold": restored["tokens"] == cold.tokens == uninterrupted.tokens,
        "lossless": all(d.get("same_output", True) for d in detail.values()),
        "bench_pair": f"{pair_target.name} + {pair_draft.name}",
        "detail": detail,
    })
    results.update(real_figures)
    return _report(results, args)


def _only_real(args: argparse.Namespace, real: Path | None) -> dict:
    if real is None:
        raise SystemExit("--real-only needs the real model (drop --no-real)")
    work = Path(tempfile.mkdtemp(prefix="mlxkv-bench-spec-"))
    try:
        return {"tokens": args.tokens, "repeats": args.repeats, **_real_pass(args, real, work)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _report(results: dict, args: argparse.Namespace) -> int:
    from mlxkv.engine.blas import blas_info

    results["blas"] = blas_info()["name"]
    results["load"] = os.getloadavg()
    if not args.json:
        for key, value in results.items():
            if key not in ("detail", "detail_real"):
                print(f"{key:34s} {value}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
