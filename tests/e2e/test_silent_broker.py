"""A broker that answers nothing (SIGSTOP: a frozen container, a debugger, a wedged host)
fails a waiting call with `BrokerUnreachable` at the client's liveness window (5 heartbeat
intervals), whatever the call waits on; not with `DeadlineExceeded` at its timeout, and not
never with `timeout=None` (the timeouts hunt):

- an `mmi_service` question (both twins): it had no liveness check at all (a question to a
  stopped broker raised DeadlineExceeded at its timeout, 10 s here; with none it waited for
  ever, heartbeats on);
- a call whose REQUEST the client's socket will not take (the high-water mark full: the
  broker does not read): the blocking `Client` waited in its send for the call's whole
  timeout, for ever with none, where `AsyncClient` queues the message and fails the call at
  the window.

Real processes; the stop is the stimulus, every wait has a timeout.  Bounds: the window is
1 s (heartbeats every 0.2 s); the client looks at least once a heartbeat period, and a
client process that did not run for two periods (a loaded machine) counts the silence again
from its return, once: a call fails within two windows and a period of its start on an idle
machine, and `LATE` leaves 3 s more for scheduling on a loaded 2-core one, still far from
the 10 s timeout that the calls waited for before."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from client_sdk import AsyncClient, BrokerUnreachable, Client

from .conftest import wait_service

pytestmark = pytest.mark.timeout(60)

HB_S = 0.2
WINDOW_S = 5 * HB_S
TIMEOUT_S = 10.0                       # each call's own: what they waited for before
LATE = 2 * WINDOW_S + HB_S + 3.0       # see the docstring


@pytest.fixture
def stopped(cluster):
    """A broker with an echo worker, and a function that stops the broker (SIGSTOP); it is
    continued at teardown, before the cluster stops it."""
    broker = cluster.broker()
    cluster.worker("echo")

    def stop():
        os.kill(broker.p.pid, signal.SIGSTOP)

    yield stop
    os.kill(broker.p.pid, signal.SIGCONT)


def _fails_in_window(fn) -> BrokerUnreachable:
    t0 = time.monotonic()
    with pytest.raises(BrokerUnreachable) as ei:
        fn()
    took = time.monotonic() - t0
    assert took < LATE, f"failed after {took:.2f}s, window {WINDOW_S}s"
    return ei.value


def test_an_mmi_question_to_a_silent_broker_fails_at_the_window(cluster, stopped):
    with Client(cluster.frontend, timeout=TIMEOUT_S, heartbeat_interval=HB_S) as c:
        wait_service(c, "echo")
        stopped()
        err = _fails_in_window(lambda: c.mmi_service("echo"))
        assert "mmi.service question about 'echo'" in str(err)


def test_an_asyncio_mmi_question_to_a_silent_broker_fails_at_the_window(cluster, stopped):
    async def main():
        async with AsyncClient(cluster.frontend, timeout=TIMEOUT_S, heartbeat_interval=HB_S) as c:
            while not await c.mmi_service("echo"):
                await asyncio.sleep(0.01)  # polling a condition, as wait_service does
            stopped()
            t0 = time.monotonic()
            with pytest.raises(BrokerUnreachable):
                await c.mmi_service("echo")
            took = time.monotonic() - t0
            assert took < LATE, f"failed after {took:.2f}s, window {WINDOW_S}s"

    asyncio.run(main())


def test_a_call_the_full_socket_will_not_take_fails_at_the_window(cluster, stopped):
    x = {"x": np.zeros(1000, np.float32)}  # inline (under 4 KiB): nothing held in shared memory
    with Client(cluster.frontend, timeout=TIMEOUT_S, heartbeat_interval=HB_S) as c:
        wait_service(c, "echo")
        stopped()
        # Fill the socket: submit(timeout=0) says False once it takes no more.
        for _ in range(100_000):
            call = c.prepare("echo", x)
            if not c.submit(call, timeout=0):
                c.give_up(call)
                break
        else:
            pytest.fail("the socket to a stopped broker took 100000 requests")
        in_flight = c.in_flight()
        err = _fails_in_window(lambda: c.infer("echo", x))
        assert "queue is full" in str(err) and "not even heartbeats" in str(err)
        assert c.in_flight() == in_flight  # the refused call is forgotten
        _fails_in_window(lambda: c.mmi_service("echo"))
