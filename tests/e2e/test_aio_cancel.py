"""The asyncio client under what asyncio applications do to it: tasks cancelled at any point
(`asyncio.wait_for`, `asyncio.timeout`, a TaskGroup cancelling siblings, shutdown), the
client closed by one task while others wait on it, a stream closed before its lease came.
Real broker and workers on ipc; every wait bounded."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client_sdk import AsyncClient, Client
from client_sdk.errors import InferenceError

pytestmark = pytest.mark.timeout(120)

X = np.arange(16, dtype=np.float32)


async def _until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        await asyncio.sleep(0.001)


def test_a_cancelled_task_stops_whatever_it_awaits(cluster):
    # On 3.11, `asyncio.wait_for` returns the inner result and drops the task's cancellation
    # when both come at once; the SDK's waits used it (with a deadline, the default), so a
    # task in a tight loop of calls ignored most cancels: 28-34 of 40 here.
    cluster.broker()
    cluster.worker("echo", "--direct")

    async def results(c, n):
        while True:
            async with c.infer_stream("echo", {"x": X}) as h:
                r = await h.result()
            r.release()
            n[0] += 1

    async def iterated(c, n):
        while True:
            async with c.infer_stream("echo", {"x": X}) as h:
                async for r in h:
                    r.release()
            n[0] += 1

    async def streamed(c, n):
        async with c.stream("echo") as s:
            while True:
                s.send({"x": X})
                r = await s.recv()
                r.release()
                n[0] += 1

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=10) as c:
            for loop in (results, iterated, streamed):
                for trial in range(10):
                    n = [0]
                    t = asyncio.create_task(loop(c, n))
                    await _until(lambda: n[0] >= 3 + trial % 4 or t.done(), what=f"{loop.__name__} calls")
                    t.cancel()
                    done, _ = await asyncio.wait([t], timeout=5)
                    assert done and t.cancelled(), f"{loop.__name__}: not cancelled (trial {trial})"
            with await c.infer("echo", {"x": X}) as r:  # and the client works on
                np.testing.assert_array_equal(r["x"], X)

    asyncio.run(scenario())


def test_a_task_cancelled_while_it_closes_the_client_is_cancelled_and_the_client_closed(cluster):
    cluster.broker()
    cluster.worker("echo")

    async def scenario():
        c = AsyncClient(cluster.frontend, timeout=10)
        with await c.infer("echo", {"x": X}) as r:  # started: its heartbeat task runs
            pass
        t = asyncio.create_task(c.close())
        await asyncio.sleep(0)  # one step: close() runs up to its one await
        t.cancel()
        done, _ = await asyncio.wait([t], timeout=5)
        assert done and t.cancelled()  # the cancellation went on (it was swallowed)
        assert c.closed
        # A task that caught a cancellation earlier (cleanup code, without uncancel()) still
        # closes a client without a CancelledError of its own.
        c2 = AsyncClient(cluster.frontend, timeout=10)
        with await c2.infer("echo", {"x": X}):
            pass

        async def caught_then_closes():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass
            await c2.close()
            return "closed"

        t = asyncio.create_task(caught_then_closes())
        await asyncio.sleep(0)
        t.cancel()
        assert await asyncio.wait_for(t, 10) == "closed" and c2.closed

    asyncio.run(scenario())


def test_close_wakes_every_task_that_waits_on_the_client(cluster, gate):
    # close() failed each call and then let go of them, error included: `infer` noticed, a
    # handle's result(), `async for`, a stream's recv() and mmi_service() waited for good
    # (or until their deadline, with the wrong error).
    cluster.broker()
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "8",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    w.wait_ready()

    async def result(c):
        async with c.infer_stream("gate", {"x": X}) as h:
            await h.result()

    async def iterated(c):
        async with c.infer_stream("gate", {"x": X}) as h:
            async for _ in h:
                pass

    async def streamed(c):
        async with c.stream("gate", pin=False) as s:
            s.send({"x": X})
            await s.recv()

    async def idle_stream(c):  # nothing in flight: no call of its own to be woken through
        async with c.stream("gate", pin=False) as s:
            async for _ in s:
                pass

    async def scenario():
        c = AsyncClient(cluster.frontend, timeout=None)
        assert await c.mmi_service("gate")
        tasks = [asyncio.create_task(f(c)) for f in (result, iterated, streamed, idle_stream)]
        asked = asyncio.create_task(c.mmi_service("gate"))
        await asyncio.sleep(0)  # each has sent and waits (or is about to)
        await c.close()
        done, pending = await asyncio.wait(tasks, timeout=5)
        assert not pending, pending
        for t in tasks:
            assert isinstance(t.exception(), InferenceError) and "closed" in str(t.exception())
        done, _ = await asyncio.wait([asked], timeout=5)
        assert done  # answered before the close, or told it closed: never a hang
        assert asked.exception() is None or isinstance(asked.exception(), InferenceError)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))  # its client waits without a timeout
    finally:
        gate.release(8)  # the gated calls end, so the worker can drain


def _gate_worker(cluster, gate):
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "8",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    w.wait_ready()


def test_a_call_made_while_close_waits_is_woken_by_the_close(cluster, gate):
    """close() waits (its linger) for the answers of what it cancelled; another task's call
    made meanwhile was sent, then let go of by the close without a word: its `infer`, its
    handle's `result()` waited for good (the close cancels the deadline timer too)."""
    cluster.broker()
    _gate_worker(cluster, gate)

    async def handle(c):
        async with c.infer_stream("gate", {"x": X}) as h:
            await h.result()

    async def scenario():
        c = AsyncClient(cluster.frontend, timeout=None, linger=0.5)
        assert await c.mmi_service("gate")
        held = c.infer_stream("gate", {"x": X})  # at the gate: close() waits for its answer
        await _until(lambda: gate.entered() >= 1, what="the gated call at its worker")
        closing = asyncio.create_task(c.close())
        await _until(lambda: held._call.abandoned, what="close() giving the held call up")
        assert not c.closed  # it waits
        late = [asyncio.create_task(c.infer("gate", {"x": X})), asyncio.create_task(handle(c))]
        await asyncio.wait_for(closing, 10)
        assert c.closed
        done, pending = await asyncio.wait(late, timeout=5)
        assert not pending, "a call made while close() waited was never woken"
        for t in late:
            assert isinstance(t.exception(), InferenceError) and "closed" in str(t.exception()), t.exception()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))  # its client waits without a timeout
    finally:
        gate.release(8)


