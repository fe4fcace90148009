"""What a Result's arrays are worth over time (docs/client.md, "Results and their lifetime"),
end to end: a worker whose output ring holds 16 of these replies (1 MiB, 64 KiB outputs), so
that it wraps around within a few dozen requests.

- An output array kept (the Result, an array taken out of it, a view of that, a torch tensor
  over it) never changes while the ring turns under it, nor after its client is closed or
  collected, nor after its worker is killed and another takes its place.
- A reply that came and was never read (a stream's last frames, a handle not waited on)
  gives its slot back when its client is closed or dropped: the worker lends a slot to the
  client's process, which gives it back by releasing it or by exiting, and such a reply,
  dropped with the socket, kept it lent for the process's life (ten `with c.stream(...)`
  sessions left 8 of the 16 slots lent for good).
- A reply still on its way when its client closes gives its slot back too: `close()` cancels
  what is in flight and waits (up to its `linger`) for the answers that may name slots (five
  `with c.stream(...)` sessions closed with three frames in flight each had left 4 slots lent
  through the broker, 10 on a lease).

Real processes (broker, worker), ipc endpoints; every wait is a poll with a deadline.
"""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import numpy as np
import pytest

from client_sdk import AsyncClient, Client
from shm.gc import list_segments

from .conftest import wait_service

pytestmark = pytest.mark.timeout(120)

MODEL = "bench.inline_crossover:make_copy"  # x + 0: every output a new array, a slot of the ring
N = 64 << 10  # bytes of each output: 16 of them fill the 1 MiB ring


def _lent(worker_pid: int) -> int:
    """Slots of the worker's output ring not FREE (lent, or released and not yet reclaimed:
    its housekeeping reclaims those every heartbeat interval, 0.2 s here)."""
    rings = [s for s in list_segments() if s.owner_pid == worker_pid]
    assert len(rings) == 1, rings
    return rings[0].live_slots


def _until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)  # polling a condition, not a delay


def _x(k: int) -> np.ndarray:
    return np.full(N, k % 251, np.uint8)


@pytest.fixture
def ring(cluster):
    cluster.broker()
    w = cluster.worker(MODEL, "--out-capacity-mb", "1")
    with Client(cluster.frontend, timeout=20) as c:
        wait_service(c, "copy")
    return cluster, w


def _cycle(c: Client, n: int) -> None:
    for k in range(n):
        with c.infer("copy", {"x": _x(k)}, timeout=20) as r:
            assert r.zero_copy["x"], "the output came through the ring"


def test_kept_outputs_never_change_while_the_ring_turns_or_after_their_client_or_worker_goes(ring):
    torch = pytest.importorskip("torch")
    cluster, w = ring
    c = Client(cluster.frontend, timeout=20)
    r = c.infer("copy", {"x": _x(1)})                 # the Result kept
    a = c.infer("copy", {"x": _x(2)})["x"]            # an array taken out of a Result dropped
    v = c.infer("copy", {"x": _x(3)})["x"][100:200]   # a view of one
    t = torch.from_numpy(c.infer("copy", {"x": _x(4)})["x"])  # a tensor over one
    assert all(x.base is not None for x in (r["x"], a, v))  # views of the ring, no copies
    want = {"r": _x(1), "a": _x(2), "v": _x(3)[100:200], "t": _x(4)}

    def unchanged() -> None:
        got = {"r": r["x"], "a": a, "v": v, "t": t.numpy()}
        for k in want:
            assert np.array_equal(got[k], want[k]), f"{k} changed"

    _cycle(c, 48)  # the ring wraps three times around the four slots held
    unchanged()
    c.close()
    with Client(cluster.frontend, timeout=20) as c2:
        _cycle(c2, 32)
        unchanged()
        del c
        gc.collect()
        _cycle(c2, 32)
        unchanged()
        w.kill()  # its ring's pages stay while arrays view them: no SIGBUS, no change
        unchanged()
        cluster.worker(MODEL, "--out-capacity-mb", "1")
        _cycle(c2, 32)
        unchanged()


def _final_waiting(sock, what: str) -> None:
    """Until a reply waits unread in ``sock`` (the client's reply inbox: replies only)."""
    assert sock.poll(10_000), what


