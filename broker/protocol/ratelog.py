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


#: suppressed messages a `RateLimitedLog.flush` line shows (the first ones held back)
SHOWN = 3


class RateLimitedLog:
    """``warning``/``exception`` at most once per ``every`` seconds; the rest are counted,
    the first `SHOWN` of them kept (unformatted: a flood costs no formatting) for `flush`."""

    def __init__(self, logger: logging.Logger, every: float = 1.0):
        self.log = logger
        self.every = every
        self.last = -float("inf")
        self.suppressed = 0
        #: (msg, args) of the first `SHOWN` different suppressed ones since the last line -> how
        #: many times each came (the same words held three times were written three times)
        self._held: dict = {}

    def _due(self, msg: str, args: tuple, extra: dict | None = None) -> bool:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            return True
        self.suppressed += 1
        rid = extra.get("rid") if extra else None
        # A held line about a request keeps its rid in the summary (grep finds it there).
        key = (msg + " rid=%s", (*args, rid)) if rid is not None else (msg, args)
        held = self._held
        try:
            if key in held:
                held[key] += 1
            elif len(held) < SHOWN:
                held[key] = 1
        except TypeError:  # (an argument that cannot be hashed: held as it comes)
            if len(held) < SHOWN:
                held[(msg, id(args), args)] = 1
        return False

    def _tail(self, msg: str) -> str:
        if self.suppressed:
            msg += f" ({self.suppressed} similar messages suppressed)"
            self.suppressed = 0
            self._held = {}
        return msg

    def warning(self, msg: str, *args, extra: dict | None = None) -> None:
        """``extra``: the line's fields (a request's ``rid``: kept in `flush`'s summary too)."""
        if self._due(msg, args, extra):
            self.log.warning(self._tail(msg), *args, extra=extra)

    def exception(self, msg: str, *args) -> None:
        """Like `logging.Logger.exception` (the traceback included), throttled."""
        if self._due(msg, args):
            self.log.exception(self._tail(msg), *args)

    def flush(self) -> None:
        """Once the interval is over, write what was held back since the last line, if any
        (the first few, and how many in all): a burst's tail was said only with the next
        line, that is never when none came (the metrics hunt: two of four worker deaths at
        once were in no line at all).  Call it periodically (the broker: once a second)."""
        if not self.suppressed or time.monotonic() - self.last < self.every:
            return
        shown = []
        for key, k in self._held.items():
            msg, args = key[0], key[-1]
            try:
                text = msg % args if args else msg
            except Exception:  # (a message that does not format is shown as it is)
                text = msg
            shown.append(text if k == 1 else f"{text} (x{k})")
        held = sum(self._held.values())
        n, self.suppressed, self._held = self.suppressed, 0, {}
        self.last = time.monotonic()
        more = f"; and {n - held} more" if n > held else ""
        self.log.warning("%d similar messages held back in the last %gs: %s%s", n, self.every, "; ".join(shown), more)
