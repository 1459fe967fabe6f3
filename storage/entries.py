"""Entries of the block store's index: what a block, tail or checkpoint file's verified
header says about it, grouped per namespace, and the reading of those headers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mlxkv.storage import diskio
from mlxkv.storage import format as fmt
from mlxkv.storage.folder import ENTRY_RE, MANIFEST_DIR
from mlxkv.storage.format import KIND_BLOCK, KIND_TAIL, PAGE, FormatError, Layout, TokenIds
from mlxkv.storage.keys import EXT, KEY_FN

__all__ = ["MANIFEST_DIR", "Entry", "Space", "kind_of", "read_entries", "read_entry"]
_SCAN_THREADS = 4
_HEAD_READ = 2 * PAGE  # one read covers the header of every usual layout


@dataclass
class Entry:
    """One indexed block, tail or checkpoint file (what its verified header says)."""

    kind: int
    key: bytes
    parent: bytes
    ns: str
    path: str
    file_size: int
    payload_offset: int
    payload_len: int
    content_hash: int
    t0: int
    t1: int
    layout: Layout
    tokens: TokenIds  # its token ids (a prompt that ends inside it uses a prefix)
    mtime: float
    last_used: float = 0.0


@dataclass
class Space:
    """The entries of one namespace."""

    blocks: dict[bytes, Entry] = field(default_factory=dict)
    # parent -> the full blocks under it: a prompt that ends inside a stored block is
    # matched against their tokens (its own chain key for that block cannot be computed)
    kids: dict[bytes, dict[bytes, Entry]] = field(default_factory=dict)
    tails: dict[bytes, dict[bytes, Entry]] = field(default_factory=dict)  # parent -> tails
    ckpts: dict[bytes, dict[bytes, Entry]] = field(default_factory=dict)  # parent -> ckpts

    def side(self, kind: int) -> dict[bytes, dict[bytes, Entry]]:
        return self.tails if kind == KIND_TAIL else self.ckpts

    def get(self, kind: int, key: bytes, parent: bytes) -> Entry | None:
        if kind == KIND_BLOCK:
            return self.blocks.get(key)
        return self.side(kind).get(parent, {}).get(key)

    def find_child(self, key: bytes) -> Entry | None:
        """A tail or checkpoint by its key alone (its parent unknown)."""
        for ts in (*self.tails.values(), *self.ckpts.values()):
            if key in ts:
                return ts[key]
        return None

    def entries(self) -> Iterator[Entry]:
        yield from self.blocks.values()
        for side in (self.tails, self.ckpts):
            for ts in side.values():
                yield from ts.values()

    def counts(self) -> dict[str, int]:
        return {"blocks": len(self.blocks),
                "tails": sum(len(t) for t in self.tails.values()),
                "checkpoints": sum(len(t) for t in self.ckpts.values())}


EMPTY_SPACE = Space()  # read-only stand-in for a namespace with nothing indexed


def read_entry(path: str, ns: str, nsid: bytes, kind: int) -> Entry:
    """Read and verify the header of one file: FormatError if it is not what its name
    says (damage), OSError if it cannot be read (diskio.NotAFile: not a regular file)."""
    fd = diskio.open_ro(path)
    try:
        st = os.fstat(fd)
        size, mtime = st.st_size, st.st_mtime
        head = os.pread(fd, _HEAD_READ, 0)
        span = fmt.header_span(head)
        if span > len(head):
            head = os.pread(fd, span, 0)
    finally:
        os.close(fd)
    hdr = fmt.decode_block_header(head)
    if hdr.kind != kind:
        raise FormatError(f"a {fmt.KIND_NAMES[hdr.kind]} stored under a {fmt.KIND_NAMES[kind]} name")
    if hdr.ns != ns or hdr.ns_id != nsid:
        raise FormatError(f"namespace {hdr.ns!r} stored under {ns!r}")
    want = KEY_FN[kind](hdr.parent, nsid, hdr.token_bytes)
    if hdr.key != want or not path.endswith(hdr.key.hex() + EXT[kind]):
        raise FormatError("key does not match the header's parent and tokens")
    if size < hdr.file_size:
        raise FormatError(f"truncated: {size} of {hdr.file_size} bytes")
    return Entry(kind, hdr.key, hdr.parent, ns, path, hdr.file_size, hdr.payload_offset,
                 hdr.payload_len, hdr.content_hash, hdr.t0, hdr.t1, hdr.layout,
                 hdr.tokens.copy(), mtime)


# what a scan asks read_entry for: (path, ns, namespace id, kind)
EntryFile = tuple[str, str, bytes, int]


def read_entries(todo: list[EntryFile]) -> Iterator[tuple[str, Entry | FormatError | OSError]]:
    """(path, Entry or the exception) per (path, ns, nsid, kind); headers are read by a
    few threads so a cold scan keeps several disk reads in flight (pread releases the GIL)."""

    def some(items: list[EntryFile]) -> list[tuple[str, Entry | FormatError | OSError]]:
        out: list[tuple[str, Entry | FormatError | OSError]] = []
        for item in items:
            try:
                out.append((item[0], read_entry(*item)))
            except (FormatError, OSError) as exc:
                out.append((item[0], exc))
        return out

    if len(todo) < 512 or _SCAN_THREADS <= 1:
        yield from some(todo)
        return
    step = -(-len(todo) // (4 * _SCAN_THREADS))  # a few chunks per thread: one future each
    with ThreadPoolExecutor(max_workers=_SCAN_THREADS, thread_name_prefix="mlxkv-scan") as ex:
        for chunk in ex.map(some, [todo[i : i + step] for i in range(0, len(todo), step)]):
            yield from chunk


_KIND_OF_EXT = {ext[1:]: kind for kind, ext in EXT.items()}


def kind_of(name: str) -> int | None:
    """The entry kind a file name says (None: not named as an entry file)."""
    m = ENTRY_RE.match(name)
    return _KIND_OF_EXT[m.group(2)] if m else None
