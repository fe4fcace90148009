"""A client whose reply queue is full is dropped after the actions being sent, not among
them: the REQUEST the same event dispatched for it reaches its worker before the CANCEL
that dropping it sends (a worker ignores a CANCEL for a request it has not seen, and would
then run the request for nobody).  The broker's two send seams stand in for its sockets."""
from __future__ import annotations

import zmq

from broker import protocol as P
from broker.server import Broker, BrokerConfig


def _frames(ident: bytes, msg: list) -> list:
    return [zmq.Frame(ident), *(zmq.Frame(bytes(f)) for f in msg)]


def test_a_stalled_client_is_dropped_after_the_dispatch_that_was_sent_for_it(tmp_path):
    cfg = BrokerConfig(frontend=f"ipc://{tmp_path}/fe.ipc", backend=f"ipc://{tmp_path}/be.ipc")
    with Broker(cfg) as b:
        to_worker, to_client, full = [], [], set()

        def send_client(frames):
            if frames[0] in full:
                raise zmq.Again()
            to_client.append(frames)

        b.send_to_client = send_client
        b.send_to_worker = to_worker.append
        b.on_worker(_frames(b"W", P.worker_ready("svc", P.Ready(credit=1, transports=["inline"]))))
        for i in (1, 2):  # credit 1: the first runs, the second waits
            req = P.Request(id=i)
            b.on_client(_frames(b"H", P.client_request("svc", [P.encode_header(req)])))
        sent = [P.parse_broker_to_worker(f[1:]) for f in to_worker]
        assert [m.command for m in sent] == [P.W_REQUEST]
        first = sent[0].envelope

        full.add(b"H")  # the client stopped reading: its queue is full from now on
        to_worker.clear()
        reply = P.encode_header(P.Reply(id=1))
        b.on_worker(_frames(b"W", P.worker_reply(first, True, [reply])))
        cmds = [P.parse_broker_to_worker(f[1:]) for f in to_worker]
        assert [m.command for m in cmds] == [P.W_REQUEST, P.W_CANCEL]
        assert cmds[0].envelope == cmds[1].envelope  # the cancel follows its own request
        assert b.stalled_clients == 1 and to_client == []
        # Dropped: nothing of it is counted (the cancelled request is the worker's to finish).
        assert b.sched.client_usage(b"H")["outstanding"] == 0


class _Tracker:
    def __init__(self):
        self.done = False


def test_the_unread_tally_follows_every_entry_and_a_reader_that_had_read_all_is_not_quiet():
    """`_Unread`'s shared tally is what the broker-wide cap reads on each big send (a sum
    over every client per send cost 49 us at 1,000 clients: the review)."""
    from broker.server import _SLOW_READ_BPS, _UNREAD_QUIET_S, _Unread

    tally = [0]
    a, b = _Unread(None, 0.0, tally), _Unread(None, 0.0, tally)
    ta, tb = _Tracker(), _Tracker()
    a.add([(ta, 100)], 0.0)
    b.add([(tb, 50), (_Tracker(), 30)], 0.0)
    assert tally == [180] and (a.total, b.total) == (100, 80)
    ta.done = tb.done = True
    assert a.settle(2.0) == 1 and b.settle(2.0) == 1
    assert tally == [30] and a.total == 0 and a.went_at == 2.0
    # a had read all it was sent: a frame sent it at 5.0 starts its quiet then, not at 2.0
    a.add([(_Tracker(), 64 << 20)], 5.0)
    assert a.went_at == 5.0
    assert a.quiet_for() == max(_UNREAD_QUIET_S, (64 << 20) / _SLOW_READ_BPS) == 4.0
    assert tally == [30 + (64 << 20)]


def test_a_tcp_frontend_listens_with_room_for_a_restarts_redials(tmp_path):
    # The reconnect-storm audit: 3,000 clients redialling a restarted broker overflowed a
    # backlog of 100 (the kernel dropped them in silence; plain clients sat 30 s on dead
    # connections).  Ipc endpoints keep half the descriptors' reserve (their accepting pauses).
    from broker.protocol.limits import TCP_BACKLOG, default_reserve, listen_backlog, nofile_limit

    cfg = BrokerConfig(frontend="tcp://127.0.0.1:0", backend=f"ipc://{tmp_path}/be.ipc")
    cfg.security.insecure = True
    with Broker(cfg) as b:
        assert b.frontend.backlog == TCP_BACKLOG
        assert b.backend.backlog == listen_backlog(default_reserve(nofile_limit()))
