"""The lean hot path of a lone small request, held to the general path's behaviour.

`Client.infer` waits for its call without a reply-stream handle; `ClientCore.new_call` skips
the argument checks for the defaults; `tensors.pack` takes one small numpy array in one
step; `ClientCore.on_message` routes the usual FINAL in one step.  Each shortcut must send,
deliver and cancel exactly what the general path does, and hand anything else to it.  The
blocking client runs against test_sdk_client's fake broker, and, for pinned calls, a fake
leased worker of its own here.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
import types

import numpy as np
import pytest
import zmq

from broker import protocol as P
from broker.protocol import ErrorCode, Priority
from broker.protocol.wire import touched
from client_sdk import Client, DeadlineExceeded, InferenceError, InvalidInput, errors
from client_sdk import tensors as T
from client_sdk.core import ClientCore
from tests.children import read_within, wait_child

from .test_sdk_client import WAIT, FakeBroker

pytestmark = pytest.mark.timeout(30)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _last_request(fake) -> P.Request:
    service, req = fake.requests[-1]
    assert isinstance(req, P.Request), (service, req)
    return req


# ================================================================================================
# Client.infer without a handle

def test_infer_deadline_raises_and_cancels(fake, endpoint):
    fake.answer_cancel = False
    with Client(endpoint, timeout=WAIT) as c:
        with c.infer("echo", {"x": np.arange(4)}) as r:  # the service is known from here on
            np.testing.assert_array_equal(r["x"], np.arange(4))
        with pytest.raises(DeadlineExceeded) as ei:
            c.infer("hold", {"x": np.arange(4)}, timeout=0.2)
        rid = fake.held_q.get(timeout=WAIT)
        assert ei.value.request_id == rid
        assert fake.cancels.get(timeout=WAIT) == rid  # CANCEL went out before the error left
        assert c.in_flight() == 1  # until the FINAL that answers the cancellation
        fake.release(1)
        with c.infer("echo", {"x": np.ones(2)}) as r:  # the late FINAL is routed first, and dropped
            np.testing.assert_array_equal(r["x"], np.ones(2))
        assert c.in_flight() == 0 and c.stray_replies == 1


def _interrupt_main_thread_after(seconds: float) -> threading.Timer:
    """KeyboardInterrupt in the main thread (which blocks in its Waiter's poll) after `seconds`."""
    main = threading.main_thread().ident
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGUSR1))
    timer.start()
    return timer


@pytest.fixture
def sigusr1_interrupts():
    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGUSR1, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_keyboard_interrupt_while_waiting_cancels(fake, endpoint, sigusr1_interrupts):
    fake.answer_cancel = False
    with Client(endpoint, timeout=WAIT) as c:
        timer = _interrupt_main_thread_after(0.2)
        try:
            with pytest.raises(KeyboardInterrupt):
                c.infer("hold", {"x": np.arange(4)})
        finally:
            timer.cancel()
        rid = fake.held_q.get(timeout=WAIT)
        assert fake.cancels.get(timeout=WAIT) == rid
        fake.release(1)
        with c.infer("echo", {"x": np.ones(2)}):
            pass
        assert c.in_flight() == 0 and c.stray_replies == 1


def test_infer_errors_partials_and_a_streamed_empty_final(fake, endpoint):
    with Client(endpoint, timeout=WAIT) as c:
        with pytest.raises(errors.WorkerFailed):
            c.infer("error", {"x": np.zeros(1)}, meta={"code": int(ErrorCode.WORKER_FAILED)})
        # PARTIALs are released unread and the FINAL is the result.
        with c.infer("partials", {"x": np.arange(3)}, meta={"n": 3}) as r:
            assert r.final and r.seq == 3
            np.testing.assert_array_equal(r["x"], np.arange(3))
        # A FINAL with no tensors after PARTIALs means the service streams: NotSupported.
        with pytest.raises(errors.NotSupported, match="infer_stream"):
            c.infer("partials", {}, meta={"n": 2})
        assert c.in_flight() == 0


