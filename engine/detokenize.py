"""Streaming detokenization: token ids in, text out as soon as it is decided.

mlx-lm picks a streaming detokenizer per tokenizer when it loads one: byte-level BPE (GPT-2
style vocabularies), SentencePiece style (``▁`` for a space, ``<0xNN>`` byte tokens), or a
naive one that decodes again with the tokenizer. :func:`stream_detokenizer` follows that
choice (the type of ``tokenizer.detokenizer``) and, for the first two, gives a
:class:`StreamDetokenizer` of ours instead: the same text, joined, as mlx-lm's, but bytes
that can no longer become valid UTF-8 (a stray continuation byte, a broken sequence) are
released at once, as the U+FFFD they decode to, and only a sequence a later token may still
complete is held back; mlx-lm's hold any text that ends in U+FFFD until a later token ends
it. A stream thus shows text no later than it is decided. The naive kind (and any other)
stays mlx-lm's own.

What ours keeps of mlx-lm's rules, so the text is theirs: the first released text drops
one leading space (SentencePiece: unless mlx-lm chose its ``trim_space=False`` variant); a
byte-level token that is a lone space is held until the next token (mlx-lm's way, which the
leading-space rule depends on); an id past the tokenizer's vocabulary (a model whose
embedding is padded) reads as ``!``; characters of a byte-level token outside the byte
alphabet (added tokens) stand for their own UTF-8 bytes, and so does ``Ā``, the alphabet's
character for byte 0: mlx-lm's stream shows it as ``Ā`` (the tokenizer's ``decode`` gives
U+0000), and the text is to be mlx-lm's.
"""

from __future__ import annotations

import codecs
import re
import threading
import weakref
from typing import Any

_SPACE = 0x20
_SPM_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet: one printable character per byte value. Bytes that are
    printable Latin-1 (and not a space) stand for themselves; the others, in byte order,
    take the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet.values():
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


_ALPHABET = _byte_alphabet()
_LONE_SPACE = next(c for c, b in _ALPHABET.items() if b == _SPACE)


class TokenTable:
    """Each token id's bytes, for one tokenizer, looked up once per id as they occur (a
    table built ahead would cost a pass over the whole vocabulary in the first request).
    ``kind`` is "bpe" (byte-level) or "spm" (SentencePiece style)."""

    def __init__(self, tokenizer: Any, kind: str, trim_space: bool = True):
        if kind not in ("bpe", "spm"):
            raise ValueError(f"unknown detokenizer kind {kind!r}")
        self.kind = kind
        self.trim_space = trim_space
        self._tokenizer = tokenizer
        self._size = len(tokenizer)
        self._bytes: dict[int, bytes] = {}
        self._lone_space: set[int] = set()

    def bytes_of(self, token: int) -> bytes:
        known = self._bytes.get(token)
        if known is None:
            known = self._bytes[token] = self._lookup(token)
        return known

    def is_lone_space(self, token: int) -> bool:
        """A byte-level token that is exactly the space character of the alphabet."""
        self.bytes_of(token)
        return token in self._lone_space

    def _lookup(self, token: int) -> bytes:
        if not 0 <= token < self._size:
            return b"!"  # as mlx-lm reads an id past the vocabulary
        piece = self._tokenizer.convert_ids_to_tokens(token)
        if piece is None:
            return b""
        if self.kind == "spm":
            m = _BYTE_TOKEN.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.encode("utf-8")
        if piece == _LONE_SPACE:
            self._lone_space.add(token)
        out = bytearray()
        for ch in piece:
            b = _ALPHABET.get(ch)
            if not b:  # outside the alphabet, or byte 0 (see the module)
                out += ch.encode("utf-8")
            else:
                out.append(b)
        return bytes(out)


class StreamDetokenizer:
    """mlx-lm's ``StreamingDetokenizer`` interface (``add_token``, ``finalize``, ``text``,
    ``tokens``, ``last_segment``, ``reset``) over a :class:`TokenTable`; see the module."""

    def __init__(self, table: TokenTable):
        self.table = table
        self.reset()

    def reset(self) -> None:
        self.text = ""
        self.tokens: list[int] = []
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""  # decided text held back behind a lone-space token

    @property
    def last_segment(self) -> str:
        """The text released since this was last read."""
        segment = self.text[self.offset:]
        self.offset = len(self.text)
        return segment

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        decided = self._held + self._decoder.decode(self.table.bytes_of(token), final=False)
        if self.table.kind == "bpe" and self.table.is_lone_space(token):
            self._held = decided  # the next token decides whether it leads the text
            return
        self._held = ""
        self._release(decided)

    def finalize(self) -> None:
        """Release what is held, a sequence left incomplete as U+FFFD."""
        decided = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        self._release(decided)

    def _release(self, text: str) -> None:
        if self.table.kind == "spm":
            text = text.replace(_SPM_SPACE, " ")
        if not self.text and text.startswith(" ") and self.table.trim_space:
            text = text[1:]
        self.text += text


_tables: weakref.WeakKeyDictionary[Any, TokenTable | None] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def _table_of(tokenizer: Any) -> TokenTable | None:
    """The tokenizer's table, from the kind of detokenizer mlx-lm chose for it (None: a
    kind of ours does not cover)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    theirs = type(tokenizer.detokenizer)
    if theirs is BPEStreamingDetokenizer:
        return TokenTable(tokenizer, "bpe")
    if theirs is SPMStreamingDetokenizer:
        return TokenTable(tokenizer, "spm", trim_space=bool(tokenizer.detokenizer.trim_space))
    return None


def stream_detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer for ``tokenizer`` (an mlx-lm ``TokenizerWrapper``):
    ours for byte-level BPE and SentencePiece tokenizers, else mlx-lm's own."""
    try:
        with _tables_lock:
            if tokenizer in _tables:
                table = _tables[tokenizer]
            else:
                table = _tables[tokenizer] = _table_of(tokenizer)
    except TypeError:  # not weakly referenceable: no table kept between requests
        table = _table_of(tokenizer)
    return StreamDetokenizer(table) if table is not None else tokenizer.detokenizer
