"""Bounded resources and fairness with real processes (docs/security.md, "Bounded resources
and fairness"): what one client can make the broker hold is bounded whatever it sends and
whether or not it reads, and nothing it does makes another client wait or fail.

- A frame over ``--max-frame-mb`` drops its sender's connection before it is buffered:
  no reply, no memory, and legitimate clients are served as before.  (libzmq applies
  ZMQ_MAXMSGSIZE to each frame, not to a multipart message as a whole.)
- A client that stops reading its replies is dropped once ``--client-hwm`` replies wait for
  it, at a bounded cost in broker memory, while a well-behaved client is served throughout.
- A burst from one client fills a service's queue only at its own expense: another client
  is never refused with QUEUE_FULL and is served round robin, not behind the burst; once
  the queue is congested (served newest first), what it evicts for another client is the
  burster's oldest queued request, not the newest it would serve next.
- A full queue holding requests whose deadline passed since the broker's timers last ran
  lets those go first, answered `DEADLINE_EXCEEDED` as their deadline says: nobody is
  evicted for them, and none of them is answered `QUEUE_FULL`.
- ``--max-client-requests`` refuses exactly the requests over the cap, and nobody else's.

The slow service is the gate model (tests/e2e/gate_model.py): each request finishes when the
test writes one byte to a FIFO, so "how many requests ran before this one" is counted
exactly rather than guessed from timings.  Every wait is a poll with a deadline.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from broker import protocol as P
from client_sdk import Client, DeadlineExceeded, InferenceError
from tests.e2e.conftest import HERE, Proc, RunLog, until_stopped, wait_service
from tests.children import readline_within

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
STALLED = "stopped reading its replies"


def _status_kib(pid: int, field: str) -> int:
    """A `VmRSS`-style line of /proc/<pid>/status, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _dealer(endpoint: str, **options) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.sndtimeo = 10_000  # a blocking send that cannot complete fails instead of hanging
    for name, value in options.items():
        s.setsockopt(getattr(zmq, name.upper()), value)
    s.connect(endpoint)
    return s


_RELAY = """
import sys
import zmq
ctx = zmq.Context.instance()
dealer, pair = ctx.socket(zmq.DEALER), ctx.socket(zmq.PAIR)
for s in (dealer, pair):
    s.linger = 0
    s.rcvhwm = s.sndhwm = 0
pair.bind(sys.argv[2])
dealer.connect(sys.argv[1])
print("READY", flush=True)
try:
    zmq.proxy(pair, dealer)
except (zmq.ContextTerminated, KeyboardInterrupt):
    pass
"""


class _ChildDealer:
    """A DEALER to the broker that lives in a child process, driven from here through a
    PAIR relay: the broker attests the child's pid for it, so it is another client
    process (principal) than the test's own `Client`, as a real second client would be."""

    def __init__(self, endpoint: str, tmp_path):
        import subprocess
        import sys

        from tests.e2e.conftest import ROOT

        relay = f"ipc://{tmp_path}/relay-{id(self)}.ipc"
        self.proc = subprocess.Popen([sys.executable, "-c", _RELAY, endpoint, relay], stdout=subprocess.PIPE,
                                     cwd=ROOT, text=True)
        try:
            said = readline_within(self.proc.stdout, 30, "the relay child's READY")
            assert said.strip() == "READY", f"the relay child did not start: {said!r}"
        except BaseException:  # a wrong line or none in time: the child goes too
            self.proc.kill()
            self.proc.wait(10)
            self.proc.stdout.close()
            raise
        self.sock = zmq.Context.instance().socket(zmq.PAIR)
        self.sock.linger = 0
        self.sock.rcvhwm = self.sock.sndhwm = 0
        self.sock.connect(relay)

    def send_multipart(self, frames) -> None:
        self.sock.send_multipart(frames)

    def recv_multipart(self):
        return self.sock.recv_multipart()

    def poll(self, timeout_ms: int) -> int:
        return self.sock.poll(timeout_ms)

    def close(self, linger: int = 0) -> None:
        self.sock.close(linger)
        self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()


def _request(service: str, rid: int, data, dtype: str, shape: list[int], reply: str = "auto") -> list:
    """A tensor REQUEST with one inline tensor `x`: `data` is its only body frame."""
    t = P.TensorRef(name="x", dtype=dtype, shape=shape, loc=P.InlineLoc(frame=0))
    head = P.encode_header(P.Request(id=rid, reply=reply, tensors=[t]))
    return P.client_request(service, [head, data])


def _small(service: str, rid: int) -> list:
    """A tiny request whose echo carries its id back (x = [rid] as float64)."""
    return _request(service, rid, np.array([rid], np.float64).tobytes(), "<f8", [1])


def _recv_final(sock: zmq.Socket, timeout_ms: int = 10_000) -> tuple[P.Reply, list]:
    assert sock.poll(timeout_ms), f"no reply within {timeout_ms} ms"
    m = P.parse_broker_to_client(sock.recv_multipart())
    assert m.command == P.C_FINAL, m
    return P.decode_reply(m.body[0], n_inline=len(m.body) - 1), list(m.body[1:])


def _barrier(sock: zmq.Socket, service: str = "gate") -> None:
    """An MMI question on `sock`, answered: the broker handles one connection's messages in
    order, so it has handled everything sent on `sock` before."""
    sock.send_multipart(P.client_request("mmi.service", [service.encode()]))
    assert sock.poll(10_000), "no MMI answer"
    m = P.parse_broker_to_client(sock.recv_multipart())
    assert m.service == b"mmi.service" and m.body[0] == b"200", m


def _echo(c: Client, x: np.ndarray, service: str = "echo", timeout: float = 10.0) -> None:
    with c.infer(service, {"x": x}, timeout=timeout) as r:
        np.testing.assert_array_equal(r["x"], x)


def _gated_call(c: Client, gate, x: np.ndarray, releases: int) -> float:  # noqa: F811
    """One call to "gate", known to be queued at the broker (the MMI answer on the same socket
    says so) before exactly `releases` requests are let through; seconds from the release to
    its result.  Raises on an error (QueueFull, DeadlineExceeded)."""
    with c.infer_stream("gate", {"x": x}, timeout=10) as replies:
        assert c.mmi_service("gate", timeout=10)
        t0 = time.monotonic()
        gate.release(releases)
        res = next(replies)
        took = time.monotonic() - t0
        assert res.final
        np.testing.assert_array_equal(res["x"], x)
        res.release()
    return took


def _gated_worker(cluster, gate):  # noqa: F811
    """One worker of service "gate" that holds one request at a time."""
    p = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "1",
                       "--no-warmup", env=gate.env, wait=False)
    gate.open()
    p.wait_ready()
    return p


# ------------------------------------------------------------------------------------------------


def test_an_oversized_frame_drops_its_connection_before_it_is_buffered(cluster):
    broker = cluster.broker("--max-frame-mb", "1")
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        _echo(c, np.arange(100, dtype=np.int32))  # warm: the broker's steady-state memory
    pid = broker.p.pid
    rss0 = _status_kib(pid, "VmRSS")
    big = bytes(2 * MiB)  # one 2 MiB frame: twice the limit
    for i in range(8):
        # Each from a socket of its own (a dropped connection is not retried: no reconnect).
        s = _dealer(cluster.frontend, reconnect_ivl=-1)
        events = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            s.send_multipart(_request("echo", i + 1, big, "|u1", [len(big)], reply="inline"), copy=False)
            assert events.poll(10_000), "the broker did not drop the connection of an oversized message"
            assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
            assert not s.poll(500 if i == 0 else 50), "an oversized request was answered"
        finally:
            s.disable_monitor()
            events.close(0)
            s.close(0)
    assert broker.p.poll() is None, broker.stderr()
    rss1 = _status_kib(pid, "VmRSS")
    hwm = _status_kib(pid, "VmHWM")
    print(f"\noversized: broker VmRSS {rss0} -> {rss1} KiB (+{rss1 - rss0}), VmHWM {hwm} KiB")
    # 16 MiB were sent; libzmq refused each at its size field, so none of it was ever held
    # (measured on the test machine: +16 KiB of RSS, and no new peak).
    assert rss1 - rss0 < 8 * 1024, (rss0, rss1)
    assert hwm - rss0 < 8 * 1024, (rss0, hwm)
    # Legitimate clients are served: shared memory, and inline through the broker's sockets
    # both ways (512 KiB in, 512 KiB back through the broker: under the 1 MiB limit).
    with Client(cluster.frontend, timeout=10) as c:
        _echo(c, np.arange(1000, dtype=np.float32))
        _echo(c, np.arange(128 * 1024, dtype=np.float32))
    with Client(cluster.frontend, timeout=10, transport="inline", direct_reply=False) as c:
        _echo(c, np.arange(1000, dtype=np.float32))
        _echo(c, np.full(512 * 1024, 7, np.uint8))