def test_a_reply_queued_behind_infers_own_is_routed_by_the_next_pump(fake, endpoint):
    """infer stops reading once its FINAL is in; what came after it is not lost."""
    with Client(endpoint, timeout=WAIT) as c:
        h = c.infer_stream("hold", {"x": np.arange(2)})
        fake.held_q.get(timeout=WAIT)
        fake.release(1)  # queued on the socket, possibly before the next FINAL
        with c.infer("echo", {"x": np.arange(3)}) as r:
            np.testing.assert_array_equal(r["x"], np.arange(3))
        stop = time.monotonic() + WAIT
        while c.in_flight() and time.monotonic() < stop:
            c.pump(0.05)
        assert c.in_flight() == 0  # pump() routed it: it reads every socket to the end
        with h.result(timeout=0) as r:
            np.testing.assert_array_equal(r["x"], np.arange(2))


def test_options_take_the_general_path_and_reach_the_header(fake, endpoint):
    with Client(endpoint, timeout=WAIT) as c:
        with c.infer("echo", {"x": np.arange(2)}):
            pass
        req = _last_request(fake)
        assert (req.priority, req.meta, req.traceparent, req.reply) == (int(Priority.NORMAL), {}, None, "auto")
        with c.infer("echo", {"x": np.arange(2)}, priority="urgent", meta={"k": 7}, traceparent=TRACEPARENT,
                     reply="inline"):
            pass
        req = _last_request(fake)
        assert (req.priority, req.meta, req.traceparent, req.reply) == (0, {"k": 7}, TRACEPARENT, "inline")
        for priority, want in (("NORMAL", 1), (Priority.BACKGROUND, 2), (0, 0)):
            with c.infer("echo", {"x": np.arange(2)}, priority=priority):
                pass
            assert _last_request(fake).priority == want
        # ... and nothing of them sticks to the next plain request.
        with c.infer("echo", {"x": np.arange(2)}):
            pass
        req = _last_request(fake)
        assert (req.priority, req.meta, req.traceparent, req.reply) == (1, {}, None, "auto")
        assert req.pid == os.getpid() and req.host == P.local_host_id()


def test_bad_arguments_are_refused_for_a_service_already_checked(fake, endpoint):
    with Client(endpoint, timeout=WAIT) as c:
        with c.infer("echo", {"x": np.arange(2)}):
            pass
        x = {"x": np.arange(2)}
        with pytest.raises(InvalidInput, match="reply"):
            c.infer("echo", x, reply="bogus")
        with pytest.raises(InvalidInput, match="reply"):  # unhashable: was a bare TypeError
            c.infer("echo", x, reply=["shm"])
        with pytest.raises(InvalidInput, match="priority"):
            c.infer("echo", x, priority="bogus")
        with pytest.raises(InvalidInput, match="traceparent"):
            c.infer("echo", x, traceparent=5)
        with pytest.raises(InvalidInput, match="timeout"):
            c.infer("echo", x, timeout=-1)
        with pytest.raises(InvalidInput, match="service"):
            c.infer("", x)
        with pytest.raises(InvalidInput, match="service"):
            c.infer(b"echo", x)
        assert c.in_flight() == 0
    with pytest.raises(InferenceError, match="closed"):
        c.infer("echo", x)


# ================================================================================================
# Pinned: a fake leased worker

LEASE = bytes(7) + b"\x05"
SECRET = bytes(range(16))


