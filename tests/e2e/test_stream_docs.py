"""Frame streams as docs/client.md ("Streams (interactive / AR)", "Pinned streams", the
`stream(...)` entry, `close()`) and docs/operations.md (`zmq_infer_stream_dropped_frames_total`)
describe them, end to end, written from the docs alone: the counting identities across
send/recv/close in both modes, `unfinished()`, `recv(timeout)`'s range, EndOfStream, `for r
in s`, the asyncio stream's `finish()`/`close()`/`async for`, a stream after its client
closed, and the dropped-frames metric of a pinned stream.  Real broker and worker
(tests/e2e/gate_model.py's `tagged`: each result names its frame; held frames released by
the test), no sleeps as synchronisation."""
from __future__ import annotations

import asyncio
import gc
import weakref
import math
import time

import numpy as np
import pytest

from client_sdk import AsyncClient, Client, DeadlineExceeded, EndOfStream, InferenceError, InvalidInput

from .conftest import wait_service
from .test_metrics import scrape, value
from .test_stream_faults import SERVICE, WAIT, _f, _got, _pin, _pump_until, _tag, _worker

pytestmark = pytest.mark.timeout(60)


def _identities(st, numbered: int) -> None:
    """docs/client.md: `sent = completed + failed + in_flight + cancelled`, and every frame
    `send()` numbered is sent, dropped, expired or pending."""
    s = st.stats()
    assert s.sent == s.completed + s.failed + s.in_flight + s.cancelled, s
    assert numbered == s.sent + s.dropped + s.expired + s.pending, (numbered, s)
    return s


def _plain_timeout(e: BaseException) -> bool:
    """recv's "nothing arrived in time": a TimeoutError that is not a frame's DeadlineExceeded."""
    return isinstance(e, TimeoutError) and not isinstance(e, InferenceError)


@pytest.fixture
def held(cluster, gate, tmp_path):
    """A broker and one `tagged` worker (frames with what = 1 wait at the gate)."""
    cluster.broker()
    _worker(cluster, gate, tmp_path / "runs")
    gate.open()
    return gate


# ------------------------------------------------------------------ the counts, through send, recv and close

@pytest.mark.parametrize("latest_wins", [True, False])
def test_the_counts_add_up_through_send_recv_and_close(cluster, held, latest_wins):
    gate = held
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        st = c.stream(SERVICE, latest_wins=latest_wins, max_in_flight=2, pin=False)
        for i in range(5):
            assert st.send(_f(i, 1)) == i
        s = _identities(st, 5)
        # two sent (max_in_flight), the rest waits: one (the newest) with latest_wins, all otherwise
        assert (s.sent, s.in_flight) == (2, 2), s
        assert (s.pending, s.dropped) == ((1, 2) if latest_wins else (3, 0)), s
        assert st.unfinished() == ({0, 1, 4} if latest_wins else {0, 1, 2, 3, 4})
        gate.wait_entered(1)
        gate.release(1)
        assert _got(st.recv(timeout=WAIT)) == (0, 0)
        s = _identities(st, 5)
        assert (s.sent, s.completed, s.in_flight) == (3, 1, 2), s  # the recv made room: the next went
        assert 0 not in st.unfinished()
        st.send(_f(5, 1))
        s = _identities(st, 6)
        assert (s.pending, s.dropped) == ((1, 2) if latest_wins else (3, 0)), s
        st.close()  # frames 1 and the next, sent, are cancelled; the one(s) waiting are dropped
        s = _identities(st, 6)
        assert (s.in_flight, s.pending, s.cancelled, s.completed) == (0, 0, 2, 1), s
        assert s.dropped == 3, s
        assert st.unfinished() == frozenset()
        with pytest.raises(EndOfStream):
            st.recv(timeout=0)
        gate.release(16)
        _pump_until(c, lambda: c.in_flight() == 0 and (c.pool is None or c.pool.in_use() == 0), "all answered")
        assert len(s.latencies_ms) == 1 and s.latencies_ms[0] > 0, s


def test_an_unread_result_holds_its_place_and_stays_unfinished(cluster, held, tmp_path):
    """A result that arrived and is not read yet holds its place (the next frame is not sent
    for it) and its frame stays in `unfinished()` until `recv` hands it out."""
    gate = held
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=1, pin=False) as st:
            st.send(_f(0))
            st.send(_f(1))
            # frame 0 answered and read by the client, not yet by the caller
            _pump_until(c, lambda: c.in_flight() == 0, "frame 0 answered")
            s = _identities(st, 2)
            assert (s.sent, s.pending, s.in_flight) == (1, 1, 1), s
            assert st.unfinished() == {0, 1}
            r = st.recv(timeout=WAIT)
            assert _got(r) == (0, 0)
            assert st.unfinished() == {1} and st.stats().sent == 2
            assert [_got(r) for r in st] == [(1, 1)]  # `for r in s` drains what was sent
            assert st.unfinished() == frozenset()
            _identities(st, 2)