def test_a_client_that_stops_reading_costs_bounded_memory_and_nobody_else_notices(cluster):
    broker = cluster.broker("--client-hwm", "8", "--max-client-mb", "32")
    cluster.worker("echo")
    n_big, size = 200, MiB
    pid = broker.p.pid
    with Client(cluster.frontend, timeout=10) as good:
        wait_service(good, "echo")
        _echo(good, np.arange(16, dtype=np.int64))
        rss0 = _status_kib(pid, "VmRSS")
        # (The hog is a connection of this process, as `good` is: the broker drops the
        # connection that stopped reading, not the process.  `good` sends through shared
        # memory, so the process's byte cap, which the hog fills, does not touch it.)
        # It takes one message at a time and a small socket buffer, and never reads.  Its
        # sends wait while the previous one is still queued here, so that what it sent is
        # what the broker has read, until the broker closes its connection (a client that
        # stopped reading): then a send waits for a connection its socket, not reading, does
        # not notice is gone (sndtimeo: it fails after 2 s instead).
        hog = _dealer(cluster.frontend, rcvhwm=1, rcvbuf=4096, sndhwm=1, sndbuf=65536, sndtimeo=2000)
        try:
            payload = bytes(size)
            sent = 0
            for i in range(n_big):
                # Zero-copy: every message references the same 1 MiB buffer of this process.
                try:
                    hog.send_multipart(_request("echo", i + 1, payload, "|u1", [size], reply="inline"), copy=False)
                except zmq.Again:
                    break
                sent += 1
                if i % 4 == 0:  # meanwhile, small echoes of a well-behaved client
                    _echo(good, np.full(64, i, np.int32))
            broker.wait_log(STALLED, timeout=20)
            _echo(good, np.arange(16, dtype=np.int64))  # still served, after all of it
            rss1 = _status_kib(pid, "VmRSS")
            hwm = _status_kib(pid, "VmHWM")
            print(f"\nstalled reader: broker VmRSS {rss0} -> {rss1} KiB (+{rss1 - rss0}), "
                  f"peak VmHWM {hwm} KiB (+{hwm - rss0}) for {sent * size >> 20} MiB sent")
            # What the broker may hold for the hog: its queued and running requests (32 MiB,
            # --max-client-mb), client_hwm (8) replies of 1 MiB waiting in its send queue, 8
            # requests of 1 MiB in its receive queue, the echo worker's replies in flight
            # (credit 16 x 1 MiB), plus the kernel's socket buffers and allocator slack:
            # about 64 MiB.  Measured on the test machine: a peak of +16 MiB (the echo worker
            # keeps up, so the byte cap is rarely reached).  Unbounded, the replies it does not
            # read would pile up here: most of the 200 MiB sent.  100 MiB leaves room for a
            # slow machine on which the worker falls behind, and is still half of that.
            assert hwm - rss0 < 100 * 1024, (rss0, hwm)
            assert rss1 - rss0 < 100 * 1024, (rss0, rss1)
        finally:
            hog.close(0)
    assert broker.p.poll() is None, broker.stderr()
    with Client(cluster.frontend, timeout=10) as fresh:
        for i in range(5):
            _echo(fresh, np.full(1000, i, np.int16))
        _echo(fresh, np.arange(256 * 1024, dtype=np.float32))


def test_a_burst_from_one_client_never_pushes_another_into_queue_full(cluster, gate, tmp_path):  # noqa: F811
    # (First in first out within the burster, for the ids below: this queue never empties,
    # and congested it would serve the burster's newest first: test_state_congestion.py)
    cluster.broker("--max-queue", "64", "--lifo-after-ms", "-1")
    _gated_worker(cluster, gate)
    n_burst = 2000
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "gate")
        # The burster is another process (caps and the round-robin count processes, not
        # connections) and queues whatever it is sent (no limit on its side), so the broker
        # never counts it as a client that stopped reading.
        burster = _ChildDealer(cluster.frontend, tmp_path)
        try:
            for i in range(n_burst):
                burster.send_multipart(_small("gate", i + 1))
            # The worker took the first, 64 queue behind it, and each of the others was
            # refused at once: a client that holds the largest share only pushes itself out.
            # (Read here only to know that the broker has handled the whole burst.)
            refused = []
            for _ in range(n_burst - 1 - 64):
                rep, _ = _recv_final(burster)
                assert rep.error is not None and rep.error.code == P.ErrorCode.QUEUE_FULL, rep
                assert "holds the largest share" in rep.error.message, rep.error.message
                refused.append(rep.id)
            assert sorted(refused) == list(range(66, n_burst + 1))
            # 10 requests of another client, one at a time.  Each is queued (the MMI answer on
            # the same socket says so) before the gate lets exactly 3 requests finish: the one
            # running, at most one of the burster's, then this one.  Behind the burst, it
            # would need 64 more.
            took = []
            for k in range(10):
                took.append(_gated_call(c, gate, np.array([1000 + k], np.float64), 3))
            print(f"\nburst: the other client's 10 requests took {[round(t * 1000, 1) for t in took]} ms")
            # Draining the queue ahead of it would take 64 gated requests; it took 3 each.
            assert max(took) < 2.0, took
            # The burster's replies: the first 20 of its requests (2 per gated round), and one
            # eviction: the first of the other client's requests found the queue full and
            # took the place of the burster's newest queued request.
            got = {}
            while len(got) < 21:
                rep, frames = _recv_final(burster)
                assert rep.id not in got, rep
                got[rep.id] = (rep, frames)
            evicted = [r for r, _ in got.values() if r.error is not None]
            assert [r.id for r in evicted] == [65], evicted
            assert evicted[0].error.code == P.ErrorCode.QUEUE_FULL
            assert "holds the largest share" in evicted[0].error.message
            assert "made room for another client's" in evicted[0].error.message
            done = sorted(rid for rid, (r, _) in got.items() if r.error is None)
            assert done == list(range(1, 21)), done
            for rid in done:
                rep, frames = got[rid]
                assert np.frombuffer(frames[0], np.float64).tolist() == [rid]
            assert not burster.poll(50)
            burster.send_multipart(P.client_disconnect())  # its 43 queued requests go
            _barrier(burster)
        finally:
            burster.close(0)
        # Its queue is gone: the running one (cancelled, still gated) and then ours.
        _gated_call(c, gate, np.array([7.0]), 2)


def test_a_congested_full_queue_evicts_the_oldest_of_the_heaviest_client(cluster, gate, tmp_path):  # noqa: F811
    # Congested at once (--lifo-after-ms 0, no missed deadline needed), each client's newest go first: another client's
    # newcomer takes the place of the burster's oldest queued request (served last, its
    # caller about to give up), not of its newest (served next): test_state_congestion.py.
    cluster.broker("--max-queue", "4", "--lifo-after-ms", "0", "--lifo-miss-ms", "-1")
    _gated_worker(cluster, gate)
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "gate")
        burster = _ChildDealer(cluster.frontend, tmp_path)
        try:
            for rid in range(1, 6):  # 1 runs, 2 to 5 queue; each with a deadline
                x = np.array([rid], np.float64)
                t = P.TensorRef(name="x", dtype="<f8", shape=[1], loc=P.InlineLoc(frame=0))
                head = P.encode_header(P.Request(id=rid, timeout_ms=30_000, tensors=[t]))
                burster.send_multipart(P.client_request("gate", [head, x.tobytes()]))
            _barrier(burster)
            x = np.array([1000.0])
            with c.infer_stream("gate", {"x": x}, timeout=10) as replies:
                assert c.mmi_service("gate", timeout=10)  # queued: the queue was full
                rep, _ = _recv_final(burster)
                assert rep.error is not None and rep.error.code == P.ErrorCode.QUEUE_FULL, rep
                assert rep.id == 2, f"evicted the burster's {rep.id}, not its oldest queued (2)"
                assert "its oldest request" in rep.error.message, rep.error.message
                assert "made room for another client's" in rep.error.message
                # The one running, the burster's newest, then ours (round robin).
                gate.release(3)
                res = next(replies)
                np.testing.assert_array_equal(res["x"], x)
                res.release()
            got = [_recv_final(burster) for _ in range(2)]
            assert [(r.id, r.error) for r, _ in got] == [(1, None), (5, None)], got
            burster.send_multipart(P.client_disconnect())  # 3 and 4 go (4 running, gated)
            _barrier(burster)
        finally:
            burster.close(0)
        _gated_call(c, gate, np.array([7.0]), 2)


