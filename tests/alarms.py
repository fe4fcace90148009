"""A SIGALRM for a test's own use that keeps pytest-timeout's.

pytest-timeout (``timeout = 60``, its signal method) arms the process's one ``ITIMER_REAL``
for each test, with its own SIGALRM handler.  A test that set the timer and handler for its
own stimulus and then disarmed the timer (``setitimer(ITIMER_REAL, 0)``) ran the rest of its
body and its teardown with no timeout at all: a hang there waited for CI's job limit.

`alarm` shares the timer: it arms it for whichever comes first, the test's alarm or
pytest-timeout's deadline; at pytest-timeout's deadline pytest-timeout's handler runs (the
test fails, with its stacks, as without `alarm`), and on leaving, pytest-timeout's timer and
handler are as they were, less the time spent.
"""
from __future__ import annotations

import contextlib
import signal
import time


@contextlib.contextmanager
def alarm(handler, delay: float, interval: float = 0.0):
    """``handler(signum, frame)`` runs in a SIGALRM ``delay`` seconds from now, then every
    ``interval`` seconds (0: once), until the block is left."""
    theirs_handler = signal.getsignal(signal.SIGALRM)
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    theirs = time.monotonic() + left if left > 0 else None  # pytest-timeout's deadline
    due = [time.monotonic() + delay]  # our next alarm; None once a one-shot one rang
    fired = [False]  # pytest-timeout's handler ran: its deadline is not armed again on leaving
    leaving = [False]  # the block is being left: a tick that comes now arms nothing

    def arm() -> None:
        nxt = [t for t in (due[0], theirs) if t is not None]
        signal.setitimer(signal.ITIMER_REAL, max(1e-6, min(nxt) - time.monotonic()) if nxt else 0.0)

    def on_alarm(signum, frame) -> None:
        now = time.monotonic()
        if theirs is not None and now >= theirs:  # pytest-timeout's time: its handler, as it armed it
            due[0] = None
            fired[0] = True
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            signal.signal(signal.SIGALRM, theirs_handler)
            if callable(theirs_handler):
                theirs_handler(signum, frame)
            return
        if leaving[0]:
            return  # (our alarm's last tick, as the block ends: nothing to run, nothing to arm)
        if due[0] is not None and now >= due[0]:
            due[0] = now + interval if interval > 0 else None
            arm()  # before the handler, which may raise
            handler(signum, frame)
            return
        arm()  # (early by the monotonic clock: the rest of the wait)

    signal.signal(signal.SIGALRM, on_alarm)
    try:
        arm()
        yield
    finally:
        leaving[0] = True
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, theirs_handler)
        if theirs is not None and not fired[0]:
            signal.setitimer(signal.ITIMER_REAL, max(1e-6, theirs - time.monotonic()))