# ------------------------------------------------------------------ recv(timeout)

def test_recv_timeout_range(cluster, held):
    """0 or less: what has arrived, no wait (TimeoutError, the frame stays in flight); None
    or math.inf: no limit; NaN or a str: InvalidInput, the frame stays in flight; nothing
    outstanding: EndOfStream."""
    gate = held
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=2, pin=False) as st:
            with pytest.raises(EndOfStream):
                st.recv()  # nothing sent: not a wait
            with pytest.raises(EndOfStream):
                st.recv(timeout=math.inf)
            st.send(_f(0, 1))
            gate.wait_entered(1)
            for t in (0, 0.0, -1, -math.inf, 0.05):
                t0 = time.monotonic()
                with pytest.raises(TimeoutError) as e:
                    st.recv(timeout=t)
                assert _plain_timeout(e.value), repr(e.value)
                assert time.monotonic() - t0 < 0.05 + 1.0
            for t in (math.nan, "1", "nan"):
                with pytest.raises(InvalidInput):
                    st.recv(timeout=t)
            s = _identities(st, 1)
            assert (s.sent, s.in_flight, s.failed, s.cancelled) == (1, 1, 0, 0), s
            gate.release(1)
            assert _got(st.recv(timeout=None)) == (0, 0)
            st.send(_f(1, 1))
            gate.release(1)
            assert _got(st.recv(timeout=math.inf)) == (1, 1)
            with pytest.raises(EndOfStream):
                st.recv(timeout=0)


def test_recv_refuses_a_bad_timeout_even_with_nothing_outstanding(cluster, held):
    """A bad `timeout` is the caller's mistake whatever the stream holds: InvalidInput, not
    EndOfStream (which would read as "all done")."""
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, pin=False) as st:
            for t in (math.nan, "1"):
                with pytest.raises(InvalidInput):
                    st.recv(timeout=t)

    async def on_the_loop():
        async with AsyncClient(cluster.frontend, timeout=WAIT) as ac:
            st = ac.stream(SERVICE, pin=False)
            st.finish()
            for t in (math.nan, "1"):
                with pytest.raises(InvalidInput):
                    await st.recv(timeout=t)
            st.close()

    asyncio.run(asyncio.wait_for(on_the_loop(), 20))


# ------------------------------------------------------------------ deadlines in latest_wins mode

def test_latest_wins_a_waiting_frame_past_its_deadline_is_never_sent(cluster, held, tmp_path):
    """With latest_wins too: a frame still waiting for room when its deadline passes is never
    sent, fails in its turn with DeadlineExceeded ("never sent") and counts in `expired`; the
    frame that was sent fails with its own deadline; the next frame goes at once."""
    gate = held
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        # (1 s: frame 3 below is answered within it, after frame 0's held run is released)
        with c.stream(SERVICE, latest_wins=True, max_in_flight=1, pin=False, timeout=1.0, reply="inline") as st:
            st.send(_f(0, 1))
            st.send(_f(1))
            st.send(_f(2))  # replaces frame 1
            s = _identities(st, 3)
            assert (s.sent, s.pending, s.dropped) == (1, 1, 1), s
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded) as e:
                st.recv(timeout=WAIT)
            assert "never sent" not in str(e.value)
            with pytest.raises(DeadlineExceeded, match="frame 2 .*never sent"):
                st.recv(timeout=WAIT)
            assert time.monotonic() - t0 < 4.0
            s = _identities(st, 3)
            assert (s.sent, s.failed, s.expired, s.dropped, s.pending, s.in_flight) == (1, 1, 1, 1, 0, 0), s
            gate.release(1)
            st.send(_f(3))
            assert _got(st.recv(timeout=WAIT)) == (3, 3)
            _identities(st, 4)
        _pump_until(c, lambda: c.pool is None or c.pool.in_use() == 0, "every input slot freed")


# ------------------------------------------------------------------ a frame refused before it left

