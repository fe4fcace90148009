"""`AsyncClient.infer`'s lean path, held to the handle's behaviour.

`AsyncClient.infer` waits for its call without a reply-stream handle: the reader resolves a
plain future through `call.notify`, one client-wide timer wakes the calls whose deadline has
passed, and each reader callback reads the socket whose descriptor signalled.  It must send,
deliver and cancel exactly what `infer_stream(...).result()` does: a deadline and a cancelled
task give the call up (CANCEL goes out), PARTIALs are released, a streaming service raises
NotSupported, and a pinned call goes through the broker when its lease's connection cannot
take it.  Run against test_sdk_client's fake broker and test_lean_path's fake leased worker.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import zmq

from broker import protocol as P
from broker.protocol import ErrorCode, Priority
from client_sdk import AsyncClient, BrokerUnreachable, DeadlineExceeded, InferenceError, InvalidInput, errors
from client_sdk import aio

from .test_lean_path import TRACEPARENT, FakeLeaseWorker, LeasingFakeBroker
from .test_sdk_client import WAIT, FakeBroker

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def no_handle(monkeypatch):
    """`infer` must not build a reply-stream handle (infer_stream still may)."""
    def refuse(*a, **kw):
        raise AssertionError("AsyncClient.infer built a reply-stream handle")

    monkeypatch.setattr(aio.AsyncClient, "infer_stream", refuse)


async def _get(q, timeout: float = WAIT):
    """A queue of the fakes' threads, read without blocking the loop (the reader must run)."""
    return await asyncio.to_thread(q.get, timeout=timeout)


def _last_request(fake) -> P.Request:
    service, req = fake.requests[-1]
    assert isinstance(req, P.Request), (service, req)
    return req


# ================================================================================================
# through the broker

async def test_infer_deadline_raises_and_cancels(fake, endpoint, no_handle):
    fake.answer_cancel = False
    async with AsyncClient(endpoint, timeout=WAIT) as c:
        r = await c.infer("echo", {"x": np.arange(4)})
        np.testing.assert_array_equal(r["x"], np.arange(4))
        r.release()
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as ei:
            await c.infer("hold", {"x": np.arange(4)}, timeout=0.2)
        # Not before its deadline, and on its own 0.2 s, not the client's timeout (WAIT): no
        # tighter bound, which would measure the machine's load.
        assert 0.15 < time.monotonic() - t0 < WAIT
        rid = await _get(fake.held_q)
        assert ei.value.request_id == rid
        assert await _get(fake.cancels) == rid  # CANCEL went out before the error left
        assert c.in_flight() == 1  # until the FINAL that answers the cancellation
        fake.release(1)
        r = await c.infer("echo", {"x": np.ones(2)})  # the late FINAL is routed first, and dropped
        np.testing.assert_array_equal(r["x"], np.ones(2))
        r.release()
        assert c.in_flight() == 0 and c.stray_replies == 1


async def test_a_cancelled_task_cancels_its_call(fake, endpoint, no_handle):
    fake.answer_cancel = False
    async with AsyncClient(endpoint, transport="shm", timeout=WAIT) as c:
        task = asyncio.create_task(c.infer("hold", {"x": np.zeros(5)}))
        rid = await _get(fake.held_q)
        assert c.pool.in_use() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _get(fake.cancels) == rid
        assert c.pool.in_use() == 1 and c.in_flight() == 1  # no FINAL yet: the worker may still read
        fake.release(1)
        (await c.infer("echo", {"x": np.ones(1)})).release()
        assert c.pool.in_use() == 0 and c.in_flight() == 0 and c.stray_replies == 1
        # asyncio.timeout() cancels the task the same way
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await c.infer("hold", {"x": np.zeros(5)})
        rid = await _get(fake.held_q)
        assert await _get(fake.cancels) == rid


async def test_errors_partials_and_a_streamed_empty_final(fake, endpoint, no_handle):
    async with AsyncClient(endpoint, transport="shm", timeout=WAIT) as c:
        with pytest.raises(errors.WorkerFailed):
            await c.infer("error", {"x": np.zeros(1)}, meta={"code": int(ErrorCode.WORKER_FAILED)})
        # PARTIALs are released unread and the FINAL is the result.
        r = await c.infer("partials", {"x": np.arange(3)}, meta={"n": 3})
        with r:
            assert r.final and r.seq == 3
            np.testing.assert_array_equal(r["x"], np.arange(3))
        # A FINAL with no tensors after PARTIALs means the service streams: NotSupported.
        with pytest.raises(errors.NotSupported, match="infer_stream"):
            await c.infer("partials", {}, meta={"n": 2})
        assert c.in_flight() == 0 and c.pool.in_use() == 0


