"""The worker's side of RECALL (docs/protocol.md section 3), in process: what it gives back,
what it keeps, and the heartbeat thread's reads while a batch computes on the loop's thread
(`Worker._read_while_computing`, then `_after_compute` on the loop), driven step by step
with real sockets (an inproc pair stands in for the broker)."""
from __future__ import annotations

import numpy as np
import pytest

from broker import protocol as P
from gpu_worker.worker import Worker, WorkerConfig
from tests.gpu_worker.pair_link import PairLink

pytestmark = pytest.mark.timeout(30)


class _Pair(PairLink):
    """PairLink with the RECALL test's messages."""

    def request(self, token: int) -> None:
        x = np.arange(4, dtype=np.float32)
        head = P.encode_header(P.Request(id=token, reply="inline",
                                         tensors=[P.TensorRef("x", "<f4", [4], P.InlineLoc(frame=0))]))
        self.to_worker([P.MDPW, P.W_REQUEST, P.token_envelope(token), b"", head, x.tobytes()])

    def recall(self, *tokens: int) -> None:
        self.to_worker([P.MDPW, P.W_RECALL, *map(P.token_envelope, tokens)])

    def cancel(self, token: int) -> None:
        self.to_worker([P.MDPW, P.W_CANCEL, P.token_envelope(token)])

    def returned(self) -> tuple[list[int], list[int]]:
        assert self.peer.poll(5000), "no RETURNED"
        msg = P.parse_worker(self.peer.recv_multipart())
        assert msg.command == P.W_RETURNED
        return [P.envelope_token(e) for e in msg.body], [P.envelope_token(e) for e in msg.info]


@pytest.fixture
def worker(tmp_path):
    up = _Pair(f"recall-{id(tmp_path)}")
    w = Worker(WorkerConfig(broker="inproc://unused", model="echo", warmup=False, max_delay=10.0), upstream=up)
    w._connect()
    w.up = up
    try:
        yield w
    finally:
        w.close()


def _settle(w: Worker, cond) -> None:
    """Let the worker's loop-side reads happen until `cond()` (inproc delivers at once)."""
    for _ in range(100):
        w._drain()
        if cond():
            return
        w.sock.poll(10)
    raise AssertionError("condition not reached")


def test_the_loop_gives_back_what_waits_and_keeps_the_rest(worker):
    up = worker.up
    up.request(1)
    up.request(2)
    _settle(worker, lambda: len(worker.jobs) == 2)
    assert len(worker.batcher) == 2
    up.recall(2, 99)  # 99: started or answered long ago
    worker.sock.poll(5000)
    worker._drain()
    assert up.returned() == ([2], [99])
    assert set(worker.jobs) == {P.token_envelope(1)} and len(worker.batcher) == 1
    assert worker.returned == 1


def test_while_a_batch_computes_the_heartbeat_thread_answers_and_the_loop_follows(worker):
    up = worker.up
    up.request(1)
    _settle(worker, lambda: len(worker.jobs) == 1)   # waiting in the batcher
    # Meanwhile (the loop computes a batch): a new request, a RECALL for both and for one
    # that has started, then a CANCEL for the new one.
    up.request(2)
    up.recall(1, 2, 7)
    up.request(3)
    up.cancel(2)
    for _ in range(100):
        if worker.sock.poll(10) and len(worker._stash) == 3:
            break
        worker._read_while_computing()
    # The RECALL was answered at once; the loop's state is untouched so far.
    assert up.returned() == ([1, 2], [7])
    assert set(worker.jobs) == {P.token_envelope(1)}
    assert [m.command for m, _ in worker._stash] == [P.W_REQUEST, P.W_REQUEST, P.W_CANCEL]
    # The batch ends: what was given back goes, the rest is handled in order.
    worker._after_compute()
    assert set(worker.jobs) == {P.token_envelope(3)}
    assert len(worker.batcher) == 1
    assert worker._stash == [] and not worker._returned_early
    assert not worker.up.peer.poll(100)  # no reply for 2 (given back) nor for its CANCEL


def test_a_cancel_for_a_running_job_drops_its_result(worker):
    up = worker.up
    up.request(5)
    _settle(worker, lambda: len(worker.jobs) == 1)
    job = worker.jobs.pop(P.token_envelope(5))
    worker.batcher.drop(lambda p: True)
    worker.running = {job.envelope: job}  # as _run sets it while the batch computes
    up.cancel(5)
    worker.sock.poll(5000)
    worker._drain()
    assert job.cancelled and worker.cancelled_running == 1
    worker._reply_batch([job], [{"x": np.zeros(4, np.float32)}], started=0.0, compute_ms=1.0, n=1)
    assert up.peer.poll(5000)
    msg = P.parse_worker(up.peer.recv_multipart())
    rep = P.decode_reply(msg.body[0])
    assert msg.command == P.W_FINAL and rep.error.code == P.ErrorCode.CANCELLED
    assert "result was dropped" in rep.error.message


def _finals(up: _Pair) -> dict[int, tuple[P.Reply, list]]:
    """token -> (reply, its inline frames) of every FINAL the worker sent so far."""
    out = {}
    for frames in up.sent():
        msg = P.parse_worker(frames)
        if msg.command == P.W_FINAL:
            out[P.envelope_token(msg.envelope)] = (P.decode_reply(msg.body[0], len(msg.body) - 1), msg.body[1:])
    return out


