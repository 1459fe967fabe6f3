"""How long a proposal to ask for, and whether to speculate at all.

Per request and source, :class:`LengthController` keeps running estimates of the
acceptance rate a (per proposed token), the time of a plain step t1 and the marginal cost m
of each proposed token (proposing plus the wider verify). A round of k proposed tokens yields
E(k) = (1 - a^(k+1)) / (1 - a) tokens in t1 + m*k, so it asks for the k in 0..max that
maximises E(k) / (t1 + m*k). k = 0 is a plain step: when speculation would be slower it
stops, then probes again after a back-off that doubles each time the probe loses, so a
lone request never pays for speculation for long.

A :class:`SourceMemory` (one per loaded source and sampling regime, kept by the provider)
carries what requests learned to the next one: acceptance, the cost of a plain step and
of a proposed token, the proposal length, and the back-off. A new request starts from
them: at the length that paid, without measuring a plain step first; or, for a source
that lost, off, probing again after at most ``NEW_REQUEST_PROBE_AFTER`` plain steps (a
new prompt may be one it pays on), then backing off from where the last request left. A
source that had nothing to propose is asked at once (that depends on the prompt), but
backs off after one empty round instead of four. A source the request named (``--spec
ngram``) starts from the costs, acceptance and length learned, never from a back-off.
"""

from __future__ import annotations

from typing import Any

# A request that starts where the source last lost speculation probes within this many
# plain steps (what it carried over may be much longer: a new prompt is new evidence).
NEW_REQUEST_PROBE_AFTER = 16
FIRST_BACKOFF = 8
MAX_BACKOFF = 256


class SourceMemory:
    """What one source showed across requests. Written by :meth:`LengthController.remember`
    at the end of each request (on the engine thread), read when the next one starts."""

    def __init__(self) -> None:
        self.requests = 0
        self.acceptance: float | None = None
        self.plain_s: float | None = None
        self.per_draft_s: float | None = None
        self.length: int | None = None
        self.due = 0  # plain tokens still due before the next probe, when stopped
        self.backoff = FIRST_BACKOFF  # the next back-off after a losing probe
        self.stopped = False  # the last decision was to stop speculating
        self.empty = False  # the source last had nothing to propose, round after round
        self.empty_backoff = FIRST_BACKOFF

    def as_dict(self) -> dict[str, Any]:
        def r(x: float | None, n: int) -> float | None:
            return None if x is None else round(x, n)

        return {"requests": self.requests, "acceptance": r(self.acceptance, 4), "plain_s": r(self.plain_s, 6),
                "per_draft_s": r(self.per_draft_s, 6), "length": self.length, "stopped": self.stopped,
                "due": self.due, "backoff": self.backoff, "empty": self.empty}


