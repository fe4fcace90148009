"""The worker's side of direct reply (docs/protocol.md section 8), in process: which replies
go straight to the client, the fallback to the broker, and when DONE is sent.  The decisions
alone are tested in test_direct.py; here the worker acts on them with real sockets."""
from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest
import zmq

from broker import protocol as P
from broker.protocol.wire import send_frames
from gpu_worker.job import Job
from gpu_worker.upstream import BrokerLink
from gpu_worker.worker import Worker, WorkerConfig

pytestmark = pytest.mark.timeout(30)


_NAMES = itertools.count()  # inproc names (not id(tmp_path): a closed one's may be held yet)


class _Recorder(BrokerLink):
    """Stands in for the broker: the worker's upstream sends on one end of an inproc pair,
    and `sent` is what has arrived at the other end."""

    def __init__(self, ctx: zmq.Context, name: str):
        super().__init__("inproc://unused", ctx)
        self.rx = ctx.socket(zmq.PAIR)
        self.rx.linger = 0
        self.rx.bind(f"inproc://{name}")
        self.tx = ctx.socket(zmq.PAIR)
        self.tx.linger = 0
        self.tx.connect(f"inproc://{name}")
        self._got: list = []

    @property
    def sent(self) -> list:
        while self.rx.poll(50):  # inproc delivers at once; the wait is only an upper bound
            self._got.append(self.rx.recv_multipart())
        return self._got

    def send(self, frames) -> None:
        send_frames(self.tx, frames)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


@pytest.fixture
def worker(tmp_path):
    rec = _Recorder(zmq.Context.instance(), f"recorder-{next(_NAMES)}")
    w = Worker(WorkerConfig(broker=f"ipc://{tmp_path}/none.ipc", model="echo", warmup=False, credit=16,
                            done_delay=0.005), upstream=rec)
    w.recorder = rec
    w._direct_ok = True  # as after our broker's WELCOME (a plain broker's worker replies through it)
    try:
        yield w
    finally:
        w.close()  # closes its upstream, the recorder


@pytest.fixture
def inbox(tmp_path):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PULL)
    s.linger = 0
    path = f"{tmp_path}/c-{os.getpid()}-1-abc123.ipc"  # a reply socket of this process
    s.bind("ipc://" + path)
    try:
        yield s, "ipc://" + path
    finally:
        s.close()


def _job(token: int, reply_to: str | None, host: str | None = None, deadline: float | None = None) -> Job:
    req = P.Request(id=token, host=host or P.local_host_id(), reply_to=reply_to, pid=os.getpid())
    return Job(P.token_envelope(token), req, {}, None, time.monotonic(), deadline, {})


def test_final_goes_to_reply_to_and_is_remembered_for_done(worker, inbox):
    sock, ep = inbox
    worker.dones.info = True  # as a counting broker's WELCOME sets it
    worker._reply_error(_job(1, ep), 500, "x")
    assert sock.poll(5000)
    msg = P.parse_broker_to_client(sock.recv_multipart())
    assert msg.command == P.C_FINAL and msg.service == b"echo"
    assert worker.recorder.sent == [] and worker.dones.envelopes == [P.token_envelope(1)]
    worker._flush_done()
    [done] = worker.recorder.sent
    msg = P.parse_worker(done)
    assert msg.command == P.W_DONE and msg.body == (P.token_envelope(1),)
    info = P.decode_done_info(msg.info, 1)
    assert info.codes == [500] and info.ages_ms[0] >= 0  # its outcome, for the broker's counts


@pytest.mark.parametrize("case", ["partial", "other_host", "unreachable", "no_reply_to", "disabled"])
def test_everything_else_goes_through_the_broker(worker, inbox, tmp_path, case):
    sock, ep = inbox
    final = case != "partial"
    job = {
        "partial": _job(1, ep),
        "other_host": _job(1, ep, host="elsewhere/0"),
        "unreachable": _job(1, f"ipc://{tmp_path}/c-{os.getpid()}-1-000000.ipc"),
        "no_reply_to": _job(1, None),
        "disabled": _job(1, ep),
    }[case]
    if case == "disabled":  # --no-direct-reply (taken at the WELCOME)
        worker._direct_ok = False
    worker._reply(job, final, [b"body"])
    assert worker.recorder.sent == [P.worker_reply(P.token_envelope(1), final, [b"body"])]
    assert worker.dones.envelopes == [] and not sock.poll(0)


def test_done_waits_for_company_but_never_past_a_deadline(worker, inbox):
    _, ep = inbox
    t0 = time.monotonic()
    worker._reply(_job(1, ep), True, [b""])
    assert t0 + 0.004 <= worker.dones.due <= time.monotonic() + 0.005
    # A request due in 2 ms pulls the DONE forward: the broker must hear of it first.
    worker._reply(_job(2, ep, deadline=time.monotonic() + 0.002), True, [b""])
    assert worker.dones.due <= time.monotonic() + 0.001
    assert worker.dones.max_pending == 4  # credit 16 // 4


def test_a_batch_answers_each_client_with_one_message(worker, inbox):
    sock, ep = inbox
    jobs = [_job(t, ep) for t in (1, 2, 3)]
    worker._complete(jobs, time.monotonic(), [{}, {}, {}], None, 0.001)
    assert sock.poll(5000)
    frames = sock.recv_multipart()
    msg = P.parse_broker_to_client(frames)
    assert msg.command == P.C_FINALS and msg.service == b"echo"
    assert [P.decode_reply(h).id for h in msg.body] == [1, 2, 3]
    assert not sock.poll(100)  # nothing else: one message for the batch
    assert worker.dones.envelopes == [P.token_envelope(t) for t in (1, 2, 3)] and worker.direct_sent == 3
    assert worker.batch_finals is None


def test_a_lone_request_is_not_held_for_company(worker, inbox):
    sock, ep = inbox
    worker._complete([_job(9, ep)], time.monotonic(), [{}], None, 0.001)
    assert sock.poll(5000)
    assert P.parse_broker_to_client(sock.recv_multipart()).command == P.C_FINAL


def test_a_batch_running_across_a_reconnect_still_answers_its_client_directly(worker, inbox):
    """Between a reconnect and the next WELCOME, a running batch's FINAL still goes straight
    to its same-host client (relayed, a stale job's reply is dropped): direct replies hang
    on a WELCOME ever received, not on the current connection's (found by a review)."""
    sock, ep = inbox
    job = _job(7, ep)
    worker.running = {job.envelope: job}
    worker.registered, worker._direct_ok = False, False  # what _reconnect does, in order
    worker._fail_pending("broker connection lost")
    assert job.stale
    worker._reply_tensors(job, {"y": np.ones(3, np.float32)}, {}, final=True)
    assert sock.poll(5000) and worker.stale_replies == 0
    assert worker.dones.envelopes == []  # its token died with the old connection: no DONE
    # A request of the new connection, before its WELCOME: through the broker (which may be a
    # plain one now, knowing no DONE), not straight to its client.
    sock.recv_multipart()
    worker.recorder.sent.clear()
    fresh = _job(8, ep)
    worker._reply(fresh, True, [b"body"])
    assert worker.recorder.sent == [P.worker_reply(P.token_envelope(8), True, [b"body"])]
    assert not sock.poll(0) and worker.dones.envelopes == []