def test_a_frame_refused_before_it_left_fails_in_its_turn(cluster, held):
    """A frame whose request is refused before it leaves (input names that make a header over
    1 MiB) fails alone: `send()` numbers it, `recv` raises its error in its turn, and it counts
    in `sent` and then `failed`; the frames around it keep their results."""
    gate = held
    huge = {"n" * (1 << 20) + "x": np.zeros(4, np.int64), **_f(1)}
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=1, pin=False) as st:
            assert st.send(_f(0, 1)) == 0
            assert st.send(huge) == 1  # waits for room: sent by the recv below
            assert st.send(_f(2)) == 2
            gate.release(1)
            assert _got(st.recv(timeout=WAIT)) == (0, 0)
            with pytest.raises(InvalidInput):
                st.recv(timeout=WAIT)
            assert _got(st.recv(timeout=WAIT)) == (2, 2)
            s = _identities(st, 3)
            assert (s.sent, s.completed, s.failed) == (3, 2, 1), s


# ------------------------------------------------------------------ after the client closed

def test_a_stream_after_its_client_closed(cluster, held):
    """`recv()` hands out what had arrived (in send order), then InferenceError; `stream()`
    on the closed client is InferenceError before anything is sent."""
    gate = held
    c = Client(cluster.frontend, timeout=WAIT)
    try:
        wait_service(c, SERVICE)
        # (outputs inline: the held frame's answer comes after the close, and a shared-memory
        # output it named would stay lent, the worker's stop waiting --drain-grace-s for it)
        st = c.stream(SERVICE, latest_wins=False, max_in_flight=3, pin=False, reply="inline")
        st.send(_f(0))
        st.send(_f(1))
        st.send(_f(2, 1))  # held: still out when the client closes
        _pump_until(c, lambda: c.in_flight() == 1, "frames 0 and 1 answered")
    finally:
        c.close(linger=0)
    assert [_got(st.recv(timeout=WAIT)) for _ in range(2)] == [(0, 0), (1, 1)]
    with pytest.raises(InferenceError) as e:
        st.recv(timeout=WAIT)
    assert not isinstance(e.value, (EndOfStream, DeadlineExceeded)), repr(e.value)
    assert "closed" in str(e.value)
    with pytest.raises(InferenceError, match="closed"):
        st.send(_f(3))
    with pytest.raises(InferenceError, match="closed"):
        c.stream(SERVICE)
    st.close()
    s = st.stats()
    assert s.sent == s.completed + s.failed + s.in_flight + s.cancelled, s
    gate.release(1)


def test_an_async_stream_after_its_client_closed(cluster, held):
    """The same on AsyncClient, whose loop reads replies as they come: results that arrived
    are handed out in send order, then InferenceError; a `recv()` waiting when the client
    closes raises InferenceError ("this stream's client was closed...")."""
    gate = held

    async def scenario():
        c = AsyncClient(cluster.frontend, timeout=WAIT)
        try:
            st = c.stream(SERVICE, latest_wins=False, max_in_flight=3, pin=False)
            other = c.stream(SERVICE, latest_wins=False, max_in_flight=3, pin=False, reply="inline")
            st.send(_f(0))
            st.send(_f(1))
            other.send(_f(10))
            assert _got(await other.recv(WAIT)) == (0, 10)
            other.send(_f(11, 1))  # held
            deadline = time.monotonic() + WAIT
            while c.in_flight() > 1:  # frames 0 and 1 answered: the loop read them
                assert time.monotonic() < deadline, "frames 0 and 1 not answered"
                await c.pump(0.02)
            s = _identities(st, 2)
            assert (s.in_flight, s.completed) == (2, 0), s  # arrived, not received
            waiting = asyncio.ensure_future(other.recv())  # waits on frame 11 when the client closes
            await asyncio.sleep(0)
        finally:
            await c.close(linger=0)
        assert [_got(await st.recv(WAIT)) for _ in range(2)] == [(0, 0), (1, 1)]
        with pytest.raises(InferenceError, match="closed") as e:
            await st.recv(0)  # then the close says so (nothing outstanding: still not EndOfStream)
        assert not isinstance(e.value, EndOfStream), repr(e.value)
        with pytest.raises(InferenceError, match="closed") as e:
            await asyncio.wait_for(waiting, WAIT)
        assert not isinstance(e.value, (EndOfStream, DeadlineExceeded)), repr(e.value)
        with pytest.raises(InferenceError, match="closed"):
            st.send(_f(2))
        with pytest.raises(InferenceError, match="closed"):
            c.stream(SERVICE)
        for x in (st, other):
            _identities(x, x.stats().sent + x.stats().pending)
            x.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    gate.release(1)


# ------------------------------------------------------------------ the asyncio stream