def test_a_full_queue_lets_requests_past_their_deadline_go_before_it_evicts_anyone(cluster, gate, tmp_path):  # noqa: F811
    # The broker's timers fire deadlines between the messages it reads; a request read before
    # them found a full queue of requests already past their deadline, and evicted one of
    # them with QUEUE_FULL (a caller told to back off when its time was simply up).  The
    # broker stops itself at a timer run (tests/e2e/self_stopping_broker.py) before the two
    # queued deadlines pass; on its thaw it runs that run's timers at the time it stopped,
    # then reads the request sent meanwhile, before any timer sees the deadlines passed.
    stop = tmp_path / "broker-stop"
    broker = Proc([str(HERE / "self_stopping_broker.py"), "--frontend", cluster.frontend, "--backend",
                   cluster.backend, "--heartbeat-interval", "0.2", "--heartbeat-liveness", "20",
                   "--max-queue", "2", "--lifo-after-ms", "-1"], env={"BROKER_STOP_FILE": str(stop)})
    cluster.procs.append(broker)
    broker.wait_ready()
    p = cluster.worker("gate_model:factory", "--service", "gate", "--max-batch", "1", "--credit", "1",
                       "--no-warmup", "--heartbeat-liveness", "20", env=gate.env, wait=False)
    gate.open()
    p.wait_ready()
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "gate")
    burster = _ChildDealer(cluster.frontend, tmp_path)
    late = _dealer(cluster.frontend)  # this process: another principal than the burster
    try:
        t = P.TensorRef(name="x", dtype="<f8", shape=[1], loc=P.InlineLoc(frame=0))
        t0 = time.monotonic()  # before the broker read them: their deadlines after t0 + 1
        for rid, timeout_ms in ((1, None), (2, 1000), (3, 1000)):  # 1 runs (gated), 2 and 3 queue
            head = P.encode_header(P.Request(id=rid, timeout_ms=timeout_ms, tensors=[t]))
            burster.send_multipart(P.client_request("gate", [head, np.array([rid], np.float64).tobytes()]))
        _barrier(burster)  # 2 and 3 are queued, their deadlines before t1 + 1
        t1 = time.monotonic()  # (not t0: the broker may read them later than t0, under load)
        stop.touch()  # the broker stops itself at its next timer run (every 0.2 s: heartbeats)
        until_stopped(broker.p.pid)
        assert time.monotonic() < t0 + 0.9, "the broker stopped too late to show anything"
        late.send_multipart(_small("gate", 100))  # read on the thaw, before the timers run again
        while time.monotonic() < t1 + 1.1:
            time.sleep(0.01)  # the stimulus: the broker stopped past both deadlines
        os.kill(broker.p.pid, signal.SIGCONT)
        got = {}
        for _ in range(2):
            rep, _ = _recv_final(burster)
            got[rep.id] = (rep.error.code, rep.error.message) if rep.error is not None else None
        assert sorted(got) == [2, 3], got
        for rid, (code, message) in got.items():
            assert code == P.ErrorCode.DEADLINE_EXCEEDED, f"{rid}: {P.ErrorCode(code).name}: {message}"
        gate.release(2)  # 1, then the request that came late
        rep, frames = _recv_final(late)
        assert rep.id == 100 and rep.error is None, rep
        assert np.frombuffer(frames[0], np.float64).tolist() == [100]
        rep, _ = _recv_final(burster)
        assert rep.id == 1 and rep.error is None, rep
    finally:
        os.kill(broker.p.pid, signal.SIGCONT)  # (a failure above may have left it stopped)
        late.close(0)
        burster.close(0)


def test_the_per_client_request_cap_refuses_exactly_what_is_over_it(cluster, gate, tmp_path):  # noqa: F811
    cluster.broker("--max-client-requests", "5")
    _gated_worker(cluster, gate)
    with Client(cluster.frontend, timeout=10) as other:
        wait_service(other, "gate")
        raw = _ChildDealer(cluster.frontend, tmp_path)  # another process: its own cap
        try:
            for rid in range(1, 9):
                raw.send_multipart(_small("gate", rid))
            # 1 running and 4 queued are its 5 outstanding; 6, 7 and 8 are over the cap.
            refused = {}
            for _ in range(3):
                rep, _ = _recv_final(raw)
                assert rep.error is not None and rep.error.code == P.ErrorCode.QUEUE_FULL, rep
                assert "max_client_requests=5" in rep.error.message, rep.error.message
                refused[rep.id] = rep
            assert sorted(refused) == [6, 7, 8]
            assert not raw.poll(50)
            # Another client is not counted against it: admitted and served in turn (the
            # running one, one of raw's, then this one).
            _gated_call(other, gate, np.array([42.0]), 3)
            # The first five all succeed.
            gate.release(3)
            done = {}
            for _ in range(5):
                rep, frames = _recv_final(raw)
                assert rep.error is None, rep
                assert np.frombuffer(frames[0], np.float64).tolist() == [rep.id]
                done[rep.id] = rep
            assert sorted(done) == [1, 2, 3, 4, 5]
            # Its results are in, so its count is back to zero: it is admitted again.
            raw.send_multipart(_small("gate", 9))
            gate.release(1)
            rep, frames = _recv_final(raw)
            assert rep.id == 9 and rep.error is None, rep
        finally:
            raw.close(0)


def test_a_broker_near_its_descriptor_limit_takes_no_new_client_and_lives(cluster):
    # At RLIMIT_NOFILE, libzmq's ipc listener aborts the process (an assertion on EMFILE in
    # accept): every client of the broker lost it, and new ones could not connect.  Near the
    # limit the broker moves its socket file aside, serves the clients it has, and lets new
    # ones in again once connections close.
    import os
    import sys

    from tests.e2e.conftest import Proc

    limited = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
               "(64, 64)); os.execv(sys.argv[1], sys.argv[1:])"]
    broker = Proc(["-m", "broker", "--frontend", cluster.frontend, "--backend", cluster.backend,
                   "--heartbeat-interval", "0.2"], prefix=limited)
    cluster.procs.append(broker)
    broker.wait_ready()
    cluster.worker("echo")
    x = {"x": np.arange(4)}
    with Client(cluster.frontend, timeout=20) as first:
        wait_service(first, "echo")
        more = [Client(cluster.frontend, timeout=20) for _ in range(60)]  # each a connection at the broker
        try:
            broker.wait_log("new clients cannot connect until some close", timeout=30)
            assert broker.p.poll() is None
            with first.infer("echo", x) as r:  # connected before: served as before
                assert r["x"][3] == 3
        finally:
            for c in more:
                c.close()
        broker.wait_log("new clients can connect to", timeout=30)
    with Client(cluster.frontend, timeout=20) as late:
        with late.infer("echo", x) as r:
            assert r["x"][3] == 3
    assert not [f for f in os.listdir(cluster.tmp) if f.endswith(".paused")]
    assert broker.terminate() == 0


def test_a_broker_under_1024_descriptors_warns_at_start(cluster):
    import sys

    from tests.e2e.conftest import Proc

    limited = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
               "(256, 256)); os.execv(sys.argv[1], sys.argv[1:])"]
    broker = Proc(["-m", "broker", "--frontend", cluster.frontend, "--backend", cluster.backend], prefix=limited)
    cluster.procs.append(broker)
    broker.wait_ready()
    broker.wait_log("the descriptor limit is 256 (its hard limit too): under 1024")
    assert broker.terminate() == 0


_CONNECTOR = """
import sys, zmq
ctx = zmq.Context(io_threads=1)
ctx.max_sockets = 10000
sys.stdin.readline()
socks = []
for _ in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(sys.argv[1])
    socks.append(s)
print("CONNECTING", flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
ctx.term()
"""


def test_a_burst_of_connections_past_the_descriptor_limit_does_not_abort_the_broker(cluster):
    # The resource hunt: 800 connections at once (clients coming back after a restart) to a
    # broker limited to 256 descriptors aborted it 3 times in 3 (libzmq's ipc listener
    # asserts on EMFILE): its reserve (32) was less than what libzmq accepted, and the
    # kernel's listen queue (100) held, before the pause took effect.  The reserve is a
    # third of a low limit now, the listen backlog at most half of it, and the broker
    # warns at start that under 1024 it cannot promise as much.
    _burst_past_the_limit(cluster, cluster.frontend)


def test_a_burst_of_connections_to_the_backend_past_the_descriptor_limit_does_not_abort_the_broker(cluster):
    # The resource audit: only the frontend's socket file was moved aside at the pause, and
    # bare sockets connecting to the backend took the last descriptors: libzmq aborted the
    # broker ("Too many open files (src/ipc_listener.cpp:297)").  Both files go aside now.
    _burst_past_the_limit(cluster, cluster.backend)


