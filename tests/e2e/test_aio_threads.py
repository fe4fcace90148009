"""An `AsyncClient` whose loop runs while other threads call its plain methods: a watchdog
thread that cancels handles (or drops them: their `__del__`), a camera thread that feeds a
stream.  Those calls used the client's socket and pool from the caller's thread while the
loop's thread used them too: multipart messages tore (the broker logged malformed requests,
other calls failed or waited out their deadlines; the fork/threads hunt, t19-t21).  Now each
is done on the loop: these tests record the thread of every frame sent or received and of
every call into the client's core, and all must be the loop's.  Real broker and workers on
ipc; every wait bounded."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from client_sdk import AsyncClient, Cancelled, EndOfStream, aio

pytestmark = pytest.mark.timeout(120)

WAIT = 10.0  # bound of every wait, and the requests' own deadline


def _x(v: float) -> dict:
    return {"x": np.full(2048, v, np.float32)}  # above the inline limit: a temporary input slot


async def _until(cond, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        await asyncio.sleep(0.001)


async def _served(c: AsyncClient, service: str) -> None:
    deadline = time.monotonic() + WAIT
    while not await c.mmi_service(service, timeout=WAIT):
        assert time.monotonic() < deadline, f"no worker for {service!r}"
        await asyncio.sleep(0.01)


@pytest.fixture
def threads_of(monkeypatch):
    """`watch(client)`: from then on, the thread of every frame the client sends or receives
    and of every call into its core that touches calls, slots or sockets is in the set this
    returns."""
    seen: set[int] = set()

    def noting(fn):
        def run(*args, **kw):
            seen.add(threading.get_ident())
            return fn(*args, **kw)

        return run

    monkeypatch.setattr(aio, "send_frames", noting(aio.send_frames))
    monkeypatch.setattr(aio, "recv_frames", noting(aio.recv_frames))

    def watch(c: AsyncClient) -> None:
        core = c._core
        for name in ("new_call", "request_frames", "give_up", "on_message", "alloc", "free", "in_flight",
                     "pinned"):
            setattr(core, name, noting(getattr(core, name)))  # (on the instance: this client only)

    from client_sdk import stream as stream_mod

    for name in ("unfinished", "stats"):  # what a stream's reads go through, whatever the class
        monkeypatch.setattr(stream_mod._StreamCore, name, noting(getattr(stream_mod._StreamCore, name)))

    return seen, watch


@pytest.fixture
def gated(cluster, gate):
    """A broker and one gate worker that holds one request at a time (the others queue)."""
    cluster.broker()
    p = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "1",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    p.wait_ready()
    return cluster


def test_handles_cancelled_or_dropped_in_another_thread_are_given_up_on_the_loop(gated, gate, threads_of):
    seen, watch = threads_of

    async def scenario() -> int:
        async with AsyncClient(gated.frontend, timeout=WAIT) as c:
            watch(c)
            await _served(c, "gate")
            busy = c.infer_stream("gate", _x(1))  # runs, held by the gate
            queued = c.infer_stream("gate", _x(2))
            dropped = [c.infer_stream("gate", _x(3))]
            assert await c.mmi_service("gate", timeout=WAIT)  # the broker has queued them

            def watchdog() -> None:
                assert queued.cancel() is True  # returns at once: the loop sends the CANCEL
                dropped.pop()  # the last reference: its __del__ runs in this thread

            await asyncio.wait_for(asyncio.to_thread(watchdog), WAIT)
            assert queued.cancelled
            with pytest.raises(Cancelled):
                await queued.result()
            # Both were cancelled at the broker (queued: they never run), whose answers come
            # at once: only `busy` is left in flight.
            await _until(lambda: c.in_flight() == 1, "CANCELLED answers")
            gate.release(1)
            with await busy.result(timeout=WAIT) as r:
                np.testing.assert_array_equal(r["x"], _x(1)["x"])
            nxt = c.infer_stream("gate", _x(4))
            gate.release(1)  # exactly one more: a cancelled request that ran would take it
            with await nxt.result(timeout=WAIT) as r:
                np.testing.assert_array_equal(r["x"], _x(4)["x"])
            assert c.in_flight() == 0 and c.pool.in_use() == 0
            return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert seen == {loop_thread}  # nothing of the client was touched by the watchdog's thread


def test_a_stream_fed_by_another_thread_sends_on_the_loop(cluster, threads_of):
    # The AR pattern: a camera thread calls send() (a plain method) while the loop awaits
    # recv() and runs other calls of its own on the same client.
    cluster.broker()
    cluster.worker("echo")
    seen, watch = threads_of
    frames = 40

    async def scenario() -> int:
        async with AsyncClient(cluster.frontend, timeout=WAIT) as c:
            watch(c)
            await _served(c, "echo")
            # Made from another thread too (done on the loop, as the rest).
            s = await asyncio.to_thread(c.stream, "echo", latest_wins=False, max_in_flight=2, pin=False)
            numbers: list[int] = []

            def camera() -> None:
                buf = np.empty(2048, np.float32)
                for i in range(frames):
                    # What a camera thread reads between frames (the alloc-ring recipe picks
                    # a buffer outside s.unfinished()): read on the loop, as a send is (read
                    # here, the loop changed what they iterate: RuntimeError, the AR audit).
                    assert all(0 <= n < i for n in s.unfinished())
                    st = s.stats()
                    assert st.sent + st.pending == i  # (latest_wins off: none dropped)
                    assert c.in_flight() >= 0 and c.pinned("echo") is False
                    buf[:] = i  # reused at once: send() copied it before it returned
                    numbers.append(s.send({"x": buf}))
                s.finish()

            async def own_calls() -> None:  # the loop's own requests, between the frames
                for i in range(frames):
                    with await c.infer("echo", _x(-i)) as r:
                        np.testing.assert_array_equal(r["x"], _x(-i)["x"])

            got: list[float] = []

            async def results() -> None:
                async for r in s:  # ends once finish()ed and every frame is in
                    with r:
                        np.testing.assert_array_equal(r["x"], np.full(2048, r["x"][0], np.float32))
                        got.append(float(r["x"][0]))

            await asyncio.wait_for(asyncio.gather(asyncio.to_thread(camera), own_calls(), results()), 3 * WAIT)
            assert numbers == list(range(frames))
            assert got == [float(i) for i in range(frames)]  # each frame's own, in order
            assert s.stats().failed == 0

            # A stream closed from another thread: what it still had is cancelled, and its
            # recv() ends.
            s2 = c.stream("echo", pin=False)
            await asyncio.to_thread(s2.send, _x(7))
            await asyncio.to_thread(s2.close)
            with pytest.raises(EndOfStream):
                await s2.recv(timeout=WAIT)
            await _until(lambda: c.in_flight() == 0, "the closed stream's answers")
            assert c.pool.in_use() == 0
            return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert seen == {loop_thread}


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # 3.12: forks on purpose
def test_a_child_forked_while_the_loop_runs_in_another_thread_is_refused_at_once(cluster):
    # The child's copy of the loop says it runs (it ran in a thread of the parent's, which the
    # child does not have): a plain method must not be handed to it (nobody would run it),
    # but refused as on any forked child's copy.
    import os

    from client_sdk import InvalidInput

    from .test_client_threads import _read_until_closed, _wait_child

    cluster.broker()
    cluster.worker("echo")
    own = asyncio.new_event_loop()
    th = threading.Thread(target=own.run_forever, daemon=True)
    th.start()

    def on_own(coro):
        return asyncio.run_coroutine_threadsafe(coro, own).result(WAIT)

    async def make():
        c = AsyncClient(cluster.frontend, timeout=WAIT)
        await _served(c, "echo")
        return c, c.stream("echo", pin=False), c.infer_stream("echo", _x(1))

    c, s, h = on_own(make())
    try:
        r_fd, w_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(r_fd)
                aio.HANDOFF_S = 1.0  # (handed to the copy of the loop, each would fail after this)
                said = []
                for name, use in (("infer_stream", lambda: c.infer_stream("echo", _x(2))),
                                  ("send", lambda: s.send(_x(3))), ("alloc", lambda: c.alloc((4,)))):
                    try:
                        use()
                        said.append(f"{name}: returned")
                    except InvalidInput as e:
                        said.append(f"{name}: " + ("fork" if "forked this one" in str(e) else str(e)))
                    except Exception as e:
                        said.append(f"{name}: {e!r}")
                said.append(f"cancel: {h.cancel()}")  # only marks the child's copy
                os.write(w_fd, "\n".join(said).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w_fd)
        said = _read_until_closed(r_fd)
        assert _wait_child(pid) == 0
        assert said.splitlines()[:2] == ["infer_stream: fork", "send: fork"], said
        assert said.splitlines()[2] in ("alloc: fork", "alloc: returned"), said  # (its pool is the child's copy)
        assert said.splitlines()[3] in ("cancel: True", "cancel: False"), said  # (its FINAL may be in)

        async def after():  # the parent's handle and client, untouched by the child
            with await h.result(timeout=WAIT) as r:
                np.testing.assert_array_equal(r["x"], _x(1)["x"])
            s.send(_x(5))
            with await s.recv(timeout=WAIT) as r:
                np.testing.assert_array_equal(r["x"], _x(5)["x"])

        on_own(after())
    finally:
        on_own(c.close())
        own.call_soon_threadsafe(own.stop)
        th.join(WAIT)
        own.close()


def test_a_buffer_dropped_in_the_thread_that_made_the_client_is_freed_on_its_loop(cluster, threads_of):
    """An AsyncClient made in one thread and served by a loop in another (the loop is the
    client's thread from its first call on): a `client.alloc` buffer the making thread drops
    is freed on the loop, not where it was dropped.  The client took its making thread for
    its own for good, and freed such a buffer there, in the pool the loop was using (the
    races hunt: about 86,000 frees a side in 30 s)."""
    cluster.broker()
    cluster.worker("echo")
    seen, watch = threads_of
    c = AsyncClient(cluster.frontend, timeout=WAIT)  # made here: this thread is not its loop's
    watch(c)
    c._core._free_buffer = _noted = (lambda fn: lambda ref: (seen.add(threading.get_ident()), fn(ref)))(
        c._core._free_buffer)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, name="client-loop")
    t.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(3 * WAIT)

    try:
        on_loop(_served(c, "echo"))
        buf = c.alloc((2048,), np.float32)  # from this thread: made on the loop
        buf[:] = 5.0
        del buf  # the last reference, in this thread: freed on the loop at its next call

        async def next_call() -> int:
            with await c.infer("echo", _x(6)) as r:
                np.testing.assert_array_equal(r["x"], _x(6)["x"])
            assert c.pool.in_use() == 0  # the dropped buffer's slot is back
            return threading.get_ident()

        loop_thread = on_loop(next_call())
        assert _noted is c._core._free_buffer
        assert seen == {loop_thread}, "the pool was touched outside the loop's thread"
    finally:
        if t.is_alive():
            on_loop(c.close())
        loop.call_soon_threadsafe(loop.stop)
        t.join(WAIT)
        loop.close()