class FakeLeaseWorker(threading.Thread):
    """A worker's direct socket: echoes inline requests on its lease's connection, holds
    those with an input named "hold" (`release()` echoes them, back to back), and records
    the CANCELs it gets."""

    def __init__(self, endpoint: str):
        super().__init__(name="fake-lease-worker", daemon=True)
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.requests: queue.Queue = queue.Queue()  # request ids
        self.cancels: queue.Queue = queue.Queue()
        self.held: list = []  # (ident, frames, request) of the requests held
        self._release = threading.Event()
        self.echoed = threading.Event()  # set once a release's echoes were all sent
        self._halt = False

    def release(self) -> None:
        """Echo the held requests, all at once (on the worker's thread, at its next look)."""
        self._release.set()

    def _echo(self, ident, frames, req) -> None:
        head = P.encode_header(P.Reply(id=req.id, tensors=list(req.tensors)))
        self.sock.send_multipart([ident, *P.client_reply(True, frames[2], [head, *frames[4:]])])

    def run(self) -> None:
        while not self._halt:
            if self._release.is_set():
                self._release.clear()
                held, self.held = self.held, []
                for h in held:
                    self._echo(*h)
                self.echoed.set()
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            cmd = frames[1]
            if cmd == P.C_CANCEL:
                self.cancels.put(P.decode_cancel(frames[3]).id)
            elif cmd == P.C_REQUEST:
                req = P.decode_request(frames[3], len(frames) - 4)
                if all(t.name != "hold" for t in req.tensors):
                    self._echo(ident, frames, req)
                else:
                    self.held.append((ident, frames, req))
                self.requests.put(req.id)

    def stop(self) -> None:
        """End the loop, then close its socket and context (also when the thread died of an
        exception).  A thread still running after WAIT s fails the test and keeps them open,
        as `FakeBroker.stop` does: the socket is the thread's (zmq sockets are not
        thread-safe: closed under a poll it may abort the process), and the context would
        wait for it for good."""
        self._halt = True
        if self.ident is not None:  # started
            self.join(WAIT)
        assert not self.is_alive(), f"the fake lease worker's thread did not stop within {WAIT} s"
        try:
            self.sock.close(linger=0)
        finally:
            self.ctx.term()


class LeasingFakeBroker(FakeBroker):
    """The fake broker, granting every LEASE on the fake worker."""

    worker_endpoint = ""

    def _on_client(self, ident: bytes, frames: list) -> None:
        if bytes(frames[1]) == P.C_LEASE:
            ask = P.decode_lease_ask(frames[3])
            info = P.LeaseInfo(id=ask.id, lease=LEASE, secret=SECRET, endpoint=self.worker_endpoint, slots=2,
                               instance=b"fakebrkr", host=P.local_host_id())
            self.sock.send_multipart([ident, *P.client_leased(bytes(frames[2]), [P.encode_header(info)])])
            return
        super()._on_client(ident, frames)


@pytest.fixture
def pinned(tmp_path_factory):
    d = tmp_path_factory.mktemp("pin")
    worker = FakeLeaseWorker(f"ipc://{d}/w.sock")
    broker = LeasingFakeBroker(f"ipc://{d}/b.sock")
    broker.worker_endpoint = worker.endpoint
    worker.start()
    broker.start()
    c = Client(broker.endpoint, pin=True, timeout=WAIT)
    try:
        stop = time.monotonic() + WAIT
        while not c.pinned("echo") and time.monotonic() < stop:
            with c.infer("echo", {"x": np.arange(2)}):  # the first ones go through the broker
                pass
            c.pump(0.01)
        assert c.pinned("echo")
        yield c, broker, worker
    finally:
        with contextlib.ExitStack() as stopping:  # each, even if one before it raises
            stopping.callback(worker.stop)
            stopping.callback(broker.stop)
            stopping.callback(c.close)


def test_pinned_infer_goes_to_the_leased_worker(pinned):
    c, broker, worker = pinned
    before = c.pinned_replies
    with c.infer("echo", {"x": np.arange(5)}) as r:
        np.testing.assert_array_equal(r["x"], np.arange(5))
    assert c.pinned_replies == before + 1 and c.in_flight() == 0


def test_pinned_deadline_and_interrupt_cancel_on_the_lease(pinned, sigusr1_interrupts):
    c, broker, worker = pinned
    while not worker.requests.empty():
        worker.requests.get()
    with pytest.raises(DeadlineExceeded):
        c.infer("echo", {"hold": np.arange(2)}, timeout=0.2)
    rid = worker.requests.get(timeout=WAIT)
    assert worker.cancels.get(timeout=WAIT) == rid
    timer = _interrupt_main_thread_after(0.2)
    try:
        with pytest.raises(KeyboardInterrupt):
            c.infer("echo", {"hold": np.arange(2)})
    finally:
        timer.cancel()
    rid = worker.requests.get(timeout=WAIT)
    assert worker.cancels.get(timeout=WAIT) == rid


