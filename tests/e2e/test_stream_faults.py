"""Frame streams (`client.stream`, docs/client.md "Streams") under failure, end to end: every
result a stream hands out is its own frame's (tests/e2e/gate_model.py's `tagged` model
answers each frame with the frame itself, so a result names the frame it answers), in send
order, once, whatever happens to the worker or the broker meanwhile; a frame that fails
fails alone; latest_wins answers the newest frames and counts the others; the counts add
up; and many short streams leave no slot, lease or request held.  Real broker and worker
processes on ipc; every wait bounded, gated frames released by the test (no sleeps)."""
from __future__ import annotations

import asyncio
import select
import threading
import time

import numpy as np
import pytest

from client_sdk import AsyncClient, Client, DeadlineExceeded, EndOfStream, InferenceError, NotSupported

from .conftest import wait_service
from .test_metrics import scrape, value

pytestmark = pytest.mark.timeout(90)

WAIT = 10.0
SERVICE = "tagged"


def _f(tag: int, what: int = 0) -> dict:
    """Frame `tag` (32 KB: a shared-memory slot each way); what = 1: held at the gate,
    2: the model raises on it."""
    x = np.full(4096, tag, np.int64)
    x[1] = what
    return {"x": x}


def _tag(r) -> int:
    """The frame a result answers (and the result released)."""
    with r:
        x = np.asarray(r["x"])
        assert (x[2:] == x[0]).all(), x  # one frame's data, whole
        return int(x[0])


def _got(r) -> tuple[int, int]:
    """(the number the stream gave the result, the frame it answers)."""
    return r.frame, _tag(r)


def _worker(cluster, gate, log, *extra, wait=True):
    return cluster.worker("gate_model:tagged", "--service", SERVICE, "--max-batch", "1", "--credit", "16",
                          *extra, env={**gate.env, "RUN_LOG": str(log)}, wait=wait)


def _pump_until(c, cond, what, timeout=WAIT):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        c.pump(0.02)


def _start_pumping(c, proc, timeout=30.0):
    """Wait for `proc`'s READY while `c` pumps (a blocking client heartbeats only in its calls)."""
    deadline = time.monotonic() + timeout
    while not select.select([proc.p.stdout.fileno()], [], [], 0)[0]:
        assert time.monotonic() < deadline, f"{proc.args} not ready within {timeout} s"
        c.pump(0.05)
    proc.wait_ready()


def _pin(c, st) -> int:
    """Frames (each tagged with its number) until the stream's service is pinned; the
    number of the next frame."""
    i = 0
    deadline = time.monotonic() + WAIT
    while not c.pinned(SERVICE):
        assert time.monotonic() < deadline, "the stream never pinned"
        assert st.send(_f(i)) == i
        assert _got(st.recv(timeout=WAIT)) == (i, i)
        i += 1
        if not c.pinned(SERVICE):
            c.pump(0.05)
    return i


def _balanced(s) -> None:
    assert s.sent == s.completed + s.failed + s.in_flight + s.cancelled, s


def test_a_stream_on_a_service_that_streams_says_so_instead_of_empty_results(cluster):
    """A frame stream on a streaming model (PARTIALs, then an empty FINAL): recv() handed out
    an empty Result for every frame, the PARTIALs released unread, where `infer` and a
    handle's `result()` raise NotSupported.  Each frame now fails alone with it (counted in
    `failed`), on both clients, pinned or not; nothing stays held."""
    cluster.broker()
    cluster.worker("faulty_model:streaming", "--direct")
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, "streaming")
        for pin in (None, False):
            with c.stream("streaming", latest_wins=False, max_in_flight=2, pin=pin) as st:
                for i in range(4):
                    st.send({"x": np.full(4, i, np.float32)})
                for i in range(4):
                    with pytest.raises(NotSupported, match="streams its results"):
                        st.recv(timeout=WAIT)
                s = st.stats()
                assert (s.failed, s.completed) == (4, 0), s
                _balanced(s)
        assert c.in_flight() == 0
        assert c.pool is None or c.pool.in_use() == 0

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=WAIT) as ac:
            st = ac.stream("streaming", latest_wins=False, max_in_flight=2)
            for i in range(3):
                st.send({"x": np.full(4, i, np.float32)})
            st.finish()
            with pytest.raises(NotSupported):
                await st.recv(WAIT)
            with pytest.raises(NotSupported):
                async for _ in st:
                    pass
            assert st.stats().failed == 2
            st.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


