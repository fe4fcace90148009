"""tests/alarms.py: a test's own SIGALRM keeps pytest-timeout's."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.alarms import alarm


def _wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        threading.Event().wait(0.005)  # polling a flag a signal handler sets (a condition)
    return cond()


def test_the_alarm_rings_and_pytest_timeouts_timer_is_left_armed():
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    if left <= 0:
        pytest.skip("pytest-timeout's signal method armed no timer here")
    theirs = signal.getsignal(signal.SIGALRM)
    rang = []
    t0 = time.monotonic()
    with alarm(lambda *_: rang.append(1), 0.02):
        assert _wait_for(lambda: rang)
        # rung once, pytest-timeout's deadline armed again at once (not after the block)
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= left
    assert rang == [1]
    assert signal.getsignal(signal.SIGALRM) is theirs
    after, _ = signal.getitimer(signal.ITIMER_REAL)
    assert left - (time.monotonic() - t0) - 0.05 <= after <= left, (left, after)


def test_an_earlier_deadline_of_the_timer_it_shares_runs_its_own_handler():
    """What pytest-timeout armed rings at its time, with its handler, inside the block (here
    an outer `alarm` stands for it)."""
    outer, inner = [], []
    with alarm(lambda *_: outer.append(time.monotonic()), 0.05):
        with alarm(lambda *_: inner.append(1), 30.0):
            assert _wait_for(lambda: outer)
        assert inner == [] and len(outer) == 1


def test_an_interval_alarm_rings_until_the_block_is_left():
    rang = []
    with alarm(lambda *_: rang.append(1), 0.001, 0.001):
        assert _wait_for(lambda: len(rang) >= 20)
    n = len(rang)
    threading.Event().wait(0.05)  # a span in which a timer left armed would ring (not a sync)
    assert len(rang) == n


def test_a_shared_deadline_that_rang_inside_the_block_is_not_armed_again_on_leaving():
    """pytest-timeout's handler ran inside the block (its test timed out): leaving the block
    does not arm that deadline again (its handler ran a second time, raising wherever the
    test's cleanup was).  Here a plain handler and timer stand for pytest-timeout's."""
    calls = []
    t0 = time.monotonic()
    theirs = signal.signal(signal.SIGALRM, lambda *_: calls.append(1))
    left, _ = signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        with alarm(lambda *_: None, 30.0):
            assert _wait_for(lambda: calls)
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
        threading.Event().wait(0.1)  # a span in which a deadline armed again would ring (not a sync)
        assert calls == [1]
    finally:
        signal.signal(signal.SIGALRM, theirs)
        if left > 0:  # pytest-timeout's own, less the time spent
            signal.setitimer(signal.ITIMER_REAL, max(1e-6, left - (time.monotonic() - t0)))
