"""The direct-reply decisions of gpu_worker.direct, alone: which replies may skip the broker,
when a DONE goes and what it carries, which FINALs are gathered per client, and the reply_to
socket cache (reachable, full, failed).  No worker, no clock: time is passed in."""
from __future__ import annotations

import os

import pytest
import zmq

from broker import protocol as P
from gpu_worker.direct import (
    BatchFinals,
    DirectSockets,
    DoneGather,
    direct_endpoint,
    gathers_finals,
)

pytestmark = pytest.mark.timeout(30)

HOST = "this-host/0"
PID = 4242
EP = f"ipc:///run/user/1/zmq-infer-1/c-{PID}-77-00ab12.ipc"  # a socket of process PID


def env(i: int) -> bytes:
    return P.token_envelope(i)


# ------------------------------------------------------------------ direct or through the broker

def _req(**kw) -> P.Request:
    return P.Request(id=1, **{"host": HOST, "reply_to": EP, "pid": PID, **kw})


def test_a_same_host_final_with_reply_to_goes_direct():
    assert direct_endpoint(True, _req(), host=HOST, enabled=True, streaming=False) == EP
    # With the start time the broker attested (an older broker sends none): the same.
    assert direct_endpoint(True, _req(pid_start=77), host=HOST, enabled=True, streaming=False) == EP


@pytest.mark.parametrize("final, req, enabled, streaming", [
    (False, _req(), True, False),                     # a PARTIAL: its order stays with the broker
    (True, None, True, False),                        # an opaque MDP request
    (True, _req(reply_to=None), True, False),         # no reply_to
    (True, _req(host="elsewhere/0"), True, False),    # a client on another host
    (True, _req(), False, False),                     # direct reply switched off
    (True, _req(), True, True),                       # a streaming model's FINAL
    (True, _req(pid=None), True, False),              # a sender the broker could not attest
    (True, _req(pid=PID + 1), True, False),           # another process's socket
    (True, _req(pid_start=78), True, False),          # a process that had PID before: PID is reused
    (True, _req(reply_to="ipc:///tmp/x.ipc"), True, False),  # not a reply-socket name at all
])
def test_everything_else_is_relayed(final, req, enabled, streaming):
    assert direct_endpoint(final, req, host=HOST, enabled=enabled, streaming=streaming) is None


# ------------------------------------------------------------------ DONE

def test_a_done_waits_up_to_the_delay_for_company():
    g = DoneGather(delay=0.005, max_pending=4)
    assert len(g) == 0 and not g.ready(0.0) and g.wait_ms(0.0) is None
    g.add(env(1), None, now=10.0)
    assert g.due == pytest.approx(10.005)
    assert not g.ready(10.004) and g.ready(10.005)
    # A later FINAL never pushes the DONE back.
    g.add(env(2), None, now=10.003)
    assert g.due == pytest.approx(10.005)
    # As a poll timeout: whole milliseconds, rounded up, never negative.
    g = DoneGather(delay=0.005, max_pending=4)
    g.add(env(1), None, now=0.0)
    assert g.wait_ms(0.0) == 5 and g.wait_ms(0.0041) == 1 and g.wait_ms(1.0) == 0


def test_a_done_goes_when_a_quarter_of_the_credit_is_pending():
    g = DoneGather(delay=10.0, max_pending=3)
    for i in range(2):
        g.add(env(i), None, now=0.0)
    assert not g.ready(0.0)
    g.add(env(2), None, now=0.0)
    assert g.ready(0.0)


def test_a_done_never_waits_past_half_a_requests_remaining_time():
    g = DoneGather(delay=0.005, max_pending=100)
    g.add(env(1), deadline=10.002, now=10.0)
    assert g.due == pytest.approx(10.001)             # half of the 2 ms left
    g.add(env(2), deadline=None, now=10.0005)         # a request without deadline: no later
    assert g.due == pytest.approx(10.001)
    g.add(env(3), deadline=9.0, now=10.0008)          # already past: due at once
    assert g.due == pytest.approx(10.0008) and g.ready(10.0008)