def _burst_past_the_limit(cluster, target: str) -> None:
    """KIDS x EACH bare connections to ``target`` at once, to a broker limited to LIMIT
    descriptors: it pauses (both socket files aside), serves what it had, lives, resumes."""
    import subprocess
    import sys
    # At 256 the broker held off 800 clients at once in 6 runs of 6 alone, and aborted once
    # in a full suite's run (the loop's reaction to the burst slower on a busy machine): under
    # 1024 nothing is promised (the start's WARNING says so).  At 1024, 1200 at once.
    LIMIT, KIDS, EACH = 1024, 4, 300

    from tests.e2e.conftest import Proc

    limited = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
               f"({LIMIT}, {LIMIT})); os.execv(sys.argv[1], sys.argv[1:])"]
    broker = Proc(["-m", "broker", "--frontend", cluster.frontend, "--backend", cluster.backend,
                   "--heartbeat-interval", "0.2"], prefix=limited)
    cluster.procs.append(broker)
    broker.wait_ready()
    cluster.worker("echo")
    x = {"x": np.arange(4)}
    kids = [subprocess.Popen([sys.executable, "-c", _CONNECTOR, target, str(EACH)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for _ in range(KIDS)]
    try:
        with Client(cluster.frontend, timeout=20) as first:
            wait_service(first, "echo")
            for k in kids:
                k.stdin.write("go\n")
                k.stdin.flush()
            for k in kids:
                assert readline_within(k.stdout, 30, f"CONNECTING from the connector {k.pid}") == "CONNECTING\n"
            broker.wait_log("new clients cannot connect until some close, nor new workers", timeout=30)
            assert broker.p.poll() is None, broker.stderr()
            with first.infer("echo", x) as r:  # connected before (the client, its worker): served as before
                assert r["x"][3] == 3
            assert broker.p.poll() is None, broker.stderr()
    finally:
        for k in kids:
            if k.poll() is None:
                k.stdin.write("close\n")
                k.stdin.close()
        for k in kids:
            try:
                k.wait(20)
            except subprocess.TimeoutExpired:
                k.kill()
                k.wait(10)
            k.stdout.close()
    broker.wait_log("new clients can connect to", timeout=30)
    assert broker.p.poll() is None, broker.stderr()
    assert broker.terminate() == 0


def test_a_worker_out_of_descriptors_relays_a_reply_it_cannot_send_direct(cluster):
    # A worker opens a socket to each local client's reply_to.  At its descriptor limit the
    # socket could be made but not its connection (the I/O thread's connect failed on EMFILE
    # and retried): the reply queued on a connection that never came, and its client waited
    # out its timeout (one request in 40 here).  A reply now queues only on a connection made;
    # any other is relayed through the broker.
    import sys

    cluster.broker()
    limited = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
               "(64, 64)); os.execv(sys.argv[1], sys.argv[1:])"]
    cluster.worker("echo", prefix=limited)
    clients = []
    try:
        for i in range(40):  # each its own reply_to socket: a socket and a connection at the worker
            c = Client(cluster.frontend, timeout=20)
            clients.append(c)
            if i == 0:
                wait_service(c, "echo")
            x = c.alloc((4,), np.float32)
            x[:] = i
            try:
                with c.infer("echo", {"x": x}) as r:
                    assert r["x"][0] == i
            except InferenceError as e:  # typed, and said at once: never a silent wait
                assert not isinstance(e, DeadlineExceeded), (i, e)
    finally:
        for c in clients:
            c.close()


def test_a_worker_near_its_descriptor_limit_never_holds_a_clients_replies(cluster):
    # 40 clients, each with its own pool (a segment the worker maps: two descriptors, and a
    # pidfd) and its own reply_to, against a worker under a limit of 128.  The worker judged
    # "near the limit" from a count of its reply sockets alone, listed again once a
    # housekeeping interval: one client's socket was made to queue before its connection,
    # the connection failed on EMFILE, and that client (the 28th) got DeadlineExceeded in
    # every round, its 500 sent at once but held by the socket.  Every answer comes at once.
    import sys

    cluster.broker()
    limited = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
               "(128, 128)); os.execv(sys.argv[1], sys.argv[1:])"]
    cluster.worker("echo", prefix=limited)
    x = np.arange(1 << 16, dtype=np.uint8)
    clients = []
    try:
        for i in range(40):
            c = Client(cluster.frontend, timeout=3, pool_capacity=1 << 20)
            clients.append(c)
            if i == 0:
                wait_service(c, "echo")
        served = 0
        for rnd in range(2):
            for i, c in enumerate(clients):
                a = c.alloc(x.shape, x.dtype)  # by reference: the worker maps this client's pool
                a[:] = x
                try:
                    with c.infer("echo", {"x": a}) as r:
                        assert np.array_equal(r["x"], x)
                        served += 1
                except InferenceError as e:  # typed, and said at once: never a silent wait
                    assert not isinstance(e, DeadlineExceeded), (rnd, i, e)
        assert served >= 40, served  # most are served (the rest are told at once why not)
    finally:
        for c in clients:
            c.close()


def test_request_meta_is_bounded_and_the_broker_never_builds_it(cluster, gate):  # noqa: F811
    """A header's `meta` is the model's: the broker keeps it as bytes, and it is at most
    MAX_META_BYTES.  Before, a 1 MiB header whose meta held a million empty arrays decoded to
    70 MB of Python objects and a tenth of a second of the broker's loop, for every such
    request queued: 40 of them took a broker to 2.8 GB, and others' requests past their
    deadlines (the resource hunt)."""
    broker = cluster.broker()
    _gated_worker(cluster, gate)
    pid = broker.p.pid
    s = _dealer(cluster.frontend)
    try:
        with Client(cluster.frontend, timeout=10) as c:
            wait_service(c, "gate")
            # Over the bound: 400 from the broker, which the SDK refuses to send at all.
            over = P.encode_header(P.Request(id=1, meta={"m": [[]] * (P.MAX_META_BYTES + 1)}))
            s.send_multipart(P.client_request("gate", [over]))
            assert s.poll(10_000), "no answer to an oversized meta"
            rep = P.decode_reply(P.parse_broker_to_client(s.recv_multipart()).body[0])
            assert rep.error.code == int(P.ErrorCode.PROTOCOL_ERROR) and "limit" in rep.error.message, rep.error
            from client_sdk import InvalidInput

            with pytest.raises(InvalidInput, match="meta takes"):
                c.infer("gate", {"x": np.zeros(1)}, meta={"m": [[]] * (P.MAX_META_BYTES + 1)})
            rss0 = _status_kib(pid, "VmRSS")
            # Under it, 40 queued behind the gated worker: about 64 KiB of bytes each here,
            # where decoded they were 4 MB of objects each (170 MB in all).
            t = P.TensorRef(name="x", dtype="|u1", shape=[1], loc=P.InlineLoc(frame=0))
            meta = {"m": [[]] * (P.MAX_META_BYTES - 64)}
            for i in range(40):
                head = P.encode_header(P.Request(id=100 + i, tensors=[t], meta=meta))
                s.send_multipart(P.client_request("gate", [head, b"\x07"]))
            # The broker has read them all once it answers a query sent after them on the
            # same connection.
            s.send_multipart(P.client_request("mmi.service", [b"gate"]))
            deadline = time.monotonic() + 10
            while True:
                assert s.poll(max(0, int((deadline - time.monotonic()) * 1000))), "no MMI answer"
                m = P.parse_broker_to_client(s.recv_multipart())
                if m.service == b"mmi.service":
                    break
            rss1 = _status_kib(pid, "VmRSS")
            print(f"\nmeta: broker VmRSS {rss0} -> {rss1} KiB (+{rss1 - rss0}) for 40 queued requests")
            assert rss1 - rss0 < 32 * 1024, (rss0, rss1)
            # The model gets the meta whole (the first one runs once released).
            gate.release(41)
            with c.infer("gate", {"x": np.arange(3)}) as r:
                np.testing.assert_array_equal(r["x"], np.arange(3))
    finally:
        s.close(0)
    assert broker.p.poll() is None, broker.stderr()


def test_replies_a_client_does_not_read_are_bounded_in_bytes_not_only_in_count(cluster):
    """With the default `client_hwm` (4096 messages), a client that asks for big inline
    replies and never reads them made the broker hold them all: 100 of 16 MiB took it to 1.6
    GB, and a memory limit killed it (the resource hunt).  Replies waiting for one client are
    bounded in bytes too (its byte cap, `--max-client-mb`): past it the client is dropped as
    one that stopped reading, and its connection closed, which frees libzmq's queue."""
    broker = cluster.broker("--max-client-mb", "32")
    cluster.worker("echo")
    pid = broker.p.pid
    size = 4 * MiB
    with Client(cluster.frontend, timeout=10) as good:
        wait_service(good, "echo")
        _echo(good, np.arange(16, dtype=np.int64))
        rss0 = _status_kib(pid, "VmRSS")
        hog = _dealer(cluster.frontend, rcvhwm=1, rcvbuf=4096, sndhwm=1, sndbuf=65536, sndtimeo=2000)
        try:
            payload = bytes(size)
            sent = 0
            # Until the broker ends its connection (each send waits while the one before is
            # still queued here; at most 60: 240 MiB, against a cap of 32; then a send times
            # out: its socket, not reading, does not see the connection go).
            while sent < 60:
                try:
                    hog.send_multipart(_request("echo", sent + 1, payload, "|u1", [size], reply="inline"), copy=False)
                except zmq.Again:
                    break
                sent += 1
                if sent % 8 == 0:
                    _echo(good, np.full(64, sent, np.int32))
            assert sent < 60, "the broker kept the connection of a client that read nothing"
            broker.wait_log("MiB of replies unread", timeout=20)
            rss1 = _status_kib(pid, "VmRSS")
            hwm = _status_kib(pid, "VmHWM")
            print(f"\nunread replies: broker VmRSS {rss0} -> {rss1} KiB (+{rss1 - rss0}), peak VmHWM {hwm} KiB "
                  f"(+{hwm - rss0}) for {sent} requests of {size >> 20} MiB")
            # Its cap of unread replies (32 MiB) and of requests (32 MiB), the echo worker's
            # replies in flight, the kernel's buffers and allocator slack; unbounded, most of
            # what was sent (4 MiB a request) stayed.
            assert hwm - rss0 < 120 * 1024, (rss0, hwm)
            # What it held goes with the connection, and back to the kernel: libzmq's I/O
            # thread frees the dropped connection's queue after the log line, so on a loaded
            # machine the first look can still see it (+70 MiB once, beside other suites); wait
            # for it to go.  glibc kept it (+62 MiB of 64 in most runs, for good: CI) until the
            # broker trimmed its heap after a drop.
            until_s = time.monotonic() + 10
            while rss1 - rss0 >= 16 * 1024 and time.monotonic() < until_s:
                time.sleep(0.05)  # polling the broker's RSS (a condition, not a delay)
                rss1 = _status_kib(pid, "VmRSS")
            assert rss1 - rss0 < 16 * 1024, (rss0, rss1)
            _echo(good, np.arange(16, dtype=np.int64))  # the well-behaved client never noticed
        finally:
            hog.close(0)
    assert broker.p.poll() is None, broker.stderr()