async def test_options_take_the_general_path_and_reach_the_header(fake, endpoint, no_handle):
    async with AsyncClient(endpoint, timeout=WAIT) as c:
        (await c.infer("echo", {"x": np.arange(2)})).release()
        req = _last_request(fake)
        assert (req.priority, req.meta, req.traceparent, req.reply) == (int(Priority.NORMAL), {}, None, "auto")
        (await c.infer("echo", {"x": np.arange(2)}, priority="urgent", meta={"k": 7}, traceparent=TRACEPARENT,
                       reply="inline")).release()
        req = _last_request(fake)
        assert (req.priority, req.meta, req.traceparent, req.reply) == (0, {"k": 7}, TRACEPARENT, "inline")
        (await c.infer("echo", {"x": np.arange(2)})).release()  # nothing of them sticks
        req = _last_request(fake)
        assert (req.priority, req.meta, req.traceparent, req.reply) == (1, {}, None, "auto")
        x = {"x": np.arange(2)}
        for bad in ({"reply": "bogus"}, {"priority": "bogus"}, {"traceparent": 5}, {"timeout": -1}):
            with pytest.raises(InvalidInput):
                await c.infer("echo", x, **bad)
        with pytest.raises(InvalidInput, match="service"):
            await c.infer(b"echo", x)
        assert c.in_flight() == 0
    with pytest.raises(InferenceError, match="closed"):
        await c.infer("echo", x)


async def test_many_waiters_one_deadline_timer(fake, endpoint, no_handle):
    """One timer serves every waiting infer: armed at the earliest deadline, again when an
    earlier one comes, and it wakes each call at its own deadline."""
    async with AsyncClient(endpoint, timeout=WAIT) as c:
        (await c.infer("echo", {"x": np.arange(2)})).release()
        timer = c._deadline_timer
        assert timer is not None
        for _ in range(20):  # later deadlines each: no new timer
            (await c.infer("echo", {"x": np.arange(2)})).release()
        assert c._deadline_timer is timer
        t0 = time.monotonic()
        slow = asyncio.create_task(c.infer("hold", {"x": np.arange(2)}, timeout=3.0))
        fast = asyncio.create_task(c.infer("hold", {"x": np.arange(2)}, timeout=0.2))
        both = [await _get(fake.held_q), await _get(fake.held_q)]
        with pytest.raises(DeadlineExceeded):
            await fast
        # At its own deadline, not the slow one's (3 s): the upper bound leaves a loaded
        # machine over a second.
        assert 0.15 < time.monotonic() - t0 < 2.0
        assert not slow.done()
        with pytest.raises(DeadlineExceeded):
            await slow
        assert time.monotonic() - t0 >= 2.95
        assert sorted([await _get(fake.cancels), await _get(fake.cancels)]) == sorted(both)
        # ... and concurrent infers all get their own results
        results = await asyncio.gather(*(c.infer("echo", {"x": np.full(3, i)}) for i in range(16)))
        for i, r in enumerate(results):
            np.testing.assert_array_equal(r["x"], np.full(3, i))
            r.release()
        assert c.in_flight() in (0, 2)  # the two held ones until the fake answers their CANCEL
        assert not c._waiters


async def test_close_wakes_a_waiting_infer_with_an_error(fake, endpoint, no_handle):
    c = AsyncClient(endpoint, timeout=WAIT)
    await c.__aenter__()
    task = asyncio.create_task(c.infer("hold", {"x": np.arange(2)}))
    await _get(fake.held_q)
    t0 = time.monotonic()
    await c.close()
    with pytest.raises(InferenceError, match="closed while") as ei:
        await task
    assert not isinstance(ei.value, DeadlineExceeded) and time.monotonic() - t0 < WAIT / 4


async def test_a_silent_broker_fails_the_infer_and_cancels(endpoint, no_handle):
    """No answer, not even to heartbeats: BrokerUnreachable after the liveness window, and
    CANCEL on its way before the error leaves."""
    ctx = zmq.Context.instance()
    r = ctx.socket(zmq.ROUTER)
    r.linger = 0
    r.bind(endpoint)
    try:
        async with AsyncClient(endpoint, timeout=30, heartbeat_interval=0.05) as c:
            t0 = time.monotonic()
            with pytest.raises(BrokerUnreachable) as ei:
                await c.infer("svc", {"x": np.arange(2)})
            assert time.monotonic() - t0 < WAIT / 2
            rid = ei.value.request_id
            seen = []
            stop = time.monotonic() + WAIT
            while P.C_CANCEL not in seen and time.monotonic() < stop:
                if r.poll(100):
                    ident, *f = r.recv_multipart()
                    seen.append(f[1])
                    if f[1] == P.C_CANCEL:
                        assert P.decode_cancel(f[3]).id == rid
            assert P.C_REQUEST in seen and P.C_CANCEL in seen
    finally:
        r.close(0)