def test_a_lease_connection_that_cannot_take_the_request_sends_it_through_the_broker(pinned):
    c, broker, worker = pinned
    [lease] = c._pin_socks
    real = c._pin_socks[lease]
    blocked = zmq.Context.instance().socket(zmq.DEALER)  # no peer: every send is refused (EAGAIN)
    c._pin_socks[lease] = blocked
    try:
        n = len(broker.requests)
        with c.infer("echo", {"x": np.arange(3)}) as r:
            np.testing.assert_array_equal(r["x"], np.arange(3))
        assert len(broker.requests) == n + 1  # the broker's, same id
        h = c.infer_stream("echo", {"x": np.arange(3)})  # the same send, read later
        assert not c._core.pins["echo"].calls  # off the lease: its slot stays free
        with h.result(timeout=WAIT):
            pass
    finally:
        c._pin_socks[lease] = real
        blocked.close(linger=0)
    before = c.pinned_replies
    with c.infer("echo", {"x": np.arange(3)}):
        pass
    assert c.pinned_replies == before + 1  # the lease is used again


# ================================================================================================
# pack(): one small array

def _arrays() -> list[np.ndarray]:
    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    return [
        np.arange(16, dtype=np.uint8),
        np.array(3.25, np.float32),                 # 0-d
        np.zeros((0, 3)),                           # empty
        base[::2, 1::3],                            # strided
        np.asfortranarray(base),                    # Fortran order
        np.arange(6, dtype=">i4"),                  # big-endian
        np.array([True, False]),
        np.array([(1, 2.0)], dtype=[("a", "<i2"), ("b", "<f8")]),
        np.array(["2024-01-01"], dtype="datetime64[ns]"),
        np.array([b"ab", b"c"]),
    ]


@pytest.mark.parametrize("pool_side", [False, True])
def test_one_small_array_packs_as_the_general_path_does(pool_side):
    pool = object() if pool_side else None  # inline_max bounds both; no slot is asked for
    for a in _arrays():
        lean = T.pack({"x": a}, pool, inline_max=P.SMALL_INLINE_BYTES)
        general = T.pack(types.MappingProxyType({"x": a}), pool, inline_max=P.SMALL_INLINE_BYTES)
        assert lean.tensors == general.tensors, a
        assert [bytes(f) for f in lean.frames] == [bytes(f) for f in general.frames], a
        assert lean.arrays["x"] is a and not lean.uses_shm and not lean.temp
        assert isinstance(lean.frames[0], bytes)  # a private copy: the caller may reuse its array


def test_pack_hands_anything_else_to_the_general_path():
    with pytest.raises(InvalidInput, match="Python objects"):
        T.pack({"x": np.array([object()])}, None)
    with pytest.raises(InvalidInput, match="non-empty"):
        T.pack({"": np.zeros(2)}, None)
    with pytest.raises(InvalidInput, match="no size"):
        T.pack({"x": np.zeros(2, dtype="V0")}, None)
    big = np.zeros(P.SMALL_INLINE_BYTES + 1, np.uint8)
    p = T.pack({"x": big}, None)  # inline only, too large to copy here: the general path's view
    assert not isinstance(p.frames[0], bytes) and bytes(p.frames[0]) == big.tobytes()
    # A list input is converted as before.
    p = T.pack({"x": [1, 2, 3]}, None)
    assert p.tensors[0].dtype == np.asarray([1, 2, 3]).dtype.str