class LengthController:
    """``fixed``: always ask for ``initial`` (the policy of a source the user chose)."""

    def __init__(self, initial: int = 4, maximum: int = 16, *, adaptive: bool = True, may_stop: bool = True,
                 memory: SourceMemory | None = None):
        self.initial = max(0, int(initial))
        self.maximum = max(self.initial, int(maximum))
        self.adaptive = adaptive
        self.may_stop = may_stop
        self.acceptance = 0.7  # prior; replaced by measurement within a few rounds
        self.plain_s: float | None = None
        self.per_draft_s: float | None = None
        self._k = self.initial
        self._rounds = 0
        self._off_left = 0  # plain steps before the next probe
        self._backoff = FIRST_BACKOFF
        self._stopped = False
        # Decoded tokens, counted as rounds are recorded (a block of plain steps when it is
        # handed out), and the count and back-off length at the last decision to stop.
        self._tokens = 0
        self._in_block = False
        self._off_at = 0
        self._off_len = 0
        self._empty = False  # backing off because the source had nothing to propose
        self._empty_run = 0  # rounds in a row the source proposed nothing
        self._empty_backoff = FIRST_BACKOFF
        self.memory = memory if adaptive else None
        if self.memory is not None and self.memory.requests:
            self._recall(self.memory)

    def _recall(self, m: SourceMemory) -> None:
        """Start from what earlier requests learned about this source."""
        if m.acceptance is not None:
            self.acceptance = m.acceptance
        self.plain_s, self.per_draft_s = m.plain_s, m.per_draft_s
        if m.length is not None:
            self._k = min(max(m.length, 1), self.maximum) if self.initial else 0
        if m.empty and self.may_stop:
            # Whether prompt lookup finds anything depends on the prompt: ask this one at
            # once, but one empty round is enough to back off again, for longer.
            self._empty_backoff, self._empty_run = m.empty_backoff, 3
        if self.may_stop:
            self._backoff = m.backoff
            self._stopped = m.stopped
            if m.stopped:
                self._off_len = m.due
                self._off_left = min(m.due, NEW_REQUEST_PROBE_AFTER)

    def remember(self, decoded: int | None = None) -> None:
        """Leave what this request learned to the next one (the request is over, after
        ``decoded`` tokens from its rounds: the controller's own count when None)."""
        m = self.memory
        if m is None:
            return
        m.requests += 1
        tokens = self._tokens if decoded is None else decoded
        if self.may_stop:
            m.stopped, m.backoff = self._stopped, self._backoff
            m.due = max(0, self._off_len - (tokens - self._off_at)) if self._stopped else 0
            m.empty, m.empty_backoff = self._empty, self._empty_backoff
        if self._rounds == 0:
            return
        m.acceptance = self.acceptance
        if self.plain_s is not None:
            m.plain_s = self.plain_s
        if self.per_draft_s is not None:
            m.per_draft_s = self.per_draft_s
        m.length = self._k

    def current(self) -> int:
        return self._k

    @property
    def in_block(self) -> bool:
        """A block of plain steps was handed out and its time not recorded yet."""
        return self._in_block

    def next_length(self) -> int:
        if self._off_left > 0:
            self._off_left -= 1
            return 0
        if not self.adaptive:
            return self.initial
        if self.plain_s is None:
            # One plain step first when the cost of a proposed token is known before the plain
            # step: measure both.
            return self._k if self._rounds == 0 or self.per_draft_s is None else 0
        return self._k

    def _best(self) -> int:
        a = min(max(self.acceptance, 0.0), 0.995)
        t1 = self.plain_s or 1e-3
        m = self.per_draft_s if self.per_draft_s is not None else t1 / 4
        best_k, best_rate = 0, 1.0 / t1
        gain = 1.0
        expected = 1.0
        for k in range(1, self.maximum + 1):
            gain *= a
            expected += gain
            rate = expected / (t1 + m * k)
            if rate > best_rate * 1.0001:
                best_k, best_rate = k, rate
        return best_k

    def take_off_steps(self) -> int:
        """Plain steps to run now, back to back (speculation is off for them)."""
        off, self._off_left = self._off_left, 0
        self._tokens += off
        self._in_block = off > 0
        return off

    def cut_off_steps(self, unused: int) -> None:
        """The block of plain steps ended ``unused`` steps early (the source saw a run it
        may propose right): the next round probes."""
        self._tokens -= max(int(unused), 0)

    def empty(self) -> None:
        """The source had nothing to propose: after a few such rounds in a row, stop asking
        for a while (the plain steps then run pipelined, as without speculation)."""
        self._empty_run += 1
        if self._empty_run >= 4:
            self._empty_run = 0
            self._off_left = self._empty_backoff
            self._empty_backoff = min(self._empty_backoff * 2, 64)
            self._empty = True
            self._off_at, self._off_len = self._tokens, self._off_left

    def record(self, proposed: int, accepted: int, seconds: float) -> None:
        """A round of ``proposed`` tokens, ``accepted`` of them kept, took ``seconds``."""
        self._rounds += 1
        if proposed:
            self._tokens += accepted + 1
        elif self._in_block:
            self._in_block = False  # the block's steps were counted when handed out
        else:
            self._tokens += 1
        if proposed == 0:
            self.plain_s = seconds if self.plain_s is None else 0.8 * self.plain_s + 0.2 * seconds
            return
        self._empty_run = 0
        self._empty = False
        if accepted:
            self._empty_backoff = 8
        rate = accepted / proposed
        self.acceptance = 0.7 * self.acceptance + 0.3 * rate
        if self.plain_s is not None:
            m = max(seconds - self.plain_s, 0.0) / proposed
            self.per_draft_s = m if self.per_draft_s is None else 0.7 * self.per_draft_s + 0.3 * m
        else:
            m = seconds / (proposed + 1)
            self.per_draft_s = m if self.per_draft_s is None else 0.7 * self.per_draft_s + 0.3 * m
        if not self.adaptive or self.plain_s is None:
            return
        best = self._best()
        if best == 0 and self.may_stop:
            self._off_left = self._backoff
            self._backoff = min(self._backoff * 2, MAX_BACKOFF)
            self._k = max(1, min(self.initial, 2))
            self._stopped = True
            self._off_at, self._off_len = self._tokens, self._off_left
        else:
            self._stopped = False
            if best > 0 and self._backoff > FIRST_BACKOFF:
                self._backoff = max(FIRST_BACKOFF, self._backoff // 2)
            self._k = max(best, 1)
            if accepted == proposed and proposed >= self._k:
                # A fully accepted window says little about longer ones: grow geometrically.
                self._k = min(self.maximum, max(self._k, 2 * proposed))
