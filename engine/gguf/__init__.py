"""GGUF files (llama.cpp's model format, as Ollama and LM Studio keep them) as mlx-lm
models: :func:`load_gguf` reads the file's header with every length checked
(:mod:`.reader`), its tensors through mlx's own reader where it can (:mod:`.weights`),
builds mlx-lm's model for the architecture (:mod:`.arch`) and the tokenizer the metadata
describes (:mod:`.tokenizer`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .reader import GGUFError, GGUFHeader, read_header

__all__ = ["GGUFError", "GGUFHeader", "GGUFModel", "load_gguf", "read_header"]


@dataclass
class GGUFModel:
    """What :func:`load_gguf` gives: the mlx-lm model, its ``TokenizerWrapper``, the
    mlx-lm config the metadata describes, and the header it was read from."""

    model: Any
    tokenizer: Any
    config: dict
    header: GGUFHeader
    dequantized: bool


def load_gguf(path: str | os.PathLike, dequantize: Any = None,
              header: GGUFHeader | None = None) -> GGUFModel:
    """Load the GGUF file at ``path`` (raises :class:`GGUFError` for anything it cannot
    load, naming what). ``dequantize``: an mlx dtype to turn the quantized tensors into
    (``None`` keeps Q4_0 / Q4_1 / Q8_0 quantized, as mlx-lm's QuantizedLinear and
    QuantizedEmbedding); call it on the thread that will run the model."""
    from .arch import build_model
    from .tokenizer import build_tokenizer
    from .weights import load_tensors

    header = header if header is not None else read_header(Path(path))
    parts = header.get("split.count", 1)
    if isinstance(parts, int) and parts > 1:
        raise GGUFError(f"{header.path}: one part of a model split into {parts} files "
                        "(merge them first: llama.cpp's llama-gguf-split --merge)")
    tokenizer = build_tokenizer(header)
    model, config = build_model(header, load_tensors(header, dequantize), dequantize)
    return GGUFModel(model=model, tokenizer=tokenizer, config=config, header=header,
                     dequantized=dequantize is not None)