@pytest.mark.parametrize("credit", ["1", "8"])
def test_a_client_that_marks_everything_urgent_does_not_starve_normal_ones(cluster, tmp_path, credit):
    """Any client may mark its requests urgent.  One (another process) that keeps 100 urgent
    requests queued made every normal request of another client wait past its 8 s deadline:
    the head of a deep backlog is about as old as the backlog takes to drain, and aging
    scored it so (the resource hunt).  Now a normal request waits about (3 - 1) x aging_s =
    1 s at most behind any flood of one principal's urgent requests (weights 3/1, 0.5 s).
    Credit 8: the worker holds 7 more urgent requests when the normal one comes, and its
    batcher aged it from its arrival there, again: 2 s in all (the fairness hunt), until the
    broker told the worker the class it had outscored (broker/state.py, "Dispatch")."""
    cluster.broker()
    cluster.worker("gate_model:sleepy", "--max-batch", "1", "--credit", credit,
                   env={"SLEEPY_LOG": str(tmp_path / "runs.log")})
    x = np.array([0.02])  # 20 ms a call
    t = P.TensorRef(name="x", dtype=x.dtype.str, shape=[1], loc=P.InlineLoc(frame=0))

    def urgent(rid: int) -> list:
        return P.client_request("sleepy", [P.encode_header(P.Request(id=rid, priority=0, tensors=[t])), x.tobytes()])

    greedy = _ChildDealer(cluster.frontend, tmp_path)
    try:
        with Client(cluster.frontend, timeout=10) as c:
            wait_service(c, "sleepy")
            rid = 0
            for _ in range(100):
                rid += 1
                greedy.send_multipart(urgent(rid))
            # Barrier: the broker handles one connection's messages in order, so once its MMI
            # answer is back the flood is queued (without it the first normal request could
            # come first and measure nothing).
            greedy.send_multipart(P.client_request("mmi.service", [b"sleepy"]))
            while True:
                assert greedy.poll(10_000), "no MMI answer"
                if b"mmi.service" in greedy.recv_multipart():
                    break
                rid += 1
                greedy.send_multipart(urgent(rid))
            took, at_worker = [], []
            for _ in range(3 if credit == "1" else 2):
                with c.infer_stream("sleepy", {"x": np.array([0.0])}, timeout=8) as replies:
                    t0 = time.monotonic()
                    while True:  # keep the backlog 100 deep while the normal request waits
                        while greedy.poll(0):
                            greedy.recv_multipart()
                            rid += 1
                            greedy.send_multipart(urgent(rid))
                        try:
                            res = replies.result(timeout=0.005)
                            break
                        except TimeoutError:
                            pass
                    took.append(time.monotonic() - t0)
                    at_worker.append(res.timing["batch_wait_ms"])
                    res.release()
            print(f"\nnormal requests behind an urgent flood: {[round(s, 2) for s in took]} s, "
                  f"{[round(ms) for ms in at_worker]} ms of it at the worker")
            # About 1 s of aging at the broker (before: past the 8 s deadline), then at most
            # the 7 urgent calls of 20 ms the worker already held (credit 8).  Before, the
            # worker's batcher aged it again from its arrival there: over 1 s at the worker
            # (weight 1 outscores 3 only after 2 x 0.5 s), counted apart from the broker's
            # wait so that a loaded machine's slower calls do not eat the margin.
            assert max(took) < 5.0, took
            assert max(at_worker) < 800.0, at_worker
    finally:
        greedy.close()


def test_another_clients_lone_request_does_not_wait_behind_a_flood_parked_at_the_worker(cluster, gate, tmp_path):
    """One client (another process) has 15 requests held by a worker of batch 4 and credit
    16: one runs (gated), 14 wait in its batcher.  Then another client sends one request
    (the worker's last credit: it is dispatched at once, and parks behind the flood).  The
    batcher takes turns between principals (gpu_worker/batching.py, "Turns"), so it goes in
    the next batch, not behind the whole flood.  Before, it ran last: the 15 of the flood
    ran first, in four batches."""
    cluster.broker()
    runs = RunLog(tmp_path / "runs.log")
    p = cluster.worker("gate_model:counted_batch", "--service", "cb", "--max-batch", "4", "--credit", "16",
                       "--no-warmup", env={**gate.env, "RUN_LOG": str(runs.path)}, wait=False)
    gate.open()  # returns at once: the model holds the FIFO open for reading and writing
    p.wait_ready()

    def tagged(rid: int, tag: int) -> list:
        return _request("cb", rid, np.array([tag], np.int64).tobytes(), "<i8", [1])

    flood = _ChildDealer(cluster.frontend, tmp_path)
    try:
        with Client(cluster.frontend, timeout=20) as c:
            wait_service(c, "cb")
            flood.send_multipart(tagged(1, 0))
            runs.until(1)  # the flood's first request runs alone, held at the gate
            for tag in range(1, 15):
                flood.send_multipart(tagged(tag + 1, tag))
            _barrier(flood, "cb")  # all 14 dispatched to the worker (credit 16)
            with c.infer_stream("cb", {"x": np.array([100], np.int64)}, timeout=20) as mine:
                assert c.mmi_service("cb", timeout=10)  # dispatched too: the last credit
                for n in (5, 9, 13, 16):  # one batch at a time
                    gate.release(1)
                    runs.until(n)
                gate.release(1)
                res = next(mine)
                assert res.final and res["x"].tolist() == [100]
                res.release()
            for _ in range(15):
                rep, _ = _recv_final(flood)
                assert rep.error is None, rep
    finally:
        flood.close(0)
    order = runs.order()
    print(f"\nrun order (100: the other client's): {order}")
    assert [t for t in order if t != 100] == list(range(15)), order  # the flood's own order stays
    # Normally in the batch right after the flood's first (index 1 to 4); a batch later if
    # the worker read it only after taking that one.  Behind the flood: index 15.
    assert order.index(100) <= 8, order


_FILLS_ITS_DESCRIPTORS = """
import os, resource, sys
import numpy as np
from client_sdk import Client
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
c = Client(sys.argv[1], timeout=20)  # few descriptors in use: its reply inbox is bound
assert c._inbox is not None
assert c.mmi_service("echo")  # connected (libzmq needs a descriptor for that), no request yet
held = []
try:
    while True:  # then the server's own connections and files take them all
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
r = c.infer("echo", {"x": np.arange(4.0)})
assert r["x"][3] == 3.0
print("OK", c.direct_replies, flush=True)
"""


def test_a_client_whose_process_runs_out_of_descriptors_after_it_was_made_lives(cluster):
    """A client made with descriptors to spare, in a process that then filled them (a server
    and its own connections): its first reply straight from a worker made libzmq accept a
    connection with none left, and abort the whole process (the application hunt).  Near
    the limit, its requests stop naming the inbox, and replies come through the broker."""
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    cluster.broker()
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
    p = subprocess.run([sys.executable, "-c", _FILLS_ITS_DESCRIPTORS, cluster.frontend], cwd=ROOT, timeout=60,
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.split() == ["OK", "0"], (p.returncode, p.stdout, p.stderr[-2000:])


_CANNOT_MAP_ITS_OUTPUTS = """
import os, resource, sys
import numpy as np
from client_sdk import Client, InferenceError
from shm.gc import list_segments
from shm.segment import HEADER_DTYPE, HEADER_SIZE, IN_FLIGHT, SLOT_DTYPE, SLOT_SIZE

def lent_to_me(worker):  # the worker's output slots this process holds
    n = 0
    for s in list_segments(count_slots=False):
        if s.owner_pid == worker:
            fd = os.open(f"/proc/{worker}/fd/{s.name.rpartition('-')[2]}", os.O_RDONLY)
            try:
                slots = int(np.frombuffer(os.pread(fd, HEADER_DTYPE.itemsize, 0), HEADER_DTYPE)[0]["slot_count"])
                tab = np.frombuffer(os.pread(fd, SLOT_SIZE * slots, HEADER_SIZE), SLOT_DTYPE)
            finally:
                os.close(fd)
            n += int(np.count_nonzero((tab["state"] == IN_FLIGHT) & (tab["holder_pid"] == os.getpid())))
    return n

endpoint, worker, then = sys.argv[1], int(sys.argv[2]), sys.argv[3]
c = Client(endpoint, timeout=20)
assert c.mmi_service("batched")  # connected (libzmq needs a descriptor for that)
x = np.full(1 << 16, 1, np.float32)  # 256 KiB in, 256 KiB out through the worker's ring
a = c.alloc(x.shape, x.dtype)
a[:] = x
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
held = []
try:
    while True:  # no descriptor left when the worker's first output arrives
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
unmapped = 0
for _ in range(3):
    try:
        c.infer("batched", {"x": a}).release()
        raise SystemExit("an output was mapped with no descriptor left")
    except InferenceError as e:
        unmapped += "cannot map it now" in str(e)
        print(type(e).__name__, e, file=sys.stderr)
assert unmapped, "no output went unmapped"
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
if then == "call":  # the next output mapped gives back those that could not be
    with c.infer("batched", {"x": a}) as r:
        assert r["y"][0] == 2.0
    print("LENT", lent_to_me(worker), flush=True)
    c.close()
else:  # close() does
    c.close()
    print("LENT", lent_to_me(worker), flush=True)
"""


def test_output_slots_a_client_could_not_map_go_back_to_the_worker_once_it_can(cluster):
    """A client out of descriptors when a worker's first output arrived got "cannot map it
    now", and those output slots stayed lent to it for its life, even after close(): the
    worker, seeing its holder alive, never took them back, and once its ring was full every
    client of it got its outputs inline (the resource hunt: 3 of 3).  Once the client has
    descriptors again its next output, or its close(), gives them back."""
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    cluster.broker()
    worker = cluster.worker("faulty_model:batched", "--service", "batched")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "batched")
    for then in ("call", "close"):
        p = subprocess.run([sys.executable, "-c", _CANNOT_MAP_ITS_OUTPUTS, cluster.frontend, str(worker.p.pid), then],
                           cwd=ROOT, timeout=60, capture_output=True, text=True)
        assert p.returncode == 0 and p.stdout.split() == ["LENT", "0"], (then, p.returncode, p.stdout,
                                                                           p.stderr[-2000:])