def test_shared_memory_takes_the_tensors_above_inline_max(tmp_path):
    core = ClientCore(f"ipc://{tmp_path}/none.sock", transport="shm", heartbeat_interval=None)
    try:
        call = core.new_call("echo", {"x": np.arange(4, dtype=np.float32)})
        assert call.packed.uses_shm and type(call.packed.tensors[0].loc) is P.ShmLoc and call.reply == "shm"
        core.discard_unsent(call)
        empty = core.new_call("echo", {"x": np.zeros(0, np.float32)})  # 0 bytes: inline, as before
        assert empty.packed.frames == [b""] and not empty.packed.uses_shm
    finally:
        core.close()


# ================================================================================================
# The core: the usual FINAL in one step, everything else as before

@pytest.fixture
def core(tmp_path):
    c = ClientCore(f"ipc://{tmp_path}/none.sock", heartbeat_interval=1.0)
    try:
        yield c
    finally:
        c.close()


def _reply(call, *, error: tuple | None = None, rid: int | None = None, delimiter: bool = False) -> list:
    t = call.packed.tensors
    rep = P.Reply(id=call.id if rid is None else rid, tensors=[] if error else list(t),
                  error=None if error is None else P.ErrorInfo(*error), timing={"compute_ms": 0.5})
    body = [P.encode_header(rep), *([] if error else call.packed.frames)]
    frames = P.client_reply(True, call.service.encode(), body)
    return [b"", *frames] if delimiter else frames


def test_an_inline_output_cannot_be_made_writeable(core):
    # "Output arrays are always read-only": a shared-memory slot's cannot be flipped back;
    # an inline one could (`flags.writeable = True` and write), so code came to depend on
    # the transport.
    import zmq

    for delimiter in (False, True):  # the lean path and the general one
        call = core.new_call("echo", {"x": np.arange(4, dtype=np.int16)})
        core.request_frames(call, 10.0)
        # As received: zmq.Frames, whose buffers are writable (bytes would prove nothing).
        frames = [zmq.Frame(bytes(f)) for f in _reply(call, delimiter=delimiter)]
        core.on_message(frames, 10.5, direct=True)
        _, res = call.inbox.popleft()
        assert res["x"].tolist() == [0, 1, 2, 3]
        with pytest.raises(ValueError):
            res["x"].flags.writeable = True
        res.release()


def test_the_usual_final_is_routed_as_the_general_path_routes_it(core):
    outcomes = []
    for delimiter in (False, True):  # an empty first frame takes the general path
        call = core.new_call("echo", {"x": np.arange(4, dtype=np.int16)})
        core.request_frames(call, 10.0)
        assert core.on_message(_reply(call, delimiter=delimiter), 10.5, direct=True) == []
        kind, res = call.inbox.popleft()
        outcomes.append((kind, res["x"].tolist(), res["x"].flags.writeable, dict(res.timing), call.done,
                         call.t_done, core.in_flight()))
        res.release()
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][:3] == ("final", [0, 1, 2, 3], False)
    assert outcomes[0][3] == {"compute_ms": 0.5, "client_ms": pytest.approx(500.0)}
    assert core.direct_replies == 2


def test_finals_the_lean_step_leaves_to_the_general_path(core):
    # An error: its typed error.
    call = core.new_call("echo", {"x": np.arange(2)})
    core.request_frames(call, 1.0)
    core.on_message(_reply(call, error=(int(ErrorCode.WORKER_FAILED), "boom")), 1.1)
    kind, err = call.inbox.popleft()
    assert kind == "error" and isinstance(err, errors.WorkerFailed)
    # An abandoned call's FINAL: dropped and counted.
    call = core.new_call("echo", {"x": np.arange(2)})
    core.request_frames(call, 1.0)
    assert core.give_up(call) is not None  # CANCEL
    core.on_message(_reply(call), 1.2)
    assert not call.inbox and core.discarded == 1 and core.in_flight() == 0
    # Nobody's id: a stray.
    core.on_message(_reply(call, rid=call.id + 1000), 1.3)
    assert core.discarded == 2
    # A bad header fails its call rather than letting it wait.
    call = core.new_call("echo", {"x": np.arange(2)})
    core.request_frames(call, 1.0)
    bad = P.TensorRef(name="y", dtype="<f4", shape=[-1], loc=P.InlineLoc(frame=0))
    core.on_message(P.client_reply(True, b"echo", [P.encode_header(P.Reply(id=call.id, tensors=[bad])), b""]), 1.4)
    kind, err = call.inbox.popleft()
    assert kind == "error" and isinstance(err, errors.ProtocolError)
    # An MMI answer is not a header at all.
    q = core.expect_mmi(core.mmi_question("echo"))
    core.on_message(P.client_reply(True, b"mmi.service", [b"200", q.token]), 1.5)
    assert q.answer == [b"200"]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # 3.12: forks on purpose
