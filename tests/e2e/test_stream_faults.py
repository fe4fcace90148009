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