def test_a_client_that_reads_big_replies_as_fast_as_they_come_is_not_taken_for_a_stalled_one(cluster):
    """The byte bound on unread replies counts what libzmq still holds for the client, so a
    client that pulls one 4 MiB reply after another, always 4 in flight, is never dropped,
    however many it reads past its byte cap (32 MiB here; found by review: a count of bytes
    sent since its kernel queue was last seen empty dropped it after 32 MiB)."""
    broker = cluster.broker("--max-client-mb", "32")
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
    s = _dealer(cluster.frontend)
    size = 4 * MiB
    payload = bytes(size)
    try:
        rid = 0
        for _ in range(4):
            rid += 1
            s.send_multipart(_request("echo", rid, payload, "|u1", [size], reply="inline"), copy=False)
        got = 0
        while got < 40:  # 160 MiB read: five times the cap
            assert s.poll(10_000), f"no reply after {got}"
            m = P.parse_broker_to_client(s.recv_multipart())
            if m.command != P.C_FINAL:
                continue
            rep = P.decode_reply(m.body[0])
            assert rep.error is None, rep.error
            got += 1
            # The client's own work on each reply (a span, not a synchronisation): slower than
            # the echo worker, so its connection is never seen with nothing queued.
            time.sleep(0.03)
            rid += 1
            s.send_multipart(_request("echo", rid, payload, "|u1", [size], reply="inline"), copy=False)
    finally:
        s.close(0)
    assert broker.terminate() == 0
    assert STALLED not in broker.stderr(None)


def test_a_reply_larger_than_the_byte_cap_reaches_a_client_that_reads(cluster):
    """What counts against a client's cap is what it was sent before and has not taken since:
    one inline reply larger than the cap (8 MiB here, 16 MiB replies to 8-byte requests) was
    taken for a stalled client the moment it was sent, every time (found by review: the call
    failed after its resends)."""
    broker = cluster.broker("--max-client-mb", "8")
    cluster.worker("grow_model:factory", "--service", "grow")
    n = 16 * MiB
    with Client(cluster.frontend, timeout=10, transport="inline", direct_reply=False) as c:
        wait_service(c, "grow")
        for _ in range(3):
            with c.infer("grow", {"x": np.array([n], np.int64)}) as r:
                assert r["y"].nbytes == n
    assert broker.terminate() == 0
    assert STALLED not in broker.stderr(None)


def test_the_broker_gives_back_the_memory_of_connections_that_left(cluster):
    """libzmq keeps ~40 KB of buffers a connection in the C heap, and glibc kept them after
    the connection closed: each round of 3,000 connections that came and left cost the
    broker 50-90 MB more for good (a scale hunt; Python's own heap stayed flat).  After many
    closes its housekeeping gives the C heap's free memory back (`heap.trim_heap`)."""
    import resource

    n = 1500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * n + 256:
        pytest.skip(f"needs {2 * n + 256} descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2 * n + 256), hard))
    broker = cluster.broker()
    pid = broker.p.pid
    base = _status_kib(pid, "VmRSS")
    ctx = zmq.Context()
    ctx.max_sockets = n + 64
    socks = []
    try:
        for _ in range(n):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(cluster.frontend)
            s.send_multipart([P.MDPC, b"\x01", b"mmi.service", b"echo"])
            socks.append(s)
        for s in socks:  # every connection made and served
            assert s.poll(10_000), "no MMI answer"
            s.recv_multipart()
        up = _status_kib(pid, "VmRSS")
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    grew = up - base
    assert grew > 20_000, f"{n} connections grew the broker by {grew} KiB only: nothing to see"
    deadline = time.monotonic() + 15
    while (now := _status_kib(pid, "VmRSS")) > base + grew // 2:
        assert time.monotonic() < deadline, (
            f"the broker holds {now - base} KiB over its start 15 s after {n} connections left ({grew} KiB with them)")
        time.sleep(0.1)  # polling /proc (a condition, not a delay)


def test_a_worker_gives_back_the_memory_of_direct_connections_that_left(cluster):
    """As the broker (above), a worker that takes leases holds libzmq's buffers of each
    connection to its direct socket in the C heap: a leaseholder that opened 1,500
    connections at once (HELLO and a request on each) and closed them left the worker 30-45
    MB larger for good, 80 MB after three such rounds (the churn hunt).  Its housekeeping
    gives the C heap's free memory back once many of its connections closed: counted as they
    end (its direct socket's monitor), not only as a fall in its open descriptors between
    two looks, which a crowd that came and left between two looks never shows.  Here the
    crowd mostly comes and goes before the worker's first look, a second after it starts;
    counted by the fall alone, it stayed (44 MB for good), as any crowd that stayed less
    than a housekeeping interval did."""
    import resource

    n = 1500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * n + 256:
        pytest.skip(f"needs {2 * n + 256} descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2 * n + 256), hard))
    cluster.broker()
    # Its own interval (the broker's 0.2 s comes with its WELCOME) times its first look.
    worker = cluster.worker("echo", "--direct", "--no-link", "--heartbeat-interval", "1")
    pid = worker.p.pid
    holder = _dealer(cluster.frontend)
    ctx = zmq.Context()
    ctx.max_sockets = n + 64
    socks = []
    try:
        holder.send_multipart(P.client_heartbeat())
        holder.send_multipart(P.client_lease("echo", P.encode_header(P.LeaseAsk(id=1, slots=2))))
        info = None
        while info is None:
            assert holder.poll(10_000), "no LEASED"
            frames = holder.recv_multipart()
            if frames[1] == P.C_LEASED:
                info = P.decode_lease_info(frames[3])
        base = _status_kib(pid, "VmRSS")
        hello = [P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=info.lease, secret=info.secret))]
        for i in range(n):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(info.endpoint)
            s.send_multipart(hello)
            s.send_multipart(_request("echo", i + 1, b"\0" * 16, "|u1", [16]))
            socks.append(s)
        for s in socks:  # every connection made and answered (a 429 for those past the slots)
            assert s.poll(10_000), "no answer on the direct socket"
            s.recv_multipart()
        up = _status_kib(pid, "VmRSS")
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    grew = up - base
    assert grew > 20_000, f"{n} connections grew the worker by {grew} KiB only: nothing to see"
    deadline = time.monotonic() + 15
    try:
        while (now := _status_kib(pid, "VmRSS")) > base + grew // 2:
            assert time.monotonic() < deadline, (
                f"the worker holds {now - base} KiB over its start 15 s after {n} direct connections left "
                f"({grew} KiB with them)")
            holder.send_multipart(P.client_heartbeat())  # (the lease is kept meanwhile)
            time.sleep(0.1)  # polling /proc (a condition, not a delay)
    finally:
        holder.close(0)