def test_a_forked_child_refuses_its_parents_client_and_its_own_names_its_pid(tmp_path):
    # Inline only: the child touches no shared memory (it leaves with os._exit).  The
    # parent's client in a child: its sockets are the parent's libzmq's (a child that used
    # them spun forever) and its slots the parent's, so it is refused; a client the child
    # makes names the child's pid.
    core = ClientCore(f"ipc://{tmp_path}/none.sock", transport="inline", heartbeat_interval=None)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            try:
                core.new_call("echo", {"x": np.arange(2)})
                said = "accepted"
            except InvalidInput as e:
                said = "refused" if "forked" in str(e) and core.forked() else repr(e)
            own = ClientCore(f"ipc://{tmp_path}/none.sock", transport="inline", heartbeat_interval=None)
            call = own.new_call("echo", {"x": np.arange(2)})
            head = P.decode_request(own.request_frames(call, 1.0)[3], 1)
            os.write(w, f"{said} {head.pid}".encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = read_within(r, 256, 20, "the child's answer").decode()
    finally:
        os.close(r)
        wait_child(pid, 20, "answering and leaving with os._exit")
    assert got == f"refused {pid}"
    assert not core.forked()
    call = core.new_call("echo", {"x": np.arange(2)})
    assert P.decode_request(core.request_frames(call, 1.0)[3], 1).pid == os.getpid()
    core.close()


def test_the_service_check_is_remembered_only_for_good_names(core):
    for bad in ("", "x" * 256, None, b"echo"):
        for _ in range(2):
            with pytest.raises(InvalidInput):
                core.new_call(bad, {"x": np.arange(2)})
    call = core.new_call("échø", {"x": np.arange(2)})
    frames = core.request_frames(call, 1.0)
    assert frames[2] == "échø".encode()
    # Names past the cache's bound are checked (and encoded) every time, and still work.
    for i in range(300):
        call = core.new_call(f"svc{i}", {"x": np.arange(2)})
        assert core.request_frames(call, 1.0)[2] == f"svc{i}".encode()


def test_a_reply_queued_behind_an_infers_final_is_read_not_failed_as_silence(endpoint):
    """The broker answers an earlier call and `infer` back to back, `infer`'s first; the
    caller comes back to the earlier call only after the liveness window (it did something
    else meanwhile): the reply that was waiting in the socket is its result, not a
    BrokerUnreachable (the broker's socket is read to the end, and a silent spell reads
    what arrived before it judges)."""
    ctx = zmq.Context.instance()
    r = ctx.socket(zmq.ROUTER)
    r.linger = 0
    r.bind(endpoint)
    seen = queue.Queue()

    def broker():
        reqs = []
        while len(reqs) < 2:
            if not r.poll(int(WAIT * 1000)):
                return
            ident, *f = r.recv_multipart()
            if f[1] == P.C_REQUEST:
                reqs.append((ident, f, P.decode_request(f[3], len(f) - 4)))
        for ident, f, req in reversed(reqs):  # the infer's FINAL first, then the earlier call's
            head = P.encode_header(P.Reply(id=req.id, tensors=list(req.tensors)))
            r.send_multipart([ident, *P.client_reply(True, f[2], [head, *f[4:]])])
        seen.put(True)

    t = threading.Thread(target=broker, daemon=True)
    t.start()
    c = Client(endpoint, timeout=30, heartbeat_interval=0.05)  # silent after 5 x 0.05 s
    try:
        earlier = c.infer_stream("svc", {"x": np.arange(2)})
        with c.infer("svc", {"x": np.arange(3)}) as res:
            np.testing.assert_array_equal(res["x"], np.arange(3))
        assert seen.get(timeout=WAIT)
        time.sleep(0.4)  # the caller is busy elsewhere, past the liveness window (not a wait for anything)
        with earlier.result(timeout=WAIT) as res:
            np.testing.assert_array_equal(res["x"], np.arange(2))
    finally:
        c.close()
        t.join(WAIT)
        r.close(0)


def test_a_resend_lease_end_finds_the_replies_already_on_the_lease_routed(pinned):
    """Replies wait on the lease's connection and a LEASE_END with resend waits on the
    broker's (the worker answered, then died): one pump routes the replies first, so nothing
    goes through the broker a second time (it would run twice)."""
    c, broker, worker = pinned
    [lease] = c._pin_socks
    lease_sock = c._pin_socks[lease]
    before = len(broker.call(lambda: list(broker.requests)))
    handles = [c.infer_stream("echo", {"x": np.arange(3) + i, "hold": np.zeros(1)}) for i in range(2)]
    for _ in handles:
        worker.requests.get(timeout=WAIT)
    # Both replies sent back to back (one after the other, the second could still be on
    # its way when the first was there, and the resend below would find it missing).
    worker.release()
    # Both sent before the client is looked at: the test's thread ran on between the two
    # sends (a loaded machine), and its pump found the second missing (1 in 30 beside two
    # CPU burners).
    assert worker.echoed.wait(WAIT)
    assert lease_sock.poll(int(WAIT * 1000))  # the replies are there (not read: poll only looks)
    ident = broker.call(lambda: broker.idents[-1])
    end = P.encode_header(P.LeaseEnd(lease=lease, reason="worker_failed", resend=True))
    broker.call(lambda: broker.sock.send_multipart([ident, *P.client_lease_end("echo", end)]))
    assert c._sock.poll(int(WAIT * 1000))
    # Socket.poll is a pyzmq call behind the client's back: say so (wire.touched), as the
    # client does after its own (they may take the descriptor's signal of a waiting message).
    touched(lease_sock)
    touched(c._sock)
    c.pump(0)
    for i, h in enumerate(handles):
        with h.result(timeout=0) as r:
            np.testing.assert_array_equal(r["x"], np.arange(3) + i)
    assert len(broker.call(lambda: list(broker.requests))) == before  # nothing resent
    assert not c.pinned("echo")


def test_infer_stops_at_its_reply_and_what_follows_is_read_on_the_next_pass(fake, endpoint):
    """`infer`'s drain stops once the broker's socket routed its reply, without asking the
    socket again: a FINAL of another call right behind it stays unread until the next pass
    (the Waiter asks before it sleeps), and is delivered then, nothing lost."""
    with Client(endpoint, timeout=WAIT) as c:
        with c.infer("echo", {"x": np.arange(2)}):
            pass
        a = c.infer_stream("hold", {"x": np.arange(3)})
        fake.held_q.get(timeout=WAIT)

        def answer_b_then_a():
            fake.held_q.get(timeout=WAIT)  # b (the infer below) is held too

            def go():
                held_a, held_b = fake.held.pop(0), fake.held.pop(0)
                fake._echo(*held_b)  # b's FINAL, then a's right behind it, in one go
                fake._echo(*held_a)
            fake.call(go)

        t = threading.Thread(target=answer_b_then_a)
        t.start()
        try:
            with c.infer("hold", {"x": np.arange(5)}) as r:
                np.testing.assert_array_equal(r["x"], np.arange(5))
        finally:
            t.join(WAIT)
        assert not a._call.inbox  # not routed by b's drain, whenever it arrived
        with a:
            np.testing.assert_array_equal(a.result()["x"], np.arange(3))
        assert c.in_flight() == 0