# ------------------------------------------------------------------ the worker or the broker goes mid-stream

@pytest.mark.parametrize("how", ["kill", "term"])
def test_a_pinned_stream_whose_worker_dies_or_drains_answers_each_frame_once(cluster, gate, tmp_path, how):
    """Four frames on the lease, one held at its worker, when that worker is SIGKILLed (the
    frames go through the broker to the other worker) or SIGTERMed (it finishes what it
    holds, refusals come through the broker): each frame gets its own result, in order."""
    log = tmp_path / "runs"
    cluster.broker()
    doomed = _worker(cluster, gate, log, "--direct")
    gate.open()
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=4) as st:
            b = _pin(c, st)
            _start_pumping(c, _worker(cluster, gate, log, "--direct", wait=False))
            for i in range(b, b + 4):
                assert st.send(_f(i, 1)) == i
            _pump_until(c, lambda: gate.entered() >= 1, "a frame at the gate")
            if how == "kill":
                doomed.kill()
            else:
                doomed.p.send_signal(15)
            gate.release(16)
            assert [_got(st.recv(timeout=WAIT)) for _ in range(4)] == [(i, i) for i in range(b, b + 4)]
            for i in range(b + 4, b + 8):  # and the stream goes on
                assert st.send(_f(i)) == i
                assert _got(st.recv(timeout=WAIT)) == (i, i)
            _balanced(st.stats())
            with pytest.raises(EndOfStream):
                st.recv(timeout=0)
        assert c.in_flight() == 0 and c.stray_replies == 0
        assert c.pool is None or c.pool.in_use() == 0


def test_a_broker_restart_mid_stream_answers_each_frame_once(cluster, gate, tmp_path):
    log = tmp_path / "runs"
    broker = cluster.broker()
    _worker(cluster, gate, log, "--direct")
    gate.open()
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=4) as st:
            b = _pin(c, st)
            for i in range(b, b + 4):
                assert st.send(_f(i, 1)) == i
            _pump_until(c, lambda: gate.entered() >= 1, "a frame at the gate")
            broker.kill()
            cluster.broker()
            _pump_until(c, lambda: c.broker_restarts == 1, "the restart heard")
            gate.release(16)
            assert [_got(st.recv(timeout=WAIT)) for _ in range(4)] == [(i, i) for i in range(b, b + 4)]
            for i in range(b + 4, b + 8):
                assert st.send(_f(i)) == i
                assert _got(st.recv(timeout=WAIT)) == (i, i)
            _balanced(st.stats())
        assert c.in_flight() == 0
        assert sorted(int(line.split()[1]) for line in log.read_text().splitlines()) == list(range(b + 8))  # each ran once
        assert c.pool is None or c.pool.in_use() == 0


# ------------------------------------------------------------------ one frame's trouble is its own

def test_a_frame_the_model_fails_or_that_expires_fails_alone(cluster, gate, tmp_path):
    log = tmp_path / "runs"
    cluster.broker()
    _worker(cluster, gate, log, "--direct")
    gate.open()
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        for pin in (False, None):
            with c.stream(SERVICE, latest_wins=False, max_in_flight=3, pin=pin) as st:
                b = _pin(c, st) if pin is None else 0
                for i in range(b, b + 6):
                    assert st.send(_f(i, 2 if i == b + 2 else 0)) == i
                out = []
                for _ in range(6):
                    try:
                        out.append(_got(st.recv(timeout=WAIT)))
                    except InferenceError as e:
                        out.append(type(e).__name__)
                assert out == [(b, b), (b + 1, b + 1), "InternalError", *((i, i) for i in range(b + 3, b + 6))], out
                assert st.stats().failed == 1
                _balanced(st.stats())
        # The head frame outlives its deadline (held at the worker): DeadlineExceeded for it,
        # and each frame behind it gets its own result or its own deadline, never another's.
        # (Outputs inline: the held frame's result comes after its caller gave up, and may
        # come after the client closed, which leaves a shared-memory output lent for the
        # process's life; the worker's stop then waits --drain-grace-s for it.)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=3, pin=False, timeout=0.3, reply="inline") as st:
            for i, what in enumerate((1, 0, 0)):
                st.send(_f(i, what))
            with pytest.raises(DeadlineExceeded):
                st.recv(timeout=WAIT)
            gate.release(1)
            for i in (1, 2):
                try:
                    assert _got(st.recv(timeout=WAIT)) == (i, i)
                except DeadlineExceeded:
                    pass
            _balanced(st.stats())
        # the expired frame's input slot goes at its FINAL (the worker could not stop it)
        _pump_until(c, lambda: c.pool is None or c.pool.in_use() == 0, "every input slot freed")


