"""Leases end to end, the worker's side (docs/protocol.md section 10): real broker and
`python -m gpu_worker --direct` processes, and a raw client (the SDK's `pin=True` is tested in
test_pinned.py) that gets a lease through the broker, connects a DEALER to the worker's direct socket,
says HELLO and sends its requests there.  Checked: the direct socket's file and mode, the
binding (no HELLO, a wrong secret: 400), echoes straight from the worker, references refused
on a lease that is not near, malformed frames survived, at most `slots` in flight (429), a
local CANCEL (499), SIGTERM ending the lease through the broker (LEASE_END worker_stopping)
and a later direct REQUEST answered 503 while held work finishes; a worker without
--direct is never leased."""
from __future__ import annotations

import os
import signal
import stat
import time
from collections import deque

import numpy as np
import pytest
import zmq

from broker import protocol as P

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 10.0


class Leaseholder:
    """A raw client: a DEALER on the broker's frontend, heartbeating it all along (a
    leaseholder is a tracked client: silent for its liveness window, it loses its leases),
    and, once leased, a DEALER on the worker's direct socket."""

    def __init__(self, cluster):
        self.ctx = zmq.Context.instance()
        self.broker = self._dealer(cluster.frontend)
        self.direct: zmq.Socket | None = None
        self._got = {"broker": deque(), "worker": deque()}
        self._beat = 0.0

    def _dealer(self, endpoint: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(endpoint)
        return s

    def close(self) -> None:
        self.broker.close(0)
        if self.direct is not None:
            self.direct.close(0)

    def _next(self, which: str, timeout_s: float = TIMEOUT_S) -> list[bytes]:
        q = self._got[which]
        deadline = time.monotonic() + timeout_s
        while not q:
            now = time.monotonic()
            assert now < deadline, f"no message from the {which} within {timeout_s} s"
            if now - self._beat >= 0.05:
                self.broker.send_multipart(P.client_heartbeat())
                self._beat = now
            poller = zmq.Poller()
            poller.register(self.broker, zmq.POLLIN)
            if self.direct is not None:
                poller.register(self.direct, zmq.POLLIN)
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart()
                if sock is self.broker:
                    if frames[1] != P.C_HEARTBEAT:
                        self._got["broker"].append(frames)
                else:
                    self._got["worker"].append(frames)
        return q.popleft()

    def from_broker(self) -> list[bytes]:
        return self._next("broker")

    def reply(self) -> tuple[P.Reply, list[bytes]]:
        """The next FINAL on the direct connection: its header and inline frames."""
        frames = self._next("worker")
        msg = P.parse_broker_to_client(frames)
        assert msg.command == P.C_FINAL, frames[:2]
        return P.decode_reply(msg.body[0], n_inline=len(msg.body) - 1), list(msg.body[1:])

    def lease(self, service: str, ask_id: int, slots: int) -> P.LeaseInfo | P.ErrorInfo:
        self.broker.send_multipart(P.client_lease(service, P.encode_header(P.LeaseAsk(id=ask_id, slots=slots))))
        frames = self.from_broker()
        assert frames[:3] == [P.MDPC, P.C_LEASED, service.encode()]
        try:
            return P.decode_lease_info(frames[3])
        except P.ProtocolError:
            return P.decode_reply(frames[3]).error

    def connect(self, endpoint: str) -> None:
        self.direct = self._dealer(endpoint)

    def hello(self, lease: bytes, secret: bytes) -> None:
        self.direct.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=lease, secret=secret))])

    def request(self, rid: int, x: np.ndarray, service: str = "echo", **kw) -> None:
        head = P.Request(id=rid, tensors=[P.TensorRef(name="x", dtype=x.dtype.str, shape=list(x.shape),
                                                      loc=P.InlineLoc(frame=0))], **kw)
        self.direct.send_multipart(P.client_request(service, [P.encode_header(head), x.tobytes()]))

    def send(self, frames) -> None:
        self.direct.send_multipart(frames)


