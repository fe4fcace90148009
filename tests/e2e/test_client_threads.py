"""A blocking `Client` shared by threads (docs/client.md: it is not thread-safe): refused with
`InvalidInput`, not interleaved.  Four threads on one client used to split multipart messages
between them, fail most calls and leave calls and pool slots held for good.  Real broker and
worker on ipc; every wait bounded."""
from __future__ import annotations

import os
import select
import threading
import time

import numpy as np
import pytest

from client_sdk import Client
from client_sdk.errors import InvalidInput

from tests.children import wait_child

from .conftest import wait_service

pytestmark = pytest.mark.timeout(120)


def test_a_second_thread_is_refused_while_one_is_inside_the_client(cluster):
    cluster.broker()
    cluster.worker("echo")
    # No heartbeats: nothing comes to end the pump early (a heartbeat's answer, or the
    # handshake's on ipc, came before the claim was seen once under load).
    with Client(cluster.frontend, timeout=10, heartbeat_interval=None) as c:
        assert c.mmi_service("echo")
        inside = threading.Thread(target=c.pump, args=(3.0,))  # waits for traffic that never comes
        inside.start()
        deadline = time.monotonic() + 10
        while not c._user:  # (its thread claimed the client)
            assert time.monotonic() < deadline, "the pump never started"
            time.sleep(0.001)
        with pytest.raises(InvalidInput, match="another thread"):
            c.infer("echo", {"x": np.ones(4)})
        with pytest.raises(InvalidInput, match="another thread"):
            c.infer_stream("echo", {"x": np.ones(4)})
        with pytest.raises(InvalidInput, match="another thread"):
            c.mmi_service("echo")
        inside.join(10)
        assert not inside.is_alive()
        with c.infer("echo", {"x": np.arange(4.0)}) as r:  # the first thread's turn is over: anyone's
            np.testing.assert_array_equal(r["x"], np.arange(4.0))


def test_threads_sharing_a_client_get_a_typed_error_and_lose_nothing(cluster):
    cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        assert c.mmi_service("echo")
        start = threading.Barrier(4, timeout=10)
        counts = {"ok": 0, "refused": 0, "other": []}
        lock = threading.Lock()

        def run(k):
            start.wait()
            for i in range(150):
                x = np.full(64, k * 1000 + i, dtype=np.int64)
                try:
                    with c.infer("echo", {"x": x}) as r:
                        np.testing.assert_array_equal(r["x"], x)  # never another's reply
                    key = "ok"
                except InvalidInput:
                    key = "refused"
                except Exception as e:  # anything else is a failure of the guard
                    with lock:
                        counts["other"].append(repr(e))
                    continue
                with lock:
                    counts[key] += 1

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert counts["other"] == [] and counts["ok"] + counts["refused"] == 600, counts
        assert c.in_flight() == 0  # no call left held
        for i in range(50):  # and it serves on, from one thread
            with c.infer("echo", {"x": np.arange(i + 1)}) as r:
                np.testing.assert_array_equal(r["x"], np.arange(i + 1))


