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


def prompt_size(usage: Any) -> int:
    """The prompt of an Anthropic reply's usage: its three parts add up to it."""
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


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


def _model_folder(name: str, template: str | None, build: Any = None) -> Path:
    """The tiny qwen3 as ``.cache/models/NAME`` (built once), with ``template`` as its chat
    template (None: its own plain ChatML, which renders no tools) and ``build(folder,
    base_config)`` writing its weights (None: the tiny model's)."""
    from support.modelgen import TEST_MODELS, tiny_model

    out = TEST_MODELS / name
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    base = tiny_model("qwen3")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and (build is None or (not f.name.endswith(".safetensors") and f.name != "config.json")):
            shutil.copy(f, tmp / f.name)
    if template is not None:
        cfg_path = tmp / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = template
        cfg_path.write_text(json.dumps(cfg, indent=2))
        (tmp / "chat_template.jinja").unlink(missing_ok=True)
    if build is not None:
        build(tmp, json.loads((base / "config.json").read_text()))
    if out.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def tool_model() -> Path:
    """The trained tool-call model folder (built once into .cache/models): its template
    renders tools (Hermes style)."""
    return _model_folder("qwen3-toolcall-v1", TOOL_TEMPLATE,
                         lambda folder, config: _train(folder, config, _template_prompt))


def default_format_tool_model() -> Path:
    """The same two replies learned by a model whose template renders no tools (the tiny
    qwen3's plain ChatML): its prompts are the server's default tool format."""
    return _model_folder("qwen3-toolcall-default-v1", None,
                         lambda folder, config: _train(folder, config, _default_format_prompt))


def system_first_model() -> Path:
    """The tiny qwen3 (random weights) with a template that refuses a system message
    anywhere but first, as Qwen3's and Gemma's do, and two turns of one role in a row."""
    return _model_folder("qwen3-system-first-v1", SYSTEM_FIRST_TEMPLATE)


SYSTEM_FIRST_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{%- if loop.index0 > 0 and messages[loop.index0 - 1].role == message.role %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def _template_prompt(tok: Any, messages: list[dict[str, Any]]) -> tuple[list[int], str]:
    from mlxkv.engine.models import chat_prompt_tokens

    return chat_prompt_tokens(tok, messages, tools=[WEATHER_TOOL]), ""


def _default_format_prompt(tok: Any, messages: list[dict[str, Any]]) -> tuple[list[int], str]:
    """The prompt the server sends a template without tools, and the call as the default
    format writes it."""
    from mlxkv.engine.models import chat_prompt_tokens
    from mlxkv.server.chat_prompt import TemplateCaps, build_prompt
    from mlxkv.server.tool_prompt import call_line

    prompt = build_prompt(messages, [WEATHER_TOOL], TemplateCaps(tools=False, system_turns=True))
    return chat_prompt_tokens(tok, prompt.messages, tools=prompt.tools), call_line("get_weather", CALL_ARGS)


def _train(folder: Path, base_config: dict, render: Any) -> None:
    """Overfit a tiny model on the two tool replies, each prompt from ``render(tokenizer,
    messages)`` -> (tokens, the call's text: "" for the Hermes template's own)."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from support.modelgen import init_model, model_config, save_model_dir

    tok = load_tokenizer(folder)
    rows = []
    for messages, reply in tool_conversations():
        prompt, call = render(tok, messages)
        if call and reply.startswith("<tool_call>"):
            reply = call
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