def _echoed(rep: P.Reply, frames: list[bytes]) -> np.ndarray:
    assert rep.error is None, rep.error
    [t] = rep.tensors
    return np.frombuffer(frames[t.loc.frame], dtype=t.dtype).reshape(t.shape)


def _direct_path(proc) -> str:
    endpoint = proc.field("direct")
    assert endpoint.startswith("ipc://")
    path = endpoint[len("ipc://"):]
    assert os.path.dirname(path) == P.default_runtime_dir()
    assert os.path.basename(path).startswith(f"w-{proc.p.pid}-")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    return path


@pytest.fixture
def client(cluster):
    c = Leaseholder(cluster)
    try:
        yield c
    finally:
        c.close()


def test_a_leased_client_gets_its_replies_straight_from_the_worker(cluster, client):
    cluster.broker()
    w = cluster.worker("echo", "--direct")
    cluster.worker("echo", "--service", "plain")  # no --direct: never leased
    path = _direct_path(w)
    err = client.lease("plain", 1, slots=1)
    assert isinstance(err, P.ErrorInfo) and err.code == int(P.ErrorCode.SERVICE_UNAVAILABLE)
    assert "direct socket" in err.message
    info = client.lease("echo", 2, slots=2)
    assert isinstance(info, P.LeaseInfo) and info.endpoint == "ipc://" + path and info.slots == 2
    assert info.host is None  # the ask named no host: inline only
    client.connect(info.endpoint)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    # Not bound yet: refused, nothing runs.
    client.request(10, x)
    rep, _ = client.reply()
    assert rep.id == 10 and rep.error.code == int(P.ErrorCode.PROTOCOL_ERROR)
    assert rep.error.message.startswith("not bound to a lease: send HELLO first")
    # A wrong secret binds nothing either.
    client.hello(info.lease, bytes(16))
    client.request(11, x)
    rep, _ = client.reply()
    assert rep.id == 11 and rep.error.code == 400 and "HELLO was refused" in rep.error.message
    # Malformed frames are logged and dropped; the worker goes on.
    client.send([b"junk"])
    client.send([P.MDPC, b"\x7f", b"?"])
    client.send([P.MDPC, P.C_HELLO, P.MAGIC + b"\xc1"])
    client.send([P.MDPC, P.C_REQUEST])
    # The right secret: requests run, and their replies come straight back.
    client.hello(info.lease, info.secret)
    for rid in (12, 13):
        client.request(rid, x * rid)
    got = {}
    for _ in range(2):
        rep, frames = client.reply()
        got[rep.id] = _echoed(rep, frames)
    assert set(got) == {12, 13}
    for rid, y in got.items():
        assert np.array_equal(y, x * rid)
    # The header's pid and reply_to are not trusted; a deadline and priorities are taken.
    big = np.arange(1 << 16, dtype=np.uint8)
    client.request(14, big, pid=1, priority=0, timeout_ms=10_000.0)
    rep, frames = client.reply()
    assert rep.id == 14 and np.array_equal(_echoed(rep, frames), big)
    # A shared-memory reference on a lease that is not near: refused, nothing is opened.
    ref = P.TensorRef(name="x", dtype="|u1", shape=[16], loc=P.ShmLoc(segment="zinf-1-2-0123456789abcdef-3",
                                                                       offset=0, nbytes=16, slot=0, generation=1))
    head = P.Request(id=15, host=P.local_host_id(), pid=os.getpid(), tensors=[ref])
    client.send(P.client_request("echo", [P.encode_header(head)]))
    rep, _ = client.reply()
    assert rep.id == 15 and rep.error.code == 400 and "inline" in rep.error.message
    # A bad header is that request's 400; a CANCEL of nothing in flight is ignored.
    client.send(P.client_request("echo", [P.MAGIC + b"\xc1"]))
    client.send(P.client_cancel("echo", 999))
    rep, _ = client.reply()
    assert rep.error.code == 400
    client.request(16, x)
    rep, frames = client.reply()
    assert rep.id == 16 and np.array_equal(_echoed(rep, frames), x)
    # The worker stops: the broker tells the client (heartbeating meanwhile, as a leaseholder
    # must), and the socket file is gone.
    w.p.send_signal(signal.SIGTERM)
    end = P.decode_lease_end(client.from_broker()[3])
    assert (end.lease, end.reason, end.resend) == (info.lease, "worker_stopping", False)
    assert w.p.wait(TIMEOUT_S) == 0
    assert not os.path.exists(path)