def test_a_done_carries_every_pending_envelope_in_order_at_most_max_done_each():
    g = DoneGather(delay=0.005, max_pending=1)
    envs = [env(i) for i in range(P.MAX_DONE + 2)]
    for i, e in enumerate(envs):
        g.add(e, None, now=0.0, code=499 if i == 1 else 0)
    msgs = g.take(0.002)
    codes = [0, 499] + [0] * (P.MAX_DONE - 2)
    assert msgs == [P.worker_done(envs[: P.MAX_DONE], P.DoneInfo(codes=codes, ages_ms=[2.0] * P.MAX_DONE)),
                    P.worker_done(envs[P.MAX_DONE:], P.DoneInfo(codes=[0, 0], ages_ms=[2.0, 2.0]))]
    # The broker reads them back: envelopes, then each FINAL's outcome and age.
    parsed = P.parse_worker(msgs[1])
    assert parsed.body == tuple(envs[P.MAX_DONE:])
    assert P.decode_done_info(parsed.info, len(parsed.body)).codes == [0, 0]
    # For a broker that does not count, no outcomes: the plain DONE.
    g.info = False
    g.add(envs[0], None, now=0.0, code=499)
    assert g.take(0.0) == [P.worker_done(envs[:1])]
    assert len(g) == 0 and g.take(0.0) == [] and not g.ready(1.0)


def test_clear_forgets_envelopes_of_a_lost_connection():
    g = DoneGather(delay=0.005, max_pending=4)
    g.add(env(1), None, now=0.0)
    g.clear()
    assert g.take(0.0) == [] and g.wait_ms(0.0) is None


# ------------------------------------------------------------------ FINALs of one batch

def test_only_a_batch_of_several_gathers_its_finals():
    assert gathers_finals(1) is False  # a lone request's FINAL is never held back
    assert gathers_finals(2) and gathers_finals(8)


def test_batch_finals_are_one_message_per_client():
    f = BatchFinals()
    assert len(f) == 0 and not f
    f.add("ipc://a", b"h1", "job1")
    f.add("ipc://b", b"h2", "job2")
    f.add("ipc://a", b"h3", "job3")
    assert len(f) == 3
    out = f.messages(b"echo")
    assert out == [
        ("ipc://a", P.direct_finals(b"echo", [b"h1", b"h3"]), [(b"h1", "job1"), (b"h3", "job3")]),
        ("ipc://b", P.client_reply(True, b"echo", [b"h2"]), [(b"h2", "job2")]),
    ]


# ------------------------------------------------------------------ reply_to sockets

@pytest.fixture
def ctx():
    return zmq.Context.instance()


def _pull(ctx, path: str, hwm: int = 1000) -> zmq.Socket:
    s = ctx.socket(zmq.PULL)
    s.linger = 0
    s.rcvhwm = hwm
    s.bind("ipc://" + path)
    return s


def test_an_unreachable_endpoint_gets_no_socket(ctx, tmp_path):
    socks = DirectSockets(ctx)
    try:
        assert socks.open(f"ipc://{tmp_path}/nobody.ipc") is None and len(socks) == 0
        assert socks.send(f"ipc://{tmp_path}/nobody.ipc", [b"x"]) is False  # nothing open: relay
    finally:
        socks.close()


def test_sockets_are_reused_and_the_least_recently_used_closed(ctx, tmp_path):
    pulls = [_pull(ctx, f"{tmp_path}/{i}.ipc") for i in range(3)]
    eps = [f"ipc://{tmp_path}/{i}.ipc" for i in range(3)]
    socks = DirectSockets(ctx, capacity=2)
    try:
        a = socks.open(eps[0])
        assert a is not None and socks.open(eps[0]) is a
        socks.open(eps[1])
        socks.open(eps[0])                 # eps[1] is now the least recently used
        socks.open(eps[2])
        assert eps[0] in socks and eps[2] in socks and eps[1] not in socks
        assert a.poll(5000, zmq.POLLOUT)  # connected: only then does a send queue (immediate)
        assert socks.send(eps[0], [P.MDPC, P.C_FINAL, b"echo", b"h"])
        assert pulls[0].poll(5000) and pulls[0].recv_multipart() == [P.MDPC, P.C_FINAL, b"echo", b"h"]
        socks.drop(eps[0])
        assert eps[0] not in socks and socks.send(eps[0], [b"x"]) is False
    finally:
        socks.close()
        assert len(socks) == 0
        for p in pulls:
            p.close()


