"""A throttle for the log lines that hostile or broken peers can trigger.

Every process that parses the protocol logs malformed input, and a peer can send a million
malformed messages a second: one line (or one traceback) per message would let it fill the
disk and spend our CPU on formatting.  `RateLimitedLog` writes at most one line per
interval per instance and says, on the next line it writes, how many it held back.

Must never: touch a socket or parse a frame.
"""
from __future__ import annotations

import logging
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """``warning``/``exception`` at most once per ``every`` seconds; the rest are counted."""

    def __init__(self, logger: logging.Logger, every: float = 1.0):
        self.log = logger
        self.every = every
        self.last = -float("inf")
        self.suppressed = 0

    def _due(self) -> bool:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            return True
        self.suppressed += 1
        return False

    def _tail(self, msg: str) -> str:
        if self.suppressed:
            msg += f" ({self.suppressed} similar messages suppressed)"
            self.suppressed = 0
        return msg

    def warning(self, msg: str, *args) -> None:
        if self._due():
            self.log.warning(self._tail(msg), *args)

    def exception(self, msg: str, *args) -> None:
        """Like `logging.Logger.exception` (the traceback included), throttled."""
        if self._due():
            self.log.exception(self._tail(msg), *args)
