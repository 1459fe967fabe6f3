"""The bound on every wait for the other ranks.

MLX collectives block inside C++ and cannot be interrupted: a peer that was stopped
(SIGSTOP), hangs, or never starts leaves the waiting rank blocked forever. One daemon
thread per process watches the waits the engine announces (``arm``: a wait for the other
ranks begins or made progress; ``disarm``: local work only) and, when one lasts longer
than its bound, prints ``mlxkv: error: rank N: ...`` and ends the process with status 1.

A lost connection is found sooner: the ring backend raises ``RuntimeError`` in the wait,
and the engine calls :func:`fail` with it. Ending the process at once is safe for the
prefix cache: every file the store writes appears whole or not at all (temporary name,
fsync, rename), so an interrupted write leaves at most an orphaned temporary file that
the store removes later.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_STATUS = 1


def fail(rank: int, message: str) -> None:
    """Print ``mlxkv: error: rank N: message`` and end the process now (status 1). Used when
    the group is broken: no collective can be issued any more, so nothing can unwind."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        sys.stderr.write(f"mlxkv: error: rank {rank}: {message}\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_STATUS)


class Watchdog:
    """Ends the process when an announced wait for the other ranks lasts too long."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self._cond = threading.Condition()
        self._what: str | None = None  # the wait in progress (None: local work only)
        self._since = 0.0
        self._bound = self.timeout_s
        self._thread = threading.Thread(target=self._watch, name="mlxkv-dist-watchdog",
                                         daemon=True)
        self._thread.start()

    def arm(self, what: str, bound_s: float | None = None) -> None:
        """A wait for the other ranks begins (or made progress): ``what`` it waits for, for
        at most ``bound_s`` (default: the timeout) from now."""
        with self._cond:
            self._what, self._since = what, time.monotonic()
            self._bound = self.timeout_s if bound_s is None else float(bound_s)
            self._cond.notify()

    def disarm(self) -> None:
        """Local work only from now on: nothing to bound."""
        with self._cond:
            self._what = None
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._what is None:
                    self._cond.wait()
                    continue
                left = self._since + self._bound - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                what, bound = self._what, self._bound
                break
        fail(self.rank, f"no answer from the other ranks for {bound:g} s while {what}: a rank "
                        "has died, hung or been stopped (the bound is --dist-timeout-s)")