def test_an_mmi_question_pending_while_close_waits_is_told_the_client_closed(cluster, gate):
    """close() woke the tasks waiting on the client before its wait; an mmi_service() woken
    with no answer and the client still open took the missing answer for the broker's:
    ProtocolError ("mmi.service answered b''"), not "the client was closed"."""
    broker = cluster.broker()
    _gate_worker(cluster, gate)

    async def scenario():
        c = AsyncClient(cluster.frontend, timeout=None, linger=0.5)
        assert await c.mmi_service("gate")
        held = c.infer_stream("gate", {"x": X})  # noqa: F841 (close() waits for its answer)
        await _until(lambda: gate.entered() >= 1, what="the gated call at its worker")
        os.kill(broker.p.pid, signal.SIGSTOP)  # the question stays unanswered
        try:
            asked = asyncio.create_task(c.mmi_service("gate"))
            await _until(c._core.mmi_waiting, what="the question asked")
            await asyncio.wait_for(c.close(), 10)
            done, _ = await asyncio.wait([asked], timeout=5)
            assert done
            e = asked.exception()
            assert isinstance(e, InferenceError) and "closed" in str(e), repr(e)
        finally:
            os.kill(broker.p.pid, signal.SIGCONT)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))  # its client waits without a timeout
    finally:
        gate.release(8)