def test_cancelling_one_request_of_a_running_batch_drops_only_its_result(worker):
    """Two requests in one batch on the loop's thread; the client of one cancels while the
    batch computes (the heartbeat thread reads the CANCEL meanwhile).  The batch cannot be
    interrupted: it runs to its end, the cancelled request gets CANCELLED and the other its
    outputs."""
    up = worker.up
    up.request(1)
    up.request(2)
    _settle(worker, lambda: len(worker.jobs) == 2)
    assert len(worker.batcher) == 2  # waiting for company (max_delay 10 s): one batch below
    plane_run = worker.plane.run
    ran = []

    def run(jobs):
        # The batch computes: the broker relays the CANCEL of request 2 meanwhile.
        ran.append(sorted(P.envelope_token(j.envelope) for j in jobs))
        assert set(worker.running) == {P.token_envelope(1), P.token_envelope(2)}
        up.cancel(2)
        for _ in range(100):
            worker._read_while_computing()
            if worker._stash:
                break
            worker.sock.poll(10)
        assert [m.command for m, _ in worker._stash] == [P.W_CANCEL]
        return plane_run(jobs)

    worker.plane.run = run
    worker.run_ready_batches(force=True)
    assert ran == [[1, 2]]
    assert worker.cancelled_running == 1 and worker.running == {} and not worker.jobs
    finals = _finals(up)
    assert set(finals) == {1, 2}, finals
    cancelled, _ = finals[2]
    assert cancelled.error is not None and cancelled.error.code == P.ErrorCode.CANCELLED
    assert "result was dropped" in cancelled.error.message and not cancelled.tensors
    done, frames = finals[1]
    assert done.error is None and [t.name for t in done.tensors] == ["x"]
    (t,) = done.tensors
    np.testing.assert_array_equal(np.frombuffer(frames[t.loc.frame], t.dtype).reshape(t.shape),
                                  np.arange(4, dtype=np.float32))
    assert done.timing["batch"] == 2.0  # it ran in the batch with the cancelled one


def test_the_read_during_compute_leaves_the_socket_armed_and_says_so(worker):
    """`_read_while_computing` returns the upstream socket's descriptor once it drained it
    (its last call an EVENTS that found nothing), so that the heartbeat thread sleeps on it:
    the next message makes it readable.  While the worker reconnects there is nothing to
    sleep on."""
    import select

    import zmq

    from broker.protocol.wire import Waiter

    waiter = Waiter()          # the loop's Waiter watches the socket (serve)
    waiter.add(worker.sock)
    try:
        up = worker.up
        up.request(1)
        assert worker.sock.poll(5000)
        read, fds = worker._read_while_computing()
        assert [m.command for m, _ in worker._stash] == [P.W_REQUEST]
        assert read == 1 and fds == [worker.sock.get(zmq.FD)]
        p = select.poll()
        p.register(fds[0], select.POLLIN)
        assert not p.poll(0)
        up.request(2)
        assert p.poll(5000), "the next message did not signal the descriptor"
        assert worker._read_while_computing() == (1, fds)
        assert len(worker._stash) == 2
        up.to_worker([P.MDPW, P.W_HEARTBEAT])  # read, but not work: it rings nothing
        assert p.poll(5000)
        assert worker._read_while_computing() == (0, fds)
        worker._reconnect_why = "test"
        assert worker._read_while_computing() == (0, [])
        worker._reconnect_why = None
        worker._after_compute()
    finally:
        waiter.close()


def test_a_retry_a_request_given_back_and_a_stream_frame_wait_in_order_and_a_plain_call_does_not(worker):
    """The broker's word that a request was dispatched before (``returned``: given back by
    a busy worker; ``attempt``: its worker died) makes the worker keep its principal's
    requests in order (`Pending.in_order`), as the broker did, and so does a stream's frame
    (``dropped``, 0 included: its client takes the results in send order); a plain first
    attempt may go newest first once its group is congested."""
    up = worker.up
    x = np.arange(4, dtype=np.float32)

    def send(token: int, attempt=None, returned=None, dropped=None) -> None:
        req = P.Request(id=token, reply="inline", returned=returned, dropped=dropped,
                        tensors=[P.TensorRef("x", "<f4", [4], P.InlineLoc(frame=0))])
        routed = P.decode_request(P.encode_header(req), 1, routed=True)
        up.to_worker([P.MDPW, P.W_REQUEST, P.token_envelope(token), b"", P.encode_routed(routed, attempt),
                      x.tobytes()])

    send(1)
    send(2, attempt=1)
    send(3, returned=1)
    send(4, dropped=0)
    _settle(worker, lambda: len(worker.jobs) == 4)
    pending = {p.item.req.id: p.in_order for p in worker.batcher.drop(lambda p: True)}
    assert pending == {1: False, 2: True, 3: True, 4: True}
    for p in list(worker.jobs.values()):
        worker.plane.finish_reads(p)
    worker.jobs.clear()


def test_a_brokered_requests_principal_in_the_batcher_is_its_process(worker):
    """The batcher's turns count a client by the process the broker attested, (pid, start
    time): a new process that reuses a pid is another principal (no remembered turn)."""
    up = worker.up
    x = np.arange(4, dtype=np.float32)
    for token, start in ((1, 111), (2, 222)):  # one pid, two processes
        req = P.Request(id=token, reply="inline", pid=4242, pid_start=start,
                        tensors=[P.TensorRef("x", "<f4", [4], P.InlineLoc(frame=0))])
        routed = P.decode_request(P.encode_header(req), 1, routed=True)
        up.to_worker([P.MDPW, P.W_REQUEST, P.token_envelope(token), b"", P.encode_routed(routed, None),
                      x.tobytes()])
    _settle(worker, lambda: len(worker.jobs) == 2)
    principals = {p.item.req.id: p.principal for p in worker.batcher.drop(lambda p: True)}
    assert principals == {1: (4242, 111), 2: (4242, 222)}
    for p in list(worker.jobs.values()):
        worker.plane.finish_reads(p)
    worker.jobs.clear()