def _wait_child(pid: int, timeout: float = 20.0) -> int:
    return wait_child(pid, timeout, "a child forked with a client")


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # 3.12: forks on purpose
def test_a_forked_child_neither_uses_nor_gives_back_its_parents_client(cluster):
    # A child that called the parent's client spun at 100 % CPU for good (libzmq's sockets
    # are the parent's); one that released or dropped a Result it inherited gave the
    # parent's output slot back to the worker, and the parent's arrays then showed other
    # requests' data.
    cluster.broker()
    cluster.worker("faulty_model:batched", "--service", "batched", "--out-capacity-mb", "1")  # 64 such slots
    x = np.full((1, 4096), 5.0, np.float32)  # 16 KiB: into the worker's output ring
    with Client(cluster.frontend, timeout=20) as c:
        held = c.infer("batched", {"x": x}, reply="shm")
        y = held["y"]
        assert held.zero_copy == {"y": True}
        pending = c.infer_stream("batched", {"x": x})  # in flight across the fork
        buf = c.alloc((1024,), np.uint8)
        buf[:] = 0x11
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                refused = 0
                for use in (lambda: c.infer("batched", {"x": x}), lambda: c.pump(0.1), pending.result,
                            lambda: c.stream("batched").send({"x": x}), lambda: c.mmi_service("batched"),
                            # (alloc() handed the child the slot the parent's next alloc() got,
                            # and free() freed nothing, silently: the client audit)
                            lambda: c.alloc((1024,), np.uint8)[:].fill(0xCC), lambda: c.free(buf)):
                    try:
                        use()
                    except InvalidInput as e:
                        refused += "forked" in str(e)
                pending.close()  # gives nothing back, sends nothing
                code = 0 if refused == 7 else 2
                held.release()
                del y
                import gc

                gc.collect()
                c.close()  # lets go of its copy only
                c._inbox._unlink()  # what the copy's collection would run: not the parent's file
            finally:
                os._exit(code)
        assert _wait_child(pid) == 0
        mine = c.alloc((1024,), np.uint8)
        mine[:] = 0x22
        assert (buf == 0x11).all() and (mine == 0x22).all()
        c.free(buf)
        c.free(mine)
        with pending.result() as r:  # the parent's call, untouched by the child's close
            np.testing.assert_array_equal(r["y"], x + 1)
        assert os.path.exists(c._inbox.path)  # its reply socket is still there
        direct = c.direct_replies
        for i in range(200):  # the ring goes round three times: a slot given back would be reused
            with c.infer("batched", {"x": np.full((1, 4096), float(i), np.float32)}, reply="shm") as r:
                np.testing.assert_array_equal(r["y"], i + 1.0)
        np.testing.assert_array_equal(y, 6.0)  # still the parent's own result
        assert c.direct_replies > direct  # and its replies still come straight from the worker
        held.release()


def test_a_close_cut_short_by_a_signal_still_closes(cluster):
    # Ctrl-C (or an alarm's handler) raising in the middle of close(): the client said it
    # was open, and its next call failed with a raw ZMQError or waited out its timeout.
    from client_sdk.errors import InferenceError

    cluster.broker()
    cluster.worker("echo")
    c = Client(cluster.frontend, timeout=10)
    with c.infer("echo", {"x": np.arange(3)}) as r:
        assert r["x"][2] == 2
    real = c._unwatch

    def interrupted():
        real()
        raise KeyboardInterrupt

    c._unwatch = interrupted
    with pytest.raises(KeyboardInterrupt):
        c.close()
    assert c.closed
    with pytest.raises(InferenceError, match="closed"):
        c.infer("echo", {"x": np.arange(3)})


@pytest.mark.parametrize("at", [1, 3])
def test_a_request_cut_short_by_a_signal_as_it_is_sent_harms_no_other(cluster, monkeypatch, at):
    # Ctrl-C landing between two frames of a REQUEST: the next request on the socket was
    # glued onto the half-sent one, and an innocent call waited out its timeout.  The
    # request now goes out whole, is cancelled, and gives everything back.
    from broker.protocol import wire

    cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        with c.infer("echo", {"x": np.arange(3)}) as r:
            assert r["x"][2] == 2
        real = wire._send
        n = {"i": 0, "on": True}

        def send(sock, f, flags, copy):
            if n["on"]:
                if n["i"] == at:
                    n["on"] = False
                    raise KeyboardInterrupt
                n["i"] += 1
            return real(sock, f, flags, copy)

        monkeypatch.setattr(wire, "_send", send)
        with pytest.raises(KeyboardInterrupt):
            c.infer("echo", {"x": np.arange(5)})
        monkeypatch.setattr(wire, "_send", real)
        for i in range(3):
            with c.infer("echo", {"x": np.full(4, i)}) as r:
                assert r["x"].tolist() == [i] * 4
        deadline = time.monotonic() + 10
        while c.in_flight() and time.monotonic() < deadline:
            c.pump(0.05)
        assert c.in_flight() == 0 and c.pool.in_use() == 0


# ----------------------------------------------------------------------------- gated: a thread held inside

GATE_WAIT = 10.0  # bound of every blocking wait below, and the requests' own deadline


@pytest.fixture
def gated(cluster, gate):
    """A broker and one gate worker (tests/e2e/gate_model.py) that holds one request at a time:
    a thread in `infer` on it stays inside the client until the test writes a byte."""
    cluster.broker()
    p = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "1",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    p.wait_ready()
    return cluster


def _gx(v: float) -> dict:
    return {"x": np.full(2048, v, np.float32)}  # above the inline limit: a temporary input slot


