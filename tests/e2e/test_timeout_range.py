"""Every timeout a client takes is a wait it can make, however long: a month (`timeout=30 *
86400`, "no limit in practice") raised OverflowError from the blocking `Client`, after the
request had gone out, wherever a wait went to a poll in whole milliseconds (a C int of them:
about 24.8 days): every call with heartbeats off, and `request()` (its own socket, no
heartbeats) with them on (the timeouts hunt).  `AsyncClient` waited with asyncio's timers
and was not affected.  Each wait is now at most `wire.MAX_WAIT_MS`, and the caller loops on
its deadline.  Real processes; each call returns at once (an echo)."""
from __future__ import annotations

import numpy as np
import pytest

from broker.protocol.wire import MAX_WAIT_MS, wait_ms
from client_sdk import Client

from .conftest import Proc, wait_service

pytestmark = pytest.mark.timeout(60)

MONTH = 30 * 86400.0
HUGE = 1e300


def test_wait_ms():
    assert wait_ms(None) == -1
    assert wait_ms(0) == 0 and wait_ms(-3.0) == 0
    assert wait_ms(0.0004) == 1 and wait_ms(0.25) == 250 and wait_ms(1.0001) == 1001  # rounded up
    assert wait_ms(MONTH) == MAX_WAIT_MS == wait_ms(HUGE)


@pytest.mark.parametrize("timeout", [MONTH, HUGE])
@pytest.mark.parametrize("heartbeat", [None, 1.0])
def test_a_blocking_client_takes_a_timeout_of_a_month_or_more(cluster, timeout, heartbeat):
    cluster.broker()
    cluster.worker("echo")
    x = np.arange(4, dtype=np.float32)
    with Client(cluster.frontend, timeout=10, heartbeat_interval=heartbeat) as c:
        wait_service(c, "echo")
        with c.infer("echo", {"x": x}, timeout=timeout) as r:
            np.testing.assert_array_equal(r["x"], x)
        assert c.mmi_service("echo", timeout=timeout)
        assert c.request("mmi.service", [b"echo"], timeout=timeout)[0] == b"200"
        with c.infer_stream("echo", {"x": x}, timeout=timeout) as h:
            with h.result(timeout=timeout) as r:
                np.testing.assert_array_equal(r["x"], x)
        with c.stream("echo", timeout=timeout, pin=False) as s:
            s.send({"x": x})
            with s.recv(timeout=timeout) as r:
                np.testing.assert_array_equal(r["x"], x)
        call = c.prepare("echo", {"x": x}, timeout=timeout)
        assert c.submit(call, timeout=timeout)
        while not call.inbox:
            c.pump(timeout)
        assert c.in_flight() == 0
    assert c.closed


def test_a_wait_refuses_nan_and_takes_inf_as_none(cluster):
    """`recv`, `result` and `pump` took NaN as "for ever" (a stream's recv) or "at once" (a
    handle's result): now `InvalidInput`, on both twins, and the call stays in flight;
    `math.inf` is no limit, as None (the timeouts hunt's left-over)."""
    import asyncio
    import math

    from client_sdk import AsyncClient, InvalidInput

    cluster.broker()
    cluster.worker("echo")
    x = np.arange(4, dtype=np.float32)
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        with c.infer_stream("echo", {"x": x}) as h:
            with pytest.raises(InvalidInput, match="timeout must be None or a number"):
                h.result(timeout=math.nan)
            with h.result(timeout=math.inf) as r:
                np.testing.assert_array_equal(r["x"], x)
        with c.stream("echo", pin=False) as s:
            s.send({"x": x})
            with pytest.raises(InvalidInput, match="timeout must be None or a number"):
                s.recv(timeout=math.nan)
            with s.recv(timeout=math.inf) as r:
                np.testing.assert_array_equal(r["x"], x)
        with pytest.raises(InvalidInput, match="timeout must be None or a number"):
            c.pump(math.nan)

    async def twin() -> None:
        async with AsyncClient(cluster.frontend, timeout=10) as ac:
            h = ac.infer_stream("echo", {"x": x})
            with pytest.raises(InvalidInput, match="timeout must be None or a number"):
                await h.result(timeout=math.nan)
            with await h.result(timeout=math.inf) as r:
                np.testing.assert_array_equal(r["x"], x)
            s = ac.stream("echo", pin=False)
            s.send({"x": x})
            with pytest.raises(InvalidInput, match="timeout must be None or a number"):
                await s.recv(timeout=math.nan)
            with await s.recv(timeout=math.inf) as r:
                np.testing.assert_array_equal(r["x"], x)
            with pytest.raises(InvalidInput, match="timeout must be None or a number"):
                await ac.pump(math.nan)
            s.close()

    asyncio.run(twin())


def test_tcp_peers_connect_under_liveness_spans_of_days(tmp_path):
    """Liveness spans the flags allow, on tcp: a broker with heartbeats an hour apart and a
    liveness of 300 (its client window 12.5 days: the frontend's span, doubled, is over 24.8
    days of milliseconds) died at its start with OverflowError; its backend's span (12.5
    days) made every worker connection fail in libzmq (a keepalive interval over Linux's
    32767 s: EINVAL, the connection closed at once, nothing said); so did a client's broker
    connection with a heartbeat interval of 30,000 s, and one of 10^6 s raised OverflowError
    from the constructor (`wire.keepalive_plan`; the long-uptime hunt)."""
    b = Proc(["-m", "broker", "--frontend", "tcp://127.0.0.1:0", "--backend", "tcp://127.0.0.1:0", "--insecure",
              "--heartbeat-interval", "3600", "--heartbeat-liveness", "300"])
    w = None
    try:
        b.wait_ready()
        w = Proc(["-m", "gpu_worker", "--broker", b.field("backend"), "--model", "echo", "--insecure",
                  "--heartbeat-interval", "3600", "--heartbeat-liveness", "300"])
        w.wait_ready()
        x = np.arange(4, dtype=np.float32)
        for hb in (30_000.0, 1e6):
            with Client(b.field("frontend"), insecure=True, timeout=10, heartbeat_interval=hb) as c:
                wait_service(c, "echo")
                with c.infer("echo", {"x": x}) as r:
                    np.testing.assert_array_equal(r["x"], x)
    finally:
        for p in (w, b):
            if p is not None:
                p.close()
