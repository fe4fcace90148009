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

Real processes (broker, worker), ipc endpoints; every wait is a poll with a deadline.
"""
from __future__ import annotations

import asyncio
import gc
import os
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
