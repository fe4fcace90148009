"""End to end: a client's connection to the broker is replaced under it (a reset: a middlebox,
a peer's crash, a connection closed for silence), with the same broker process behind it.

What was on the old connection is lost with it, and so is every reply the broker still had
to send on it (its ROUTER knows the client by the connection, and the new one has a new
identity).  The broker's heartbeat answers name the connection they came on; a client that
sees a new name sends again the calls it still waits for (docs/client.md, "When the
connection to the broker is replaced").  Before, such a call waited for its deadline, or
forever without one, while heartbeats went on being answered on the new connection.

The cut is a TCP relay between the client and the broker (`bench.relay`) that resets every
connection through it on demand (RST both ways) and keeps accepting new ones.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from bench.relay import Relay
from broker import protocol as P
from client_sdk import AsyncClient, Client

from .conftest import Proc

pytestmark = pytest.mark.timeout(120)

WAIT = 30.0


@contextlib.contextmanager
def _tcp_cluster(tmp_path, *worker_args: str, broker_hb: float = 0.2):
    """A plain-tcp broker (clients over loopback tcp, workers over ipc) and a `held` worker
    (tests/e2e/gate_model.py: a call with x < 0 runs until the test releases it; each call
    logs a line); yields (frontend port, log path, release(n), the worker's Proc)."""
    log = tmp_path / "runs.log"
    fifo = tmp_path / "gate.fifo"
    os.mkfifo(fifo)
    b = Proc(["-m", "broker", "--frontend", "tcp://127.0.0.1:0", "--backend", f"ipc://{tmp_path}/be.ipc",
              "--heartbeat-interval", str(broker_hb), "--insecure"])
    w = None
    gate_fd = None
    try:
        b.wait_ready()
        port = int(b.field("frontend").rsplit(":", 1)[1])
        env = {"SLEEPY_LOG": str(log), "GATE_FIFO": str(fifo)}  # Proc puts gate_model's folder on the path
        w = Proc(["-m", "gpu_worker", "--broker", f"ipc://{tmp_path}/be.ipc", "--model", "gate_model:held",
                  "--heartbeat-interval", "0.2", *worker_args], env=env)
        w.wait_ready()
        gate_fd = os.open(fifo, os.O_WRONLY)  # the worker holds it open read-write: never blocks
        yield port, log, lambda n: os.write(gate_fd, b"x" * n), w
    finally:
        if gate_fd is not None:
            os.close(gate_fd)
        for p in (w, b):
            if p is not None:
                p.close()


@pytest.fixture
def tcp_broker(tmp_path):
    with _tcp_cluster(tmp_path, "--credit", "1") as (port, log, release, _):
        yield port, log, release


def _runs(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def _until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.01)  # polling an outside condition (a file), not synchronising with a process


async def _held_then_cut(c: AsyncClient, x: np.ndarray, log: Path, relay: Relay) -> asyncio.Future:
    """Start a held call on `c` (once the hello's answer named the connection: MMI is a round
    trip behind it), wait until it runs at the worker, reset the connection; the call's task."""
    assert await c.mmi_service("held")
    task = asyncio.ensure_future(c.infer("held", {"x": x}))
    deadline = time.monotonic() + 20
    while _runs(log) < 1:
        assert time.monotonic() < deadline and not task.done(), "the call did not start at the worker"
        await asyncio.sleep(0.01)  # polling a file, not synchronising with a process
    await asyncio.to_thread(relay.cut)
    return task


def test_the_broker_names_the_connection_in_its_heartbeat_answers_when_asked(tcp_broker):
    """A HEARTBEAT with the flag that asks for it gets an answer that names the connection
    it came on: the same name on every answer on that connection, another on another, and
    not the ROUTER's identity itself (a keyed hash of it: a client learns "the same or
    not", not how many connections came before it).  Without the flag (an older SDK, a
    plain MDP client), the answer is what it always was."""
    port = tcp_broker[0]
    ctx = zmq.Context.instance()
    named, anon, old = (ctx.socket(zmq.DEALER) for _ in range(3))
    try:
        named.setsockopt(zmq.ROUTING_ID, b"me-1")
        for s in (named, anon, old):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")

        def answer(s, ask=True) -> list:
            s.send_multipart(P.client_heartbeat(ask_route=ask))
            assert s.poll(10_000), "no heartbeat answer"
            frames = s.recv_multipart()
            assert P.parse_broker_to_client(frames).command == P.C_HEARTBEAT
            return frames

        first, again = answer(named)[4], answer(named)[4]
        other = answer(anon)[4]
        assert first == again and len(first) == 8 and other != first and b"me-1" not in first
        assert len(answer(old, ask=False)) == 4  # instance and window only
    finally:
        for s in (named, anon, old):
            s.close(0)


def test_a_call_whose_connection_was_reset_while_it_ran_still_gets_its_result_sync(tcp_broker):
    """The call runs at the worker; the relay resets the connection; the worker finishes,
    and the broker has no connection to send the FINAL on (it went to the old one).  libzmq
    connects again through the relay, the next heartbeat answer names the new connection,
    and the client sends the call again: it completes, once, with its result."""
    port, log, release = tcp_broker
    relay = Relay(port)
    try:
        with Client(f"tcp://127.0.0.1:{relay.port}", insecure=True, timeout=WAIT, heartbeat_interval=0.2) as c:
            assert c.mmi_service("held")  # a round trip: the hello's answer named the connection before it
            x = np.array([-1.0, 7.0])
            handle = c.infer_stream("held", {"x": x})
            _until(lambda: _runs(log) == 1, "the call starting at the worker")
            relay.cut()
            release(2)  # the first run (its FINAL goes nowhere) and the one sent again
            with handle.result(timeout=20) as r:
                assert np.array_equal(r["x"], x)
            assert c.broker_reconnects == 1 and c.broker_restarts == 0
            assert _runs(log) == 2 and relay.accepted == 2
            with c.infer("held", {"x": np.array([0.0])}) as r:  # and the client goes on as before
                assert r["x"][0] == 0.0
    finally:
        relay.close()


def test_a_call_whose_connection_was_reset_while_it_ran_still_gets_its_result_async(tcp_broker):
    """As above, for AsyncClient (its heartbeat task reads the answers)."""
    port, log, release = tcp_broker
    relay = Relay(port)

    async def main():
        async with AsyncClient(f"tcp://127.0.0.1:{relay.port}", insecure=True, timeout=WAIT,
                               heartbeat_interval=0.2) as c:
            x = np.array([-1.0, 7.0])
            task = await _held_then_cut(c, x, log, relay)
            release(2)
            with await asyncio.wait_for(task, 20) as r:
                assert np.array_equal(r["x"], x)
            assert c.broker_reconnects == 1 and c.broker_restarts == 0
            assert _runs(log) == 2 and relay.accepted == 2

    try:
        asyncio.run(main())
    finally:
        relay.close()


def test_a_call_on_a_lease_when_the_broker_connection_was_reset_still_gets_its_result(tmp_path):
    """The broker granted the lease to the old connection and ends it once it presumes that
    connection's client gone.  So the client, seeing the new route, ends the lease as a drain
    does: a call held at the worker on the lease when the connection to the broker was reset
    (the lease's own connection, straight to the worker, untouched) completes there, and
    runs once (it was sent through the broker too, and ran twice), while new calls go
    through the broker."""
    with _tcp_cluster(tmp_path, "--credit", "2", "--direct-tcp", "tcp://127.0.0.1:0", "--insecure") as (
            port, log, release, _), Relay(port) as relay:
        with Client(f"tcp://127.0.0.1:{relay.port}", insecure=True, pin=True, timeout=WAIT,
                    heartbeat_interval=0.2) as c:
            deadline = time.monotonic() + 20
            while not c.pinned("held"):
                assert time.monotonic() < deadline, "the client never pinned"
                c.infer("held", {"x": np.array([0.0])}).release()  # x = 0: not logged, not held
                if not c.pinned("held"):
                    c.pump(0.05)
            before = c.pinned_replies
            x = np.array([-1.0, 7.0])
            handle = c.infer_stream("held", {"x": x})
            _until(lambda: _runs(log) == 1, "the call starting at the worker, on the lease")
            relay.cut()
            deadline = time.monotonic() + 20
            while not c.broker_reconnects:  # the next heartbeat answer names the new connection
                assert time.monotonic() < deadline, "the client never saw its new connection"
                c.pump(0.05)
            assert not c.pinned("held")  # the lease is given back; its call stays on it
            release(2)  # (room for a second run, which would show in the log)
            with handle.result(timeout=20) as r:
                assert np.array_equal(r["x"], x)
            assert c.broker_reconnects == 1 and c.broker_restarts == 0
            assert c.pinned_replies == before + 1  # on the lease's connection
            c.infer("held", {"x": np.array([0.0])}).release()  # through the broker, after it
            assert _runs(log) == 1 and c.stray_replies == 0


@pytest.mark.parametrize("twin", ["sync", "async"])
def test_a_new_connection_is_named_at_once_not_at_the_next_heartbeat(tmp_path, twin):
    """The client watches its broker connection's handshakes (over tcp) and heartbeats at
    each new one, so the answer naming the connection, and the resend, come within a round
    trip of the reconnect rather than up to a heartbeat interval later: here the interval is
    5 s (the broker's too, so the client does not shorten it), and the client sees its new
    connection well inside it."""
    hb = 5.0
    with _tcp_cluster(tmp_path, "--credit", "1", broker_hb=hb) as (port, log, release, _), Relay(port) as relay:
        ep = f"tcp://127.0.0.1:{relay.port}"
        x = np.array([-1.0, 7.0])
        if twin == "sync":
            with Client(ep, insecure=True, timeout=WAIT, heartbeat_interval=hb) as c:
                assert c.mmi_service("held")  # the hello's answer named the connection before it
                handle = c.infer_stream("held", {"x": x})
                _until(lambda: _runs(log) == 1, "the call starting at the worker")
                relay.cut()
                t0 = time.monotonic()
                while not c.broker_reconnects:
                    assert time.monotonic() - t0 < hb / 2, "the new connection was named only by a later heartbeat"
                    c.pump(0.05)
                release(2)
                with handle.result(timeout=20) as r:
                    assert np.array_equal(r["x"], x)
            return

        async def main():
            async with AsyncClient(ep, insecure=True, timeout=WAIT, heartbeat_interval=hb) as c:
                task = await _held_then_cut(c, x, log, relay)
                t0 = time.monotonic()
                while not c.broker_reconnects:
                    assert time.monotonic() - t0 < hb / 2, "the new connection was named only by a later heartbeat"
                    await asyncio.sleep(0.01)  # the client's reader does the work; this only looks
                release(2)
                with await asyncio.wait_for(task, 20) as r:
                    assert np.array_equal(r["x"], x)

        asyncio.run(main())



@pytest.mark.parametrize("twin", ["sync", "async"])
def test_an_mmi_question_whose_answer_was_lost_with_the_connection_is_asked_again(tcp_broker, twin):
    """The broker answers `mmi.service`, and the relay drops that answer and resets the
    connection with it (`Relay.cut_at`): the answer is lost.  The client, seeing its new
    connection named, asks again what it still waits for, and `mmi_service` returns the
    answer, where before it waited for its timeout (or forever without one)."""
    port = tcp_broker[0]
    with Relay(port) as relay:
        ep = f"tcp://127.0.0.1:{relay.port}"
        if twin == "sync":
            with Client(ep, insecure=True, timeout=WAIT, heartbeat_interval=0.2) as c:
                assert c.mmi_service("held")  # a round trip: the hello's answer named the connection
                relay.cut_at(b"mmi.service")
                assert c.mmi_service("held", timeout=10)
                assert c.broker_reconnects == 1 and relay.accepted == 2
            return

        async def main():
            async with AsyncClient(ep, insecure=True, timeout=WAIT, heartbeat_interval=0.2) as c:
                assert await c.mmi_service("held")
                relay.cut_at(b"mmi.service")
                assert await c.mmi_service("held", timeout=10)
                assert c.broker_reconnects == 1 and relay.accepted == 2

        asyncio.run(main())