def test_latest_wins_with_a_slow_model_answers_the_newest_frames_and_counts_the_rest(cluster, gate, tmp_path):
    log = tmp_path / "runs"
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    _worker(cluster, gate, log)
    gate.open()
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        with c.stream(SERVICE, latest_wins=True, max_in_flight=2, pin=False) as st:
            for i in range(10):
                assert st.send(_f(i, 1)) == i
            s = st.stats()
            assert (s.sent, s.pending, s.dropped) == (2, 1, 7), s
            gate.release(1)
            assert _got(st.recv(timeout=WAIT)) == (0, 0)  # frame 9, the newest, goes out now
            for i in range(10, 15):
                st.send(_f(i, 1))
            gate.release(16)
            assert [_got(r) for r in st] == [(1, 1), (9, 9), (14, 14)]
            s = st.stats()
            assert (s.dropped, s.completed) == (11, 4), s
            _balanced(s)
        assert sorted(int(line.split()[1]) for line in log.read_text().splitlines()) == [0, 1, 9, 14]
        # the broker counted every drop (each told by the next frame sent)
        assert value(scrape(base), "zmq_infer_stream_dropped_frames_total", service=SERVICE) == 11


SENT = r"^(?!.*never sent)"  # a frame sent, then out of time (the client's word or the broker's)


