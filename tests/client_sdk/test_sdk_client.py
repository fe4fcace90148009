"""Client, AsyncClient and streams against an in-test fake broker.

The fake is one thread running a ROUTER that decodes everything with broker.protocol and
answers like broker + worker together: it reads inputs in place through its own
SegmentCache (which refuses any slot that is not IN_FLIGHT, so it also checks the client's
slot states) and writes outputs into its own ShmPool, marked IN_FLIGHT for the client's
pid, or inline when asked.  Requests to the "hold" services wait until the test releases
them, so every test paces the fake with queues and events, never with sleeps.

Tests that apply to both twins take the `connect` fixture: it opens a `Client`, or an
`AsyncClient` driven through `BlockingTwin` (each coroutine run to completion on a private
event loop), so one test body checks that both clients behave the same.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import inspect
import os
import queue
import re
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest
import zmq

import shm
from broker import protocol as P
from broker.protocol import ErrorCode
from client_sdk import (
    AsyncClient,
    BrokerUnreachable,
    Client,
    DeadlineExceeded,
    EndOfStream,
    InferenceError,
    InvalidInput,
    NotSupported,
    errors,
    run,
)
from tests.alarms import alarm

pytestmark = pytest.mark.timeout(30)

WAIT = 10.0  # upper bound for any single blocking wait in these tests
KNOWN_SERVICES = {"echo", "echo_inline", "hold", "partials", "error", "remote", "opaque", "identity", "opaque_hold"}


class FakeBroker(threading.Thread):
    def __init__(self, endpoint: str):
        super().__init__(name="fake-broker", daemon=True)
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self._wake_rx = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(f"inproc://fake-wake-{id(self)}")
        self._wake_tx = self.ctx.socket(zmq.PUSH)
        self._wake_tx.connect(f"inproc://fake-wake-{id(self)}")
        self._wake_lock = threading.Lock()
        self._calls: queue.Queue = queue.Queue()
        # Everything below is touched only by the fake's thread once it runs; tests reach it
        # through call() or through the thread-safe queues.
        self.pool = shm.ShmPool(8 << 20)
        self.cache = shm.SegmentCache()
        self.requests: list[tuple[str, Any]] = []    # (service, Request or opaque body)
        self.held: list[tuple[bytes, str, P.Request, list]] = []
        self.hold_for_heartbeat: list[tuple[bytes, str, P.Request, list]] = []
        self.out_refs: list[shm.ShmRef] = []
        self.out_arrays: list[np.ndarray] = []
        self.held_opaque: list[tuple[bytes, list[bytes]]] = []
        self.held_mmi: list[bytes] = []               # identities waiting for a "hold_mmi" answer
        self.idents: list[bytes] = []                 # sender of each tensor request and MMI question
        self.held_q: queue.Queue = queue.Queue()     # request id of each request put on hold
        self.cancels: queue.Queue = queue.Queue()    # ids of CANCELs received
        self.events: queue.Queue = queue.Queue()     # ("heartbeat",), ("disconnect",)
        self.lease_asks: list[tuple[str, P.LeaseAsk]] = []  # every LEASE (a stream's), refused
        self.answer_cancel = True
        self._halt = threading.Event()                # stop(): the loop ends at its next look
        self._direct: dict[str, zmq.Socket] = {}      # reply_to -> PUSH, like a worker's

    # ---------------------------------------------------------------- test-side API

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn in the fake's thread (so its sockets and pool stay single-threaded)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        with self._wake_lock:
            self._wake_tx.send(b"")
        return fut.result(WAIT)

    def release(self, n: int = 1, identity: bool = False) -> None:
        def go():
            for _ in range(n):
                ident, service, req, body = self.held.pop(0)
                if identity:
                    rep = P.Reply(id=req.id, tensors=list(req.tensors))
                    self._send(ident, True, service, [P.encode_header(rep), *body[1:]])
                else:
                    self._echo(ident, service, req, body)
        self.call(go)

    def release_direct_batch(self, n: int) -> None:
        """Answer the first `n` held requests (same client) with one FINALS message on the
        client's reply socket, as a worker answers a batch."""
        def go():
            items, self.held = self.held[:n], self.held[n:]
            heads = []
            for ident, service, req, body in items:
                self._echo(ident, service, req, body, collect=heads)
            sock = self._direct.get(items[0][2].reply_to)
            if sock is None:
                sock = self._direct[items[0][2].reply_to] = self.ctx.socket(zmq.PUSH)
                sock.connect(items[0][2].reply_to)
            sock.send_multipart(P.direct_finals(b"hold", heads))
        self.call(go)

    def answer_opaque_reversed(self) -> None:
        def go():
            while self.held_opaque:
                ident, body = self.held_opaque.pop()
                self._send(ident, True, "opaque_hold", body)
        self.call(go)

    def release_mmi(self) -> None:
        """Answer the held `hold_mmi` questions, late, with "200"."""
        def go():
            while self.held_mmi:
                self._send(self.held_mmi.pop(0), True, "mmi.service", [b"200"])
        self.call(go)

    def out_states(self) -> list[int]:
        return self.call(lambda: [int(self.pool.table["state"][r.slot]) for r in self.out_refs])

    def reclaim(self) -> int:
        return self.call(self.pool.reclaim)

    def stop(self) -> None:
        """End the loop, then close its sockets, cache, pool and context, each even if one
        before it raises, and also when the thread died of an exception.  A thread still
        running after WAIT s fails the test and keeps them open: its sockets are its own
        (zmq sockets are not thread-safe), and the context would wait for them for good."""
        self._halt.set()
        if self.ident is not None:  # started
            self.join(WAIT)
        assert not self.is_alive(), f"the fake broker's thread did not stop within {WAIT} s"
        with contextlib.ExitStack() as closing:  # its callbacks run last-in first-out
            closing.callback(self.ctx.term)
            closing.callback(self.pool.close)
            closing.callback(self.cache.close)
            for s in (self.sock, self._wake_rx, self._wake_tx, *self._direct.values()):
                closing.callback(s.close, linger=0)

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._halt.is_set():
            ready = dict(poller.poll(50))  # a timeout: it looks at `_halt` at least this often
            if self._wake_rx in ready:
                self._wake_rx.recv()
                fn, fut = self._calls.get()
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the test thread
                    fut.set_exception(e)
            if self.sock in ready:
                frames = self.sock.recv_multipart(copy=False)
                self._on_client(frames[0].bytes, frames[1:])

    def _send(self, ident: bytes, final: bool, service: str, body: list) -> None:
        self.sock.send_multipart(P.to_client(ident, final, service.encode(), body), copy=False)

    def _error(self, ident: bytes, service: str, rid: int, code: int, message: str) -> None:
        self._send(ident, True, service, P.error_body(rid, code, message))

    def next_event_but_heartbeats(self) -> tuple:
        """The next event that is not a HEARTBEAT (clients send one when they connect, and one
        per interval while calls wait)."""
        event = self.events.get(timeout=WAIT)
        while event == ("heartbeat",):
            event = self.events.get(timeout=WAIT)
        return event

    def _on_client(self, ident: bytes, frames: list) -> None:
        msg = P.parse_client(frames)
        if msg.command == P.C_HEARTBEAT:
            self.events.put(("heartbeat",))
            self.sock.send_multipart([ident, *P.client_heartbeat()])
            waiting, self.hold_for_heartbeat = self.hold_for_heartbeat, []
            for item in waiting:
                self._echo(*item)
            return
        if msg.command == P.C_DISCONNECT:
            self.events.put(("disconnect",))
            return
        if msg.command in (P.C_LEASE, P.C_LEASE_END):
            # As a broker whose workers take no leases: every ask refused (LEASED, an error).
            if msg.command == P.C_LEASE:
                ask = P.decode_lease_ask(msg.body[0])
                self.lease_asks.append((msg.service.decode(), ask))
                self.sock.send_multipart([ident, *P.client_leased(msg.service, P.error_body(
                    ask.id, ErrorCode.SERVICE_UNAVAILABLE, "no worker of it takes leases"))])
            return
        if msg.command == P.C_CANCEL:
            rid = P.decode_cancel(msg.body[0]).id
            self.cancels.put(rid)
            for i, (hid, service, req, _) in enumerate(self.held):
                if hid == ident and req.id == rid and self.answer_cancel:
                    del self.held[i]
                    self._error(ident, service, rid, ErrorCode.CANCELLED, "cancelled by the client")
                    break
            return
        service = msg.service.decode()
        body = list(msg.body)
        if service == "mmi.service":
            name = bytes(body[0]).decode()
            self.idents.append(ident)
            if name == "hold_mmi":
                self.held_mmi.append(ident)
                self.held_q.put(b"hold_mmi")
                return
            self._send(ident, True, service, [b"200" if name in KNOWN_SERVICES else b"404"])
            return
        if not P.is_header(body[0]):
            self.requests.append((service, [bytes(f) for f in body]))
            if service == "opaque":
                self._send(ident, True, service, [bytes(f) for f in body])
            elif service == "opaque_hold":
                self.held_opaque.append((ident, [bytes(f) for f in body]))
                self.held_q.put(bytes(body[0]))
            else:
                self._error(ident, service, 0, ErrorCode.SERVICE_UNAVAILABLE, f"no service {service!r}")
            return
        try:
            req = P.decode_request(body[0], len(body) - 1)
            P.check_inline_sizes(req.tensors, body[1:])
        except P.ProtocolError as e:
            self._error(ident, service, 0, e.code, str(e))
            return
        self.requests.append((service, req))
        self.idents.append(ident)
        has_shm = any(type(t.loc) is P.ShmLoc for t in req.tensors)
        if service in ("echo", "echo_inline"):
            self._echo(ident, service, req, body)
        elif service == "partials":
            n = int(req.meta.get("n", 2))
            for seq in range(n):
                self._echo(ident, service, req, body, final=False, seq=seq)
            self._echo(ident, service, req, body, seq=n)
        elif service == "error":
            self._error(ident, service, req.id, int(req.meta["code"]), req.meta.get("message", "fake error"))
        elif service == "identity":
            # Like a worker whose model returns its input unchanged: the output descriptor
            # is the client's own input descriptor (no byte moves), in PARTIALs too.
            n = int(req.meta.get("n", 0))
            for seq in range(n + 1):
                rep = P.Reply(id=req.id, tensors=list(req.tensors), seq=seq)
                self._send(ident, seq == n, service, [P.encode_header(rep), *body[1:]])
        elif service == "badheader":
            # A reply that breaks the protocol (negative dimension); its id is still readable.
            bad = P.TensorRef(name="y", dtype="<f4", shape=[-1], loc=P.InlineLoc(frame=0))
            self._send(ident, True, service, [P.encode_header(P.Reply(id=req.id, tensors=[bad])), b""])
        elif service == "direct_dup":
            # What a retry that raced a direct reply looks like to the client: the FINAL
            # straight from a worker on its reply_to socket, and the same FINAL relayed.
            assert req.reply_to is not None and req.reply_to.startswith("ipc:///")
            sock = self._direct.get(req.reply_to)
            if sock is None:
                sock = self._direct[req.reply_to] = self.ctx.socket(zmq.PUSH)
                sock.connect(req.reply_to)
            rep_ = P.Reply(id=req.id, tensors=[P.TensorRef(name="n", dtype="<i8", shape=[], loc=P.InlineLoc(frame=0))])
            head = P.encode_header(rep_)
            sock.send_multipart(P.client_reply(True, service.encode(), [head, np.int64(1).tobytes()]))
            self._send(ident, True, service, [head, np.int64(2).tobytes()])
        elif service == "hold":
            self.held.append((ident, service, req, body))
            self.held_q.put(req.id)
        elif service == "hold_hb":
            self.hold_for_heartbeat.append((ident, service, req, body))
        elif service == "remote":
            if has_shm:
                self._error(ident, service, req.id, ErrorCode.NOT_LOCAL, "the worker is on another host")
            else:
                self._echo(ident, service, req, body)
        else:
            self._error(ident, service, req.id, ErrorCode.SERVICE_UNAVAILABLE, f"no service {service!r}")

    def _inputs(self, req: P.Request, body: list) -> dict[str, np.ndarray]:
        out = {}
        for t in req.tensors:
            dt = P.parse_dtype(t.dtype)
            if type(t.loc) is P.ShmLoc:
                assert req.host == P.local_host_id()
                loc = t.loc
                out[t.name] = self.cache.view(
                    shm.ShmRef(loc.segment, loc.offset, loc.nbytes, loc.slot, loc.generation), dt, tuple(t.shape)
                )
            else:
                buf = memoryview(body[1 + t.loc.frame])
                out[t.name] = (np.frombuffer(buf, dt).reshape(t.shape) if buf.nbytes
                               else np.empty(t.shape, dt))
        return out

    def _echo(self, ident: bytes, service: str, req: P.Request, body: list, *, final: bool = True,
              seq: int = 0, collect: list | None = None) -> None:
        try:
            arrays = self._inputs(req, body)
        except shm.ShmError as e:
            self._error(ident, service, req.id, ErrorCode.PROTOCOL_ERROR, f"bad input descriptor: {e}")
            return
        inline = req.reply == "inline" or service == "echo_inline"
        tensors, frames = [], []
        for name, arr in arrays.items():
            if inline or arr.nbytes == 0:
                loc = P.InlineLoc(frame=len(frames))
                frames.append(np.ascontiguousarray(arr).tobytes())
            else:
                dst = self.pool.alloc(arr.shape, arr.dtype)
                dst[...] = arr
                ref = self.pool.ref_of(dst)
                self.pool.mark_in_flight(ref, holder_pid=req.pid)
                self.out_refs.append(ref)
                self.out_arrays.append(dst)
                loc = P.ShmLoc(segment=ref.segment, offset=ref.offset, nbytes=ref.nbytes, slot=ref.slot,
                               generation=ref.generation)
            tensors.append(P.TensorRef(name=name, dtype=arr.dtype.str, shape=list(arr.shape), loc=loc))
        rep = P.Reply(id=req.id, tensors=tensors, timing={"compute_ms": 0.25}, seq=seq)
        if collect is not None:
            assert not frames
            collect.append(P.encode_header(rep))
            return
        self._send(ident, final, service, [P.encode_header(rep), *frames])


