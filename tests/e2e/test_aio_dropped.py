"""An `AsyncClient` dropped without `close()` while its event loop keeps running (a gateway
that forgets `await c.close()`) is let go of, as a dropped `Client` is: its descriptors, its
input pool's segment and its reply socket's file go, and so does its connection at the
broker.  Its loop's reader callbacks, its deadline timer and its heartbeat task hold it
weakly (aio.py, `_weakly`, `_heartbeat`), and its finalizer (`_let_go`) takes what it had off
the loop and closes it.  Once they held it for as long as the loop ran (the soak hunt: per
100 dropped clients, 600 descriptors, 100 memfd segments and 100 reply-socket files more,
and 100 broker connections, still heartbeating).

Real broker and worker on ipc; every wait is a poll with a deadline.
"""
from __future__ import annotations

import asyncio
import gc
import os
import time
import weakref

import numpy as np
import pytest

from client_sdk import AsyncClient, DeadlineExceeded
from shm.gc import _segments_of

from ..conftest import reply_socket_files

pytestmark = pytest.mark.timeout(120)

WAIT = 10.0
N = 12


def _x() -> dict:
    return {"x": np.ones((64, 1024), np.float32)}  # through the input pool (its memfd segment)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _until(cond, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("heartbeat", [0.2, None], ids=["heartbeats", "no-heartbeats"])
def test_an_async_client_dropped_without_close_is_let_go(cluster, heartbeat):
    broker = cluster.broker()
    cluster.worker("echo")
    me = os.getpid()
    bpid = broker.p.pid

    async def main() -> None:
        # One client used and closed first: the process-wide parts (zmq's context and its
        # threads, the loop's own descriptors) are in the baseline.
        async with AsyncClient(cluster.frontend, timeout=WAIT, heartbeat_interval=heartbeat) as c:
            deadline = time.monotonic() + WAIT
            while not await c.mmi_service("echo", timeout=WAIT):
                assert time.monotonic() < deadline, "no worker for 'echo'"
                await asyncio.sleep(0.01)
            r = await c.infer("echo", _x())
            r.release()
        del c
        gc.collect()
        base_broker = None

        def broker_settled() -> bool:  # the first client's connection gone at the broker
            nonlocal base_broker
            n = _fds(bpid)
            settled = n == base_broker
            base_broker = n
            return settled

        await _until(broker_settled, "the broker's descriptors did not settle")
        base_fds, base_segs, base_files = _fds(me), set(_segments_of(str(me))), reply_socket_files(me)

        clients = [AsyncClient(cluster.frontend, timeout=WAIT, heartbeat_interval=heartbeat) for _ in range(N)]
        refs = [weakref.ref(c) for c in clients]
        try:
            for c in clients:
                r = await c.infer("echo", _x())
                np.testing.assert_array_equal(r["x"], 1.0)
                r.release()
            del c, r
            assert _fds(me) >= base_fds + N  # (they were there)
            assert _fds(bpid) >= base_broker + N
            clients.clear()  # dropped: no close(), no `async with`
            gc.collect()
            alive = sum(ref() is not None for ref in refs)
            assert alive == 0, f"{alive} of {N} dropped AsyncClients still alive (held by their loop)"
            await _until(lambda: _fds(me) <= base_fds,
                         f"this process's descriptors not back to {base_fds} (now {_fds(me)})")
            await _until(lambda: set(_segments_of(str(me))) <= base_segs,
                         f"memfd segments left: {set(_segments_of(str(me))) - base_segs}")
            await _until(lambda: reply_socket_files(me) <= base_files,
                         f"reply-socket files left: {reply_socket_files(me) - base_files}")
            await _until(lambda: _fds(bpid) <= base_broker,
                         f"the broker's descriptors not back to {base_broker} (now {_fds(bpid)})")
        finally:
            for ref in refs:  # (the old code's: closed here, so that the failure is the only one)
                c = ref()
                if c is not None:
                    await c.close()

    asyncio.run(main())


def test_a_live_async_client_keeps_working_after_the_collector_runs(cluster, gate):
    """The reader, the deadline timer and the heartbeat hold the client weakly: one that is
    still referenced serves on, and heartbeats while its call waits, whatever the collector
    does meanwhile."""
    cluster.broker()
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--no-warmup",
                       env=gate.env, wait=False)
    gate.open()
    w.wait_ready()

    async def main() -> None:
        c = AsyncClient(cluster.frontend, timeout=WAIT, heartbeat_interval=0.2)
        try:
            deadline = time.monotonic() + WAIT
            while not await c.mmi_service("gate", timeout=WAIT):
                assert time.monotonic() < deadline, "no worker for 'gate'"
                await asyncio.sleep(0.01)
            gate.release()
            gc.collect()
            r = await c.infer("gate", _x())
            np.testing.assert_array_equal(r["x"], 1.0)
            r.release()
            waiting = asyncio.ensure_future(c.infer("gate", _x()))  # held at the gate
            for _ in range(2):  # the heartbeat task beats while it waits, the collector run between
                gc.collect()
                beat = c._core.last_heartbeat
                await _until(lambda: c._core.last_heartbeat > beat, "no heartbeat while a call waits")
            gate.release()
            r = await asyncio.wait_for(waiting, WAIT)
            np.testing.assert_array_equal(r["x"], 1.0)
            r.release()
            with pytest.raises(DeadlineExceeded):  # the deadline timer still wakes a call
                await c.infer("gate", _x(), timeout=0.3)
            gate.release()  # (that call's turn at the gate: the worker goes on)
        finally:
            await c.close()

    asyncio.run(main())
