"""A buggy worker (a model's bug, or a worker another team wrote in another language) against
our real broker and SDK clients: a raw DEALER speaks MDP/0.2 as that worker.  The broker
trusts a worker with a valid key to compute results (docs/security.md), but what such a
worker sends must never make a client read memory nobody lent it, free memory it does not
own, or take one request's answer for another's.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

import shm
from broker import protocol as P
from client_sdk import Client, ProtocolError
from tests.e2e.conftest import ROOT
from tests.children import readline_within

HOST = P.local_host_id()


class RawWorker:
    """A DEALER that registered ``service`` with a `Ready` header (shared memory on this host)."""

    def __init__(self, backend: str, service: str = "bad", credit: int = 8):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(backend)
        self.sock.send_multipart(P.worker_ready(service, P.Ready(
            credit=credit, host=HOST, transports=["inline", "shm"], pid=os.getpid(), welcome=True)))
        msg = self._recv()
        assert msg[:2] == [P.MDPW, P.W_WELCOME], msg

    def _recv(self, timeout: float = 10.0) -> list[bytes]:
        assert self.sock.poll(int(timeout * 1000)), "the broker sent the worker nothing"
        return self.sock.recv_multipart()

    def work(self, timeout: float = 10.0) -> list[bytes]:
        """The next REQUEST's frames (heartbeats answered meanwhile)."""
        end = time.monotonic() + timeout
        while True:
            msg = self._recv(max(0.01, end - time.monotonic()))
            if msg[:2] == [P.MDPW, P.W_HEARTBEAT]:
                self.sock.send_multipart(P.worker_heartbeat())
                continue
            assert msg[:2] == [P.MDPW, P.W_REQUEST], f"the worker got {msg[:2]}"
            return msg

    def request(self, timeout: float = 10.0) -> tuple[bytes, P.Request]:
        """The next REQUEST: its envelope and its header."""
        msg = self.work(timeout)
        return msg[2], P.decode_request(msg[4], frames=msg[5:])

    def final(self, envelope: bytes, reply: P.Reply, frames=()) -> None:
        self.sock.send_multipart(P.worker_reply(envelope, True, [P.encode_header(reply), *frames]))

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def bad(cluster):
    # A long liveness window: the raw worker answers heartbeats only when it reads.
    cluster.broker("--heartbeat-liveness", "50")
    w = RawWorker(cluster.backend)
    try:
        yield w
    finally:
        w.close()


def _shm_out(name: str, loc: P.ShmLoc) -> P.TensorRef:
    return P.TensorRef(name=name, dtype="|u1", shape=[loc.nbytes], loc=loc)


VICTIM = """
import sys
import numpy as np
from shm import ShmPool, IN_FLIGHT
pool = ShmPool(1 << 20, slots=8)
buf = pool.alloc(8192, np.uint8)
buf[:] = 0x5A
ref = pool.ref_of(buf)
pool.mark_in_flight(ref)   # an input of a request of this process: not lent to any reader
print(*ref, flush=True)
for _ in sys.stdin:        # each line: free what readers released, and say what is left of `buf`
    print(pool.reclaim(), int(pool.table["state"][ref.slot]) == IN_FLIGHT, flush=True)
"""


