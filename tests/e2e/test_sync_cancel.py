"""The blocking client's cancel paths against the real processes (`python -m broker`,
`python -m gpu_worker`): a handle's `cancel()`, KeyboardInterrupt while `infer` waits, and
`infer(timeout=...)`; and when the cancelled call's input slots go back.

The service is the gate model (tests/e2e/gate_model.py) on one worker that holds one request
at a time (`--max-batch 1 --credit 1`): each call reads one byte from a FIFO before it
answers, so a first request keeps the worker busy until the test writes a byte, and the next
ones wait in the broker's queue.  That a cancelled request never ran is shown by counting
bytes: the broker dispatches one client's requests in order, so had the cancelled (queued)
request run, it would have taken the byte written for the request sent after it, and that one
would never be answered.  That the broker heard a CANCEL is shown by its CANCELLED answer: a
queued request with a 10 s deadline is finalised within seconds only because it was
cancelled.  Every wait polls a condition with a timeout; nothing sleeps.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from client_sdk import Cancelled, Client, DeadlineExceeded, EndOfStream
from tests.alarms import alarm

from .conftest import wait_service

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0      # bound of every blocking wait, and the requests' own deadline
AT_ONCE = 0.25   # "at once", generous for a loaded machine (what proves it: nothing was routed)


@pytest.fixture
def gated(cluster, gate):
    """A broker and one gate worker that holds a single request at a time."""
    cluster.broker()
    p = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "1",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    p.wait_ready()
    return cluster


def _x(v: float) -> dict:
    # Ordinary arrays above P.SMALL_INLINE_BYTES (8 KiB): each is copied into a temporary
    # slot of the client's pool (smaller ones would travel inline).
    return {"x": np.full(2048, v, np.float32)}


def _pump_until(c: Client, cond, what: str, timeout: float = WAIT, each=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if each is not None:
            each()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        c.pump(0.05)


def _busy(c: Client):
    """A first request, running on the worker (blocked on the gate) once this returns."""
    wait_service(c, "gate")
    h = c.infer_stream("gate", _x(1), timeout=WAIT)
    # The worker had credit, so the broker dispatched it on arrival; the MMI answer says
    # the broker has handled it.
    assert c.mmi_service("gate", timeout=WAIT)
    return h


def _served_after(c: Client, gate, busy) -> None:
    """Finish `busy` and show the queue behind it held nothing but a request sent now."""
    nxt = c.infer_stream("gate", _x(3), timeout=WAIT)
    gate.release(1)  # the busy request's byte
    with busy.result(timeout=WAIT) as r:
        np.testing.assert_array_equal(r["x"], _x(1)["x"])
    gate.release(1)  # exactly one more: a cancelled request that ran would take it
    with nxt.result(timeout=WAIT) as r:
        np.testing.assert_array_equal(r["x"], _x(3)["x"])
    assert c.in_flight() == 0
    assert c.pool.in_use() == 0


def test_handle_cancel_of_a_queued_request(gated, gate):
    with Client(gated.frontend, timeout=WAIT) as c:
        busy = _busy(c)
        h = c.infer_stream("gate", _x(2), timeout=WAIT)
        assert c.mmi_service("gate", timeout=WAIT)  # queued at the broker behind `busy`
        assert c.pool.in_use() == 2 and c.in_flight() == 2
        strays = c.stray_replies

        t0 = time.monotonic()
        assert h.cancel() is True
        assert time.monotonic() - t0 < AT_ONCE
        assert h.cancelled and not busy.cancelled
        t0 = time.monotonic()
        with pytest.raises(Cancelled) as ei:
            h.result()
        with pytest.raises(Cancelled):
            next(h)
        with pytest.raises(Cancelled):
            h.result(timeout=WAIT)
        assert time.monotonic() - t0 < AT_ONCE
        assert ei.value.request_id == h.request_id and ei.value.code == 499
        assert h.cancel() is True  # idempotent
        h.close()                  # and close() after it is harmless

        # Nothing waited for the broker: its answer has not been routed yet.  The input slot
        # goes back when that CANCELLED FINAL arrives, not before.
        assert c.stray_replies == strays and c.pool.in_use() == 2
        _pump_until(c, lambda: c.stray_replies > strays, "the broker's CANCELLED final",
                    each=lambda: c.pool.in_use() == 2 or pytest.fail("slot freed before the FINAL"))
        assert c.stray_replies == strays + 1
        assert c.pool.in_use() == 1 and c.in_flight() == 1  # only the running request's

        _served_after(c, gate, busy)


def test_handle_cancel_of_a_running_request_frees_the_caller_at_once(gated, gate):
    """Client side only (the worker's handling of a running request's CANCEL is its own):
    the call ends at once; the slots wait for whatever FINAL the worker sends.  Before that,
    `result(timeout)` bounds the wait and leaves the request in flight."""
    with Client(gated.frontend, timeout=WAIT) as c:
        busy = _busy(c)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as ei:
            busy.result(timeout=0.1)
        assert not isinstance(ei.value, DeadlineExceeded)
        assert time.monotonic() - t0 < 5.0
        assert not busy.cancelled and c.in_flight() == 1  # still in flight

        t0 = time.monotonic()
        assert busy.cancel() is True
        with pytest.raises(Cancelled):
            busy.result(timeout=WAIT)
        assert time.monotonic() - t0 < AT_ONCE
        assert c.pool.in_use() == 1  # the worker may be reading it
        gate.release(1)              # let the model return, whatever the worker makes of it
        _pump_until(c, lambda: c.in_flight() == 0, "the running request's FINAL")
        assert c.pool.in_use() == 0

        # The worker is free again and serves the next request; a handle whose FINAL was
        # taken has nothing left to cancel or return.
        h = c.infer_stream("gate", _x(4), timeout=WAIT)
        gate.release(1)
        with h.result(timeout=WAIT) as r:
            np.testing.assert_array_equal(r["x"], _x(4)["x"])
        assert h.cancel() is False and not h.cancelled
        with pytest.raises(EndOfStream):
            h.result()
        assert c.pool.in_use() == 0


class _Interrupt:
    """SIGALRM raising KeyboardInterrupt after `delay` seconds, as Ctrl-C would, in the main
    thread; pytest-timeout's alarm is kept meanwhile and after (tests/alarms.py)."""

    def __init__(self, delay: float):
        def handler(signum, frame):
            raise KeyboardInterrupt

        self._alarm = alarm(handler, delay)

    def __enter__(self):
        self._alarm.__enter__()
        return self

    def __exit__(self, *exc):
        return self._alarm.__exit__(*exc)