def test_slots_cancel_and_sigterm_on_a_lease(cluster, client, gate):
    cluster.broker()
    w = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "4",
                       "--no-warmup", "--direct", env=gate.env, wait=False)
    gate.open()
    w.wait_ready()
    path = _direct_path(w)
    info = client.lease("gate", 1, slots=2)
    assert isinstance(info, P.LeaseInfo) and info.slots == 2
    client.connect(info.endpoint)
    client.hello(info.lease, info.secret)
    x = np.arange(5, dtype=np.int64)
    client.request(1, x, service="gate")      # runs: held by the gate
    client.request(2, x + 2, service="gate")  # waits in the worker's batcher
    client.request(3, x + 3, service="gate")  # beyond the lease's 2 slots
    rep, _ = client.reply()
    assert rep.id == 3 and rep.error.code == int(P.ErrorCode.QUEUE_FULL)
    client.send(P.client_cancel("gate", 2))  # cancelled where it waits, by the worker itself
    rep, _ = client.reply()
    assert rep.id == 2 and rep.error.code == int(P.ErrorCode.CANCELLED)
    # SIGTERM: the worker ends its lease through the broker before anything else ...
    w.p.send_signal(signal.SIGTERM)
    end_frames = client.from_broker()
    assert end_frames[:3] == [P.MDPC, P.C_LEASE_END, b"gate"]
    end = P.decode_lease_end(end_frames[3])
    assert (end.lease, end.reason, end.resend) == (info.lease, "worker_stopping", False)
    # ... so a new direct request is sent back to the broker's path, while the held one finishes.
    client.request(4, x, service="gate")
    rep, _ = client.reply()
    assert rep.id == 4 and rep.error.code == int(P.ErrorCode.SERVICE_UNAVAILABLE)
    assert "through the broker" in rep.error.message
    gate.release(1)
    rep, frames = client.reply()
    assert rep.id == 1 and np.array_equal(_echoed(rep, frames), x)
    assert w.p.wait(TIMEOUT_S) == 0
    assert not os.path.exists(path)


def _lines(path) -> list[str]:
    return path.read_text().split("\n")[:-1] if path.exists() else []


def _until(cond, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.005)  # polling a file the worker writes (a condition, not a delay)