def test_a_frame_that_waits_for_room_past_its_deadline_is_never_sent(cluster, gate, tmp_path):
    """A frame's timeout counts from its `send()`: one still waiting for room when it passes
    is never sent and fails in its turn (`expired`), so `latest_wins=False` under a model
    that cannot keep up builds no backlog past the timeout; one sent late keeps only what is
    left of its budget.  (Before: each was sent once room came, with a whole timeout from
    then, and results came long after their deadline.)"""
    log = tmp_path / "runs"
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    _worker(cluster, gate, log)
    gate.open()

    async def on_the_loop():  # the asyncio stream, the same
        async with AsyncClient(cluster.frontend, timeout=WAIT) as ac:
            st = ac.stream(SERVICE, latest_wins=False, max_in_flight=1, pin=False, timeout=0.3, reply="inline")
            for i, what in enumerate((1, 0)):
                st.send(_f(7 + i, what))
            with pytest.raises(DeadlineExceeded, match=SENT):
                await st.recv(timeout=WAIT)
            with pytest.raises(DeadlineExceeded, match="frame 1 .*never sent"):
                await st.recv(timeout=WAIT)
            s = st.stats()
            assert (s.sent, s.failed, s.expired) == (1, 1, 1), s
            st.close()
            gate.release(1)

    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        # (1 s: frame 4 below is answered within it, after frame 0's held run is released:
        # 0.3 s asked much of a loaded machine)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=1, pin=False, timeout=1.0, reply="inline") as st:
            st.send(_f(0, 1))  # held at the worker
            for i in (1, 2, 3):
                st.send(_f(i))
            assert (st.stats().sent, st.stats().pending) == (1, 3)
            assert st.unfinished() == {0, 1, 2, 3}
            with pytest.raises(DeadlineExceeded, match=SENT):
                st.recv(timeout=WAIT)  # frame 0, sent: its deadline
            # (frames never sent one after another are one outcome: recv once per send, a
            # reader was served their errors as fast as it read, and never caught up)
            with pytest.raises(DeadlineExceeded, match="frames 1 to 3 .*never sent"):
                st.recv(timeout=WAIT)
            s = st.stats()
            assert (s.sent, s.failed, s.expired, s.pending, s.in_flight) == (1, 1, 3, 0, 0), s
            _balanced(s)
            assert st.unfinished() == frozenset()
            with pytest.raises(EndOfStream):
                st.recv(timeout=0)
            gate.release(1)
            # the next frame goes at once, with its own whole timeout
            st.send(_f(4))
            assert _got(st.recv(timeout=WAIT)) == (4, 4)
        # A frame sent late keeps what is left of its timeout: frame 2 (tag 9) waits behind
        # frames 0 (quick, its result not read) and 1 (held) for most of its 2 s, then is
        # sent and held: it fails at 2 s from its send(), not 2 s from when it was sent.
        with c.stream(SERVICE, latest_wins=False, max_in_flight=2, pin=False, timeout=2.0, reply="inline") as st:
            st.send(_f(5))
            st.send(_f(6, 1))
            t9 = time.monotonic()
            st.send(_f(9, 1))
            _pump_until(c, lambda: time.monotonic() >= t9 + 1.4, "1.4 s")  # (waiting out the clock is the point)
            assert _got(st.recv(timeout=WAIT)) == (0, 5)  # (a new stream numbers from 0)
            assert st.stats().sent == 3  # frame 2 went when frame 0's result was taken
            gate.release(1)
            assert _got(st.recv(timeout=WAIT)) == (1, 6)
            with pytest.raises(DeadlineExceeded, match=SENT):
                st.recv(timeout=WAIT)
            assert time.monotonic() - t9 < 3.2, "frame 2's deadline counted from when it was sent"
            gate.release(1)
        # A frame with less time left than recent frames took to their outcome (and than
        # half its timeout) is not sent either: frame 10 took 1 s, and frame 12, 0.8 s
        # left when room comes, lapses; frame 13, sent then, goes (and completes).  (In
        # seconds twice the rule's example: frame 11's release and answer have 0.8 s.)
        with c.stream(SERVICE, latest_wins=False, max_in_flight=1, pin=False, timeout=2.0, reply="inline") as st:
            t = time.monotonic()
            st.send(_f(10, 1))
            _pump_until(c, lambda: time.monotonic() >= t + 1.0, "1.0 s")
            gate.release(1)
            assert _got(st.recv(timeout=WAIT)) == (0, 10)  # it took 1 s: that is what a frame takes
            st.send(_f(11, 1))
            t = time.monotonic()
            st.send(_f(12))
            _pump_until(c, lambda: time.monotonic() >= t + 1.2, "1.2 s")
            st.send(_f(13))
            gate.release(1)
            assert _got(st.recv(timeout=WAIT)) == (1, 11)
            with pytest.raises(DeadlineExceeded, match=r"frame 2 .* ms left of its timeout of 2s, less than .* never sent"):
                st.recv(timeout=WAIT)
            assert _got(st.recv(timeout=WAIT)) == (3, 13)
            s = st.stats()
            assert (s.sent, s.completed, s.expired) == (3, 3, 1), s
        _pump_until(c, lambda: c.pool is None or c.pool.in_use() == 0, "every input slot freed")
    asyncio.run(on_the_loop())
    # the worker ran the frames tagged 0, 4, 5, 6, 7, 9, 10, 11 and 13 only; 1, 2, 3, 8 and 12
    # never left their client
    deadline = time.monotonic() + WAIT
    while sorted(int(line.split()[1]) for line in log.read_text().splitlines()) != [0, 4, 5, 6, 7, 9, 10, 11, 13]:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)  # polling a file (a condition, not a delay)
    # the broker counted the frames given up unsent as each stream told them, on its next
    # frame sent (1, 2 and 3 on tag 4, 12 on 13; 8 after its stream's last)
    assert value(scrape(base), "zmq_infer_stream_dropped_frames_total", service=SERVICE) == 4


# ------------------------------------------------------------------ many streams, two at once, another thread