def test_keyboard_interrupt_in_infer_cancels_at_the_broker(gated, gate):
    with Client(gated.frontend, timeout=WAIT) as c:
        busy = _busy(c)
        strays = c.stray_replies
        t0 = time.monotonic()
        with _Interrupt(0.3), pytest.raises(KeyboardInterrupt):
            c.infer("gate", _x(2), timeout=WAIT)  # queued behind `busy` until interrupted
        assert time.monotonic() - t0 < 5.0
        # The CANCEL left before the exception did: the broker answers the queued request
        # CANCELLED long before its deadline, and that FINAL frees its slot.
        assert c.in_flight() == 2 and c.pool.in_use() == 2
        _pump_until(c, lambda: c.in_flight() == 1, "the broker's CANCELLED final", timeout=5.0)
        assert c.stray_replies == strays + 1 and c.pool.in_use() == 1
        _served_after(c, gate, busy)


def test_infer_timeout_on_a_queued_request(gated, gate):
    with Client(gated.frontend, timeout=WAIT) as c:
        busy = _busy(c)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.infer("gate", _x(2), timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 5.0
        _pump_until(c, lambda: c.in_flight() == 1, "the timed-out request's FINAL", timeout=5.0)
        assert c.pool.in_use() == 1
        _served_after(c, gate, busy)


def test_close_right_after_cancel_leaks_nothing(gated, gate):
    """Closing the client before the CANCELLED final arrives: the pool goes with the client
    (the autouse leak check sees every segment closed and the reply socket unlinked)."""
    c = Client(gated.frontend, timeout=WAIT)
    try:
        busy = _busy(c)
        h = c.infer_stream("gate", _x(2), timeout=WAIT)
        assert h.cancel() and busy.cancel()
        assert c.pool.in_use() == 2
    finally:
        c.close()
    assert c.closed and c.in_flight() == 0
    with pytest.raises(Cancelled):
        h.result()
    gate.release(1)  # the worker finishes the running one for nobody