def test_a_connection_that_does_not_read_its_refusals_on_a_direct_socket_is_ended(cluster):
    """A REQUEST on a worker's direct socket that may not run (no HELLO, the lease's slots
    all in flight, its lease ended) is answered at once (400, 429, 503), and libzmq queues up
    to 10,000 answers for a connection (`DirectSocket.sndhwm`).  A peer that sent requests
    without reading held that much of the worker's memory per connection, with no bound on
    its connections: five such connections of 12,000 requests grew the worker by 70 MB (the
    churn hunt).  A refusal that finds its connection's queue full, nothing in flight on it,
    now ends that connection (its client stopped reading: 10,000 answers wait for it), as
    the broker drops a client that stopped reading, and libzmq frees what waited for it;
    the worker serves on."""
    from zmq.utils.monitor import recv_monitor_message

    cluster.broker()
    worker = cluster.worker("echo", "--direct", "--no-link")
    holder = _dealer(cluster.frontend)
    ctx = zmq.Context()
    socks = []
    mon = None
    try:
        holder.send_multipart(P.client_heartbeat())
        holder.send_multipart(P.client_lease("echo", P.encode_header(P.LeaseAsk(id=1, slots=2))))
        info = None
        while info is None:
            assert holder.poll(10_000), "no LEASED"
            frames = holder.recv_multipart()
            if frames[1] == P.C_LEASED:
                info = P.decode_lease_info(frames[3])
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.rcvhwm = 1  # what waits is the worker's
        s.sndhwm = 0
        socks.append(s)
        mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        s.connect(info.endpoint)
        request = _request("echo", 1, b"\0" * 16, "|u1", [16])
        for _ in range(15_000):  # no HELLO: each is answered 400, and none is read
            s.send_multipart(request)
        worker.wait_log("ended a connection to the direct socket that does not read its replies")
        # Now it reads: what reached it before the end, then the end (a DEALER that reads
        # nothing never looks at its connection: it sees the end only now).
        deadline, read = time.monotonic() + 10, 0
        while not mon.poll(0):
            assert time.monotonic() < deadline, f"the connection did not end; {read} answers read"
            while s.poll(50):
                s.recv_multipart()
                read += 1
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
        assert read < 10_000, f"{read} answers came: what waited for the connection was not dropped"
        # The worker serves on: a leaseholder's request, on a connection of its own.
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        socks.append(s)
        s.connect(info.endpoint)
        s.send_multipart([P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=info.lease, secret=info.secret))])
        s.send_multipart(_request("echo", 2, b"\1" * 16, "|u1", [16]))
        assert s.poll(10_000), "no answer on the direct socket"
        head = P.decode_reply(P.parse_broker_to_client(s.recv_multipart()).body[0])
        assert head.id == 2 and head.error is None, head
    finally:
        if mon is not None:
            mon.close(0)
        for s in socks:
            s.close(0)
        ctx.term()
        holder.close(0)


def test_a_worker_reads_a_bounded_backlog_from_one_direct_connection(cluster, gate, tmp_path):  # noqa: F811
    """While the worker's loop runs a long batch, libzmq reads ahead what a connection to its
    direct socket sends, up to the socket's receive high-water mark, into the worker's
    memory.  It was 100,000 messages per connection (the broker link's): a peer sending
    faster than the worker refuses it held that many of its requests in the worker, per
    connection (20 connections: 390 MB at peak; the churn hunt).  A leaseholder never has
    more than its lease's slots in flight, so the socket now reads at most
    `DirectSocket.rcvhwm` (4,096) ahead of the worker: past it, the peer's sends wait."""
    from gpu_worker.leases import DirectSocket

    cluster.broker()
    cluster.worker("gate_model:held", "--direct", "--no-link",
                   env={**gate.env, "SLEEPY_LOG": str(tmp_path / "runs.log")})
    gate.open()
    holder = _dealer(cluster.frontend)
    flood = None
    try:
        holder.send_multipart(P.client_heartbeat())
        holder.send_multipart(P.client_lease("held", P.encode_header(P.LeaseAsk(id=1, slots=1))))
        info = None
        while info is None:
            assert holder.poll(10_000), "no LEASED"
            frames = holder.recv_multipart()
            if frames[1] == P.C_LEASED:
                info = P.decode_lease_info(frames[3])
        x = np.array([-1.0])  # held until the gate opens: the worker's loop is busy meanwhile
        holder.send_multipart(_request("held", 7, x.tobytes(), x.dtype.str, [1]))
        deadline = time.monotonic() + 10
        while not (tmp_path / "runs.log").exists():
            assert time.monotonic() < deadline, "the held call never started"
            time.sleep(0.005)  # polling a file (a condition, not a delay)
        flood = zmq.Context.instance().socket(zmq.DEALER)
        flood.linger = 0
        flood.sndhwm = 1000
        flood.connect(info.endpoint)
        request = _request("held", 1, b"\0" * 1024, "|u1", [1024])  # no HELLO: never runs
        sent, most = 0, 10 * DirectSocket.rcvhwm
        while sent < most:
            try:
                flood.send_multipart(request, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                if not flood.poll(300, zmq.POLLOUT):  # the worker's side stopped reading it
                    break
        assert sent < 3 * DirectSocket.rcvhwm, (
            f"the worker took {sent} messages from one connection while its loop was busy")
    finally:
        gate.release()
        if flood is not None:
            flood.close(0)
        holder.close(0)


def test_a_client_within_a_raised_request_cap_is_not_taken_for_one_that_stopped_reading(cluster):
    """`--client-hwm` defaults to the request cap, so that a client that pipelines within it
    is never taken for one that stopped reading.  Raising `--max-client-requests` alone left
    the queue at 4096: an AsyncClient with 30,000 requests in flight whose deadlines passed
    together (the broker answered each while the client's loop was busy raising them) was
    dropped, and its other requests with it, which it then sent again (the second scale
    hunt).  Here a client sends 6,000 requests, within its raised cap, and reads nothing
    until the broker has answered them all: it then reads all 6,000 replies."""
    from tests.e2e.test_metrics import scrape, value

    n = 6000
    broker = cluster.broker("--max-client-requests", str(n + 100), "--max-queue", str(n + 100),
                            "--http", "127.0.0.1:0")
    cluster.worker("echo")
    base = "http://" + broker.field("http")
    with Client(cluster.frontend, timeout=10) as good:
        wait_service(good, "echo")
    # Small kernel buffers and a receive queue of one: what waits is in the broker's queue.
    s = _dealer(cluster.frontend, rcvhwm=1, rcvbuf=4096, sndhwm=n + 100)
    try:
        payload = bytes(1024)
        for rid in range(1, n + 1):
            s.send_multipart(_request("echo", rid, payload, "|u1", [1024]))
        deadline = time.monotonic() + 30
        while value(scrape(base), "zmq_infer_requests_total", service="echo", outcome="ok") < n:
            assert STALLED not in broker.pull(), "the client was taken for one that stopped reading"
            assert time.monotonic() < deadline, "the broker did not answer the requests within 30 s"
            time.sleep(0.05)  # polling an HTTP endpoint (a condition, not a delay)
        got = set()
        while len(got) < n:
            assert s.poll(10_000), f"{len(got)} of {n} replies read, then nothing"
            msg = P.parse_broker_to_client(s.recv_multipart())
            rep = P.decode_reply(msg.body[0], n_inline=len(msg.body) - 1)
            assert rep.error is None, rep.error
            got.add(rep.id)
        assert got == set(range(1, n + 1))
    finally:
        s.close(0)
    assert STALLED not in broker.pull()
    assert broker.p.poll() is None




_HOGS = """
import sys
import zmq
from broker import protocol as P
from tests.e2e.test_bounded_resources import _request
endpoint, conns, each, size = sys.argv[1], *map(int, sys.argv[2:5])
ctx = zmq.Context.instance()
hogs = []
for _ in range(conns):
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.rcvhwm, s.rcvbuf, s.sndhwm, s.sndbuf, s.sndtimeo = 1, 4096, 1, 65536, 2000
    s.connect(endpoint)
    hogs.append(s)
payload = bytes(size)
for r in range(each):
    for i, s in enumerate(hogs):
        try:  # (one whose connection the broker ended times out: not reading, it cannot tell)
            s.send_multipart(_request("echo", r * conns + i + 1, payload, "|u1", [size], reply="inline"), copy=False)
        except zmq.Again:
            pass
print("SENT", flush=True)
sys.stdin.read()  # until the test closes its end: reading nothing meanwhile
"""


def test_replies_unread_on_many_connections_of_one_client_are_bounded_by_its_one_cap(cluster):
    """The byte cap on unread replies was counted per connection: a client process that
    opened eight connections and read none held eight caps' worth of replies in the broker
    (the security audit: 384 MiB for a cap of 64).  It is the principal's, as its request
    caps are: past it, its connection holding the most unread is dropped as one that stopped
    reading; another client is served throughout."""
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    broker = cluster.broker("--max-client-mb", "16")
    cluster.worker("echo")
    pid = broker.p.pid
    size, conns, each = 4 * MiB, 8, 5
    with Client(cluster.frontend, timeout=10) as good:
        wait_service(good, "echo")
        _echo(good, np.arange(16, dtype=np.int64))
        rss0 = _status_kib(pid, "VmRSS")
        hogs = subprocess.Popen([sys.executable, "-c", _HOGS, cluster.frontend, str(conns), str(each), str(size)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, text=True)
        try:
            broker.wait_log("on all the connections of its principal", timeout=30)
            _echo(good, np.arange(16, dtype=np.int64))  # served throughout
            hwm = _status_kib(pid, "VmHWM")
            print(f"\nunread replies on {conns} connections: broker peak VmHWM +{hwm - rss0} KiB for "
                  f"{conns * each} requests of {size >> 20} MiB")
            # Its cap (16 MiB) of unread replies, the requests in flight, the kernel's buffers
            # and allocator slack; per connection, up to 8 x 5 x 4 MiB = 160 MiB stayed.
            assert hwm - rss0 < 90 * 1024, (rss0, hwm)
        finally:
            hogs.stdin.close()
            try:
                hogs.wait(20)
            finally:
                if hogs.poll() is None:
                    hogs.kill()
                    hogs.wait(10)
                hogs.stdout.close()
    assert broker.p.poll() is None, broker.stderr()


def test_connections_of_one_client_that_read_big_replies_are_not_taken_for_stalled_ones(cluster):
    """The other side of the principal's cap on unread replies (found by review): four
    connections of one process, each with two 6 MiB replies in flight (48 MiB at once, over
    a cap of 16), all reading as the replies come.  None is dropped: a connection is taken
    for one that stopped reading only when libzmq let none of its frames go for the client
    liveness window."""
    broker = cluster.broker("--max-client-mb", "16")
    cluster.worker("grow_model:factory", "--service", "grow", "--no-warmup")
    size, conns, each = 6 * MiB, 4, 12
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "grow")
    socks = [_dealer(cluster.frontend) for _ in range(conns)]
    try:
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        sent = {s: 0 for s in socks}
        got = {s: 0 for s in socks}

        def send(s):
            sent[s] += 1
            s.send_multipart(_request("grow", sent[s], np.array([size], np.int64).tobytes(), "<i8", [1],
                                      reply="inline"))

        for s in socks:
            send(s)
            send(s)
        deadline = time.monotonic() + 60
        while any(n < each for n in got.values()):
            assert time.monotonic() < deadline, got
            for s, _ in poller.poll(1000):
                rep, body = _recv_final(s)
                assert rep.error is None, rep.error
                assert len(body[0]) == size
                got[s] += 1
                if sent[s] < each:
                    send(s)
    finally:
        for s in socks:
            s.close(0)
    assert "stopped reading" not in broker.stderr(tail=None), broker.stderr()
    assert broker.p.poll() is None


_HOLDER = """
import sys
import numpy as np
from client_sdk import Client
with Client(sys.argv[1], timeout=30, transport="inline") as c:
    h = c.infer_stream("later", {"x": np.zeros(700_000, np.uint8)})  # queued: no worker yet
    c.mmi_service("later", timeout=10)  # a barrier: the request above is queued at the broker
    print("SENT", flush=True)
    sys.stdin.readline()
    h.cancel()
"""


def test_processes_each_within_their_cap_are_held_to_the_brokers(cluster):
    # The resource audit: three processes, each under --max-client-mb, held 900 MB of inline
    # requests in a broker whose cgroup allowed 500: the kernel killed it.  All clients'
    # outstanding bytes together are capped now (--max-total-mb; by default half the memory
    # the broker may use): over it, QUEUE_FULL, and the broker lives.
    import subprocess
    import sys

    from client_sdk import QueueFull

    broker = cluster.broker("--max-total-mb", "1", "--service-grace", "30")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, cluster.frontend], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert readline_within(holder.stdout, 30, "the holder's SENT") == "SENT\n"
        with Client(cluster.frontend, timeout=10, transport="inline") as c:
            with pytest.raises(QueueFull, match="max_total_bytes=1048576"):
                c.infer("later", {"x": np.zeros(700_000, np.uint8)})
            with pytest.raises(DeadlineExceeded):  # a small one still goes in (and waits for a worker)
                c.infer("later", {"x": np.zeros(8, np.uint8)}, timeout=0.3)
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(20)
        holder.stdout.close()
    assert broker.p.poll() is None


