"""`wire.tcp_liveness` over spans of days: libzmq applies its TCP keepalive settings to every
connection a socket accepts or makes, and closes one whose settings the kernel refuses.  A
third of a span of more than about 27 hours is a probe interval over Linux's 32767 s: no tcp
connection of the socket ever came up (the broker's tcp frontend under a client liveness
window of more than half a day, its backend under heartbeat_interval x heartbeat_liveness
of more than 13.6 hours, a client with a heartbeat interval of more than 5.5 hours), and
nothing said why; a span of more than about 24.8 days raised OverflowError (TCP_MAXRT is a
C int of milliseconds).  Found by the long-uptime hunt.  Loopback tcp, real sockets."""
from __future__ import annotations

import pytest
import zmq

from broker.protocol.wire import MAX_KEEPALIVE_PROBES, MAX_KEEPALIVE_S, MAX_WAIT_MS, keepalive_plan, tcp_liveness

pytestmark = pytest.mark.timeout(30)

DAY = 86400.0


def test_short_spans_keep_their_plan():
    assert keepalive_plan(10.0) == (3, 3, 10_000)   # a third, three probes, the span
    assert keepalive_plan(0.2) == (1, 3, 1000)      # keepalive takes whole seconds; MAXRT a second at least
    assert keepalive_plan(3 * 3600.0) == (3600, 3, 3 * 3600 * 1000)


@pytest.mark.parametrize("span", [DAY, 2 * DAY, 12.5 * DAY, 24.9 * DAY, 48 * DAY, 83 * DAY, float("inf"), float("nan")])
def test_long_spans_stay_in_what_linux_and_libzmq_take(span):
    idle, probes, maxrt = keepalive_plan(span)
    assert 1 <= idle <= MAX_KEEPALIVE_S and 3 <= probes <= MAX_KEEPALIVE_PROBES and 1000 <= maxrt <= MAX_WAIT_MS
    if span <= MAX_KEEPALIVE_S * (MAX_KEEPALIVE_PROBES + 1):
        # An unreachable idle peer is still dropped after about the span, not much sooner.
        assert idle * (1 + probes) >= span


@pytest.mark.parametrize("span", [10.0, 2 * DAY, 90 * DAY])
def test_a_socket_with_a_long_span_still_takes_tcp_connections(span):
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        tcp_liveness(router, span)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        tcp_liveness(dealer, span)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"ping")
        assert router.poll(5000), f"no message over a tcp connection in 5 s with a liveness span of {span} s"
        route, body = router.recv_multipart()
        assert body == b"ping"
        router.send_multipart([route, b"pong"])
        assert dealer.poll(5000) and dealer.recv() == b"pong"
    finally:
        ctx.destroy(linger=0)