def test_on_uvloop(fake, endpoint):
    """The same waits on uvloop (`client_sdk.aio.run`): its futures and timers."""
    pytest.importorskip("uvloop")
    fake.answer_cancel = False

    async def main():
        async with AsyncClient(endpoint, timeout=WAIT) as c:
            r = await c.infer("echo", {"x": np.arange(3)})
            np.testing.assert_array_equal(r["x"], np.arange(3))
            r.release()
            with pytest.raises(DeadlineExceeded):
                await c.infer("hold", {"x": np.arange(2)}, timeout=0.2)
            rid = await _get(fake.held_q)
            assert await _get(fake.cancels) == rid
            task = asyncio.create_task(c.infer("hold", {"x": np.arange(2)}))
            rid = await _get(fake.held_q)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await _get(fake.cancels) == rid
            fake.release(2)
            (await c.infer("echo", {"x": np.ones(2)})).release()
            assert c.in_flight() == 0 and c.stray_replies == 2

    aio.run(main())


# ================================================================================================
# pinned: the fake leased worker

@pytest.fixture
async def pinned(tmp_path_factory):
    d = tmp_path_factory.mktemp("pinaio")
    worker = FakeLeaseWorker(f"ipc://{d}/w.sock")
    broker = LeasingFakeBroker(f"ipc://{d}/b.sock")
    broker.worker_endpoint = worker.endpoint
    worker.start()
    broker.start()
    c = AsyncClient(broker.endpoint, pin=True, timeout=WAIT)
    try:
        stop = time.monotonic() + WAIT
        while not c.pinned("echo") and time.monotonic() < stop:
            (await c.infer("echo", {"x": np.arange(2)})).release()  # the first ones go through the broker
            await asyncio.sleep(0.01)
        assert c.pinned("echo")
        while not worker.requests.empty():
            worker.requests.get()
        yield c, broker, worker
    finally:
        await c.close()
        broker.stop()
        worker.stop()


async def test_pinned_infer_goes_to_the_leased_worker(pinned, no_handle):
    c, broker, worker = pinned
    before = c.pinned_replies
    for i in range(5):
        r = await c.infer("echo", {"x": np.arange(i + 1)})
        np.testing.assert_array_equal(r["x"], np.arange(i + 1))
        r.release()
    assert c.pinned_replies == before + 5 and c.in_flight() == 0


async def test_pinned_deadline_and_task_cancellation_cancel_on_the_lease(pinned, no_handle):
    c, broker, worker = pinned
    with pytest.raises(DeadlineExceeded):
        await c.infer("echo", {"hold": np.arange(2)}, timeout=0.2)
    rid = await _get(worker.requests)
    assert await _get(worker.cancels) == rid
    task = asyncio.create_task(c.infer("echo", {"hold": np.arange(2)}))
    rid = await _get(worker.requests)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _get(worker.cancels) == rid


async def test_a_lease_connection_that_cannot_take_the_request_sends_it_through_the_broker(pinned, no_handle):
    c, broker, worker = pinned
    [lease] = c._pin_socks
    real = c._pin_socks[lease]
    blocked = zmq.Context.instance().socket(zmq.DEALER)  # no peer: every send is refused (EAGAIN)
    c._pin_socks[lease] = blocked
    try:
        n = len(broker.requests)
        r = await c.infer("echo", {"x": np.arange(3)})
        np.testing.assert_array_equal(r["x"], np.arange(3))
        r.release()
        assert len(broker.requests) == n + 1  # the broker's
        assert not c._core.pins["echo"].calls  # off the lease: its slot stays free
        assert worker.requests.empty()
    finally:
        c._pin_socks[lease] = real
        blocked.close(linger=0)
    before = c.pinned_replies
    (await c.infer("echo", {"x": np.arange(3)})).release()
    assert c.pinned_replies == before + 1  # the lease is used again


async def test_a_resend_lease_end_finds_the_replies_already_on_the_lease_routed(pinned):
    """As the blocking client's: replies wait on the lease's connection and a LEASE_END with
    resend on the broker's (the loop was busy meanwhile); the replies are routed first, so
    nothing goes through the broker a second time."""
    c, broker, worker = pinned
    [lease] = c._pin_socks
    lease_sock = c._pin_socks[lease]
    before = len(broker.call(lambda: list(broker.requests)))
    futs = [asyncio.ensure_future(c.infer("echo", {"x": np.arange(3) + i})) for i in range(2)]
    await asyncio.sleep(0)  # both sent on the lease
    # The loop is held (blocking calls, on purpose) while both messages arrive.
    for _ in futs:
        worker.requests.get(timeout=WAIT)
    assert lease_sock.poll(int(WAIT * 1000))
    ident = broker.call(lambda: broker.idents[-1])
    end = P.encode_header(P.LeaseEnd(lease=lease, reason="worker_failed", resend=True))
    broker.call(lambda: broker.sock.send_multipart([ident, *P.client_lease_end("echo", end)]))
    assert c._sock.poll(int(WAIT * 1000))
    for i, r in enumerate(await asyncio.wait_for(asyncio.gather(*futs), WAIT)):
        np.testing.assert_array_equal(r["x"], np.arange(3) + i)
        r.release()
    assert len(broker.call(lambda: list(broker.requests))) == before  # nothing resent