def test_async_stream_finish_close_and_async_for(cluster, held):
    """`await s.recv()` with nothing outstanding waits for the next `send()`; `async for`
    ends after `finish()` once everything sent is in, or at `close()`, which cancels the
    outstanding frames now; then recv is EndOfStream."""
    gate = held

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=WAIT) as c:
            st = c.stream(SERVICE, latest_wins=False, max_in_flight=2, pin=False)
            with pytest.raises(TimeoutError) as e:
                await st.recv(timeout=0.05)  # nothing outstanding, not finished: it waits
            assert _plain_timeout(e.value), repr(e.value)
            waiting = asyncio.ensure_future(st.recv())
            await asyncio.sleep(0)
            assert st.send(_f(0)) == 0
            assert _got(await asyncio.wait_for(waiting, WAIT)) == (0, 0)
            for i in (1, 2, 3):
                st.send(_f(i))
            st.finish()
            assert [(r.frame, _tag(r)) async for r in st] == [(1, 1), (2, 2), (3, 3)]
            with pytest.raises(EndOfStream):
                await st.recv(timeout=WAIT)
            s = _identities(st, 4)
            assert (s.completed, s.in_flight) == (4, 0), s

            st = c.stream(SERVICE, latest_wins=False, max_in_flight=2, pin=False)
            for i in range(4):
                st.send(_f(i, 1))
            gate.wait_entered(1)

            async def reader():
                return [r.frame async for r in st]

            task = asyncio.ensure_future(reader())
            await asyncio.sleep(0)
            st.close()
            assert await asyncio.wait_for(task, WAIT) == []
            s = _identities(st, 4)
            assert (s.sent, s.cancelled, s.dropped, s.in_flight, s.pending) == (2, 2, 2, 0, 0), s
            with pytest.raises(EndOfStream):
                await st.recv(timeout=WAIT)
            assert st.unfinished() == frozenset()
            gate.release(16)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_stream_dropped_without_close_cancels_its_frames(cluster, held, tmp_path):
    """`stream(...)`: a stream dropped without `close()` is closed when it is garbage-collected:
    its frames in flight are cancelled (frame 1, queued behind frame 0 at the worker, never
    runs; so one byte at the gate ends everything)."""
    gate = held
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        st = c.stream(SERVICE, latest_wins=False, max_in_flight=2, pin=False)
        st.send(_f(0, 1))
        st.send(_f(1, 1))
        gate.wait_entered(1)
        del st
        gc.collect()
        gate.release(1)
        _pump_until(c, lambda: c.in_flight() == 0, "frame 1 cancelled")
    assert [line.split()[1] for line in (tmp_path / "runs").read_text().splitlines()] == ["0"]

    async def on_the_loop():  # an AsyncStream the same
        async with AsyncClient(cluster.frontend, timeout=WAIT) as ac:
            st = ac.stream(SERVICE, latest_wins=False, max_in_flight=2, pin=False)
            st.send(_f(2, 1))
            st.send(_f(3, 1))
            while gate.entered() < 2:
                await asyncio.sleep(0.005)  # polls a file
            ref = weakref.ref(st)
            del st
            gc.collect()
            assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
            gate.release(1)
            deadline = time.monotonic() + WAIT
            while ac.in_flight():
                assert time.monotonic() < deadline, "frame 3 was not cancelled"
                await ac.pump(0.02)

    asyncio.run(asyncio.wait_for(on_the_loop(), 30))
    assert [line.split()[1] for line in (tmp_path / "runs").read_text().splitlines()] == ["0", "2"]


# ------------------------------------------------------------------ the dropped-frames metric, pinned

