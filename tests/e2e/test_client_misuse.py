"""A client used in ways it does not support, against the real processes: each mistake gets a
typed error at once and loses nothing else.

- `Client.close()` from a signal handler (a SIGTERM handler, as servers have) while the main
  thread waits in a call of that client: the waiting call raises "the client was closed" at
  once.  It used to wait for good (`timeout=None`) or for its whole timeout, then raise a
  misleading `DeadlineExceeded`.
- Any other call of a `Client` from a signal handler while the main thread is inside a call
  of the same client: refused with `InvalidInput` before it touches anything, and the call it
  interrupted completes.  It used to run nested: a raw `RuntimeError` (concurrent poll()),
  messages interleaved on the socket both ways, innocent calls failed after their timeout.
- An `AsyncClient` on a second event loop: refused with `InvalidInput` before anything is
  sent while its own loop lives (it used to send, then raise a raw `RuntimeError` with the
  call left in flight and its input slot held until `close()`); once its loop is closed
  (`asyncio.run()` returned) it moves to the next one.

The signals come from the worker: the `signalling` model below sends SIGUSR1 to this process
while it holds the request (before it answers), so the handler runs exactly while the call
waits, without timers.  This module is also that model's (`--model test_client_misuse:...`,
tests/e2e on the worker's PYTHONPATH): it imports nothing from the test package.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest

WAIT = 10.0     # bound of every blocking wait
AT_ONCE = 1.0   # "at once", generous for a loaded machine (the bug waited for good)

HOLD = -1000.0  # `signalling`: signal, then hold the request until the gate releases it
SIGNAL = -1.0   # `signalling`: (this or below, above HOLD) signal, then answer


def signalling(device: str = "cpu"):
    """Echoes `x`; when x[0] < 0 it first sends SIGUSR1 to $SIGNAL_PID (the test), and when
    x[0] <= HOLD it then holds the request until one byte comes on the FIFO $GATE_FIFO (the
    `gate` fixture's `release()`).  The signal is sent before the answer, so it reaches the
    test while its call waits."""
    pid = int(os.environ["SIGNAL_PID"])
    fifo = os.environ.get("GATE_FIFO")
    fd = os.open(fifo, os.O_RDWR) if fifo else None  # read-write: never blocks (Linux)

    def run(inputs):
        x = np.asarray(inputs["x"])
        v = float(x.flat[0]) if x.size else 0.0
        if v < 0:
            os.kill(pid, signal.SIGUSR1)
        if v <= HOLD and fd is not None:
            os.read(fd, 1)
        return {"x": np.array(x, copy=True)}

    run.name = "signalling"
    run.batchable = False
    run.example_inputs = lambda: {"x": np.zeros(1)}
    return run


# ----------------------------------------------------------------------------- helpers

def _x(v: float) -> dict:
    # Above the 4 KiB inline limit: copied into a temporary slot of the client's pool (a slot
    # held by a lost call shows in `pool.in_use()`).
    return {"x": np.full(2048, v, np.float32)}


def _wait_service(client, service: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not client.mmi_service(service, timeout=WAIT):
        assert time.monotonic() < deadline, f"no worker for {service!r} after {timeout} s"
        time.sleep(0.01)


def _pump_until(c, cond, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        c.pump(0.05)


class _OnSigusr1:
    """Runs `fn` as the SIGUSR1 handler; restores the previous one on exit.  (Every signal the
    worker sends comes before its answer, so none is left for the default action, which would
    end this process.)"""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __enter__(self):
        def handler(signum, frame):
            self.calls += 1
            self.fn()

        self.old = signal.signal(signal.SIGUSR1, handler)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGUSR1, self.old)


@pytest.fixture
def signalled(cluster, gate):
    """A broker, the `signalling` model as service "sig" (one request at a time) and an echo
    worker."""
    cluster.broker()
    # (--drain-grace-s: a result it holds for a client that closed, the test's own process, is
    # not waited for at teardown: that took the fixture's 15 s bound and a SIGKILL)
    cluster.worker("test_client_misuse:signalling", "--service", "sig", "--max-batch", "1", "--credit", "1",
                   "--drain-grace-s", "0.5", env={"SIGNAL_PID": str(os.getpid()), **gate.env})
    gate.open()  # the worker holds the read end already: returns at once
    cluster.worker("echo")
    return cluster


# ----------------------------------------------------------------------------- close() from a signal handler

@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["infer-no-timeout", "infer-timeout", "result", "no-heartbeats"])
def test_close_from_a_signal_handler_ends_the_waiting_call_at_once(signalled, gate, how):
    from client_sdk import Client, DeadlineExceeded, InferenceError

    # Without a timeout (nor heartbeats) the call used to wait for good.
    limit = WAIT if how in ("infer-timeout", "result") else None
    c = Client(signalled.frontend, timeout=limit, heartbeat_interval=None if how == "no-heartbeats" else 1.0)
    try:
        _wait_service(c, "sig")
        closed_at = []

        def on_signal():
            c.close()  # a SIGTERM handler's, say
            closed_at.append(time.monotonic())

        with _OnSigusr1(on_signal):
            with pytest.raises(InferenceError, match="closed") as info:
                if how == "result":
                    c.infer_stream("sig", _x(HOLD)).result(timeout=WAIT)
                else:
                    c.infer("sig", _x(HOLD))
            raised_at = time.monotonic()
        assert not isinstance(info.value, DeadlineExceeded)
        assert len(closed_at) == 1 and raised_at - closed_at[0] < AT_ONCE
        assert c.closed and c.in_flight() == 0
        with pytest.raises(InferenceError, match="closed"):
            c.infer("echo", _x(1))
    finally:
        c.close()
        gate.release(1)  # the held request finishes, for nobody


@pytest.mark.timeout(60)
def test_close_from_a_signal_handler_between_calls_closes_at_once(signalled, gate):
    # Not nested (the main thread is outside the client): closed by the handler itself.
    from client_sdk import Client, InferenceError

    c = Client(signalled.frontend, timeout=WAIT)
    try:
        _wait_service(c, "sig")
        with _OnSigusr1(c.close):
            os.kill(os.getpid(), signal.SIGUSR1)  # handled before the next bytecodes
            assert c.closed
        with pytest.raises(InferenceError, match="closed"):
            c.infer("echo", _x(1))
    finally:
        c.close()


# ----------------------------------------------------------------------------- other calls from a signal handler

@pytest.mark.timeout(90)
def test_calls_from_a_signal_handler_are_refused_and_the_interrupted_call_completes(signalled):
    from client_sdk import Client, InvalidInput

    with Client(signalled.frontend, timeout=WAIT) as c:
        _wait_service(c, "sig")
        _wait_service(c, "echo")
        refused: dict[str, int] = {}
        other: list[str] = []
        uses = {
            "infer": lambda: c.infer("echo", _x(7)),
            "infer_stream": lambda: c.infer_stream("echo", _x(7)),
            "mmi_service": lambda: c.mmi_service("echo"),
            "pump": lambda: c.pump(0),
            "alloc": lambda: c.alloc((4,), np.float32),
            "stream": lambda: c.stream("echo"),
            "prepare": lambda: c.prepare("echo", _x(7)),
        }

        def on_signal():
            for name, use in uses.items():
                try:
                    use()
                except InvalidInput as e:
                    assert "already in a call on this thread" in str(e), e
                    refused[name] = refused.get(name, 0) + 1
                except Exception as e:  # anything else is a failure of the guard
                    other.append(f"{name}: {e!r}")
                else:
                    other.append(f"{name}: ran nested")

        with _OnSigusr1(on_signal) as sig:
            for i in range(20):
                with c.infer("sig", _x(SIGNAL - i)) as r:  # the worker signals us while this waits
                    np.testing.assert_array_equal(r["x"], _x(SIGNAL - i)["x"])
                with c.infer("echo", _x(i)) as r:  # and the next call is served as ever
                    np.testing.assert_array_equal(r["x"], _x(i)["x"])
        assert other == [] and sig.calls == 20
        assert refused == {name: 20 for name in uses}, refused
        assert c.in_flight() == 0 and c.pool.in_use() == 0  # nothing held


@pytest.mark.timeout(60)
def test_a_handle_cancelled_from_a_signal_handler_is_cancelled_after_the_call_it_interrupted(cluster, gate):
    # cancel() (give_up) from a handler is not refused: it is done as soon as the interrupted
    # call can (the CANCEL must not cut into a message the call is sending), and the broker
    # hears it: the queued request is answered CANCELLED long before its deadline.
    from client_sdk import Cancelled, Client

    cluster.broker()
    p = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "1",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    p.wait_ready()
    cluster.worker("test_client_misuse:signalling", "--service", "sig", env={"SIGNAL_PID": str(os.getpid())})
    with Client(cluster.frontend, timeout=WAIT) as c:
        _wait_service(c, "gate")
        _wait_service(c, "sig")
        busy = c.infer_stream("gate", _x(1))  # holds the gate worker
        queued = c.infer_stream("gate", _x(2))  # waits at the broker behind it
        assert c.in_flight() == 2 and c.pool.in_use() == 2
        with _OnSigusr1(queued.cancel):
            with c.infer("sig", _x(SIGNAL)) as r:
                np.testing.assert_array_equal(r["x"], _x(SIGNAL)["x"])
        assert queued.cancelled
        with pytest.raises(Cancelled):
            queued.result(timeout=WAIT)
        _pump_until(c, lambda: c.in_flight() == 1, "the broker's CANCELLED final")
        assert c.pool.in_use() == 1
        gate.release(1)
        with busy.result(timeout=WAIT) as r:
            np.testing.assert_array_equal(r["x"], _x(1)["x"])
        assert c.in_flight() == 0 and c.pool.in_use() == 0


# ----------------------------------------------------------------------------- AsyncClient on another loop

@pytest.mark.timeout(60)
def test_an_async_client_moves_to_the_next_loop_once_its_loop_is_closed(cluster):
    # asyncio.run() twice with one client (a module-level client, a test per loop).
    from client_sdk import AsyncClient, run

    cluster.broker()
    cluster.worker("echo")
    c = AsyncClient(cluster.frontend, timeout=WAIT)
    big = np.full(64 * 1024, 3.0, np.float32)  # through a temporary slot

    async def one(v: float) -> float:
        if not await c.mmi_service("echo", timeout=WAIT):
            return -1.0
        with await c.infer("echo", {"x": big * v}) as r:
            return float(r["x"][0])

    async def streamed(v: float) -> float:
        async with c.stream("echo") as s:
            s.send({"x": big * v})
            with await s.recv(timeout=WAIT) as r:
                return float(r["x"][0])

    try:
        deadline = time.monotonic() + 20
        while asyncio.run(one(1)) < 0:
            assert time.monotonic() < deadline, "no echo worker"
        assert asyncio.run(one(2)) == 6.0
        assert run(one(3)) == 9.0  # uvloop's, when installed
        assert asyncio.run(streamed(4)) == 12.0
        assert c.in_flight() == 0 and c.pool.in_use() == 0
    finally:
        asyncio.run(c.close())
    assert c.closed


@pytest.mark.timeout(60)
def test_an_async_client_refuses_a_second_live_loop_before_sending_anything(cluster):
    from client_sdk import AsyncClient, InvalidInput

    cluster.broker()
    cluster.worker("echo")
    own = asyncio.new_event_loop()
    th = threading.Thread(target=own.run_forever, daemon=True)
    th.start()

    def on_own(coro):
        return asyncio.run_coroutine_threadsafe(coro, own).result(WAIT)

    async def make() -> AsyncClient:  # on its loop's thread, whose pool it is
        return AsyncClient(cluster.frontend, timeout=WAIT)

    c = on_own(make())

    async def one(v: float) -> float:
        with await c.infer("echo", _x(v)) as r:
            return float(r["x"][0])

    async def mmi() -> bool:
        return await c.mmi_service("echo", timeout=WAIT)

    async def streamed() -> None:
        c.stream("echo").send(_x(5))

    async def handle() -> None:
        c.infer_stream("echo", _x(6))

    try:
        deadline = time.monotonic() + 20
        while not on_own(mmi()):
            assert time.monotonic() < deadline, "no echo worker"
        assert on_own(one(1)) == 1.0
        for wrong in (one(2), mmi(), streamed(), handle(), c.pump(0)):
            with pytest.raises(InvalidInput, match="event loop"):
                asyncio.run(wrong)
            assert c.in_flight() == 0 and c.pool.in_use() == 0  # nothing sent, no slot held
        assert on_own(one(3)) == 3.0  # its own loop is served as ever
        assert c.in_flight() == 0 and c.pool.in_use() == 0 and c.stray_replies == 0
    finally:
        on_own(c.close())
        own.call_soon_threadsafe(own.stop)
        th.join(WAIT)
        own.close()
    assert c.closed


@pytest.mark.timeout(60)
def test_a_claim_left_by_an_interrupt_before_its_try_is_taken_over(signalled):
    """A KeyboardInterrupt that lands between a call's claim of the client and the `try`
    that lets go of it left the claim for good: every later call was refused as "nested"
    and close() was deferred for ever (an interruption hunt: 99 in 162,404 random Ctrl-Cs).
    The claim is this thread's and no call of it is on the stack: the next call takes it."""
    import threading

    from client_sdk import Client

    c = Client(signalled.frontend, timeout=WAIT)
    try:
        _wait_service(c, "echo")
        for use in (lambda: c.infer("echo", _x(3)), lambda: c.infer_stream("echo", _x(3)).result(timeout=WAIT),
                    lambda: c.mmi_service("echo")):
            c._user[0] = threading.get_ident()  # what the interrupted claim left
            r = use()
            if hasattr(r, "release"):
                np.testing.assert_array_equal(r["x"], _x(3)["x"])
                r.release()
            assert 0 not in c._user
        c._user[0] = threading.get_ident()
        c.close()
        assert c.closed  # not deferred to a call that will never come
    finally:
        c.close()


def _interrupt_the_next_request(c) -> None:
    """The next REQUEST `c` makes raises KeyboardInterrupt once the call is registered, as a
    Ctrl-C landing while its frames are made."""
    real = c._core._encode_request

    def interrupted(call, now):
        c._core._encode_request = real
        raise KeyboardInterrupt

    c._core._encode_request = interrupted


@pytest.mark.timeout(60)
def test_an_interrupt_while_a_request_is_made_leaves_nothing_in_flight(signalled):
    """A KeyboardInterrupt while a call's REQUEST frames were made (after the call was
    registered) left it in flight for good, with its input slot (the interruption hunt)."""
    from client_sdk import Client

    with Client(signalled.frontend, timeout=WAIT) as c:
        _wait_service(c, "echo")
        _interrupt_the_next_request(c)
        big = {"x": np.arange(1 << 16, dtype=np.float32)}  # by shared memory: a slot of the pool
        with pytest.raises(KeyboardInterrupt):
            c.infer("echo", big)
        assert c.in_flight() == 0 and c.pool.in_use() == 0
        with c.infer("echo", big) as r:
            np.testing.assert_array_equal(r["x"], big["x"])


@pytest.mark.timeout(60)
def test_an_interrupt_while_a_prepared_call_is_submitted_leaves_nothing_in_flight(signalled):
    """`submit` had the window `infer` had: a KeyboardInterrupt while its REQUEST was made
    left the call registered and never sent (the interruption hunt)."""
    from client_sdk import Client

    with Client(signalled.frontend, timeout=WAIT) as c:
        _wait_service(c, "echo")
        big = {"x": np.arange(1 << 16, dtype=np.float32)}
        call = c.prepare("echo", big)
        _interrupt_the_next_request(c)
        with pytest.raises(KeyboardInterrupt):
            c.submit(call)
        c.give_up(call)
        assert c.in_flight() == 0 and c.pool.in_use() == 0
        with c.infer("echo", big) as r:
            np.testing.assert_array_equal(r["x"], big["x"])


@pytest.mark.timeout(60)
def test_a_ctrl_c_in_the_release_of_a_result_reaches_the_caller(signalled, monkeypatch):
    """`Result.release` dropped its arrays first, so each output slot's finalizer ran from
    the collector, where an exception is printed and swallowed: a Ctrl-C landing there was
    lost (the interruption hunt: 165 of 38,893).  Now it reaches the caller."""
    from client_sdk import Client
    from client_sdk.tensors import Adopted

    with Client(signalled.frontend, timeout=WAIT) as c:
        _wait_service(c, "echo")
        big = {"x": np.arange(1 << 16, dtype=np.float32)}
        real = Adopted.drop
        armed = []

        def interrupted(self, *args):  # (bound when the output is made: patched first)
            real(self, *args)
            if armed:
                armed.clear()
                raise KeyboardInterrupt

        monkeypatch.setattr(Adopted, "drop", interrupted)
        r = c.infer("echo", big)  # the echo hands its input's slot back: an Adopted view of it
        assert r.zero_copy["x"]
        armed.append(1)
        with pytest.raises(KeyboardInterrupt):
            r.release()
        with c.infer("echo", big) as again:  # the client goes on
            np.testing.assert_array_equal(again["x"], big["x"])
