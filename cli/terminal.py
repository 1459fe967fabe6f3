"""Signals and line input for the chat.

SIGTERM unwinds like Ctrl-D (engine shutdown, prefix-cache flush) and exits 143. A signal
that lands while the chat waits for a line must take effect at once, so the wait is a
``select`` on stdin and a signal wakeup pipe. On a terminal the line is then read with
``input()`` (line editing); otherwise (a pipe, a file) lines are read from fd 0 into our
own buffer, because a ``select`` on fd 0 cannot see lines Python already buffered (two
piped lines arriving together would leave the second one unanswered).
"""

from __future__ import annotations

import os
import select
import signal
import sys
from types import FrameType
from typing import TextIO

_wakeup_fd: int | None = None  # read end of the signal wakeup pipe (main thread only)


class Terminated(BaseException):
    """SIGTERM. A BaseException so that the chat's Ctrl-C handling (cancel the reply)
    does not catch it."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def watch_signals() -> None:
    """SIGTERM raises :class:`Terminated`; signals also go to a wakeup pipe, so that a
    wait for input can wait on them too. Call from the main thread."""
    global _wakeup_fd
    signal.signal(signal.SIGTERM, _on_sigterm)
    if _wakeup_fd is None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        _wakeup_fd = r


def _wait_readable(fd: int) -> None:
    """Block until ``fd`` is readable; a signal's handler runs while waiting (SIGTERM and
    Ctrl-C raise from here), and a signal that raises nothing just resumes the wait."""
    if _wakeup_fd is None:
        return
    while True:
        ready, _, _ = select.select([fd, _wakeup_fd], [], [])
        if _wakeup_fd in ready:
            try:
                while os.read(_wakeup_fd, 512):
                    pass
            except BlockingIOError:
                pass
        if fd in ready:
            return


class LineReader:
    """``read(prompt)`` -> one line without its newline; EOFError at end of input."""

    def __init__(self, stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        self.tty = _isatty(self.stdin)
        self._buf = b""
        self._eof = False

    def read(self, prompt: str) -> str:
        self.stdout.write(prompt)
        self.stdout.flush()
        if self.tty:
            _wait_readable(self.stdin.fileno())
            return input()
        return self._read_line()

    def _read_line(self) -> str:
        fd = self.stdin.fileno()
        while b"\n" not in self._buf and not self._eof:
            _wait_readable(fd)
            chunk = os.read(fd, 65536)
            if chunk:
                self._buf += chunk
            else:
                self._eof = True
        if b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
        elif self._buf:  # a last line without a newline
            line, self._buf = self._buf, b""
        else:
            raise EOFError
        return line.decode("utf-8", errors="replace").rstrip("\r")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