def test_the_dropped_frames_metric_counts_a_pinned_streams_drops(cluster, gate, tmp_path):
    """operations.md: frames given up unsent (replaced, or expired), a pinned stream's from its
    worker's STATS, told on the next frame sent: those after the stream's last frame are not
    counted."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    _worker(cluster, gate, tmp_path / "runs", "--direct")
    gate.open()
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, latest_wins=True, max_in_flight=1) as st:
            n = _pin(c, st)
            st.send(_f(n, 1))
            for i in range(n + 1, n + 5):
                st.send(_f(i))  # n+1 .. n+3 replaced
            gate.release(1)
            assert _got(st.recv(timeout=WAIT)) == (n, n)
            assert _got(st.recv(timeout=WAIT)) == (n + 4, n + 4)
            st.send(_f(n + 5))  # tells the 3 drops
            assert _got(st.recv(timeout=WAIT)) == (n + 5, n + 5)
            st.send(_f(n + 6, 1))
            st.send(_f(n + 7))
            st.send(_f(n + 8))  # replaces n+7, and is sent (told) once n+6 is in
            gate.release(1)
            assert [r.frame for r in st] == [n + 6, n + 8]
            st.send(_f(n + 9, 1))
            st.send(_f(n + 10))
            st.send(_f(n + 11))  # replaces n+10; n+11 is dropped at the close: neither told
            s = _identities(st, n + 12)
            assert c.pinned_replies > 0
        s = _identities(st, n + 12)
        assert (s.dropped, s.cancelled) == (6, 1), s
        with c.stream(SERVICE, pin=False) as other:  # another stream's frame tells none of them
            other.send(_f(0))
            gate.release(1)
            assert _got(other.recv(timeout=WAIT)) == (0, 0)

        deadline = time.monotonic() + WAIT
        while value(scrape(base), "zmq_infer_stream_dropped_frames_total", service=SERVICE) < 4:
            assert time.monotonic() < deadline, "the pinned stream's drops never counted"
            c.pump(0.05)
        assert value(scrape(base), "zmq_infer_stream_dropped_frames_total", service=SERVICE) == 4


def test_a_frame_with_half_its_timeout_left_is_always_sent(cluster, held):
    """The lapse rule's cap: a frame whose room comes with less time left than recent frames
    took (1.6 s of a 2 s timeout, twice) but more than half its timeout is still sent.  (In
    seconds twice those of the rule's example, 0.8 of 1: the release, the worker and the reply
    have 0.4 s, which a loaded machine may take.)"""
    gate = held
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=1, pin=False, timeout=2.0, reply="inline") as st:
            t = time.monotonic()
            st.send(_f(0, 1))
            _pump_until(c, lambda: time.monotonic() >= t + 1.6, "1.6 s")  # (the clock is the point)
            gate.release(1)
            assert _got(st.recv(timeout=WAIT)) == (0, 0)  # it took 1.6 s
            t = time.monotonic()
            st.send(_f(1, 1))
            _pump_until(c, lambda: time.monotonic() >= t + 1.0, "1.0 s")
            st.send(_f(2))  # waits behind frame 1
            _pump_until(c, lambda: time.monotonic() >= t + 1.6, "0.6 s more")
            gate.release(1)
            assert _got(st.recv(timeout=WAIT)) == (1, 1)  # it took 1.6 s too: room for frame 2, 1.4 s left
            assert _got(st.recv(timeout=WAIT)) == (2, 2)
            s = _identities(st, 3)
            assert (s.sent, s.completed, s.expired) == (3, 3, 0), s


def test_a_streams_lease_lasts_while_a_stream_on_it_is_open(cluster):
    """A stream made without `pin` pins its service; the lease asks for its `max_in_flight`
    slots and ends (LEASE_END) when the last stream on it closes; `pin=False` never pins, and
    `pin=True` without heartbeats is InvalidInput."""
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    cluster.worker("gate_model:tagged", "--service", SERVICE, "--max-batch", "1", "--credit", "16", "--direct")

    def leases() -> tuple[float, float]:
        m = scrape(base)
        return value(m, "zmq_infer_leases", service=SERVICE), value(m, "zmq_infer_leased_credit", service=SERVICE)

    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, pin=False) as st:
            for i in range(5):
                st.send(_f(i))
                assert _got(st.recv(timeout=WAIT)) == (i, i)
                c.pump(0.02)
        assert not c.pinned(SERVICE) and c.pinned_replies == 0 and leases() == (0, 0)
        a = c.stream(SERVICE, latest_wins=False, max_in_flight=3)
        _pin(c, a)
        assert leases() == (1, 3)
        b = c.stream(SERVICE, latest_wins=False, max_in_flight=2)
        b.send(_f(0))
        assert _got(b.recv(timeout=WAIT)) == (0, 0)
        a.close()
        assert c.pinned(SERVICE)  # b still streams on it
        b.send(_f(1))
        assert _got(b.recv(timeout=WAIT)) == (1, 1)
        b.close()
        assert not c.pinned(SERVICE)
        _pump_until(c, lambda: leases() == (0, 0), "the lease ended")
    with Client(cluster.frontend, timeout=WAIT, heartbeat_interval=None) as c:
        with pytest.raises(InvalidInput):
            c.stream(SERVICE, pin=True)
        c.stream(SERVICE).close()  # pin=None: simply brokered


def test_send_copies_an_ordinary_array_even_while_its_frame_waits(cluster, held):
    """`send()` copies ordinary arrays, so the caller may reuse its buffer at once: a frame
    still waiting for room goes with what the buffer held at its `send()`."""
    gate = held
    buf = _f(1)["x"]
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=1, pin=False) as st:
            st.send(_f(0, 1))
            st.send({"x": buf})  # waits for room
            buf[:] = 7  # reused at once
            assert st.stats().pending == 1
            gate.release(1)
            assert [_got(r) for r in st] == [(0, 0), (1, 1)]