def test_replies_left_unread_give_their_slots_back_when_the_client_goes(ring):
    cluster, w = ring
    wpid = w.p.pid
    _until(lambda: _lent(wpid) == 0, "the ring is free")

    # close() with a handle not waited on, its FINAL in the client's socket
    c = Client(cluster.frontend, timeout=20)
    h = c.infer_stream("copy", {"x": _x(1)})
    _final_waiting(c._inbox.sock, "the FINAL came straight to the client's reply socket")
    c.close()
    del h
    _until(lambda: _lent(wpid) == 0, "close() kept the slot of an unread reply lent")

    # a stream whose last frame's result was not read when it and its client closed
    with Client(cluster.frontend, timeout=20) as c, c.stream("copy", pin=False) as s:
        s.send({"x": _x(2)})
        s.recv(timeout=10).release()
        s.send({"x": _x(3)})
        _final_waiting(c._inbox.sock, "the last frame's result came")
    _until(lambda: _lent(wpid) == 0, "a stream's unread result kept its slot lent")

    # a client dropped without close()
    c = Client(cluster.frontend, timeout=20)
    h = c.infer_stream("copy", {"x": _x(4)})
    _final_waiting(c._inbox.sock, "the FINAL came")
    del c, h
    gc.collect()
    _until(lambda: _lent(wpid) == 0, "a client collected unclosed kept the slot of an unread reply lent")

    # AsyncClient: closed with a reply its loop has not read
    async def unread_at_close() -> None:
        async with AsyncClient(cluster.frontend, timeout=20) as ac:
            h = ac.infer_stream("copy", {"x": _x(5)})
            _final_waiting(ac._inbox.sock, "the FINAL came")  # (blocking: the loop reads nothing meanwhile)
            del h

    asyncio.run(unread_at_close())
    _until(lambda: _lent(wpid) == 0, "AsyncClient.close() kept the slot of an unread reply lent")

    # The ring is whole: a client holding nothing gets every output through it.
    with Client(cluster.frontend, timeout=20) as c:
        _cycle(c, 20)


def test_close_waits_for_a_reply_on_its_way_and_releases_it(cluster, gate):
    """The answer was sent before the close and reaches the broker only after it began (the
    broker stopped meanwhile): the close cancels the call and waits for that answer, then
    gives its slot back.  (It had closed at once: the answer, relayed to a closed socket or
    dropped for a departed client, kept its slot lent for the process's life.)"""
    broker = cluster.broker()
    w = cluster.worker("gate_model:copying", "--out-capacity-mb", "1", env=gate.env, wait=False)
    gate.open()  # (the model opens its end as it loads)
    w.wait_ready()
    c = Client(cluster.frontend, timeout=20, direct_reply=False)  # every answer through the broker
    wait_service(c, "gate")
    h = c.infer_stream("gate", {"x": _x(1)})
    gate.wait_entered(1)
    closer = threading.Thread(target=c.close, name="closer")
    os.kill(broker.p.pid, signal.SIGSTOP)
    try:
        gate.release()
        _until(lambda: _lent(w.p.pid) == 1, "the worker wrote its answer into its ring and sent it")
        closer.start()
        _until(lambda: h._call.abandoned, "close() gave the call up")
    finally:
        os.kill(broker.p.pid, signal.SIGCONT)
    closer.join(20)
    assert not closer.is_alive()
    assert c.closed
    _until(lambda: _lent(w.p.pid) == 0, "the answer that came after close() began kept its slot lent")


def test_close_with_frames_in_flight_gives_every_slot_back(ring):
    """A gateway's session: a stream with frames in flight, closed without reading them, then
    its client; on a lease (a stream's default), through the broker, and with AsyncClient."""
    cluster, w = ring
    wpid = w.p.pid
    _until(lambda: _lent(wpid) == 0, "the ring is free")
    for pin in (None, False):
        for k in range(5):
            with Client(cluster.frontend, timeout=20) as c, c.stream("copy", pin=pin, max_in_flight=3) as s:
                for j in range(3):
                    s.send({"x": _x(k + j)})
        _until(lambda: _lent(wpid) == 0, f"closing with frames in flight (pin={pin}) kept slots lent")

    async def sessions() -> None:
        for k in range(3):
            async with AsyncClient(cluster.frontend, timeout=20) as ac:
                s = ac.stream("copy", max_in_flight=3)
                for j in range(3):
                    s.send({"x": _x(k + j)})

    asyncio.run(sessions())
    _until(lambda: _lent(wpid) == 0, "AsyncClient closed with frames in flight kept slots lent")


def test_close_waits_no_longer_than_its_linger(cluster, gate):
    """A request whose batch does not end: close() waits its linger and no more, and the
    cancel it sent reaches the worker, which drops the result when the batch ends (nothing
    lent)."""
    cluster.broker()
    w = cluster.worker("gate_model:copying", "--out-capacity-mb", "1", env=gate.env, wait=False)
    gate.open()  # (the model opens its end as it loads)
    w.wait_ready()
    c = Client(cluster.frontend, timeout=20)
    wait_service(c, "gate")
    h = c.infer_stream("gate", {"x": _x(1)})  # (kept: a handle dropped is given up)
    gate.wait_entered(1)
    t0 = time.monotonic()
    c.close(linger=0.3)
    took = time.monotonic() - t0
    assert 0.3 <= took < 5, took  # (an upper bound for a loaded machine, not a timing claim)
    assert h._call.abandoned
    gate.release(2)  # the held call's batch ends; then another client's call runs after it
    with Client(cluster.frontend, timeout=20) as c2, c2.infer("gate", {"x": _x(2)}) as r:
        assert r.zero_copy["x"], "the output came through the ring"
    _until(lambda: _lent(w.p.pid) == 0, "the cancelled call's result was sent, and kept its slot lent")