def test_a_full_socket_is_kept_and_the_reply_relayed(ctx, tmp_path):
    path = f"{tmp_path}/slow.ipc"
    pull = _pull(ctx, path, hwm=1)
    socks = DirectSockets(ctx)
    socks.sndhwm = 1
    try:
        ep = "ipc://" + path
        sock = socks.open(ep)
        assert sock is not None and sock.poll(5000, zmq.POLLOUT)
        # The client reads nothing: libzmq's queues and the kernel's buffers fill up.
        results = [socks.send(ep, [b"x" * (1 << 16)]) for _ in range(200)]
        # Refused once full (libzmq's I/O thread may still move one into the kernel between
        # two sends, so a later one can pass again: not the last, necessarily, that fails).
        assert results[0] is True and False in results, results
        assert ep in socks  # full is not failed: what is queued stays queued
    finally:
        socks.close()
        pull.close()


def test_a_reply_is_never_queued_on_a_connection_not_made(ctx, tmp_path):
    # A worker out of descriptors could open the socket but its I/O thread could not make the
    # connection: the reply queued on the pipe the connect had created and its client waited
    # out its timeout.  Near the limit a socket without a connection refuses the send: the
    # reply is relayed.
    import socket

    from broker.protocol.limits import Headroom

    path = f"{tmp_path}/c.ipc"
    ep = "ipc://" + path
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deaf.bind(path)  # the file is there, nobody listens: every connect is refused
    near = Headroom(64, count=lambda: 60)  # 60 of 64 descriptors in use
    socks = DirectSockets(ctx, guard=near)
    try:
        assert socks.open(ep) is not None
        assert socks.send(ep, [b"x"]) is False and ep in socks  # refused (kept: it may connect later)
        deaf.close()
        os.unlink(path)
        again = _pull(ctx, path)  # the client is back: the socket connects and sends go direct
        try:
            assert socks.open(ep).poll(5000, zmq.POLLOUT)
            assert socks.send(ep, [b"y"]) is True
            assert again.poll(5000) and again.recv_multipart() == [b"y"]
        finally:
            again.close()
    finally:
        socks.close()
        deaf.close()


