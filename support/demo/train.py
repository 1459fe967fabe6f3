"""Train the embedded demo model and its draft model with MLX, offline and deterministically.

    python -m support.demo.train [--quick] [--out DIR]

Builds a byte-level BPE tokenizer on the generated corpus (``support.demo.corpus``), a
qwen3-architecture model from mlx-lm's own classes (``support.modelgen``), trains it with
AdamW on the chat dialogues (loss on the assistant's tokens) and the plain texts (loss on
every token), then trains a much smaller draft model with the same tokenizer. Both are
saved as float16 model folders that load with plain ``mlx_lm.load``:
``DIR/model`` and ``DIR/draft`` (default ``engine/demo``).

Compute runs in float32 (on Linux with the system OpenBLAS preloaded, see engine/blas.py).
On a busy machine ``OPENBLAS_NUM_THREADS=1`` keeps BLAS threads from spinning; results are
the same. Seeds are fixed: a rerun gives the same corpus, tokenizer and loss curve (bit
equality of weights across machines is not promised: BLAS summation order differs).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

from mlxkv.engine.demo import DEMO_DIR

SEED = 1234
TOKENIZER_VOCAB = 3072

# Main demo model: qwen3 architecture, 3.0M parameters (2.4M besides the tied embedding).
# 600 steps of 3 rows of 640 tokens (1.15M tokens, most of one pass over the corpus): the
# whole run took 37 minutes on two CPU cores shared with other work (load average 3 to 6).
# 500 main and 160 draft steps took 31 but missed a trained paraphrase and drafted worse.
MAIN = {
    "config": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   max_position_embeddings=4096),
    "steps": 600, "lr": 3e-3, "rows": 3, "warmup": 30,
}
# Draft model for speculative decoding: same tokenizer and corpus, 0.7M parameters.
DRAFT = {
    "config": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=384,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   max_position_embeddings=4096),
    "steps": 200, "lr": 4e-3, "rows": 4, "warmup": 20,
}
QUICK_STEPS = {"main": 30, "draft": 20}
ROW_LEN = 640  # tokens per training row (examples are packed into rows): 7 turns fit
MAX_LEN = 640  # longer dialogues and plain texts are cut at this many tokens
PLAIN_WEIGHT = 0.5  # plain text counts less than the dialogues the model must answer
OPENING_TOKENS, OPENING_WEIGHT = 5, 8.0  # the first tokens of every answer weigh more


def _preload_blas() -> str:
    """Load the system OpenBLAS before mlx.core (float32 matmuls are far faster with it)."""
    try:
        from mlxkv.engine import blas

        info = blas.preload()
        return str(info.get("path") or info.get("reason"))
    except ImportError:  # engine.blas not present: do the same directly
        import ctypes
        import glob

        for path in sorted(glob.glob("/usr/lib/*/openblas-pthread/libopenblas.so.0")):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        return "reference BLAS"


def encode_examples(tokenizer_file: Path, corpus) -> list[tuple[list[int], list[float]]]:
    """Token ids and per-token loss weights for every dialogue and plain text.

    A weight belongs to the token it predicts: assistant content and its <|im_end|> get 1
    (the first OPENING_TOKENS of each answer OPENING_WEIGHT), everything else in a dialogue
    0; plain text gets PLAIN_WEIGHT everywhere."""
    from tokenizers import Tokenizer

    from support.demo.corpus import render

    tok = Tokenizer.from_file(str(tokenizer_file))
    end = "<|im_end|>"
    examples = []
    for msgs in corpus.dialogues:
        text = render(msgs)
        spans, pos = [], 0
        for m in msgs:
            head = f"<|im_start|>{m['role']}\n"
            start = pos + len(head)
            stop = start + len(m["content"]) + len(end)
            if m["role"] == "assistant" and m.get("train", True):
                spans.append((start, stop))
            pos = stop + 1  # the newline after <|im_end|>
        enc = tok.encode(text)
        w, seen = [], [0] * len(spans)
        for start, _ in enc.offsets:
            k = next((j for j, (a, b) in enumerate(spans) if a <= start < b), None)
            if k is None:
                w.append(0.0)
                continue
            # The first tokens of an answer decide which answer it is; they are a tiny
            # share of the loss, so without extra weight the model never learns to pick
            # them from the question and greedy decoding starts the wrong answer.
            w.append(OPENING_WEIGHT if seen[k] < OPENING_TOKENS else 1.0)
            seen[k] += 1
        ids = enc.ids[:MAX_LEN]
        examples.append((ids, w[:MAX_LEN]))
    for text in corpus.texts:
        ids = tok.encode(text + "<|endoftext|>").ids
        for i in range(0, len(ids), MAX_LEN):
            piece = ids[i:i + MAX_LEN]
            if len(piece) > 8:
                examples.append((piece, [PLAIN_WEIGHT] * len(piece)))
    return examples


def make_batches(examples, rows_per_batch: int, rng: random.Random):
    """Shuffle the examples and pack them into rows of ROW_LEN + 1 tokens, first fit (each
    example goes into the first row it fits in, so short ones fill the gaps that long
    dialogues leave; the rest is padding with weight 0), ``rows_per_batch`` rows per batch.
    One fixed shape, so the compiled step is built once."""
    order = list(examples)
    rng.shuffle(order)
    rows: list[tuple[list[int], list[float]]] = []
    open_rows: list[int] = []  # indices of rows that still have room for a short example
    for ids, w in order:
        ids, w = ids[: ROW_LEN + 1], w[: ROW_LEN + 1]
        k = next((j for j in open_rows if len(rows[j][0]) + len(ids) <= ROW_LEN + 1), None)
        if k is None:
            rows.append(([], []))
            k = len(rows) - 1
            open_rows.append(k)
        rows[k][0].extend(ids)
        rows[k][1].extend(w)
        if ROW_LEN + 1 - len(rows[k][0]) < 24:
            open_rows.remove(k)
    rng.shuffle(rows)
    batches = []
    for i in range(0, len(rows) - rows_per_batch + 1, rows_per_batch):
        x, y, m = [], [], []
        for ids, w in rows[i:i + rows_per_batch]:
            pad = ROW_LEN + 1 - len(ids)
            ids, w = ids + [0] * pad, w + [0.0] * pad
            x.append(ids[:-1])
            y.append(ids[1:])
            m.append(w[1:])
        batches.append((x, y, m))
    return batches


def train_model(name: str, spec: dict, vocab: int, examples, out_dir: Path, steps: int,
                tok_dir: Path, log=print) -> dict:
    """Train one model for ``steps`` optimizer steps and save it (float16) to ``out_dir``."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from support.modelgen import init_model, model_config, save_model_dir

    config = model_config("qwen3", vocab, **spec["config"])
    model = init_model(config, seed=SEED)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"[{name}] qwen3 {spec['config']} params={n_params / 1e6:.2f}M steps={steps}")

    warmup = min(spec["warmup"], max(1, steps // 10))
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-6, spec["lr"], warmup),
         optim.cosine_decay(spec["lr"], max(1, steps - warmup), spec["lr"] * 0.05)],
        [warmup])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(m, x, y, w):
        ce = nn.losses.cross_entropy(m(x), y)
        return (ce * w).sum() / mx.maximum(w.sum(), 1.0)

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step(x, y, w):
        loss, grads = grad_fn(model, x, y, w)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)

    rng = random.Random(SEED)
    batches: list = []
    t0 = time.time()
    avg, tokens = None, 0
    for i in range(1, steps + 1):
        if not batches:
            batches = make_batches(examples, spec["rows"], rng)
        x, y, w = batches.pop()
        loss = step(mx.array(x), mx.array(y), mx.array(w))
        mx.eval(state, loss)
        tokens += len(x) * len(x[0])
        avg = loss.item() if avg is None else 0.95 * avg + 0.05 * loss.item()
        if i % max(1, min(50, steps // 10)) == 0 or i == steps:
            el = time.time() - t0
            log(f"[{name}] step {i}/{steps} loss {avg:.3f} lr {schedule(i).item():.2e} "
                f"{tokens / el:.0f} tok/s {el:.0f}s")
    train_s = time.time() - t0

    # Ship float16: half the bytes, and the engine upcasts to float32 on CPU.
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    config["torch_dtype"] = "float16"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    save_model_dir(model, config, out_dir)
    for f in tok_dir.iterdir():
        shutil.copy2(f, out_dir / f.name)
    # The demo models memorise their answers: greedy decoding reproduces them, sampling
    # drifts. Recommend greedy the standard way; --temp still overrides it.
    (out_dir / "generation_config.json").write_text('{"do_sample": false}\n')
    return {"params": n_params, "final_loss": avg, "train_s": train_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m support.demo.train", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few steps only (checks the pipeline)")
    ap.add_argument("--out", type=Path, default=DEMO_DIR, help="folder for model/ and draft/")
    ap.add_argument("--only", choices=["main", "draft"], help="train only one of the two")
    ap.add_argument("--steps", type=int, help="override the number of steps (experiments)")
    args = ap.parse_args(argv)

    blas = _preload_blas()
    import mlx.core as mx

    from support.demo.corpus import build_corpus, tokenizer_texts
    from support.modelgen import build_tokenizer

    mx.random.seed(SEED)
    print(f"BLAS: {blas}", flush=True)
    t0 = time.time()
    corpus = build_corpus(seed=SEED)
    out: Path = args.out
    tok_dir = out / "tokenizer.tmp"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    vocab = build_tokenizer(tok_dir, tokenizer_texts(corpus), vocab_size=TOKENIZER_VOCAB)
    examples = encode_examples(tok_dir / "tokenizer.json", corpus)
    n_tok = sum(len(ids) for ids, _ in examples)
    n_sup = sum(sum(1 for v in w if v > 0) for _, w in examples)
    print(f"corpus: {len(corpus.dialogues)} dialogues, {len(corpus.texts)} texts, "
          f"{n_tok} tokens ({n_sup} trained), vocab {vocab}", flush=True)

    results = {}
    for name, spec, folder in (("main", MAIN, "model"), ("draft", DRAFT, "draft")):
        if args.only and args.only != name:
            continue
        steps = QUICK_STEPS[name] if args.quick else (args.steps or spec["steps"])
        results[name] = train_model(name, spec, vocab, examples, out / folder, steps, tok_dir,
                                    log=lambda s: print(s, flush=True))
    shutil.rmtree(tok_dir)
    for name, r in results.items():
        size = sum(f.stat().st_size for f in (out / ("model" if name == "main" else "draft")).iterdir())
        print(f"{name}: params {r['params'] / 1e6:.2f}M, final loss {r['final_loss']:.3f}, "
              f"train {r['train_s']:.0f}s, folder {size / 1e6:.1f} MB")
    print(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