def test_a_reply_naming_memory_nobody_lent_the_client_is_refused_and_frees_nothing(cluster, bad):
    """A worker that answers with a slot of the client's own input pool (here a `client.alloc`
    buffer another call of it sent, answering a call whose inputs went inline) or of another
    process's segment (an input of that process's request) made the client view that memory
    as its output, and its release store RELEASED there: the owner's next reclaim freed a
    slot still in use (the client's own buffer was handed out again by the next alloc while
    the caller still held it; the other process lost its request's input).  The client now
    takes as output only slots lent to it (the slot's holder is this process)."""
    victim = subprocess.Popen([sys.executable, "-c", VICTIM], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    ring = shm.ShmPool(1 << 20, slots=8)
    try:
        name, off, nb, slot, gen = readline_within(victim.stdout, 30, "the victim's input slot").split()
        theirs = P.ShmLoc(segment=name, offset=int(off), nbytes=int(nb), slot=int(slot), generation=int(gen))
        with Client(cluster.frontend, timeout=5, direct_reply=False) as c:
            buf = c.alloc((8192,), np.uint8)
            buf[:] = 7
            first = c.infer_stream("bad", {"x": buf})  # by reference: the buffer's slot is in flight
            env1, req1 = bad.request()
            mine = req1.tensors[0].loc
            assert type(mine) is P.ShmLoc and mine.segment == c.pool.name
            for loc in (mine, theirs):
                call = c.infer_stream("bad", {"y": np.zeros(4, np.uint8)})  # inline: nothing of ours lent
                env, req = bad.request()
                bad.final(env, P.Reply(id=req.id, tensors=[_shm_out("out", loc)]))
                with pytest.raises(ProtocolError, match="not lent to this process"):
                    call.result()
            gc.collect()
            assert c.pool.table["state"][mine.slot] == shm.IN_FLIGHT, "the client released its own buffer's slot"
            assert c.pool.reclaim() == 0
            again = c.alloc((8192,), np.uint8)
            assert not np.shares_memory(again, buf), "alloc() handed out a buffer the caller still holds"
            victim.stdin.write("reclaim\n")
            victim.stdin.flush()
            said = readline_within(victim.stdout, 30, "the victim's reclaim and its slot's state").split()
            assert said == ["0", "True"], "the other process's input slot was freed"
            # The worker's own ring, lent to this client, still goes through (and back).
            out = ring.alloc(8192, np.uint8)
            out[:] = 3
            ref = ring.ref_of(out)
            ring.mark_in_flight(ref, holder_pid=os.getpid())
            bad.final(env1, P.Reply(id=req1.id, tensors=[_shm_out("out", P.shm_loc(ref))]))
            with first.result() as r:
                assert r.zero_copy == {"out": True} and int(r["out"][0]) == 3
            assert ring.reclaim() == 1
    finally:
        ring.close()
        if victim.poll() is None:
            victim.kill()
        victim.wait(10)
        victim.stdin.close()
        victim.stdout.close()


def _two_at_the_worker(c, bad):
    """Two calls of ``c`` (x = [1]*4, [2]*4) held by the raw worker ``bad``: (handle,
    envelope, request) of each, and a one-byte inline output's reference."""
    first = c.infer_stream("bad", {"x": np.full(4, 1, np.uint8)})
    env1, req1 = bad.request()
    second = c.infer_stream("bad", {"x": np.full(4, 2, np.uint8)})
    env2, req2 = bad.request()
    one = P.TensorRef(name="y", dtype="|u1", shape=[1], loc=P.InlineLoc(frame=0))
    return (first, env1, req1), (second, env2, req2), one


def test_a_reply_carrying_another_requests_id_answers_neither_wrongly(cluster, bad):
    """A worker that answers one request with a header naming another request of the same
    client (a mix-up in its batch): the broker relayed the body as it came, so the client
    took it for the other call's answer (a result delivered as right, to the wrong call,
    perhaps of another service) and the request it answered waited for its deadline.  The
    broker checks the id of each reply it relays against the request it answers: a FINAL that
    names another id becomes a 400 for its own request (the client gives back the output
    slots it named), a PARTIAL is dropped."""
    ring = shm.ShmPool(1 << 20, slots=8)
    try:
        with Client(cluster.frontend, timeout=5) as c:
            (first, env1, req1), (second, env2, req2), one = _two_at_the_worker(c, bad)
            out = ring.alloc(8192, np.uint8)
            ref = ring.ref_of(out)
            ring.mark_in_flight(ref, holder_pid=os.getpid())
            bad.sock.send_multipart(P.worker_reply(env2, False, [
                P.encode_header(P.Reply(id=req1.id, tensors=[one])), b"\x01"]))
            bad.final(env1, P.Reply(id=req2.id, tensors=[one, _shm_out("z", P.shm_loc(ref))]), [b"\x01"])
            # (a ProtocolError: had it waited for its deadline, a DeadlineExceeded)
            with pytest.raises(ProtocolError, match=f"a reply for request id {req2.id}"):
                first.result()
            assert ring.reclaim() == 1, "the output slot the dropped reply named stayed lent"
            bad.final(env2, P.Reply(id=req2.id, tensors=[one]), [b"\x02"])
            assert [int(r["y"][0]) for r in second] == [2]  # its own FINAL, and no PARTIAL before it
    finally:
        ring.close()


def test_a_reply_header_that_names_its_id_twice_is_read_as_the_client_reads_it(cluster, bad):
    """The interop audit: a header with the key `id` twice (its own request's, then
    another's) passed the broker's check, which read the first, and the client, whose
    decoder keeps the last, took it for the other call's answer.  The broker reads what the
    client reads: a misaddressed reply, a 400 for its own request."""
    import msgpack

    with Client(cluster.frontend, timeout=5) as c:
        (first, env1, req1), (second, env2, req2), one = _two_at_the_worker(c, bad)
        fields = list(msgpack.unpackb(P.encode_header(P.Reply(id=req1.id, tensors=[one]))[len(P.MAGIC):],
                                      raw=False).items())
        assert [k for k, _ in fields[:2]] == ["v", "id"]
        twice = P.MAGIC + msgpack.Packer().pack_map_pairs([*fields[:2], ("id", req2.id), *fields[2:]])
        bad.sock.send_multipart(P.worker_reply(env1, True, [twice, b"\x01"]))
        with pytest.raises(ProtocolError, match=f"a reply for request id {req2.id}"):
            first.result()
        bad.final(env2, P.Reply(id=req2.id, tensors=[one]), [b"\x02"])
        assert [int(r["y"][0]) for r in second] == [2]  # its own answer, not the other's


def test_a_heartbeat_on_the_reply_socket_is_not_the_brokers(cluster, bad):
    """Only the broker speaks for the broker.  A worker that sent a HEARTBEAT to a client's
    direct-reply socket with another instance id made the client believe the broker had
    restarted: it sent every call in flight again (the worker ran this one twice).  A
    HEARTBEAT there is dropped, as one on a lease's connection already was."""
    with Client(cluster.frontend, timeout=5) as c:
        call = c.infer_stream("bad", {"x": np.full(4, 1, np.uint8)})
        env, req = bad.request()
        assert req.reply_to is not None
        end = time.monotonic() + 5
        while c._core.broker_instance is None:  # the broker's own heartbeat answer came
            assert time.monotonic() < end, "the broker never answered a heartbeat"
            c.pump(0.1)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.linger = 0
        try:
            push.connect(req.reply_to)
            push.send_multipart([P.MDPC, P.C_HEARTBEAT, b"\x01" * 8, (3000).to_bytes(4, "big")])
            one = P.TensorRef(name="y", dtype="|u1", shape=[1], loc=P.InlineLoc(frame=0))
            push.send_multipart([P.MDPC, P.C_FINAL, b"bad", P.encode_header(P.Reply(id=req.id, tensors=[one])),
                                 b"\x07"])  # after the HEARTBEAT, on the same connection
            bad.sock.send_multipart(P.worker_done([env]))
            assert int(call.result()["y"][0]) == 7
        finally:
            push.close(0)
        assert c._core.broker_restarts == 0 and c._core.resent == 0, "the client took a worker for the broker"


def test_a_slot_named_twice_goes_back_only_when_no_result_views_it(cluster, bad):
    """A worker that names one output slot twice (two outputs of a reply, two requests' replies,
    or the same FINAL sent straight to the client and through the broker): the client's
    release of one copy, or its discarding of a duplicate, stored RELEASED while a result
    still viewed the slot, and the worker wrote its next output there, under that result.
    The client gives a slot back once nothing of it views the slot any more."""
    ring = shm.ShmPool(1 << 20, slots=8)
    try:
        with Client(cluster.frontend, timeout=5) as c:
            out = ring.alloc(8192, np.uint8)
            out[:] = 3
            ref = ring.ref_of(out)
            ring.mark_in_flight(ref, holder_pid=os.getpid())
            loc = P.shm_loc(ref)
            calls = [c.infer_stream("bad", {"x": np.full(4, i, np.uint8)}) for i in range(2)]
            work = [bad.request() for _ in calls]
            push = zmq.Context.instance().socket(zmq.PUSH)
            push.linger = 0
            try:
                push.connect(work[0][1].reply_to)
                # The first call's FINAL both ways, with the slot under two names; the second
                # call's naming it too.
                head = P.encode_header(P.Reply(id=work[0][1].id, tensors=[_shm_out("a", loc), _shm_out("b", loc)]))
                push.send_multipart([P.MDPC, P.C_FINAL, b"bad", head])
                first = calls[0].result()
                bad.final(work[0][0], P.Reply(id=work[0][1].id, tensors=[_shm_out("a", loc), _shm_out("b", loc)]))
                bad.final(work[1][0], P.Reply(id=work[1][1].id, tensors=[_shm_out("c", loc)]))
                second = calls[1].result()  # after the relayed duplicate: both came through the broker
            finally:
                push.close(0)
            assert c._core.discarded == 1  # the relayed duplicate
            assert ring.reclaim() == 0, "the slot went back while results viewed it"
            second.release()
            del second
            gc.collect()
            assert ring.reclaim() == 0, "the slot went back while a result viewed it"
            assert int(first["a"][0]) == int(first["b"][0]) == 3
            first.release()
            assert ring.reclaim() == 1
    finally:
        ring.close()


def test_a_done_for_a_request_with_no_reply_socket_answers_its_client(cluster, bad):
    """DONE says "I sent this FINAL straight to the client".  A worker that said it for a
    request that named no reply socket (a client with direct replies off, a plain MDP client)
    had it settled with nothing sent: our client waited for its deadline, a plain client
    without one for good.  Such a request is answered 400 instead."""
    with Client(cluster.frontend, timeout=5, direct_reply=False) as c:
        call = c.infer_stream("bad", {"x": np.ones(4, np.uint8)})
        env, req = bad.request()
        assert req.reply_to is None
        bad.sock.send_multipart(P.worker_done([env]))
        with pytest.raises(ProtocolError, match="no reply socket"):
            call.result()
    plain = zmq.Context.instance().socket(zmq.DEALER)
    plain.linger = 0
    try:
        plain.connect(cluster.frontend)
        plain.send_multipart([P.MDPC, P.C_REQUEST, b"bad", b"opaque"])
        msg = bad.work()
        assert msg[4:] == [b"opaque"], msg
        bad.sock.send_multipart(P.worker_done([msg[2]]))
        assert plain.poll(5000), "the plain client got no answer"
        got = plain.recv_multipart()
        assert got[:3] == [P.MDPC, P.C_FINAL, b"bad"] and P.decode_reply(got[3]).error.code == 400, got
    finally:
        plain.close(0)


@pytest.mark.parametrize("head", [P.MAGIC, P.MAGIC + b"\x85\xa1v\x01\xa2id"], ids=["magic-only", "cut-at-id"])
def test_a_reply_whose_header_is_cut_short_harms_no_other_request(cluster, head):
    """A worker's FINAL whose first frame is our header's magic and no more (or is cut right
    after `id`'s key): reading its id for the relay check raised IndexError in the middle of
    the broker's actions, so what came after that action in the same step was never done:
    the next queued request, dispatched to the worker in the scheduler's books, never left
    the broker (its client waited for its deadline), and the answered one got nothing.  Such
    a reply is a 400 for its own request, and the next request reaches the worker."""
    cluster.broker("--heartbeat-liveness", "50")
    w = RawWorker(cluster.backend, credit=1)
    try:
        with Client(cluster.frontend, timeout=5) as c:
            first = c.infer_stream("bad", {"x": np.full(4, 1, np.uint8)})
            env1, req1 = w.request()
            second = c.infer_stream("bad", {"x": np.full(4, 2, np.uint8)})  # queued: the worker's credit is 1
            w.sock.send_multipart(P.worker_reply(env1, True, [head]))
            env2, req2 = w.request(timeout=3)  # dispatched once the FINAL freed the credit
            assert req2.id != req1.id
            with pytest.raises(ProtocolError, match="the worker answered this request"):
                first.result()
            one = P.TensorRef(name="y", dtype="|u1", shape=[1], loc=P.InlineLoc(frame=0))
            w.final(env2, P.Reply(id=req2.id, tensors=[one]), [b"\x02"])
            assert int(second.result()["y"][0]) == 2
    finally:
        w.close()


def test_a_partial_carrying_another_requests_id_gives_its_slots_back(cluster, bad):
    """A misaddressed PARTIAL is not relayed (the client would take it for that other call's),
    but the output slots it names are lent to the client, which alone gives them back: dropped
    whole, they stayed lent for the client's life (the worker's ring filled, one slot per such
    PARTIAL).  The client gets them named in an error PARTIAL under its own request's id,
    which it ignores after giving them back; its call goes on."""
    ring = shm.ShmPool(1 << 20, slots=8)
    try:
        with Client(cluster.frontend, timeout=5) as c:
            call = c.infer_stream("bad", {"x": np.full(4, 1, np.uint8)})
            env, req = bad.request()
            out = ring.alloc(8192, np.uint8)
            ref = ring.ref_of(out)
            ring.mark_in_flight(ref, holder_pid=os.getpid())
            bad.sock.send_multipart(P.worker_reply(env, False, [
                P.encode_header(P.Reply(id=req.id + 1000, tensors=[_shm_out("z", P.shm_loc(ref))]))]))
            one = P.TensorRef(name="y", dtype="|u1", shape=[1], loc=P.InlineLoc(frame=0))
            bad.final(env, P.Reply(id=req.id, tensors=[one]), [b"\x05"])
            assert [int(r["y"][0]) for r in call] == [5]  # its own FINAL, and no PARTIAL before it
            assert ring.reclaim() == 1, "the output slot the dropped PARTIAL named stayed lent"
    finally:
        ring.close()


def test_a_late_reply_carrying_another_requests_id_gives_its_slots_back(cluster, bad):
    """A reply that comes after its request's deadline is forwarded for the output slots it
    names (the client alone gives them back).  One naming another request's id was dropped
    whole, and its slots stayed lent for the client's life; the client gets them under its
    own request's id (a 400 for a call already answered, which it discards after giving
    them back)."""
    from client_sdk import DeadlineExceeded

    ring = shm.ShmPool(1 << 20, slots=8)
    try:
        with Client(cluster.frontend, timeout=0.3, direct_reply=False) as c:
            call = c.infer_stream("bad", {"x": np.full(4, 1, np.uint8)})
            env, req = bad.request()
            with pytest.raises(DeadlineExceeded):
                call.result()
            out = ring.alloc(8192, np.uint8)
            ref = ring.ref_of(out)
            ring.mark_in_flight(ref, holder_pid=os.getpid())
            bad.final(env, P.Reply(id=req.id + 1000, tensors=[_shm_out("z", P.shm_loc(ref))]))
            end = time.monotonic() + 5
            while ring.reclaim() == 0:
                assert time.monotonic() < end, "the output slot the late reply named stayed lent"
                c.pump(0.02)  # (a blocking client reads inside its calls)
    finally:
        ring.close()


def test_an_opaque_answer_to_a_tensor_request_fails_that_request(cluster, bad):
    """A worker that answers a tensor request with a body that is no header (a plain MDP
    worker that does not speak our tensors) carried no id: the client could only fail the
    oldest call it had waiting on that service, here another request than the one answered,
    whose own answer then found no call.  The broker knows which request a reply answers:
    it makes such a FINAL a 400 for that request."""
    with Client(cluster.frontend, timeout=5, direct_reply=False) as c:
        old = c.infer_stream("bad", {"x": np.zeros(4, np.uint8)})
        env_old, req_old = bad.request()
        new = c.infer_stream("bad", {"x": np.ones(4, np.uint8)})
        env_new, req_new = bad.request()
        bad.sock.send_multipart(P.worker_reply(env_new, True, [b"plain bytes"]))
        with pytest.raises(ProtocolError, match="opaque body .* use client.request"):
            new.result(timeout=5)
        bad.final(env_old, P.Reply(id=req_old.id))  # the older call's own answer: no outputs
        assert old.result(timeout=5) is not None
