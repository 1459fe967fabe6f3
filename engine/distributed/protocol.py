"""What the ranks say to each other, all of it MLX collectives on the launch's group.

Rank 0 sends and the others receive through ``all_sum`` of arrays only rank 0 fills (the
others add zeros), so there is no transport of our own: the ring, MPI or Thunderbolt
backend mlx.launch set up carries everything. Every rank issues the same collectives in
the same order; a fixed header makes that checkable:

    header  int32[6]: PROTOCOL, op, seq, n_tokens, n_words, arg
    body    int32[n_tokens + n_words]: prompt tokens, then the request's JSON (sampling,
            session) as UTF-8 bytes padded to 4

Ops: HEARTBEAT (rank 0 is idle and alive), REQUEST (tokens + body: serve it), FLUSH
(persist the cache; ``arg`` = timeout in ms), SHUTDOWN. A follower that sees another
protocol or a sequence number out of order stops with an error instead of guessing.

Per request the ranks also agree, with one ``all_gather``, on the cached prefix every rank
holds (:func:`agree_prefix`); at load they compare what must be equal (:func:`handshake`).
Every collective is bounded by the watchdog; a lost connection ends the process with a
clear error (``World.fail``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

PROTOCOL = 0x6D6B7631  # "mkv1"
HEARTBEAT, REQUEST, FLUSH, SHUTDOWN = 1, 2, 3, 4
OP_NAMES = {HEARTBEAT: "heartbeat", REQUEST: "request", FLUSH: "flush", SHUTDOWN: "shutdown"}
HEADER_WORDS = 6


@dataclass
class Message:
    op: int
    seq: int
    tokens: list[int] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)
    arg: int = 0


def pack_body(body: dict[str, Any]) -> np.ndarray:
    raw = json.dumps(body, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 4)
    return np.frombuffer(raw, dtype=np.int32)


def unpack_body(words: np.ndarray) -> dict[str, Any]:
    return json.loads(words.astype(np.int32).tobytes().decode().rstrip(" ") or "{}")


class Channel:
    """The collectives of one rank (engine thread only)."""

    def __init__(self, world: Any, fail: Any = None):
        self.world = world
        self.fail: Callable[[str], NoReturn] = fail or world.fail  # never returns: the group is broken
        self.rank = world.rank
        self.leader = world.rank == 0
        self.seq = 0

    # ------------------------------------------------------------------ primitives
    def _run(self, what: str, op: Any, values: np.ndarray, bound_s: float | None) -> np.ndarray:
        import mlx.core as mx

        dog = self.world.watchdog
        dog.arm(what, bound_s)
        try:
            out = op(mx.array(values), group=self.world.group)
            mx.eval(out)
            return np.array(out)
        except RuntimeError as e:  # the backend lost a peer
            self.fail(f"lost the other ranks while {what} ({e})")
        finally:
            dog.disarm()

    def all_sum(self, values: np.ndarray, what: str, bound_s: float | None = None) -> np.ndarray:
        import mlx.core as mx

        return self._run(what, mx.distributed.all_sum, values, bound_s)

    def all_gather(self, values: np.ndarray, what: str) -> np.ndarray:
        """Every rank's ``values`` (same length on every rank), one row per rank."""
        import mlx.core as mx

        out = self._run(what, mx.distributed.all_gather, values, None)
        return out.reshape(self.world.size, -1)

    def any_rank(self, flag: bool, what: str) -> bool:
        """True on every rank when rank 0 says so (only rank 0's flag counts)."""
        value = np.array([1 if flag and self.leader else 0], dtype=np.int32)
        return bool(self.all_sum(value, what)[0])

    # ------------------------------------------------------------------ rank 0
    def send(self, op: int, tokens: list[int] | None = None, body: dict[str, Any] | None = None,
             arg: int = 0) -> None:
        """Rank 0: one message to every other rank."""
        assert self.leader
        self.seq += 1
        toks = np.asarray(tokens or [], dtype=np.int32)
        words = pack_body(body) if body is not None else np.zeros(0, dtype=np.int32)
        header = np.array([PROTOCOL, op, self.seq, len(toks), len(words), arg], dtype=np.int32)
        what = f"sending a {OP_NAMES[op]} to the other ranks"
        self.all_sum(header, what)
        if len(toks) or len(words):
            self.all_sum(np.concatenate([toks, words]), what)

    # ------------------------------------------------------------------ other ranks
    def receive(self, bound_s: float | None = None) -> Message:
        """Every other rank: the next message from rank 0 (waits at most ``bound_s``)."""
        assert not self.leader
        header = self.all_sum(np.zeros(HEADER_WORDS, dtype=np.int32),
                              "waiting for rank 0 (it sends a heartbeat while idle)", bound_s)
        protocol, op, seq, n_tokens, n_words, arg = (int(x) for x in header)
        if protocol != PROTOCOL or op not in OP_NAMES:
            self.fail(f"rank 0 speaks another protocol (header {header.tolist()}): run the "
                            "same mlxkv on every rank")
        if seq != self.seq + 1:
            self.fail(f"out of step with rank 0 (message {seq}, expected {self.seq + 1})")
        self.seq = seq
        msg = Message(op, seq, arg=arg)
        if n_tokens or n_words:
            data = self.all_sum(np.zeros(n_tokens + n_words, dtype=np.int32),
                                f"receiving a {OP_NAMES[op]} from rank 0")
            msg.tokens = [int(t) for t in data[:n_tokens]]
            msg.body = unpack_body(data[n_tokens:])
        return msg