def test_close_does_not_wait_on_a_silent_broker_past_its_window(cluster, gate):
    """close() does not wait for an answer through a broker silent for the liveness window
    (docs/client.md, "Closing with requests in flight"), on either twin: the asyncio one
    judged the silence only when something arrived, so a stopped broker held its close for
    the whole linger (the blocking one looks every heartbeat period)."""
    broker = cluster.broker()
    _gate_worker(cluster, gate)
    hb = 0.05  # the window: 5 intervals

    async def scenario():
        c = AsyncClient(cluster.frontend, timeout=None, heartbeat_interval=hb, linger=6)
        assert await c.mmi_service("gate")
        held = c.infer_stream("gate", {"x": X})  # noqa: F841 (close() waits for its answer)
        await _until(lambda: gate.entered() >= 1, what="the gated call at its worker")
        os.kill(broker.p.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            await asyncio.wait_for(c.close(), 20)
            took = time.monotonic() - t0
        finally:
            os.kill(broker.p.pid, signal.SIGCONT)
        assert c.closed and took < 3, f"close() waited {took:.1f}s on a broker silent after {5 * hb:g}s"

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))  # its client waits without a timeout
        gate.release(1)  # the twin's turn: its call reaches the gate
        c = Client(cluster.frontend, timeout=None, heartbeat_interval=hb, linger=6)
        held = c.infer_stream("gate", {"x": X})  # noqa: F841
        deadline = time.monotonic() + 10
        while gate.entered() < 2:
            assert time.monotonic() < deadline, "the gated call at its worker"
            time.sleep(0.005)  # polling a condition
        os.kill(broker.p.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            c.close()
            took = time.monotonic() - t0
        finally:
            os.kill(broker.p.pid, signal.SIGCONT)
        assert c.closed and took < 3, f"Client.close() waited {took:.1f}s on a broker silent after {5 * hb:g}s"
    finally:
        gate.release(8)


def _events(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        body = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name == "zmq_infer_broker_events_total":
                out[s.labels["event"]] = s.value
    return out


def test_a_stream_closed_before_its_lease_came_ends_that_lease(cluster):
    # A stream that pins on demand, closed at once (a TaskGroup or a timeout cancelling its
    # block): the LEASED that answers its ask came to a client that pinned nothing any more,
    # which dropped it as malformed; the lease held the worker's credit for the client's life.
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    cluster.worker("echo", "--direct")
    n = 5

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=10) as c:
            assert await c.mmi_service("echo")
            for _ in range(n):
                async with c.stream("echo") as s:
                    s.send({"x": X})
            # Each ask answered (granted or refused), then each granted lease ended.
            await asyncio.to_thread(_wait_events, base, lambda e: e.get("leases_granted", 0)
                                    + e.get("leases_refused", 0) >= n, "every ask answered")
            ev = await asyncio.to_thread(_wait_events, base, lambda e: e.get("leases_ended", 0)
                                         >= e.get("leases_granted", 0), "every granted lease ended")
            assert ev.get("leases_granted", 0) >= 1, ev
            with await c.infer("echo", {"x": X}) as r:
                np.testing.assert_array_equal(r["x"], X)

    asyncio.run(scenario())


def _wait_events(base, cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        ev = _events(base)
        if cond(ev):
            return ev
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s: {json.dumps(ev)}")
        time.sleep(0.02)


def test_a_client_whose_event_loop_was_closed_with_a_call_pending_still_closes(cluster):
    # loop.stop() with an infer pending, then loop.close(): every close() raised "Event loop
    # is closed" (waking the dead loop's futures first), and the socket, the reply inbox and
    # the pool stayed open until the process exited.
    cluster.broker("--service-grace", "60")  # no worker: the request waits at the broker
    loop = asyncio.new_event_loop()
    try:
        async def make():
            return AsyncClient(cluster.frontend, timeout=30)

        c = loop.run_until_complete(make())
        pending = loop.create_task(c.infer("nobody", {"x": np.zeros(3)}))
        loop.run_until_complete(asyncio.sleep(0.2))
        assert not pending.done()
    finally:
        loop.close()
    asyncio.run(c.close())
    assert c.closed


def _arrived(c) -> None:
    """Block the event loop's thread (no await: its reader cannot run) until a message is in
    one of the client's sockets."""
    import zmq

    poller = zmq.Poller()
    for sock in c._socks:
        poller.register(sock, zmq.POLLIN)
    assert poller.poll(10_000), "no reply within 10 s"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_reply_that_arrived_counts_with_no_time_left(cluster, loop):
    # Found by the asyncio hunt: `await s.recv(timeout=0)` never saw a reply already in the
    # socket (0 of 20 on both loops), and `await h.result(timeout=0)` half the time on plain
    # asyncio (its sleep(0) ran before the loop polled the socket): a polling AR gateway got
    # each result a frame late.  The blocking twin's pump(0) always saw it.
    cluster.broker()
    cluster.worker("echo")

    async def main():
        # No heartbeats: `_arrived` takes any message for the reply, and a heartbeat's answer
        # (one at each handshake, one an interval) came first once under load.
        async with AsyncClient(cluster.frontend, timeout=10, heartbeat_interval=None) as c:
            (await c.infer("echo", {"x": X})).release()  # its sockets and inbox made
            for _ in range(5):
                async with c.infer_stream("echo", {"x": X}) as h:
                    _arrived(c)
                    (await h.result(timeout=0)).release()
            async with c.stream("echo", pin=False) as s:
                for _ in range(5):
                    s.send({"x": X})
                    _arrived(c)
                    r = await s.recv(timeout=0)
                    np.testing.assert_array_equal(r["x"], X)
                    r.release()

    (__import__("uvloop").run if loop == "uvloop" else asyncio.run)(main())