def test_a_reply_over_the_brokers_reply_frame_limit_is_an_error_and_no_worker_is_cut_off():
    """A tcp backend reads reply frames of at most --max-reply-mb.  A model output over it
    ended the worker's connection: the broker took the worker for dead and ran the request
    again on the next worker, which lost its connection the same way, every request in
    flight on them sent again elsewhere (the ninth session's left-alone list).  The broker
    says its limit in WELCOME, and the worker answers such a request with an error."""
    from client_sdk import InternalError

    b = Proc(["-m", "broker", "--frontend", "tcp://127.0.0.1:0", "--backend", "tcp://127.0.0.1:0", "--insecure",
              "--max-reply-mb", "1"])
    workers = []
    try:
        b.wait_ready()
        for _ in range(2):
            w = Proc(["-m", "gpu_worker", "--broker", b.field("backend"), "--model", "echo", "--insecure"])
            workers.append(w)
            w.wait_ready()
        with Client(b.field("frontend"), insecure=True, timeout=10) as c:
            wait_service(c, "echo")
            for _ in range(2):
                with pytest.raises(InternalError) as e:
                    c.infer("echo", {"x": np.zeros(2 << 20, np.uint8)}).close()
                words = str(e.value)
                assert "--max-reply-mb" in words and "retrying may help" not in words, words
            x = np.arange(1 << 17, dtype=np.int64)  # 1 MiB: at the limit, not over it
            with c.infer("echo", {"x": x}) as r:
                np.testing.assert_array_equal(r["x"], x)
        # No worker was lost (WorkerFailed before: "the workers running this request died 3
        # times"): the broker said nothing but its --insecure warning.
        assert all(w.p.poll() is None for w in workers)
        said = [line for line in b.pull().splitlines() if line and "INSECURE" not in line]
        assert not said, said
    finally:
        for p in (*workers, b):
            p.close()


_STOPPED_READER = """
import sys
import numpy as np
import zmq
sys.path.insert(0, sys.argv[2])
from tests.e2e.test_bounded_resources import _dealer, _request
d = _dealer(sys.argv[1], rcvhwm=1, rcvbuf=4096)
size = 4 << 20
for rid in range(1, 5):  # 16 MiB of inline replies it never reads
    d.send_multipart(_request("echo", rid, bytes(size), "|u1", [size], reply="inline"), copy=False)
print("SENT", flush=True)
sys.stdin.readline()
d.close(0)
"""


def test_replies_unread_by_several_clients_are_bounded_together(cluster):
    """Each client's unread replies are bounded by its own byte cap; four stopped readers of
    300 MiB replies, each within it, took a 1 GiB broker's cgroup, and the OOM killer took
    the broker (the memory audit).  All clients' unread replies together are bounded too
    (--max-unread-mb; by default a quarter of the memory the broker may use): over it, the
    stopped readers holding the most are dropped until it is under."""
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    broker = cluster.broker("--max-client-mb", "32", "--max-unread-mb", "20")
    cluster.worker("echo")
    readers = []
    try:
        with Client(cluster.frontend, timeout=10) as good:
            wait_service(good, "echo")
            for _ in range(3):  # three processes, 16 MiB each (12 once the first 4 MiB went to the kernel)
                p = subprocess.Popen([sys.executable, "-c", _STOPPED_READER, cluster.frontend, str(ROOT)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
                readers.append(p)
                assert readline_within(p.stdout, 30, "the reader's SENT") == "SENT\n"
            # Two are dropped (36-48 -> 24-32 -> 12-16 MiB), once they read nothing for a second
            # (two lines in the same second: the second is said with the next second's).
            said = "MiB for all clients together"
            until = time.monotonic() + 20
            while broker.pull().count(said) < 2:
                broker.wait_log(said, timeout=max(0.1, until - time.monotonic()), after=broker.logged)
            assert broker.pull().count(said) == 2, broker.pull()
            _echo(good, np.arange(16, dtype=np.int64))  # the well-behaved client never noticed
    finally:
        for p in readers:
            p.stdin.write("\n")
            p.stdin.close()
            p.wait(20)
            p.stdout.close()
    assert broker.p.poll() is None


def test_a_burst_of_inline_tensors_leaves_no_memory_behind(cluster):
    """glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB),
    so that the next frames of that size come from its heap, which keeps them once freed: a
    burst of 24 inline requests of 16 MiB left the broker 193 MiB larger and its echo
    worker 48 MiB, for good (the memory audit).  Both give the heap's free memory back once
    a burst is over (`heap.BurstSeen`: 5 s without big frames; not between the two bursts
    here)."""
    broker = cluster.broker()
    worker = cluster.worker("echo")
    size = 16 * MiB
    with Client(cluster.frontend, timeout=30, transport="inline") as c:
        wait_service(c, "echo")
        _echo(c, np.arange(16, dtype=np.int64))
        base = {p.p.pid: _status_kib(p.p.pid, "VmRSS") for p in (broker, worker)}
        for _ in range(2):
            handles = [c.infer_stream("echo", {"x": np.full(size, i, np.uint8)}, reply="inline") for i in range(12)]
            for i, h in enumerate(handles):
                with h.result() as r:
                    assert r["x"].nbytes == size and int(r["x"][-1]) == i
        until = time.monotonic() + 25  # (a burst is over after TRIM_QUIET_S, 5 s, without big frames)
        while True:  # polling their RSS (a condition, not a delay)
            grown = {pid: _status_kib(pid, "VmRSS") - kib for pid, kib in base.items()}
            if all(g < 24 * 1024 for g in grown.values()) or time.monotonic() > until:
                break
            time.sleep(0.05)
        assert all(g < 24 * 1024 for g in grown.values()), grown  # KiB over each one's before
    assert broker.p.poll() is None and worker.p.poll() is None