def _words(text: str, n: int = 4) -> list[int]:
    digest = hashlib.sha256(text.encode()).digest()[: 4 * n]
    return np.frombuffer(digest, dtype=np.int32).tolist()


def handshake(channel: Channel, facts: dict[str, str]) -> None:
    """Every rank checks that the others run what it runs (``facts``: name -> value, e.g.
    the model fingerprint, the sharding, whether the prefix cache is on); a difference
    stops every rank with an error naming it. Called once, after loading."""
    names = sorted(facts)
    mine = np.array([PROTOCOL] + [w for n in names for w in _words(f"{n}={facts[n]}")],
                    dtype=np.int32)
    rows = channel.all_gather(mine, "comparing the ranks' setups")
    for rank, row in enumerate(rows):
        if row[0] != PROTOCOL:
            channel.fail(f"rank {rank} runs another mlxkv protocol: run the same mlxkv "
                               "on every rank")
        for i, name in enumerate(names):
            if not np.array_equal(row[1 + 4 * i: 5 + 4 * i], mine[1 + 4 * i: 5 + 4 * i]):
                channel.fail(
                    f"rank {rank} differs from rank {channel.rank} in {name} (here: {facts[name]}): "
                    "give every rank the same model folder and settings")


@dataclass
class Agreement:
    """The cached prefix the ranks agreed on for one request."""

    used: int  # tokens every rank starts from
    cached_by_rank: list[int]  # what each rank's own lookup found
    ram_by_rank: list[int]
    ssd_by_rank: list[int]


def agree_prefix(channel: Channel, n_local: int, trimmable: bool, ram: int, ssd: int
                 ) -> Agreement:
    """One all_gather: each rank's cached length, whether it can cut its cache shorter,
    and its RAM / SSD shares. Every rank then computes the same answer: the shortest
    length, or 0 when a rank that holds more cannot cut its cache to it."""
    rows = channel.all_gather(np.array([n_local, int(trimmable), ram, ssd], dtype=np.int32),
                              "agreeing on the cached prefix")
    return decide(rows.tolist())


def decide(rows: list[list[int]]) -> Agreement:
    """The agreement from every rank's ``[cached, trimmable, ram, ssd]`` (one row per rank,
    the same rows on every rank, so every rank decides the same)."""
    lengths = [int(r[0]) for r in rows]
    used = min(lengths)
    if any(n != used and not r[1] for n, r in zip(lengths, rows)):
        used = 0
    return Agreement(used, lengths, [int(r[2]) for r in rows], [int(r[3]) for r in rows])