def test_the_direct_socket_is_read_while_a_batch_computes_on_the_loop_thread(cluster, client, tmp_path, gate):
    """gate_model's `held` runs even a long call on the worker loop's own thread (its warm-up
    is fast), and holds it until the test releases it.  What the lease sends during such a
    batch is read then, by the heartbeat thread (the worker's debug log says so, which is
    what the test waits for): a REQUEST's wait counts from its arrival (batch_wait_ms covers
    the time it waited behind the batch), and a CANCEL of the running request drops its
    result."""
    log = tmp_path / "runs.log"
    cluster.broker()
    w = cluster.worker("gate_model:held", "--direct", "--credit", "6", "--log-level", "debug",
                       env={"SLEEPY_LOG": str(log), **gate.env})
    gate.open()
    info = client.lease("held", 1, slots=3)
    assert isinstance(info, P.LeaseInfo) and info.slots == 3
    client.connect(info.endpoint)
    client.hello(info.lease, info.secret)
    client.request(1, np.array([-1.0]), service="held")  # held until released
    _until(lambda: len(_lines(log)) == 1, "the held batch starting")
    client.request(2, np.array([0.0]), service="held")  # arrives during the batch
    w.wait_log("read a REQUEST on the direct socket while a batch computes")
    read_by = time.monotonic()  # request 2's arrival, as the worker took it, is before this
    # The held batch goes on 200 ms more (a span measured, not a synchronisation): request 2
    # starts after the release, so its wait is at least that, if counted from its arrival.
    _until(lambda: time.monotonic() - read_by >= 0.2, "200 ms passing")
    gate.release(1)
    got = {}
    for _ in range(2):
        rep, frames = client.reply()
        got[rep.id] = (rep, frames)
    assert got[1][0].error is None and got[2][0].error is None, (got[1][0].error, got[2][0].error)
    timing = got[2][0].timing
    assert timing["batch_wait_ms"] >= 200.0, timing  # not ~0: its wait behind the batch shows
    # A CANCEL during a loop-thread batch: read then (the log says so before the release), so
    # the result is dropped.
    client.request(3, np.array([-1.0]), service="held")
    _until(lambda: len(_lines(log)) == 2, "the second held batch starting")
    client.send(P.client_cancel("held", 3))
    w.wait_log("read a CANCEL on the direct socket while a batch computes")
    gate.release(1)
    rep, _ = client.reply()
    assert rep.id == 3 and rep.error is not None and rep.error.code == int(P.ErrorCode.CANCELLED), rep
    assert "while its batch ran" in rep.error.message
    client.request(4, np.array([0.0]), service="held")
    rep, frames = client.reply()
    assert rep.id == 4 and rep.error is None and np.array_equal(_echoed(rep, frames), [0.0])


def test_a_lease_does_not_wait_behind_another_leases_long_batch(cluster, tmp_path, gate):
    """Two leases on one worker: while lease A's long batch runs (on the loop's thread, held
    by the gate until the test releases it), lease B's request is answered 429 "send this
    one through the broker" instead of waiting (the SDK resends it there; test_pinned.py):
    its answer comes while A's batch is still held, which no clock margin could fake.  The
    worker tells the broker BUSY, so brokered work goes elsewhere meanwhile."""
    log = tmp_path / "runs.log"
    cfg = tmp_path / "broker.toml"
    # Each raw leaseholder heartbeats only while it waits for its own messages: a long client
    # liveness keeps the one not being read from losing its lease meanwhile.
    cfg.write_text("[scheduler]\nclient_liveness = 60.0\n")
    cluster.broker("--config", str(cfg))
    w = cluster.worker("gate_model:held", "--direct", "--credit", "4", "--log-level", "debug",
                       env={"SLEEPY_LOG": str(log), **gate.env})
    gate.open()
    a, b = Leaseholder(cluster), Leaseholder(cluster)
    try:
        for n, holder in enumerate((a, b)):
            info = holder.lease("held", n + 1, slots=1 + n)
            assert isinstance(info, P.LeaseInfo), info
            holder.connect(info.endpoint)
            holder.hello(info.lease, info.secret)
        a.request(1, np.array([-1.0]), service="held")  # held until released
        _until(lambda: len(_lines(log)) == 1, "A's held batch starting")
        b.request(1, np.array([0.0]), service="held")
        rep, _ = b.reply()  # A's batch is still held: this did not wait behind it
        assert rep.id == 1 and rep.error is not None and rep.error.code == int(P.ErrorCode.QUEUE_FULL), rep
        assert "through the broker" in rep.error.message and "did not run" in rep.error.message
        w.wait_log("told the broker BUSY")
        gate.release(1)
        rep, frames = a.reply()
        assert rep.id == 1 and rep.error is None
        # Nothing runs now: B's requests run on the lease again.
        b.request(2, np.array([0.0]), service="held")
        rep, frames = b.reply()
        assert rep.id == 2 and rep.error is None and np.array_equal(_echoed(rep, frames), [0.0])
        assert len(_lines(log)) == 1
    finally:
        a.close()
        b.close()