def _deaf(path: str):
    """A file at ``path`` that nobody listens on: every connect to it is refused."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    return s


def test_near_the_mark_a_new_socket_counts_the_descriptors_it_did_not_open(ctx, tmp_path):
    # The estimate counted this cache's sockets alone, while each new client also costs the
    # worker a pidfd and its segment's two mappings: a worker at its limit took itself for
    # far from it, and made a socket that queued a reply on a connection that failed on
    # EMFILE (the resource hunt: one client in 40 waited out its timeout on every request).
    from broker.protocol.limits import Headroom

    used = [40]
    guard = Headroom(128, count=lambda: used[0])  # mark at 86, listed again from 44
    socks = DirectSockets(ctx, guard=guard)
    path = f"{tmp_path}/c.ipc"
    deaf = _deaf(path)
    try:
        used[0] = 120  # segments and pidfds of new clients, which only a listing sees
        ep = "ipc://" + path
        assert socks.open(ep) is not None
        assert guard.paused and guard.used == 120
        assert socks.send(ep, [b"x"]) is False  # not queued on a connection not made: relayed
    finally:
        socks.close()
        deaf.close()


def test_a_socket_made_to_queue_is_closed_once_the_worker_is_found_near_its_limit(ctx, tmp_path):
    # Made far from the limit (it queues while its connection is made), but the connection
    # failed for want of descriptors: what it queued, and every later reply to its client,
    # waited for a connection that never came.  The sweep that finds the worker near its
    # limit closes the sockets made to queue since the last sweep that found it far (libzmq
    # retries a connection, and it had descriptors to make it with then); the next socket
    # for the client queues only once connected.
    from broker.protocol.limits import Headroom

    used = [10]
    guard = Headroom(128, count=lambda: used[0])
    socks = DirectSockets(ctx, guard=guard)
    old_path, new_path, ok_path = f"{tmp_path}/old.ipc", f"{tmp_path}/new.ipc", f"{tmp_path}/ok.ipc"
    old, new, ok = _deaf(old_path), _deaf(new_path), _pull(ctx, ok_path)
    old_ep, new_ep, ok_ep = "ipc://" + old_path, "ipc://" + new_path, "ipc://" + ok_path
    try:
        assert socks.open(old_ep) is not None
        socks.sweep()  # far from the limit: kept
        assert old_ep in socks and not guard.paused
        assert socks.open(new_ep) is not None and socks.send(new_ep, [b"x"]) is True  # queued
        assert socks.open(ok_ep) is not None
        used[0] = 120
        socks.sweep()
        assert guard.paused and new_ep not in socks and ok_ep not in socks and old_ep in socks
        assert socks.open(new_ep) is not None
        assert socks.send(new_ep, [b"y"]) is False and new_ep in socks  # relayed, socket kept
        sock = socks.open(ok_ep)  # a client whose connection is made: direct again once it is
        assert sock.poll(5000, zmq.POLLOUT) and socks.send(ok_ep, [b"z"]) is True
        assert ok.poll(5000) and ok.recv_multipart() == [b"z"]
        socks.sweep()  # made while near: not closed again
        assert new_ep in socks and ok_ep in socks
    finally:
        socks.close()
        old.close()
        new.close()
        ok.close()


def test_far_from_the_limit_a_reply_queues_while_its_connection_is_made(ctx, tmp_path):
    # Relaying until the connection is up would send a new client's first replies (about 3)
    # through the broker; far from the descriptor limit they queue and go direct.
    from broker.protocol.limits import Headroom

    path = f"{tmp_path}/c.ipc"
    pull = _pull(ctx, path)
    socks = DirectSockets(ctx, guard=Headroom(1024, count=lambda: 10))
    try:
        ep = "ipc://" + path
        assert socks.open(ep) is not None and socks.send(ep, [b"x"]) is True  # at once
        assert pull.poll(5000) and pull.recv_multipart() == [b"x"]
    finally:
        socks.close()
        pull.close()


def test_a_failed_send_drops_the_socket_unless_told_to_keep_it(ctx, tmp_path):
    pull = _pull(ctx, f"{tmp_path}/c.ipc")
    ep = f"ipc://{tmp_path}/c.ipc"
    socks = DirectSockets(ctx)
    try:
        socks.open(ep).close()  # a socket that fails on every send (ENOTSOCK)
        assert socks.send(ep, [b"x"], keep_failed=True) is False and ep in socks
        assert socks.send(ep, [b"x"]) is False and ep not in socks
    finally:
        socks.close()
        pull.close()


def test_sweep_closes_the_sockets_of_clients_that_exited(ctx, tmp_path):
    import subprocess
    import sys

    from shm.segment import proc_starttime, self_identity

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = proc_starttime(child.pid)
        me, my_start = self_identity()
        gone_ep = f"ipc://{tmp_path}/c-{child.pid}-{start}-00ab12.ipc"
        live_ep = f"ipc://{tmp_path}/c-{me}-{my_start}-00cd34.ipc"
        other_ep = f"ipc://{tmp_path}/other.ipc"  # a name stating no owner: LRU only
        pulls = [_pull(ctx, ep[len("ipc://"):]) for ep in (gone_ep, live_ep, other_ep)]
        socks = DirectSockets(ctx)
        try:
            for ep in (gone_ep, live_ep, other_ep):
                assert socks.open(ep) is not None
            assert socks.sweep() == []  # everyone alive
            child.stdin.close()
            child.wait(10)
            assert socks.sweep() == [gone_ep]
            assert gone_ep not in socks and live_ep in socks and other_ep in socks
            assert socks._holders._cache.keys() == {me}  # the exited client's pidfd is closed
            # A live process whose client closed (its socket file unlinked): nobody will
            # bind that name again.
            pulls[1].close()
            os.unlink(live_ep[len("ipc://"):]) if os.path.exists(live_ep[len("ipc://"):]) else None
            assert socks.sweep() == [live_ep] and live_ep not in socks
        finally:
            socks.close()
            for p in pulls:
                p.close()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)
