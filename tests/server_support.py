"""What the server tests share: a server on a loopback port in a thread, and a tiny model
trained to answer with a tool call (random weights never write ``<tool_call>``).

The tool model is a tiny qwen3 with a Hermes-style chat template (tools in the system turn,
calls as ``<tool_call>{json}</tool_call>``, results as ``<tool_response>``), overfitted with
mlx in a few seconds on two replies: the weather question answers with a get_weather call,
and the same conversation with that call's result answers with a sentence. Greedy decoding
then writes both exactly, through the server's real template and parsing path.

The default-tools model is the same, under a plain ChatML template that has no tool
format (as SmolLM2's): trained on the prompts ``/v1/responses`` writes for such templates
(tools in the system message, calls and results as tags), so that it answers the server's
own default tool format.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tc in message.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n"
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = "What is the weather in Paris?"
CALL_ARGS = {"city": "Paris"}
TOOL_RESULT = '{"temp_c": 22}'
FINAL_ANSWER = "It is 22 C in Paris."


def tool_conversations() -> list[tuple[list[dict[str, Any]], str]]:
    """(messages, reply) pairs the tool model is trained on, as the server renders them."""
    first = [{"role": "user", "content": QUESTION}]
    call = ("<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": CALL_ARGS})
            + "\n</tool_call>")
    second = first + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}}]},
        {"role": "tool", "tool_call_id": "x", "content": TOOL_RESULT}]
    return [(first, call), (second, FINAL_ANSWER)]


PLAIN_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def default_tool_conversations() -> list[tuple[list[dict[str, Any]], str]]:
    """The tool conversations as ``/v1/responses`` writes them for a template without tools."""
    from mlxkv.server.responses_items import call_text, inline_tools, parse_input, to_messages

    call = {"type": "function_call", "call_id": "x", "name": "get_weather",
            "arguments": json.dumps(CALL_ARGS)}
    first = [{"type": "message", "role": "user", "content": QUESTION}]
    second = first + [call, {"type": "function_call_output", "call_id": "x", "output": TOOL_RESULT}]
    reply = call_text({"function": {"name": "get_weather", "arguments": CALL_ARGS}})
    return [(inline_tools(to_messages(parse_input(items), None), [WEATHER_TOOL]), answer)
            for items, answer in ((first, reply), (second, FINAL_ANSWER))]


def tool_model() -> Path:
    """The trained tool-call model folder (built once into .cache/models)."""
    return _trained("qwen3-toolcall-v1", TOOL_TEMPLATE, tool_conversations(), [WEATHER_TOOL])


def default_tool_model() -> Path:
    """The model trained on the default tool format (one folder per version of its prompts)."""
    rows = default_tool_conversations()
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:10]
    return _trained(f"qwen3-defaulttools-{digest}", PLAIN_TEMPLATE, rows, None)


def _trained(name: str, template: str, rows: list[tuple[list[dict[str, Any]], str]],
             tools: list[dict[str, Any]] | None) -> Path:
    from support.modelgen import TEST_MODELS, tiny_model

    out = TEST_MODELS / name
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    base = tiny_model("qwen3")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "config.json" and f.is_file():
            shutil.copy(f, tmp / f.name)
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (tmp / "chat_template.jinja").unlink(missing_ok=True)
    _train(tmp, json.loads((base / "config.json").read_text()), rows, tools)
    if out.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def _train(folder: Path, base_config: dict, conversations: list[tuple[list[dict[str, Any]], str]],
           tools: list[dict[str, Any]] | None) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxkv.engine.models import chat_prompt_tokens
    from support.modelgen import init_model, model_config, save_model_dir

    tok = load_tokenizer(folder)
    rows = []
    for messages, reply in conversations:
        prompt = chat_prompt_tokens(tok, messages, tools=tools)
        answer = list(tok.encode(reply, add_special_tokens=False)) + [tok.eos_token_id]
        rows.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in rows)
    inputs, targets, mask = [], [], []
    for prompt, answer in rows:
        seq = prompt + answer
        pad = width - len(seq)
        inputs.append(seq[:-1] + [0] * pad)
        targets.append(seq[1:] + [0] * pad)
        mask.append([0] * (len(prompt) - 1) + [1] * len(answer) + [0] * pad)
    x, y, m = mx.array(inputs), mx.array(targets), mx.array(mask, dtype=mx.float32)
    config = model_config("qwen3", base_config["vocab_size"], hidden_size=128, intermediate_size=256,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = init_model(config, seed=3)
    opt = optim.Adam(learning_rate=3e-3)

    def loss_fn(model: Any) -> mx.array:
        ce = nn.losses.cross_entropy(model(x), y, reduction="none")
        return (ce * m).sum() / m.sum()

    step = nn.value_and_grad(model, loss_fn)
    for _ in range(400):
        loss, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if loss.item() < 1e-3:
            break
    save_model_dir(model, config, folder)


class LoopbackServer:
    """``server.app`` on uvicorn in a thread, on a port the OS picked (bound before the
    thread starts, so a client never races the bind); ``wrap``: ASGI middleware around it."""

    def __init__(self, engine: Any, config: Any, wrap: Any = None):
        import uvicorn

        from mlxkv.server.app import create_app

        self.engine = engine
        self.app = create_app(engine, config)
        served = self.app if wrap is None else wrap(self.app)  # ASGI middleware around the app
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(served, log_level="warning", access_log=False,
                                                    lifespan="off", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       name="uvicorn-test", daemon=True)

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    @property
    def ctx(self) -> Any:
        return self.app.state.ctx