def _read_until_closed(fd: int, timeout: float = GATE_WAIT) -> str:
    """What a child writes to its pipe, until it closes its end (exits), bounded."""
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the child did not finish within {timeout} s: {data!r}"
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return data.decode()
                data += chunk
    finally:
        os.close(fd)


def _held_inside(c: Client, t: threading.Thread) -> None:
    """Until thread `t` is inside the client (its claim), bounded."""
    deadline = time.monotonic() + GATE_WAIT
    while c._user.get(0) != t.ident:
        assert t.is_alive() and time.monotonic() < deadline, "the thread never got inside the client"
        time.sleep(0.001)


def test_a_cancel_refused_for_another_threads_use_leaves_the_handle_as_it_was(gated, gate):
    # cancel() (and close()) from a second thread while one was inside the client raised
    # InvalidInput, as documented, but marked the handle first: `cancelled` said True, a
    # second cancel() did nothing (no CANCEL ever went out), and result() raised Cancelled
    # for a request that ran and answered (the fork/threads hunt, t2_cancel_other_thread).
    with Client(gated.frontend, timeout=GATE_WAIT) as c:
        wait_service(c, "gate")
        h = c.infer_stream("gate", _gx(1))  # runs first, held by the gate
        out = {}
        inside = threading.Thread(target=lambda: out.setdefault("r", c.infer("gate", _gx(2))))
        inside.start()  # its request queues behind h's: it stays inside until two bytes
        try:
            _held_inside(c, inside)
            with pytest.raises(InvalidInput, match="another thread"):
                h.cancel()
            assert not h.cancelled
            with pytest.raises(InvalidInput, match="another thread"):
                h.close()
        finally:
            gate.release(2)  # h's byte, then the inside thread's
            inside.join(GATE_WAIT)
        assert not inside.is_alive()
        with out["r"] as r:
            np.testing.assert_array_equal(r["x"], _gx(2)["x"])
        with h.result(timeout=GATE_WAIT) as r:  # it ran, and its answer is the caller's
            np.testing.assert_array_equal(r["x"], _gx(1)["x"])
        assert not h.cancelled and h.cancel() is False  # nothing left to cancel
        assert c.in_flight() == 0 and c.pool.in_use() == 0


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # 3.12: forks on purpose
def test_a_child_forked_while_another_thread_was_inside_the_client_gets_the_fork_error(gated, gate):
    # The child inherited the other thread's claim on the client (that thread does not exist
    # there): every call, close() included, raised "in use by another thread" instead of the
    # documented fork error, and close() could not let go of the child's copy (the fork/threads
    # hunt, t16_fork_while_thread_inside).
    with Client(gated.frontend, timeout=GATE_WAIT) as c:
        wait_service(c, "gate")
        out = {}
        inside = threading.Thread(target=lambda: out.setdefault("r", c.infer("gate", _gx(1))))
        inside.start()
        try:
            _held_inside(c, inside)
            r_fd, w_fd = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 1
                try:
                    os.close(r_fd)
                    said = []
                    for name, use in (("infer", lambda: c.infer("gate", _gx(3))),
                                      ("infer_stream", lambda: c.infer_stream("gate", _gx(3))),
                                      ("mmi_service", lambda: c.mmi_service("gate"))):
                        try:
                            use()
                            said.append(f"{name}: returned")
                        except InvalidInput as e:
                            said.append(f"{name}: " + ("fork" if "forked this one" in str(e) else str(e)))
                    try:
                        c.close()  # lets go of the child's copy
                        c.close()
                        said.append(f"close: closed={c.closed}")
                    except Exception as e:
                        said.append(f"close: {e!r}")
                    os.write(w_fd, "\n".join(said).encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(w_fd)
            said = _read_until_closed(r_fd)
            assert _wait_child(pid) == 0
            assert said.splitlines() == ["infer: fork", "infer_stream: fork", "mmi_service: fork",
                                         "close: closed=True"], said
        finally:
            gate.release(1)
            inside.join(GATE_WAIT)
        assert not inside.is_alive()
        with out["r"] as r:  # the parent's call, untouched by the child
            np.testing.assert_array_equal(r["x"], _gx(1)["x"])
        assert not c.closed
        gate.release(1)
        with c.infer("gate", _gx(4)) as r:  # and the parent's client serves on
            np.testing.assert_array_equal(r["x"], _gx(4)["x"])
        assert c.in_flight() == 0 and c.pool.in_use() == 0