def test_200_short_streams_leave_no_slot_lease_or_request_held(cluster, gate, tmp_path):
    """Short streams on a lease that a long one keeps, each closed with frames in flight or
    answered and unread (output slots of a 1 MB ring), then short brokered ones: every
    result its own frame's, and afterwards nothing is held anywhere: the client's slots,
    its calls, the broker's in-flight count, leases, leased credit, the worker's ring."""
    log = tmp_path / "runs"
    broker = cluster.broker("--http", "127.0.0.1:0")
    base = "http://" + broker.field("http")
    _worker(cluster, gate, log, "--direct", "--out-capacity-mb", "1")
    gate.open()
    with Client(cluster.frontend, timeout=WAIT) as c:
        wait_service(c, SERVICE)
        keeper = c.stream(SERVICE, latest_wins=False, max_in_flight=8)
        n = _pin(c, keeper)

        def short_streams(ks, pin):
            for k in ks:
                with c.stream(SERVICE, latest_wins=bool(k % 2), max_in_flight=1 + k % 4, pin=pin) as st:
                    for i in range(5):
                        st.send(_f(100 * k + i))
                    r = st.recv(timeout=WAIT)
                    assert _tag(r) == 100 * k + r.frame
                    if k % 3 == 0:
                        r = st.recv(timeout=WAIT)
                        assert _tag(r) == 100 * k + r.frame
                _balanced(st.stats())
            _pump_until(c, lambda: c.in_flight() == 0 and (c.pool is None or c.pool.in_use() == 0),
                        "every call answered")

        short_streams(range(100), None)  # on the keeper's lease
        before = c.pinned_replies
        for i in range(n, n + 8):
            keeper.send(_f(i))
        assert [_got(keeper.recv(timeout=WAIT)) for _ in range(8)] == [(i, i) for i in range(n, n + 8)]
        assert c.pinned_replies - before == 8  # the lease's slots are all free
        keeper.close()
        short_streams(range(100, 200), False)  # through the broker

        def held() -> list:
            m = scrape(base)
            return [value(m, name, service=SERVICE) for name in ("zmq_infer_in_flight", "zmq_infer_leases",
                                                                  "zmq_infer_leased_credit")] + [
                v for (name, _), v in m.items() if name == "zmq_infer_shm_pool_used_bytes"]

        _pump_until(c, lambda: not any(held()), "nothing held at the broker or the worker")


def test_two_streams_of_an_async_client_one_fed_from_a_thread_through_a_worker_death(cluster, gate, tmp_path):
    """Two streams of one AsyncClient to one service, one of them latest_wins and fed by a
    camera thread, while the leased worker is SIGKILLed: no cross-talk, each stream's
    results in its own order, every one its own frame's.  A recv() task cancelled while it
    waits leaves its frame for the next recv()."""
    log = tmp_path / "runs"
    cluster.broker()
    doomed = _worker(cluster, gate, log, "--direct")
    gate.open()
    _worker(cluster, gate, log, "--direct")

    async def scenario():
        async with AsyncClient(cluster.frontend, timeout=WAIT) as c:
            a = c.stream(SERVICE, latest_wins=False, max_in_flight=3)
            b = c.stream(SERVICE, latest_wins=True, max_in_flight=2)
            a.send(_f(0, 1))
            waiting = asyncio.ensure_future(a.recv())
            while gate.entered() < 1:
                await asyncio.sleep(0.005)  # polls a file
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            gate.release(1)
            assert _got(await a.recv(WAIT)) == (0, 0)
            deadline = time.monotonic() + WAIT
            while not c.pinned(SERVICE):
                assert time.monotonic() < deadline, "never pinned"
                await c.pump(0.05)

            def camera():  # b's frames, tagged 100000 + their number
                for i in range(60):
                    assert b.send(_f(100_000 + i, 1 if i % 3 == 0 else 0)) == i
                b.finish()

            async def take(st, base):
                return [(r.frame, _tag(r) - base) async for r in st]

            async def feed_a():
                for i in range(1, 61):
                    assert a.send(_f(i, 1 if i % 3 == 0 else 0)) == i
                    await asyncio.sleep(0)
                a.finish()
                return await take(a, 0)

            async def killer():
                # a frame of a or b at a gate (the first held frame of either may wait behind
                # the other's at the same worker: both streams are on one lease)
                while gate.entered() < 2:
                    await asyncio.sleep(0.005)
                doomed.kill()
                gate.release(200)

            th = threading.Thread(target=camera)
            th.start()
            got_a, got_b, _ = await asyncio.gather(feed_a(), take(b, 100_000), killer())
            await asyncio.to_thread(th.join, WAIT)
            assert got_a == [(i, i) for i in range(1, 61)]
            assert all(f == t for f, t in got_b) and [f for f, _ in got_b] == sorted({f for f, _ in got_b}), got_b
            assert got_b[-1][0] == 59  # the newest frame is answered
            for st in (a, b):
                _balanced(st.stats())
                st.close()
            s = b.stats()
            assert s.completed + s.dropped == 60, s
            assert c.in_flight() == 0 and c.stray_replies == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))
