"""Tool calls and reasoning in a model's replies, in each model family's own format: one seam
(:func:`detect` gives a :class:`ReplyFormat`, whose ``parser`` splits one reply) over mlx-lm's
parsers and this package's own (harmony, DeepSeek, Llama 3)."""

from mlxkv.server.formats.calls import CallSyntax, ToolCall
from mlxkv.server.formats.families import DEFAULT_SYNTAX, VOCAB_MARKERS, ReplyFormat, detect
from mlxkv.server.formats.stream import CALL, REASONING, TEXT, Piece, split_reply

__all__ = ["CALL", "DEFAULT_SYNTAX", "REASONING", "TEXT", "VOCAB_MARKERS", "CallSyntax", "Piece",
           "ReplyFormat", "ToolCall", "detect", "split_reply"]