class BlockingTwin:
    """An AsyncClient behind Client's blocking API: each coroutine method runs to completion
    on a private event loop (the reader and heartbeat task run while it does); everything
    else is the AsyncClient's own attribute."""

    def __init__(self, *args: Any, **kw: Any):
        self._twin = AsyncClient(*args, **kw)
        self._twin_loop = asyncio.new_event_loop()
        self._run(self._twin.__aenter__())  # the reader joins our loop

    def _run(self, coro: Any) -> Any:
        return self._twin_loop.run_until_complete(coro)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._twin, name)
        if inspect.iscoroutinefunction(attr):
            return lambda *a, **kw: self._run(attr(*a, **kw))
        return attr

    def infer_stream(self, *args: Any, **kw: Any) -> "BlockingReplies":
        return BlockingReplies(self, self._twin.infer_stream(*args, **kw))

    def close(self) -> None:
        self._run(self._twin.close())

    def shutdown(self) -> None:
        """Close the client if the test did not, then the loop."""
        try:
            if not self._twin.closed:
                self.close()
        finally:
            self._twin_loop.close()

    def __enter__(self) -> "BlockingTwin":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BlockingReplies:
    """An AsyncReplyStream behind ReplyStream's blocking API."""

    def __init__(self, twin: BlockingTwin, replies: Any):
        self._twin = twin
        self._replies = replies

    @property
    def request_id(self) -> int:
        return self._replies.request_id

    def __iter__(self) -> "BlockingReplies":
        return self

    def __next__(self) -> Any:
        try:
            return self._twin._run(self._replies.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    @property
    def cancelled(self) -> bool:
        return self._replies.cancelled

    def cancel(self) -> bool:
        return self._replies.cancel()

    def result(self, timeout: Any = None) -> Any:
        return self._twin._run(self._replies.result(timeout))

    def close(self) -> None:
        self._replies.close()

    def __enter__(self) -> "BlockingReplies":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@pytest.fixture(params=["Client", "AsyncClient"])
def connect(request):
    """Opens clients of the kind the test runs with (`connect(endpoint, **options)`)."""
    twins: list[BlockingTwin] = []

    def make(*args: Any, **kw: Any) -> Any:
        if request.param == "Client":
            return Client(*args, **kw)
        twin = BlockingTwin(*args, **kw)
        twins.append(twin)
        return twin

    try:
        yield make
    finally:
        for twin in twins:
            twin.shutdown()


# ================================================================================================
# Round trips

def _cases() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    base = rng.standard_normal((6, 8)).astype(np.float32)
    return [
        ("f32_0d", np.array(3.25, np.float32)),
        ("f64_empty", np.zeros((0, 3))),
        ("i16_5d", np.arange(2 * 1 * 3 * 1 * 2, dtype=np.int16).reshape(2, 1, 3, 1, 2)),
        ("f32_strided", base[::2, 1::3]),
        ("f32_fortran", np.asfortranarray(base)),
        ("bool", rng.random((4, 5)) > 0.5),
        ("c64", (base[:2] + 1j * base[2:4]).astype(np.complex64)),
        ("c128", np.array([1 + 2j, -3.5j, 0], np.complex128)),
        ("f16", base.astype(np.float16)),
        ("dt64", np.array(["2024-02-29T12:00", "1970-01-01", "NaT"], "datetime64[ns]")),
        ("td64", np.array([1, -2, 3], "timedelta64[s]")),
        ("u8_big", rng.integers(0, 255, 1 << 20, dtype=np.uint8)),
        ("i32_be", np.arange(5, dtype=">i4")),
        ("u64", np.array([0, 2**64 - 1], np.uint64)),
        ("str", np.array(["a", "héllo"], "U5")),
        ("bytes", np.array([b"ab", b"xyz"], "S3")),
    ]


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_round_trip_dtypes_and_shapes(connect, fake, endpoint, transport):
    cases = _cases()
    with connect(endpoint, transport=transport) as c:
        for name, x in cases:
            with c.infer("echo", {name: x}) as r:
                y = r[name]
                assert y.dtype == x.dtype and y.shape == x.shape, name
                np.testing.assert_array_equal(y, x, err_msg=name)
                assert not y.flags.writeable
                assert r.zero_copy[name] == (transport == "shm" and x.size > 0)
                assert r.timing["compute_ms"] == 0.25 and r.final
        # all inputs in one request too
        with c.infer("echo", dict(cases)) as r:
            for name, x in cases:
                np.testing.assert_array_equal(r[name], x, err_msg=name)
        service, req = fake.requests[-1]
        kinds = {t.name: type(t.loc) for t in req.tensors}
        want = P.ShmLoc if transport == "shm" else P.InlineLoc
        assert kinds["f32_fortran"] is want and kinds["u8_big"] is want
        assert kinds["f64_empty"] is P.InlineLoc  # nothing to put in a slot
        assert req.reply == ("shm" if transport == "shm" else "inline")  # transport="shm": replies by reference too
        if transport == "shm":
            assert c.pool.in_use() == 0
    assert not fake.out_states() or set(fake.out_states()) <= {shm.RELEASED, shm.FREE}


def test_torch_inputs(connect, fake, endpoint):
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
    g = torch.ones(3, requires_grad=True)
    with connect(endpoint) as c:
        with c.infer("echo", {"t": t, "g": g}) as r:
            np.testing.assert_array_equal(r["t"], t.numpy())
            np.testing.assert_array_equal(r["g"], np.ones(3, np.float32))
        with pytest.raises(NotSupported, match="GPU tensors") as ei:
            c.infer("echo", {"m": torch.empty(3, device="meta")})
        assert isinstance(ei.value, NotImplementedError) and isinstance(ei.value, InferenceError)
        with pytest.raises(InvalidInput, match="bfloat16"):
            c.infer("echo", {"b": torch.zeros(2, dtype=torch.bfloat16)})
        assert c.pool.in_use() == 0


def test_bad_inputs_fail_before_sending(connect, fake, endpoint):
    with connect(endpoint) as c:
        with pytest.raises(InvalidInput, match="Python objects"):
            c.infer("echo", {"x": np.array([1, "a", None], dtype=object)})
        with pytest.raises(InvalidInput, match="mapping"):
            c.infer("echo", [np.zeros(2)])
        with pytest.raises(InvalidInput, match="priority"):
            c.infer("echo", {"x": np.zeros(2)}, priority="asap")
        with pytest.raises(InvalidInput, match="meta"):
            c.infer("echo", {"x": np.zeros(2)}, meta={"f": object()})
        assert c.pool.in_use() == 0
        assert c.mmi_service("echo")  # a round trip after them: none of them reached the fake
    assert fake.requests == [] or all(s == "mmi.service" for s, _ in fake.requests)


# ================================================================================================
# Shared memory: inputs by reference, slot lifetimes, outputs released

def test_alloc_buffers_go_by_reference(connect, fake, endpoint):
    with connect(endpoint, transport="shm") as c:
        buf = c.alloc((4, 6), np.float32)
        buf[...] = np.arange(24).reshape(4, 6)
        with c.infer("echo", {"x": buf, "row": buf[2]}) as r:
            np.testing.assert_array_equal(r["x"], buf)
            np.testing.assert_array_equal(r["row"], buf[2])
        _, req = fake.requests[-1]
        locs = {t.name: t.loc for t in req.tensors}
        assert type(locs["x"]) is P.ShmLoc and locs["x"].segment == c.pool.name
        assert locs["row"].slot == locs["x"].slot  # same slot: no copy was made
        assert locs["row"].offset == locs["x"].offset + 2 * 6 * 4 and locs["row"].nbytes == 24
        assert c.pool.in_use() == 1  # the request did not free the user's buffer
        # A column is strided: it must be copied, into a temporary slot freed at the FINAL.
        with c.infer("echo", {"col": buf[:, 1]}) as r:
            np.testing.assert_array_equal(r["col"], buf[:, 1])
        _, req = fake.requests[-1]
        assert req.tensors[0].loc.slot != locs["x"].slot
        assert c.pool.in_use() == 1
        view = buf[1:]
        del buf
        gc.collect()
        assert c.pool.in_use() == 1  # a view keeps the buffer
        del view
        gc.collect()
        assert c.pool.in_use() == 0
        b2 = c.alloc((3,), np.int64)
        c.free(b2)
        assert c.pool.in_use() == 0
        with pytest.raises(InvalidInput):
            c.free(np.zeros(3))
        # A view is refused, and frees nothing: it freed the whole buffer, which the next
        # alloc() then shared with the array it was sliced from (silently mixed data).
        a = c.alloc((1000,), np.float32)
        a[:] = 5
        for view in (a[10:20], a.reshape(10, 100), a[:]):
            with pytest.raises(InvalidInput, match="not a view of it"):
                c.free(view)
        b = c.alloc((1000,), np.float32)
        b[:] = 9
        assert not np.shares_memory(a, b) and (a == 5).all()
        c.free(a)
        c.free(b)
        assert c.pool.in_use() == 0


def test_buffer_dropped_in_another_thread(connect, endpoint):
    with connect(endpoint, transport="shm") as c:
        box = [c.alloc((16,), np.uint8)]
        t = threading.Thread(target=box.clear)
        t.start()
        t.join(WAIT)
        assert c.pool.in_use() == 1  # the pool is single-threaded: freed by the client's thread...
        c.alloc((1,), np.uint8)      # ...at its next call
        assert c.pool.in_use() == 0


def test_temp_slots_freed_at_final_not_before(connect, fake, endpoint):
    with connect(endpoint, transport="shm") as c:
        x = np.arange(10.0)
        replies = c.infer_stream("hold", {"x": x, "y": x[::2]})
        assert fake.held_q.get(timeout=WAIT) == replies.request_id
        assert c.pool.in_use() == 2  # the worker may still be reading them
        fake.release(1)
        (r,) = list(replies)
        assert r.final
        np.testing.assert_array_equal(r["y"], x[::2])
        assert c.pool.in_use() == 0
        r.release()


def test_outputs_are_zero_copy_and_released(connect, fake, endpoint):
    with connect(endpoint, transport="shm") as c:
        x = np.arange(16, dtype=np.int32)
        r = c.infer("echo", {"x": x})
        assert r.zero_copy == {"x": True}
        assert fake.out_states() == [shm.IN_FLIGHT]
        # Zero copy: a write by the owner (never done for real while IN_FLIGHT) shows
        # through the client's view.
        fake.call(lambda: fake.out_arrays[0].__setitem__(3, -5))
        assert r["x"][3] == -5
        r.release()
        assert fake.out_states() == [shm.RELEASED]
        assert fake.reclaim() == 1
        with pytest.raises(InferenceError, match="released"):
            r["x"]
        r.release()  # idempotent

        # Garbage collection releases too, once the last view is gone.
        r = c.infer("echo", {"x": x})
        y = r["x"]
        tail = y[4:].reshape(3, 4).T
        del r, y
        gc.collect()
        assert fake.out_states()[-1] == shm.IN_FLIGHT
        np.testing.assert_array_equal(tail, x[4:].reshape(3, 4).T)
        del tail
        gc.collect()
        assert fake.out_states()[-1] == shm.RELEASED
        assert fake.reclaim() == 1


def test_inputs_handed_back_as_outputs(connect, fake, endpoint):
    """A worker may answer with the client's own input descriptor.  The input slot then
    outlives the FINAL as long as the outputs do, and the client never stores RELEASED into
    its own pool (its reclaim would free a slot still in use)."""
    with connect(endpoint, transport="shm") as c:
        x = np.arange(12, dtype=np.int16).reshape(3, 4)
        r = c.infer("identity", {"x": x, "t": x.T})
        assert r.zero_copy == {"x": True, "t": True}  # views of the input slots themselves
        np.testing.assert_array_equal(r["x"], x)
        np.testing.assert_array_equal(r["t"], x.T)
        assert not r["x"].flags.writeable
        assert c.pool.in_use() == 2  # adopted by the result
        assert set(c.pool.table["state"][:2]) == {shm.IN_FLIGHT}
        keep = r["t"][1:]
        r.release()
        assert c.pool.in_use() == 0

        # PARTIALs and the FINAL share the slot: it goes when the last of them does.
        rs = list(c.infer_stream("identity", {"x": x}, meta={"n": 2}))
        assert len(rs) == 3 and c.pool.in_use() == 1
        rs[2].release()
        rs[0].release()
        assert c.pool.in_use() == 1
        y = rs[1]["x"]
        del rs
        gc.collect()
        assert c.pool.in_use() == 1 and y[2, 3] == 11
        del y
        gc.collect()
        assert c.pool.in_use() == 0

        # A buffer from alloc() stays the caller's.
        buf = c.alloc((3, 4), np.int16)
        buf[...] = x
        with c.infer("identity", {"b": buf}) as r:
            np.testing.assert_array_equal(r["b"], x)
        assert c.pool.in_use() == 1 and shm.RELEASED not in set(c.pool.table["state"].tolist())
        c.free(buf)
        assert c.pool.in_use() == 0
    del keep


def test_late_identity_reply_is_not_released_into_own_pool(connect, fake, endpoint):
    fake.answer_cancel = False
    with connect(endpoint, transport="shm") as c:
        buf = c.alloc((4,), np.float32)
        with pytest.raises(DeadlineExceeded):
            c.infer("hold", {"b": buf, "tmp": np.ones(3)}, timeout=0.1)
        fake.held_q.get(timeout=WAIT)
        fake.release(1, identity=True)
        c.infer("echo", {"x": np.ones(1)}).release()  # the late reply was handled before this
        assert c.stray_replies == 1
        assert c.pool.in_use() == 1  # only the user's buffer
        assert shm.RELEASED not in set(c.pool.table["state"].tolist())
        c.free(buf)


def test_result_outlives_client(connect, fake, endpoint):
    with connect(endpoint, transport="shm") as c:
        r = c.infer("echo", {"x": np.arange(5)})
    np.testing.assert_array_equal(r["x"], np.arange(5))  # mapping kept while results live
    r.release()
    assert fake.out_states() == [shm.RELEASED]


def test_partials(connect, fake, endpoint):
    with connect(endpoint) as c:
        x = np.arange(3)
        got = list(c.infer_stream("partials", {"x": x}, meta={"n": 3}))
        assert [(r.final, r.seq) for r in got] == [(False, 0), (False, 1), (False, 2), (True, 3)]
        for r in got:
            np.testing.assert_array_equal(r["x"], x)
            r.release()
        r = c.infer("partials", {"x": x}, meta={"n": 2})
        assert r.final and r.seq == 2
        r.release()
        assert set(fake.out_states()) == {shm.RELEASED}  # unread PARTIALs were given back


def test_pool_full_falls_back_to_inline(connect, fake, endpoint):
    with connect(endpoint, transport="shm", pool_capacity=64 << 10) as c:
        big = np.ones(1 << 17, np.float64)  # 1 MiB > the pool
        small = np.arange(4.0)
        with c.infer("echo", {"big": big, "small": small}) as r:
            np.testing.assert_array_equal(r["big"], big)
        _, req = fake.requests[-1]
        locs = {t.name: type(t.loc) for t in req.tensors}
        assert locs == {"big": P.InlineLoc, "small": P.ShmLoc}
        assert c.pool.in_use() == 0


# ================================================================================================
# Errors, timeouts, cancellation, fallbacks

@pytest.mark.parametrize("code,cls", [
    (ErrorCode.PROTOCOL_ERROR, errors.ProtocolError),
    (ErrorCode.NOT_LOCAL, errors.NotLocal),
    (ErrorCode.QUEUE_FULL, errors.QueueFull),
    (ErrorCode.CANCELLED, errors.Cancelled),
    (ErrorCode.INTERNAL, errors.InternalError),
    (ErrorCode.WORKER_FAILED, errors.WorkerFailed),
    (ErrorCode.SERVICE_UNAVAILABLE, errors.ServiceUnavailable),
    (ErrorCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (599, errors.InferenceError),
])
def test_error_codes_raise_typed_errors(connect, fake, endpoint, code, cls):
    with connect(endpoint, transport="shm") as c:
        with pytest.raises(cls) as ei:
            c.infer("error", {"x": np.zeros(3)}, meta={"code": int(code), "message": "boom"})
        assert type(ei.value) is cls and ei.value.code == code and "boom" in str(ei.value)
        assert c.pool.in_use() == 0  # the error is the FINAL: inputs freed


def test_bad_reply_header_fails_its_call(connect, fake, endpoint):
    with connect(endpoint, transport="shm") as c:
        with pytest.raises(errors.ProtocolError, match="negative dimension"):
            c.infer("badheader", {"x": np.zeros(2)})
        assert c.pool.in_use() == 0


def test_argument_checks(connect, endpoint):
    import math

    with pytest.raises(InvalidInput, match="spelling"):
        connect("tcp://no-port-here", insecure=True)
    with pytest.raises(InvalidInput, match="endpoint"):
        connect("/tmp/not-an-endpoint")
    with pytest.raises(InvalidInput, match="its path is 125 bytes, and a socket's path holds at most 107"):
        connect("ipc:///tmp/" + "a" * 120)  # spelt right: too long (it said "check the endpoint's spelling")
    # libzmq wraps a port over 65535 (99999 is 34463) and connected there without a word
    # (the configuration hunt; the broker and the worker refused it already).
    for port in (65536, 99999):
        with pytest.raises(InvalidInput, match=f"port {port} is not from 0 to 65535"):
            connect(f"tcp://127.0.0.1:{port}", insecure=True)
    with connect(endpoint, transport="inline") as c:
        for bad in (0, -1, float("nan")):
            with pytest.raises(InvalidInput, match="timeout"):
                c.infer("echo", {"x": np.zeros(1)}, timeout=bad)
        with pytest.raises(InvalidInput, match="reply"):
            c.infer("echo", {"x": np.zeros(1)}, reply="carrier")
        with pytest.raises(InvalidInput, match="service name"):
            c.infer("", {"x": np.zeros(1)})
        with pytest.raises(InvalidInput, match="service name"):
            c.request("x" * 256, [b""])
        # An MMI name is a broker query, not a service: said as such (it was a ProtocolError
        # blaming a plain MDP worker).
        with pytest.raises(InvalidInput, match="broker query.*mmi_service"):
            c.infer("mmi.service", {"x": np.zeros(1)})
        call = c.prepare("echo", {"x": np.zeros(1)}, timeout=math.inf)
        assert call.timeout is None
        c.give_up(call)
        # (None, NaN and inf raised a bare TypeError/ValueError/OverflowError: the edge hunt)
        for bad in (0, None, float("nan"), float("inf"), "x"):
            with pytest.raises(InvalidInput, match="max_in_flight"):
                c.stream("echo", max_in_flight=bad)


def test_edge_values_of_arguments_are_invalid_input(connect, endpoint):
    # Found by the edge hunt: each of these raised a bare TypeError, ValueError or
    # OverflowError, or (a bad default timeout) was taken, and then every call raised
    # "timeout must be a positive number ..., got None".
    for bad in (0, -1, float("nan"), "1"):
        with pytest.raises(InvalidInput, match=f"timeout .*got {bad!r}"):
            connect(endpoint, timeout=bad)
    for bad in (0, -1, float("nan"), None, 1 << 64, 1.5, "256", 256e6):  # (1.5 was a pool of 1 byte, "256" of 256)
        with pytest.raises(InvalidInput, match="pool_capacity"):
            connect(endpoint, pool_capacity=bad)
    # A str is true whatever it says: insecure="false" connected in plain tcp (and left the
    # keys of $ZMQ_INFER_* unused); the configuration hunt.
    for bad in ("false", "0", None, 2, 1.0):
        with pytest.raises(InvalidInput, match=f"insecure must be True or False, got {bad!r}"):
            connect("tcp://127.0.0.1:5555", insecure=bad)
    for bad in (-1, 1.5, "2", None, True):  # (-1 was taken as 0, 1.5 as 1)
        with pytest.raises(InvalidInput, match="restart_resends"):
            connect(endpoint, restart_resends=bad)
    # The other switches likewise: fallback_inline="false" turned the fallback on (review
    # of the configuration hunt).
    for opt in ("fallback_inline", "direct_reply"):
        for bad in ("false", "0", None, 2, 1.0):
            with pytest.raises(InvalidInput, match=f"{opt} must be True or False, got {bad!r}"):
                connect(endpoint, **{opt: bad})
        connect(endpoint, **{opt: np.False_}).close()
    # A tcp endpoint turns direct replies off: what direct_reply said was never looked at.
    for bad in ("false", None, 2):
        with pytest.raises(InvalidInput, match=f"direct_reply must be True or False, got {bad!r}"):
            connect("tcp://127.0.0.1:5555", insecure=True, direct_reply=bad)
    with connect(endpoint) as c:
        for bad in ("false", None, 2):
            with pytest.raises(InvalidInput, match=f"latest_wins must be True or False, got {bad!r}"):
                c.stream("echo", latest_wins=bad)
        with pytest.raises(InvalidInput, match="timeout .*got 'x'"):
            c.infer("echo", {"x": np.zeros(1)}, timeout="x")
        for bad in ([1], "x"):
            with pytest.raises(InvalidInput, match="meta must be a dict"):
                c.infer("echo", {"x": np.zeros(1)}, meta=bad)
        for shape, dtype in (((-1,), np.float32), (5.5, np.float32), (("a",), np.float32), ((2,), object),
                             ((2,), "V0"), ((True, 3), np.float32), ([2, False], np.float32), (True, np.uint8)):
            with pytest.raises(InvalidInput, match="alloc"):
                c.alloc(shape, dtype)
        empty = c.alloc((0, 5), np.float32)
        c.free(empty)  # was refused: "free() takes an array returned by alloc()"
        assert c.pool.in_use() == 0
        for bad in ("\ud800", None, b"echo"):
            with pytest.raises(InvalidInput, match="service name|str"):
                c.mmi_service(bad)
        for bad in (["str"], [None], b"abc"):
            with pytest.raises(InvalidInput, match="frames"):
                c.request("echo", bad)
        # Coerced before: int() cut 1.5 to normal, True was urgent... or normal; a bool
        # timeout was a second.
        for bad in (1.5, True, "1"):
            with pytest.raises(InvalidInput, match="priority"):
                c.infer("echo", {"x": np.zeros(1)}, priority=bad)
        with pytest.raises(InvalidInput, match="timeout"):
            c.infer("echo", {"x": np.zeros(1)}, timeout=True)
        c.give_up(c.prepare("echo", {"x": np.zeros(1)}, priority=np.int64(2)))  # numpy's ints are ints
    # A negative or NaN interval turned heartbeats off without a word, and one of 1e-6 failed
    # every call at once with BrokerUnreachable ("has not answered for 0.0s").
    for bad in (-1, float("nan"), 1e-6, "1", True, float("inf")):
        with pytest.raises(InvalidInput, match="heartbeat_interval"):
            connect(endpoint, heartbeat_interval=bad)
    for off in (None, 0):
        with connect(endpoint, heartbeat_interval=off) as c:
            assert c._core.heartbeat_interval is None


def test_unknown_service(connect, fake, endpoint):
    with connect(endpoint) as c:
        with pytest.raises(errors.ServiceUnavailable, match="mmi_service"):
            c.infer("nope", {"x": np.zeros(1)})


def test_timeout_cancels_and_late_final_frees_slots(connect, fake, endpoint):
    fake.answer_cancel = False
    with connect(endpoint, transport="shm") as c:
        with pytest.raises(DeadlineExceeded) as ei:
            c.infer("hold", {"x": np.zeros(8)}, timeout=0.2)
        assert isinstance(ei.value, TimeoutError)
        rid = fake.held_q.get(timeout=WAIT)
        assert fake.cancels.get(timeout=WAIT) == rid
        _, req = fake.requests[-1]
        assert 0 < req.timeout_ms <= 200
        assert c.pool.in_use() == 1  # no FINAL yet: a worker may still read the input
        fake.release(1)              # the late FINAL (with an output slot) arrives...
        with c.infer("echo", {"x": np.ones(2)}) as r:  # ...and is processed before this reply
            np.testing.assert_array_equal(r["x"], np.ones(2))
        assert c.pool.in_use() == 0
        assert c.stray_replies == 1
        assert fake.out_states()[0] == shm.RELEASED  # the discarded output went back


def test_handle_cancel_and_result(connect, fake, endpoint):
    """The reply-stream handle: `result(timeout)` bounds the wait only, `cancel()` sends
    CANCEL at once and ends the handle (`Cancelled` without waiting), and the input slot
    waits for the FINAL that answers the cancellation."""
    fake.answer_cancel = False  # the CANCELLED final comes when the test says
    with connect(endpoint, transport="shm", timeout=WAIT) as c:
        h = c.infer_stream("hold", {"x": np.zeros(8)})
        rid = fake.held_q.get(timeout=WAIT)
        with pytest.raises(TimeoutError) as ei:
            h.result(timeout=0.05)
        assert not isinstance(ei.value, DeadlineExceeded) and not h.cancelled
        assert c.in_flight() == 1  # still in flight
        assert h.cancel() is True and h.cancelled and h.cancel() is True
        assert fake.cancels.get(timeout=WAIT) == rid
        t0 = time.monotonic()
        for _ in range(2):
            with pytest.raises(errors.Cancelled) as ei:
                h.result(timeout=WAIT)
            assert ei.value.request_id == rid
            with pytest.raises(errors.Cancelled):
                next(h)
        assert time.monotonic() - t0 < 1.0
        assert c.pool.in_use() == 1  # no FINAL yet: a worker may still read the input
        fake.release(1)              # the late FINAL...
        with c.infer("echo", {"x": np.ones(2)}) as r:  # ...routed before this reply
            np.testing.assert_array_equal(r["x"], np.ones(2))
        assert c.pool.in_use() == 0 and c.stray_replies == 1

        # result() releases PARTIALs unread and returns the FINAL; afterwards nothing is left.
        h = c.infer_stream("partials", {"x": np.arange(3)}, meta={"n": 2})
        with h.result(timeout=WAIT) as r:
            assert r.final and r.seq == 2
            np.testing.assert_array_equal(r["x"], np.arange(3))
        assert h.cancel() is False and not h.cancelled
        with pytest.raises(EndOfStream):
            h.result()
        assert list(h) == []
        # A FINAL that arrived unread cannot be cancelled any more: it is still the result.
        h = c.infer_stream("echo", {"x": np.arange(2)})
        c.mmi_service("echo")  # the echo's FINAL is routed before this answer
        assert h.cancel() is False
        with h.result() as r:
            np.testing.assert_array_equal(r["x"], np.arange(2))
        # Errors are infer's.
        h = c.infer_stream("error", {"x": np.zeros(1)}, meta={"code": int(ErrorCode.WORKER_FAILED)})
        with pytest.raises(errors.WorkerFailed):
            h.result(timeout=WAIT)
        assert c.pool.in_use() == 0
    fake.reclaim()
    assert set(fake.out_states()) <= {shm.FREE, shm.RELEASED}  # unread PARTIALs went back


def test_heartbeats_while_waiting(connect, fake, endpoint):
    with connect(endpoint, heartbeat_interval=0.05) as c:
        # The fake answers this request only when a heartbeat arrives.
        with c.infer("hold_hb", {"x": np.arange(3)}, timeout=WAIT) as r:
            np.testing.assert_array_equal(r["x"], np.arange(3))
    assert fake.events.get(timeout=WAIT) == ("heartbeat",)


def test_broker_unreachable(connect, endpoint):
    with connect(endpoint, heartbeat_interval=0.02, timeout=WAIT) as c:
        with pytest.raises(BrokerUnreachable, match="not answered"):
            c.infer("echo", {"x": np.zeros(1024)})  # 8 KiB: by shared memory, not inline
        assert c.pool.in_use() == 1  # never answered: kept until close, which unlinks the pool


def test_not_local_resends_inline(connect, fake, endpoint):
    with connect(endpoint, transport="shm") as c:
        x = np.arange(6.0).reshape(2, 3)
        with c.infer("remote", {"x": x}) as r:
            np.testing.assert_array_equal(r["x"], x)
            assert r.zero_copy == {"x": False}
        assert c.pool.in_use() == 0
        (s1, first), (s2, second) = fake.requests[-2:]
        assert type(first.tensors[0].loc) is P.ShmLoc
        assert type(second.tensors[0].loc) is P.InlineLoc and second.reply == "inline"
        assert second.id != first.id
        n = len(fake.requests)
        with c.infer("remote", {"x": x}) as r:  # remembered: straight inline
            np.testing.assert_array_equal(r["x"], x)
        assert len(fake.requests) == n + 1
    with connect(endpoint, transport="shm", fallback_inline=False) as c:
        with pytest.raises(errors.NotLocal):
            c.infer("remote", {"x": np.zeros(2)})


def test_not_local_resend_uses_what_was_sent(fake, endpoint):
    with Client(endpoint, transport="shm") as c, c.stream("remote") as s:
        frame = np.arange(4.0)
        s.send({"x": frame})
        frame[:] = -1  # the caller reuses its buffer at once
        with s.recv(WAIT) as r:
            np.testing.assert_array_equal(r["x"], np.arange(4.0))
        assert c.pool.in_use() == 0


def test_opaque_request_and_mmi(connect, fake, endpoint):
    with connect(endpoint) as c:
        assert c.request("opaque", [b"hello", b"", b"\x00\x01"]) == [b"hello", b"", b"\x00\x01"]
        with pytest.raises(errors.ServiceUnavailable):
            c.request("missing", [b"x"])
        assert c.mmi_service("echo") is True
        assert c.mmi_service("nope") is False
        with pytest.raises(InvalidInput):
            c.request("opaque", [P.MAGIC + b"x"])


def test_mmi_uses_the_main_socket_and_matches_answers_in_order(connect, fake, endpoint):
    """Both twins ask MMI on the socket their requests use (so an answer is a barrier behind
    them); a timed-out question's late answer is not taken for the next one's."""
    with connect(endpoint, timeout=WAIT) as c:
        c.infer("echo", {"x": np.zeros(1)}).release()
        assert c.mmi_service("echo") is True
        with pytest.raises(DeadlineExceeded, match="MMI"):
            c.mmi_service("hold_mmi", timeout=0.1)
        assert fake.held_q.get(timeout=WAIT) == b"hold_mmi"
        fake.release_mmi()                     # "200", for the question that timed out
        assert c.mmi_service("nope") is False  # its own answer, "404"
        assert c.mmi_service("echo") is True
        assert len(set(fake.call(lambda: list(fake.idents)))) == 1  # one socket for all of it


def test_opaque_timeout_disconnects_its_socket(connect, fake, endpoint):
    with connect(endpoint) as c:
        with pytest.raises(DeadlineExceeded):
            c.request("opaque_hold", [b"late"], timeout=0.1)
        assert fake.held_q.get(timeout=WAIT) == b"late"
        assert fake.next_event_but_heartbeats() == ("disconnect",)
        fake.answer_opaque_reversed()  # the late reply goes to a closed socket...
        assert c.request("opaque", [b"next"]) == [b"next"]  # ...never to the next request


def test_an_opaque_timeout_shorter_than_a_millisecond_is_waited_out(connect, fake, endpoint):
    """The wait is in whole milliseconds: rounded down, a 0.8 ms timeout was a poll of none
    and failed at once, before its time."""
    with connect(endpoint) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.request("opaque_hold", [b"late"], timeout=0.0008)
        assert time.monotonic() - t0 >= 0.0008  # not before the deadline (a wait never ends early)
        assert c.request("opaque", [b"next"]) == [b"next"]  # (whether "late" left before the close or not)


async def test_async_opaque_out_of_order(fake, endpoint):
    async with AsyncClient(endpoint) as c:
        first = asyncio.create_task(c.request("opaque_hold", [b"1"]))
        second = asyncio.create_task(c.request("opaque_hold", [b"2"]))
        got = {await asyncio.to_thread(fake.held_q.get, timeout=WAIT) for _ in range(2)}
        assert got == {b"1", b"2"}
        fake.answer_opaque_reversed()
        assert await first == [b"1"] and await second == [b"2"]
        with pytest.raises(DeadlineExceeded):
            await c.request("opaque_hold", [b"x"], timeout=0.05)


def test_close_disconnects_and_unlinks(connect, fake, endpoint):
    c = connect(endpoint, transport="shm")
    c.infer("echo", {"x": np.zeros(4)}).release()
    name = c.pool.name
    from shm.gc import list_segments

    # (By label: `list_segments` names a segment by the owner's lowest descriptor of it, which
    # may be its mapping's duplicate, made later at a lower free number.)
    assert name.rpartition("-")[0] in {s.name.rpartition("-")[0] for s in list_segments(count_slots=False)}
    c.close()
    c.close()
    with shm.SegmentCache() as cache, pytest.raises(shm.SegmentGone):  # no reader can open it now
        cache.view(shm.ShmRef(name, 0, 0, 0, 0), np.uint8, 0)
    assert fake.next_event_but_heartbeats() == ("disconnect",)
    with pytest.raises(InferenceError, match="closed"):
        c.infer("echo", {"x": np.zeros(1)})


def test_transport_resolution(endpoint):
    from client_sdk.client import resolve_transport

    assert resolve_transport("auto", "ipc:///tmp/x")
    assert resolve_transport("auto", "tcp://127.0.0.1:5555")
    assert resolve_transport("auto", "tcp://127.3.2.1:5555")
    assert resolve_transport("auto", "tcp://localhost:5555")
    assert resolve_transport("auto", "tcp://[::1]:5555")
    assert not resolve_transport("auto", "tcp://10.0.0.5:5555")
    assert not resolve_transport("auto", "tcp://gpu-box:5555")
    assert resolve_transport("shm", "tcp://10.0.0.5:5555")
    assert not resolve_transport("inline", "ipc:///tmp/x")
    with pytest.raises(InvalidInput):
        resolve_transport("carrier-pigeon", "ipc:///tmp/x")
    with Client(endpoint, transport="inline") as c:
        assert not c.uses_shm


# ================================================================================================
# Streams (blocking)

def test_a_streams_frames_say_what_they_dropped_and_a_plain_call_says_nothing(fake, endpoint):
    """Every frame of a stream writes ``dropped`` (0 included), and nothing else does: the
    worker keeps a stream's frames in order by it (docs/models.md, "Congestion")."""
    with Client(endpoint) as c:
        out = c.infer("echo", {"x": np.ones(2)})
        out.release()
        with c.stream("hold", max_in_flight=1) as s:
            for i in range(4):
                s.send({"x": np.full(3, i)})   # 1 and 2 are replaced by 3 (latest wins)
            fake.held_q.get(timeout=WAIT)
            fake.release(1)
            assert int(s.recv(WAIT)["x"][0]) == 0
            fake.held_q.get(timeout=WAIT)
            fake.release(1)
            assert int(s.recv(WAIT)["x"][0]) == 3
    heads = fake.call(lambda: [(service, req.dropped) for service, req in fake.requests
                               if isinstance(req, P.Request)])
    assert heads == [("echo", None), ("hold", 0), ("hold", 2)], heads


def test_stream_latest_wins_drops_and_keeps_order(fake, endpoint):
    with Client(endpoint) as c, c.stream("hold", max_in_flight=2) as s:
        for i in range(10):
            assert s.send({"x": np.full(3, i)}) == i
        held = [fake.held_q.get(timeout=WAIT) for _ in range(2)]
        assert s.dropped == 7  # frames 2..8 were replaced, 9 waits
        st = s.stats()
        assert (st.sent, st.in_flight, st.pending, st["dropped"]) == (2, 2, 1, 7)
        fake.release(2)
        got = [s.recv(WAIT), s.recv(WAIT)]
        held.append(fake.held_q.get(timeout=WAIT))  # frame 9 went out once there was room
        fake.release(1)
        got.append(s.recv(WAIT))
        assert [int(r["x"][0]) for r in got] == [0, 1, 9]
        assert [r.frame for r in got] == [0, 1, 9]
        assert held == sorted(held)
        with pytest.raises(EndOfStream):
            s.recv(0)
        st = s.stats()
        assert (st.sent, st.completed, st.dropped, st.failed) == (3, 3, 7, 0)
        assert len(st.latencies_ms) == 3 and all(v > 0 for v in st.latencies)
        for r in got:
            r.release()
        assert c.pool.in_use() == 0


def test_a_result_not_yet_read_holds_its_place_so_a_late_reader_gets_fresh_frames(fake, endpoint):
    # A result that had arrived but was not read freed its place: a reader behind kept the
    # stream sending, latest_wins dropped nothing, and results piled up stale (a hunt saw a
    # backlog of 103 frames, 3.4 s, and the worker's output ring full).  It holds its place.
    with Client(endpoint, transport="inline") as c, c.stream("echo", max_in_flight=1) as s:
        s.send({"x": np.full(2, 0)})
        deadline = time.monotonic() + WAIT
        while not s._outstanding[0].done:  # its result arrived; nobody read it
            assert time.monotonic() < deadline
            c.pump(0.01)
        for i in (1, 2, 3):
            s.send({"x": np.full(2, i)})
        st = s.stats()
        assert (st.sent, st.in_flight, st.pending, st.dropped) == (1, 1, 1, 2)  # 3 waits, 1 and 2 dropped
        assert s.unfinished() == {0, 3}  # their inputs may still be read: do not write them
        with s.recv(WAIT) as r0:
            assert r0.frame == 0
        with s.recv(WAIT) as r3:  # the newest frame, sent once 0 was read
            assert r3.frame == 3 and int(r3["x"][0]) == 3
        st = s.stats()
        assert st.sent == st.completed + st.failed + st.in_flight + st.cancelled == 2


def test_stream_keep_all_in_order(fake, endpoint):
    with Client(endpoint, transport="inline") as c:
        s = c.stream("echo", latest_wins=False, max_in_flight=3)
        frame = np.zeros(4)
        for i in range(8):
            frame[:] = i  # the stream copied the previous frame: reusing the buffer is safe
            s.send({"x": frame})
        got = [int(r["x"][0]) for r in s]
        assert got == list(range(8))
        assert s.stats().dropped == 0
        s.close()


def test_stream_errors_and_close(fake, endpoint):
    with Client(endpoint, transport="shm") as c:
        s = c.stream("error", latest_wins=False, meta={"code": int(ErrorCode.WORKER_FAILED)})
        s.send({"x": np.zeros(2)})
        with pytest.raises(errors.WorkerFailed):
            s.recv(WAIT)
        assert s.stats().failed == 1
        s.close()
        with pytest.raises(InferenceError, match="closed"):
            s.send({"x": np.zeros(2)})

        s = c.stream("hold", max_in_flight=2)
        for i in range(3):
            s.send({"x": np.full(2, i)})
        ids = [fake.held_q.get(timeout=WAIT) for _ in range(2)]
        s.close()  # cancels both in flight, drops the pending one (its slot at once)
        st = s.stats()  # every frame counted (the hunt saw three vanish at close)
        assert (st.sent, st.cancelled, st.dropped, st.in_flight, st.pending) == (2, 2, 1, 0, 0)
        assert sorted(fake.cancels.get(timeout=WAIT) for _ in range(2)) == sorted(ids)
        assert c.pool.in_use() == 2  # until the CANCELLED finals arrive
        c.infer("echo", {"x": np.ones(1)}).release()
        assert c.pool.in_use() == 0



def _pump_for(c, seconds: float) -> None:
    """Let ``seconds`` pass while ``c`` reads what comes (waiting out the clock is the point)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        c.pump(0.02)

def test_a_latest_wins_frame_that_lapses_is_not_told_to_use_latest_wins(fake, endpoint):
    # A latest_wins stream's newest frame may still outlive its timeout waiting for room (a
    # reader behind: an unread result holds its place).  Its error told the caller to "use
    # latest_wins=True", which the stream already did.
    with Client(endpoint, transport="inline") as c, c.stream("hold", max_in_flight=1, timeout=0.2) as s:
        s.send({"x": np.zeros(2)})
        fake.held_q.get(timeout=WAIT)
        s.send({"x": np.ones(2)})  # waits for room
        _pump_for(c, 0.25)
        with pytest.raises(DeadlineExceeded, match="no reply"):
            s.recv(WAIT)
        with pytest.raises(DeadlineExceeded, match="frame 1 .*never sent") as ei:
            s.recv(WAIT)
        assert "latest_wins=True" not in str(ei.value), ei.value
        st = s.stats()
        assert (st.sent, st.failed, st.expired, st.dropped) == (1, 1, 1, 0), st
    with Client(endpoint, transport="inline") as c, c.stream("hold", latest_wins=False, max_in_flight=1,
                                                           timeout=0.2) as s:
        s.send({"x": np.zeros(2)})
        fake.held_q.get(timeout=WAIT)
        s.send({"x": np.ones(2)})
        _pump_for(c, 0.25)
        with pytest.raises(DeadlineExceeded, match="no reply"):
            s.recv(WAIT)
        with pytest.raises(DeadlineExceeded, match="frame 1 .*never sent.*latest_wins=True"):
            s.recv(WAIT)


def test_a_frame_that_lapses_lets_go_of_its_inputs_before_its_turn(fake, endpoint):
    # A frame never sent (its deadline passed while it waited for room) keeps only its error
    # for its turn: it held its packed inputs (its private copy, and the caller's array) until
    # the reader got to it, so a reader behind kept every lapsed frame's data alive.
    import weakref

    with Client(endpoint, transport="inline") as c, c.stream("hold", latest_wins=False, max_in_flight=1,
                                                           timeout=0.1) as s:
        s.send({"x": np.zeros(2)})
        fake.held_q.get(timeout=WAIT)
        x = np.ones(1 << 16)
        gone = weakref.ref(x)
        s.send({"x": x})
        del x
        _pump_for(c, 0.15)
        s.send({"x": np.zeros(2)})  # frame 1 lapses here
        assert s.stats().expired == 1 and s.unfinished() == {0, 2}
        gc.collect()
        assert gone() is None, "a lapsed frame still holds its inputs"
        with pytest.raises(DeadlineExceeded):
            s.recv(WAIT)
        # (frame 2 lapses too while frame 0's outcome is waited for: one outcome with 1)
        with pytest.raises(DeadlineExceeded, match="frames? 1 .*never sent"):
            s.recv(WAIT)


def test_frames_that_lapse_one_after_another_are_one_outcome(fake, endpoint):
    # Found by the streams audit: a latest_wins=False stream whose reader paused was served
    # one "never sent" error per lapsed frame; read once per send, the errors came as fast as
    # they were read, and the stream never caught up (results 13 times older than their
    # timeout, its backlog growing 2 KB a frame).  A run of them is one outcome.
    with Client(endpoint, transport="inline") as c, c.stream("hold", latest_wins=False, max_in_flight=1,
                                                           timeout=0.1) as s:
        s.send({"x": np.zeros(2)})
        fake.held_q.get(timeout=WAIT)
        for _ in range(5):
            s.send({"x": np.ones(2)})
        _pump_for(c, 0.15)
        s.send({"x": np.zeros(2)})  # frames 1-5 lapse here
        st = s.stats()
        assert st.expired == 5 and s.unfinished() == {0, 6}, (st, s.unfinished())
        with pytest.raises(DeadlineExceeded):
            s.recv(WAIT)  # frame 0's, held at the worker past its deadline
        with pytest.raises(DeadlineExceeded, match=r"frames 1 to 5 .*\(5 frames\).*never sent"):
            s.recv(WAIT)
        assert len(s._outstanding) <= 1  # frame 6 alone, if sent (no backlog of errors)


def test_a_stream_without_a_timeout_takes_the_clients_default_counted_from_send(fake, endpoint):
    # docs/client.md, "Streams": a stream's `timeout` is `infer`'s, so None is the client's
    # default (`Client(timeout=10.0)`), counted from each frame's `send()`: a frame waiting
    # for room past it is never sent.  Only with no timeout anywhere does every frame wait
    # its turn.
    with Client(endpoint, transport="inline", timeout=0.2) as c, c.stream("hold", latest_wins=False,
                                                                        max_in_flight=1) as s:
        s.send({"x": np.zeros(2)})
        fake.held_q.get(timeout=WAIT)
        s.send({"x": np.ones(2)})  # waits for room
        _pump_for(c, 0.25)
        s.send({"x": np.ones(2)})  # frame 1 lapses here
        assert s.stats().expired == 1, s.stats()
    with Client(endpoint, transport="inline", timeout=None) as c, c.stream("hold", latest_wins=False,
                                                                         max_in_flight=1) as s:
        s.send({"x": np.zeros(2)})
        fake.held_q.get(timeout=WAIT)
        s.send({"x": np.ones(2)})
        _pump_for(c, 0.25)
        s.send({"x": np.ones(2)})
        st = s.stats()
        assert (st.expired, st.pending) == (0, 2), st


# 250 input names of 5 kB: packed, but a request header the client refuses to send.
_UNSENDABLE = {f"n{i:03d}" + "y" * 5000: np.zeros(1) for i in range(250)}


def _unsendable_behind_a_held_frame(fake, s) -> int:
    s.send({"x": np.zeros(3)})
    fake.held_q.get(timeout=WAIT)
    assert s.send(_UNSENDABLE) == 1  # waits for room: sent (refused) when frame 0 is read
    fake.release(1)
    return 1


def _counted(s) -> None:
    st = s.stats()
    assert st.sent == st.completed + st.failed + st.in_flight + st.cancelled, st
    assert s._frames == st.sent + st.dropped + st.expired + st.pending, st


def test_a_frame_the_client_cannot_send_fails_alone_in_its_turn(fake, endpoint):
    # A frame whose submit raised (its request refused before it left: a header too big,
    # out of descriptors) raised out of whichever call sent it: here frame 0's recv(), which
    # had already taken frame 0's result (lost: counted completed, never handed out), and
    # the refused frame was counted nowhere.  It fails alone, in its turn.
    with Client(endpoint) as c, c.stream("hold", latest_wins=False, max_in_flight=1) as s:
        _unsendable_behind_a_held_frame(fake, s)
        with s.recv(WAIT) as r:
            assert r.frame == 0
        with pytest.raises(InvalidInput, match="header"):
            s.recv(WAIT)
        with pytest.raises(EndOfStream):
            s.recv(0)
        assert (s.stats().completed, s.stats().failed) == (1, 1)
        _counted(s)
        assert c.pool.in_use() == 0
        assert s.send({"x": np.ones(2)}) == 2  # the stream goes on
        fake.held_q.get(timeout=WAIT)
        fake.release(1)
        with s.recv(WAIT) as r:
            assert r.frame == 2


async def test_a_frame_the_async_client_cannot_send_fails_alone_in_its_turn(fake, endpoint):
    async with AsyncClient(endpoint) as c:
        s = c.stream("hold", latest_wins=False, max_in_flight=1)
        s.send({"x": np.zeros(3)})
        await asyncio.to_thread(fake.held_q.get, timeout=WAIT)
        assert s.send(_UNSENDABLE) == 1
        await asyncio.to_thread(fake.release, 1)
        with await s.recv(WAIT) as r:
            assert r.frame == 0
        with pytest.raises(InvalidInput, match="header"):
            await s.recv(WAIT)
        _counted(s)
        s.close()


# A frame waiting for the socket (the broker not reading) when recv() is interrupted.

@contextlib.contextmanager
def _a_frame_waiting_for_the_socket(fake, c):
    """The fake stops reading; a filler stream fills the client's socket (its queue and the
    fake's, about 2000 messages); then yields a stream whose one frame, 0, waits for the
    socket (pending, nothing outstanding), so its `recv` waits in the socket's send."""
    go = threading.Event()
    paused = threading.Thread(target=fake.call, args=(lambda: go.wait(WAIT),), daemon=True)
    paused.start()
    filler = c.stream("hold", latest_wins=False, max_in_flight=1 << 20, pin=False)
    s = None
    try:
        deadline = time.monotonic() + WAIT
        while s is None:
            assert time.monotonic() < deadline, "the client's socket never filled"
            while filler.stats().pending == 0:
                filler.send({"x": np.zeros(1)})
            s = c.stream("echo", max_in_flight=1, pin=False)
            s.send({"x": np.full(1, 7)})
            if s.stats().pending != 1:  # (the socket took it after all: fill it again)
                s.close()
                s = None
        yield s, go
    finally:
        go.set()
        paused.join(WAIT)
        filler.close()
        if s is not None:
            s.close()


def _alarm(handler):
    """``handler`` runs in a SIGALRM 50 ms from now (inside the wait that follows);
    pytest-timeout's alarm is kept (tests/alarms.py)."""
    return alarm(handler, 0.05)


def _interrupt(*_):
    raise KeyboardInterrupt


def test_a_recv_interrupted_while_its_frame_waits_for_the_socket_keeps_the_frame(fake, endpoint):
    # A KeyboardInterrupt in recv's wait for the socket (the broker not reading) lost the
    # frame recv had taken from the pending ones to send: counted nowhere, its outcome never
    # delivered, the next recv() EndOfStream.  It waits again, pending, for a later recv().
    with Client(endpoint, transport="inline", timeout=None) as c:
        with _a_frame_waiting_for_the_socket(fake, c) as (s, go):
            with _alarm(_interrupt), pytest.raises(KeyboardInterrupt):
                s.recv(WAIT)
            st = s.stats()
            assert (st.sent, st.pending) == (0, 1) and s.unfinished() == {0}, st
            _counted(s)
            go.set()  # the fake reads again
            with s.recv(WAIT) as r:
                assert r.frame == 0 and int(r["x"][0]) == 7
            st = s.stats()
            assert (st.sent, st.completed, st.pending) == (1, 1, 0), st
            _counted(s)


def test_a_frame_interrupted_while_it_was_being_sent_fails_alone_in_its_turn(fake, endpoint, monkeypatch):
    # An interrupt in the send itself (its request being made: the client discards the call
    # and frees its inputs) lost the frame too.  It cannot be sent any more: it fails alone,
    # in its turn, as a frame the client could not send (sent, then failed).
    with Client(endpoint, transport="inline") as c, c.stream("echo", latest_wins=False, max_in_flight=1) as s:
        real = c._core.request_frames

        def interrupted(call, now):
            monkeypatch.setattr(c._core, "request_frames", real)
            raise KeyboardInterrupt

        monkeypatch.setattr(c._core, "request_frames", interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.send({"x": np.zeros(2)})
        _counted(s)
        assert s.send({"x": np.ones(2)}) == 1
        with pytest.raises(InferenceError, match=r"frame 0 .*interrupted \(KeyboardInterrupt\).*never sent"):
            s.recv(WAIT)
        with s.recv(WAIT) as r:
            assert r.frame == 1
        st = s.stats()
        assert (st.sent, st.completed, st.failed) == (2, 1, 1), st
        _counted(s)


def test_a_frame_the_client_closed_before_it_was_sent_is_not_counted_sent(fake, endpoint):
    # A close() from a signal handler while recv waited for the socket to take a frame: the
    # frame never left, yet it counted in `sent` and then `failed`.  It is never sent: it
    # waits with the others, and close() drops it (docs/client.md, "Streams").
    with Client(endpoint, transport="inline", timeout=None) as c:
        with _a_frame_waiting_for_the_socket(fake, c) as (s, go):
            with _alarm(lambda *_: c.close()), pytest.raises(InferenceError, match="closed") as ei:
                s.recv(WAIT)
            assert not isinstance(ei.value, EndOfStream), ei.value
            st = s.stats()
            assert (st.sent, st.failed, st.pending) == (0, 0, 1), st
            _counted(s)
            s.close()
            st = s.stats()
            assert (st.sent, st.failed, st.dropped, st.pending) == (0, 0, 1, 0), st
            _counted(s)


def test_a_stream_closed_by_a_signal_handler_while_its_frame_is_sent(fake, endpoint, monkeypatch):
    # The stream's own close() from a signal handler while a frame was being sent (here, as
    # its request is made): close() dropped the frame from the pending ones, the send went
    # on, and the stream then took it off the emptied pending frames: IndexError out of
    # send() (or recv()).  The frame went (close() cancels it, at the client: deferred to the
    # end of the send) and counts dropped, as a frame close() found waiting.
    with Client(endpoint, transport="inline") as c:
        s = c.stream("echo", latest_wins=False, max_in_flight=1)
        real = c._core.request_frames

        def closing(call, now):
            monkeypatch.setattr(c._core, "request_frames", real)
            s.close()  # (a signal handler's, landing in the send)
            return real(call, now)

        monkeypatch.setattr(c._core, "request_frames", closing)
        assert s.send({"x": np.zeros(2)}) == 0
        st = s.stats()
        assert (st.sent, st.dropped, st.pending, st.in_flight) == (0, 1, 0, 0), st
        _counted(s)
        deadline = time.monotonic() + WAIT
        while c.in_flight():  # its CANCEL went: the fake answers it
            assert time.monotonic() < deadline, "the frame close() dropped stayed in flight"
            c.pump(0.05)
        with pytest.raises(EndOfStream):
            s.recv(WAIT)


def test_a_call_given_up_while_submit_waits_for_the_socket_is_not_sent(fake, endpoint, monkeypatch):
    # A give_up() (a signal handler's, a stream's close() there) while submit() waited for
    # the socket is left to the wait, which does it on waking: the call was discarded, its
    # input slots freed, and the submit went on and sent it all the same (a worker then read
    # slots that another request may hold by then).  The submit refuses it.
    import client_sdk.client as client_mod
    with Client(endpoint) as c:
        call = c.prepare("echo", {"x": np.zeros(4096)})
        monkeypatch.setattr(client_mod, "sock_events", lambda sock: 0)  # the socket looks full
        real = c._wait_writable

        def wait(sock, ms):
            c.give_up(call)  # nested: deferred to this wait (and wakes it)
            real(sock, ms)

        monkeypatch.setattr(c, "_wait_writable", wait)
        with pytest.raises(InvalidInput, match="given up"):
            c.submit(call, WAIT)
        assert call.id == 0 and call.done and c.in_flight() == 0


def test_a_frame_waiting_at_close_past_its_deadline_counts_as_expired(fake, endpoint):
    # A frame still waiting for room at close() whose deadline had passed counted in
    # `dropped` (replaced, or not sent when the stream closed), not `expired`.
    with Client(endpoint, transport="inline") as c:
        s = c.stream("hold", latest_wins=False, max_in_flight=1, timeout=0.1)
        s.send({"x": np.zeros(2)})
        fake.held_q.get(timeout=WAIT)
        s.send({"x": np.ones(2)})   # waits for room, past its deadline below
        _pump_for(c, 0.15)
        s.send({"x": np.ones(2)})   # frame 1 lapses here (expired); frame 2 waits
        assert s.stats().expired == 1
        _pump_for(c, 0.15)          # frame 2's deadline passes too, unseen
        s.close()
        st = s.stats()
        assert (st.expired, st.dropped, st.cancelled) == (2, 0, 1), st
        _counted(s)
        s = c.stream("hold", latest_wins=False, max_in_flight=1, timeout=WAIT)
        s.send({"x": np.zeros(2)})
        fake.held_q.get(timeout=WAIT)
        s.send({"x": np.ones(2)})
        s.close()  # time left: dropped
        st = s.stats()
        assert (st.expired, st.dropped, st.cancelled) == (0, 1, 1), st
        _counted(s)


def test_stream_recv_timeout_keeps_frame(fake, endpoint):
    with Client(endpoint) as c:
        s = c.stream("hold", timeout=WAIT)
        s.send({"x": np.ones(2)})
        fake.held_q.get(timeout=WAIT)
        with pytest.raises(TimeoutError) as ei:
            s.recv(0.05)
        assert not isinstance(ei.value, DeadlineExceeded)
        fake.release(1)
        np.testing.assert_array_equal(s.recv(WAIT)["x"], np.ones(2))
        s.close()
        assert c.pool.in_use() == 0


# ================================================================================================
# asyncio

async def test_async_many_concurrent(fake, endpoint):
    async with AsyncClient(endpoint, transport="shm") as c:
        async def one(i):
            x = np.full((2, 3), i, np.int64)
            r = await c.infer("echo", {"x": x, "y": x.T})
            with r:
                np.testing.assert_array_equal(r["x"], x)
                np.testing.assert_array_equal(r["y"], x.T)
                return r.id

        ids = await asyncio.gather(*(one(i) for i in range(32)))
        assert len(set(ids)) == 32
        assert c.pool.in_use() == 0
        assert await c.request("opaque", [b"a"]) == [b"a"]
        assert await c.mmi_service("echo") and not await c.mmi_service("nope")
        with pytest.raises(errors.QueueFull):
            await c.infer("error", {"x": np.zeros(1)}, meta={"code": 429})
    fake.reclaim()
    assert set(fake.out_states()) <= {shm.FREE, shm.RELEASED}


async def test_async_cancellation_sends_cancel(fake, endpoint):
    async with AsyncClient(endpoint, transport="shm") as c:
        task = asyncio.create_task(c.infer("hold", {"x": np.zeros(5)}))
        rid = await asyncio.to_thread(fake.held_q.get, timeout=WAIT)
        assert c.pool.in_use() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(fake.cancels.get, timeout=WAIT) == rid
        # The fake answers the CANCEL with a CANCELLED FINAL, queued before this reply.
        r = await c.infer("echo", {"x": np.ones(1)})
        r.release()
        assert c.pool.in_use() == 0


async def test_async_cancel_keeps_inputs_until_late_final(fake, endpoint):
    fake.answer_cancel = False  # like a worker that finishes anyway
    async with AsyncClient(endpoint, transport="shm") as c:
        task = asyncio.create_task(c.infer("hold", {"x": np.zeros(5)}))
        rid = await asyncio.to_thread(fake.held_q.get, timeout=WAIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(fake.cancels.get, timeout=WAIT) == rid
        assert c.pool.in_use() == 1  # no FINAL yet: the worker may still be reading
        fake.release(1)              # the late result, with an output slot
        (await c.infer("echo", {"x": np.ones(1)})).release()
        assert c.pool.in_use() == 0
        assert fake.out_states()[0] == shm.RELEASED  # the discarded output was given back


async def test_async_deadline(fake, endpoint):
    async with AsyncClient(endpoint) as c:
        with pytest.raises(DeadlineExceeded):
            await c.infer("hold", {"x": np.zeros(1)}, timeout=0.1)
        rid = await asyncio.to_thread(fake.held_q.get, timeout=WAIT)
        assert await asyncio.to_thread(fake.cancels.get, timeout=WAIT) == rid


async def test_async_not_local_and_partials(fake, endpoint):
    async with AsyncClient(endpoint, transport="shm") as c:
        r = await c.infer("remote", {"x": np.arange(3)})
        np.testing.assert_array_equal(r["x"], np.arange(3))
        seen = []
        async with c.infer_stream("partials", {"x": np.arange(2)}, meta={"n": 2}) as replies:
            async for res in replies:
                seen.append((res.final, res.seq))
                res.release()
        assert seen == [(False, 0), (False, 1), (True, 2)]
        assert c.pool.in_use() == 0


def _asks(fake) -> list[tuple[str, int]]:
    return [(svc, ask.slots) for svc, ask in fake.call(lambda: list(fake.lease_asks))]


def test_a_stream_asks_for_a_lease_and_stays_brokered_when_refused(fake, endpoint):
    """Streams pin by default (issue 13): a plain client's stream asks for a lease on its
    service (LEASE goes before the first frame), the refusal leaves it brokered, and nothing
    else asks: not a plain request, not a `pin=False` stream, not a client without heartbeats."""
    with Client(endpoint, transport="inline", timeout=WAIT) as c:
        with c.infer("echo", {"x": np.zeros(2)}) as r:
            assert r["x"].shape == (2,)
        with c.stream("echo_inline", pin=False) as s:
            s.send({"x": np.zeros(2)})
            s.recv(WAIT).release()
        assert _asks(fake) == []
        with c.stream("echo", latest_wins=False, max_in_flight=3) as s:
            for i in range(4):
                s.send({"x": np.full(2, i)})
            assert [int(r["x"][0]) for r in s] == [0, 1, 2, 3]
        asks = _asks(fake)
        assert asks and set(asks) == {("echo", 3)}  # one ask (its max_in_flight), maybe another after the 1 s backoff
        assert not c.pinned("echo") and c.pinned_replies == 0 and c.stray_replies == 0
        with c.infer("echo_inline", {"x": np.zeros(2)}) as r:
            pass
        assert {svc for svc, _ in _asks(fake)} == {"echo"}
    with Client(endpoint, transport="inline", heartbeat_interval=None) as c:
        with pytest.raises(InvalidInput, match="heartbeats"):
            c.stream("echo", pin=True)
        with c.stream("echo_inline") as s:  # pin=None: cannot pin without heartbeats, does not try
            s.send({"x": np.zeros(2)})
            s.recv(WAIT).release()
        assert {svc for svc, _ in _asks(fake)} == {"echo"}


async def test_async_stream_asks_for_a_lease_and_stays_brokered_when_refused(fake, endpoint):
    async with AsyncClient(endpoint, transport="inline", timeout=WAIT) as c:
        (await c.infer("echo", {"x": np.zeros(2)})).release()
        s = c.stream("echo_inline", pin=False)
        s.send({"x": np.zeros(2)})
        (await s.recv(WAIT)).release()
        s.close()
        assert await asyncio.to_thread(_asks, fake) == []
        s = c.stream("echo", latest_wins=False, max_in_flight=12)
        for i in range(4):
            s.send({"x": np.full(2, i)})
        s.finish()
        got = [r async for r in s]
        assert [int(r["x"][0]) for r in got] == [0, 1, 2, 3]
        for r in got:
            r.release()
        assert set(await asyncio.to_thread(_asks, fake)) == {("echo", 12)}
        assert not c.pinned("echo") and c.pinned_replies == 0 and c.stray_replies == 0
    async with AsyncClient(endpoint, transport="inline", heartbeat_interval=None) as c:
        with pytest.raises(InvalidInput, match="heartbeats"):
            c.stream("echo", pin=True)


async def test_async_broker_unreachable(endpoint):
    async with AsyncClient(endpoint, heartbeat_interval=0.02, timeout=WAIT) as c:
        with pytest.raises(BrokerUnreachable):
            await c.infer("echo", {"x": np.zeros(2)})


async def test_async_stream_latest_wins(fake, endpoint):
    async with AsyncClient(endpoint) as c:
        s = c.stream("hold", max_in_flight=1)
        for i in range(5):
            s.send({"x": np.full(2, i)})
        await asyncio.to_thread(fake.held_q.get, timeout=WAIT)
        assert s.dropped == 3  # 1..3 replaced; 4 waits
        fake.release(1)
        r0 = await s.recv(WAIT)
        await asyncio.to_thread(fake.held_q.get, timeout=WAIT)  # 4 was sent by the reader
        fake.release(1)
        s.finish()
        rest = [r async for r in s]
        assert [int(r["x"][0]) for r in [r0, *rest]] == [0, 4]
        st = s.stats()
        assert (st.sent, st.completed, st.dropped) == (2, 2, 3)
        for r in [r0, *rest]:
            r.release()
        with pytest.raises(InferenceError, match=r"finished.*no more frames after finish\(\)"):
            s.send({"x": np.zeros(1)})
        s.close()
        with pytest.raises(InferenceError, match="closed"):
            s.send({"x": np.zeros(1)})


def test_run_with_uvloop(fake, endpoint):
    async def main():
        loop = type(asyncio.get_running_loop()).__module__
        async with AsyncClient(endpoint) as c:
            rs = await asyncio.gather(*(c.infer("echo", {"x": np.arange(i + 1)}) for i in range(8)))
            s = c.stream("echo", latest_wins=False)
            for i in range(4):
                s.send({"x": np.full(1, i)})
            s.finish()
            got = [int(r["x"][0]) async for r in s]
            out = [int(r["x"].sum()) for r in rs], got
            for r in rs:
                r.release()
            return loop, out

    loop, (sums, got) = run(main())
    assert loop.startswith("uvloop")
    assert sums == [sum(range(i + 1)) for i in range(8)] and got == [0, 1, 2, 3]


# ================================================================================================
# Direct replies (docs/protocol.md section 8)

def test_direct_reply_and_relayed_duplicate_give_one_result(connect, fake, endpoint):
    with connect(endpoint, timeout=WAIT) as c:
        path = c._inbox.path
        assert os.path.exists(path) and oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
        for _ in range(3):
            with c.infer("direct_dup", {"x": np.arange(3)}) as out:
                assert int(out["n"]) in (1, 2)
        # Each request: one result, one duplicate dropped.  Which copy wins is a race, so
        # read until all six copies are in (a condition with a deadline, not a sleep).
        deadline = time.monotonic() + WAIT
        while (c.direct_replies, c.stray_replies) != (3, 3) and time.monotonic() < deadline:
            c.pump(0.05)
        assert (c.direct_replies, c.stray_replies) == (3, 3)
    assert not os.path.exists(path)  # libzmq leaves the file; close() unlinks it


def test_direct_reply_option_off_and_remote_broker(connect, fake, endpoint):
    with connect(endpoint, timeout=WAIT, direct_reply=False) as c:
        assert c._inbox is None
        with c.infer("echo", {"x": np.arange(3)}) as out:
            np.testing.assert_array_equal(out["x"], np.arange(3))
        assert fake.call(lambda: fake.requests[-1][1].reply_to) is None
    with connect("tcp://192.0.2.1:5555", timeout=WAIT, insecure=True) as c:  # not local: nothing to bind
        assert c._inbox is None


def test_async_client_reads_direct_replies(fake, endpoint):
    async def main():
        async with AsyncClient(endpoint, timeout=WAIT) as c:
            path = c._inbox.path
            outs = await asyncio.gather(*(c.infer("direct_dup", {"x": np.arange(2)}) for _ in range(4)))
            for out in outs:
                assert int(out["n"]) in (1, 2)
                out.release()
            deadline = time.monotonic() + WAIT
            while (c.direct_replies, c.stray_replies) != (4, 4) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert (c.direct_replies, c.stray_replies) == (4, 4)
        return path

    path = run(main())
    assert not os.path.exists(path)


def test_sweep_removes_only_dead_clients_reply_sockets(tmp_path):
    import subprocess
    import sys

    from broker.server import sweep_reply_sockets
    from shm.segment import self_identity

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(WAIT)
    pid, start = self_identity()
    dead = tmp_path / f"c-{p.pid}-12345-abc.ipc"
    reused = tmp_path / f"c-{pid}-{start + 1}-abc.ipc"   # our pid, another process's start time
    alive = tmp_path / f"c-{pid}-{start}-abc.ipc"
    other = tmp_path / "frontend.ipc"
    dead_worker = tmp_path / f"w-{p.pid}-12345-abc.ipc"  # a SIGKILLed worker's direct socket (leases)
    live_worker = tmp_path / f"w-{pid}-{start}-abc.ipc"
    dead_link = tmp_path / f"w-{p.pid}-12345-abc.link"  # ... and its local link
    live_link = tmp_path / f"w-{pid}-{start}-abc.link"
    for f in (dead, reused, alive, other, dead_worker, live_worker, dead_link, live_link):
        f.write_bytes(b"")
    assert sorted(sweep_reply_sockets(str(tmp_path))) == sorted([dead.name, reused.name, dead_worker.name,
                                                                 dead_link.name])
    assert alive.exists() and other.exists() and live_worker.exists() and live_link.exists()


def test_one_finals_message_resolves_each_call_it_carries(fake, endpoint):
    async def main():
        async with AsyncClient(endpoint, timeout=WAIT) as c:
            xs = [np.full(4, i, np.float32) for i in range(3)]
            tasks = [asyncio.ensure_future(c.infer("hold", {"x": x})) for x in xs]
            for _ in xs:
                await asyncio.get_running_loop().run_in_executor(None, fake.held_q.get, True, WAIT)
            fake.release_direct_batch(3)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
            for x, out in zip(xs, outs):
                np.testing.assert_array_equal(out["x"], x)
                out.release()
            assert c.direct_replies == 3 and c.stray_replies == 0

    run(main())


def test_a_header_that_cannot_be_encoded_is_invalid_input_and_keeps_nothing(tmp_path):
    # Found by the data hunt: a lone surrogate in an input name or a meta string, or a meta
    # int over 64 bits, raised a bare UnicodeEncodeError/OverflowError with the call still
    # registered and its input slot taken (until close()); input names adding up to more
    # than a header holds were refused by the broker under request id 0, so the call waited
    # out its deadline, its slot held.
    x = np.ones(100_000, np.float32)  # 400 KB: a shared-memory slot
    bad = os.fsdecode(b"n\xff")
    cases = [({bad: x}, None, "input name 'n\\udcff' is not valid UTF-8"),
             ({"x": x}, {"path": bad}, "meta cannot be encoded"),
             ({"x": x}, {"n": 1 << 70}, "meta cannot be encoded"),
             ({"x": x}, {1: "a"}, "meta keys must be str"),
             ({"n" * (1 << 20): x}, None, "input names are too long"),
             ({f"{i:04d}" + "n" * 5000: x[:10] for i in range(256)}, None, "input names are too long")]
    with Client(f"ipc://{tmp_path}/nobody.ipc", timeout=5) as c:
        for inputs, meta, words in cases:
            with pytest.raises(InvalidInput, match=re.escape(words)):
                c.infer("echo", inputs, meta=meta)
            assert c.in_flight() == 0 and c.pool.live_bytes() == 0, words
        with pytest.raises(InvalidInput, match="is not valid UTF-8"):
            c.infer(bad, {"x": x})



def test_a_calls_last_wait_ends_at_its_deadline_not_the_next_whole_millisecond(fake, endpoint):
    """The blocking client's wait for a call's deadline is to the microsecond (the Waiter
    sleeps a fraction of a millisecond in select): rounded up to whole milliseconds, the
    call ended up to 1 ms past its deadline and took a result that came in that overshoot,
    which the broker had counted `deadline_exceeded` (the game-server audit)."""
    asked: list[float] = []
    with Client(endpoint, timeout=WAIT) as c:
        class Noting:  # the client's Waiter, its waits noted
            def __init__(self, waiter):
                self._w = waiter

            def __getattr__(self, name):
                return getattr(self._w, name)

            def wait(self, ms):
                asked.append(ms)
                return self._w.wait(ms)

        c._waiter = Noting(c._waiter)
        with pytest.raises(DeadlineExceeded):
            c.infer("hold", {"x": np.ones(1)}, timeout=0.0123)
        waits = [ms for ms in asked if ms > 0]  # the call's (not close()'s)
        fake.held_q.get(timeout=WAIT)
    assert waits and all(ms <= 12.3 for ms in waits), asked
    assert any(ms != int(ms) for ms in waits), asked  # a fraction asked for, not rounded up
