"""Our broker with MDP peers we did not write, as they put frames on the wire (docs/protocol.md,
"Interoperability").  The peers are raw pyzmq sockets that send exactly what the third-party
code sends, each mirroring a named file (the packages are not test dependencies):

- majortomo 0.2.0 (PyPI, Python, "MDP/0.2"): its Worker puts MDP/0.1's empty delimiter before
  every command and drops any message without one (majortomo/worker.py, `_send`:
  ``send_multipart((b'', WORKER_HEADER, message_type) + args)``; `_verify_message`:
  ``if message.pop(0) != b''`` raises ProtocolError); its Client adds the delimiter too and
  numbers client commands as worker ones (majortomo/client.py, `send`: REQUEST is 0x02).
- the zguide's Majordomo examples (MDP/0.1, RFC 7): a worker sends ``"", "MDPW01", 0x01,
  service`` and asserts that what it reads is at least 3 frames starting with an empty one
  (examples/Python/mdwrkapi.py, `recv`); an asynchronous client sends ``"", "MDPC01",
  service, body`` on a DEALER (mdcliapi2.py).  Both heartbeat only while they wait for work,
  and their broker (mdbroker) expires only waiting workers.
"""
from __future__ import annotations

import time

import pytest
import zmq

import broker.protocol as P

pytestmark = pytest.mark.timeout(60)

MDPC, MDPW = b"MDPC02", b"MDPW02"


def _dealer(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(endpoint)
    return s


def _recv(s: zmq.Socket, timeout: float = 10.0) -> list[bytes]:
    assert s.poll(int(timeout * 1000)), f"nothing came within {timeout} s"
    return s.recv_multipart()


def _mmi(client: zmq.Socket, service: bytes, want: bytes, timeout: float = 10.0) -> None:
    """Ask `mmi.service` on a raw client socket until the answer is `want` (a condition)."""
    deadline = time.monotonic() + timeout
    while True:
        client.send_multipart([MDPC, P.C_REQUEST, b"mmi.service", service])
        reply = _recv(client)
        assert reply[:3] == [MDPC, P.C_FINAL, b"mmi.service"], reply
        if reply[3] == want:
            return
        assert time.monotonic() < deadline, f"mmi.service {service!r} still {reply[3]!r}, not {want!r}"
        time.sleep(0.01)


def test_a_worker_that_keeps_mdp01s_empty_delimiter_gets_it_back(cluster):
    # Found running majortomo 0.2.0's Worker against our broker: the broker took its READY
    # (it tolerates the delimiter), `mmi.service` said 200, and every REQUEST and HEARTBEAT
    # then went without the delimiter, which majortomo drops as malformed ("Expecting first
    # message frame to be empty"): each request to its service waited out its deadline,
    # retried on the same worker after each of its silent-broker reconnects.  The broker
    # now sends a worker that leads with the empty frame one before each message.
    broker = cluster.broker("--heartbeat-interval", "0.5")  # (a loaded test process keeps its worker)
    w, c = _dealer(cluster.backend), _dealer(cluster.frontend)
    try:
        # Unknown to the broker (a broker restart, for majortomo): told DISCONNECT, delimited.
        w.send_multipart([b"", MDPW, P.W_HEARTBEAT])
        assert _recv(w) == [b"", MDPW, P.W_DISCONNECT]
        w.close()
        w = _dealer(cluster.backend)
        w.send_multipart([b"", MDPW, P.W_READY, b"mt"])
        _mmi(c, b"mt", b"200")
        big = bytes(range(256)) * (16 << 10)  # 4 MiB
        bodies = [[b"one"], [b"a", b"", b"c"], [big, b"tail"]]
        for i, body in enumerate(bodies):
            c.send_multipart([MDPC, P.C_REQUEST, b"mt", *body])
            while True:
                msg = _recv(w)
                assert msg[0] == b"", f"a message to a delimited worker without the delimiter: {msg[:3]}"
                assert msg[1] == MDPW, msg[:3]
                if msg[2] == P.W_HEARTBEAT:
                    w.send_multipart([b"", MDPW, P.W_HEARTBEAT])
                    continue
                assert msg[2] == P.W_REQUEST and msg[4] == b"", msg[:5]
                break
            env, got = msg[3], msg[5:]
            assert got == body
            if i == 1:  # majortomo's send_reply_partial, then its final
                w.send_multipart([b"", MDPW, P.W_PARTIAL, env, b"", b"part"])
                assert _recv(c) == [MDPC, P.C_PARTIAL, b"mt", b"part"]
            w.send_multipart([b"", MDPW, P.W_FINAL, env, b"", *got])
            assert _recv(c) == [MDPC, P.C_FINAL, b"mt", *body]
        # majortomo's close(): DISCONNECT, delimited; the service is gone at once.
        w.send_multipart([b"", MDPW, P.W_DISCONNECT])
        _mmi(c, b"mt", b"404")
        # Its Client is not RFC 18 (REQUEST numbered 0x02, as a worker's): not served, and
        # the broker's line says what is wrong.
        c.send_multipart([b"", MDPC, b"\x02", b"mt", b"x"])
        broker.wait_log("a client's REQUEST is 0x01")
    finally:
        w.close()
        c.close()


def test_mdp01_peers_are_named_in_the_log_and_left_unanswered(cluster):
    # Found with the zguide's MDP/0.1 worker: the broker answered its READY with an MDP/0.2
    # DISCONNECT (2 or 3 frames, no delimiter), on which that worker asserts and dies
    # (`assert len(msg) >= 3`, `assert empty == ''`); the log said "refused a READY ...
    # must start with MDPW02, got b'MDPW01'".  An MDP/0.1 peer is now not answered at all
    # (RFC 18: drop invalid messages; the zguide's worker reconnects on its own silence
    # timer), and the line names MDP/0.1 and what the broker speaks.
    broker = cluster.broker()
    w, c = _dealer(cluster.backend), _dealer(cluster.frontend)
    try:
        w.send_multipart([b"", b"MDPW01", b"\x01", b"old"])  # mdwrkapi: READY
        w.send_multipart([b"", b"MDPW01", b"\x04"])  # mdwrkapi: HEARTBEAT
        c.send_multipart([b"", b"MDPC01", b"old", b"hello"])  # mdcliapi2: a request
        # zeromq/majordomo's libmajordomo (zproto): one packed frame (src/mdp_client_msg.c)
        c.send_multipart([b"\xaa\xa4\x01\x06MDPC02\x01\x03old", b"hello"])
        # Barriers: the broker handles one connection's messages in order, so anything it
        # answered to those would come before the answer to these.
        w.send_multipart([MDPW, P.W_HEARTBEAT])  # an unknown MDP/0.2 worker: DISCONNECT
        assert _recv(w) == [MDPW, P.W_DISCONNECT]
        c.send_multipart([MDPC, P.C_REQUEST, b"mmi.service", b"old"])
        assert _recv(c) == [MDPC, P.C_FINAL, b"mmi.service", b"404"]
        broker.wait_log("sent an MDP/0.1 message (MDPW01, ZeroMQ RFC 7")
        broker.wait_log("sent an MDP/0.1 message (MDPC01, ZeroMQ RFC 7")
        broker.wait_log("sent a zproto-encoded message")
    finally:
        w.close()
        c.close()


def test_a_plain_worker_silent_while_it_runs_a_request_is_not_presumed_dead(cluster):
    # Found with majortomo's Worker (and so would the zguide's): it heartbeats only while it
    # waits for work, and the brokers it comes with never expire a busy worker.  Ours
    # presumed it dead after heartbeat_interval x heartbeat_liveness (0.9 s here; 3 s by
    # default) of running one request: the request ran again elsewhere (max_retries), then
    # failed, and the worker was told DISCONNECT (majortomo's then exits).  A worker that
    # registered with a bare READY may now be silent while it runs a request a client
    # waits for; its silence counts again once nothing it runs has a client waiting.
    cluster.broker("--heartbeat-interval", "0.3")  # liveness window 0.9 s
    w, c = _dealer(cluster.backend), _dealer(cluster.frontend)
    try:
        w.send_multipart([MDPW, P.W_READY, b"slow"])
        _mmi(c, b"slow", b"200")
        c.send_multipart([MDPC, P.C_REQUEST, b"slow", b"job"])
        while (msg := _recv(w))[1] == P.W_HEARTBEAT:
            w.send_multipart([MDPW, P.W_HEARTBEAT])  # idle: it heartbeats
        assert msg[1] == P.W_REQUEST, msg
        env = msg[2]
        # Busy: silent while the broker heartbeats it nine times (2.4 s at least of the
        # broker's own clock: three liveness windows).
        beats = 0
        while beats < 9:
            msg = _recv(w)
            assert msg == [MDPW, P.W_HEARTBEAT], f"after {beats} heartbeats: {msg}"
            beats += 1
        w.send_multipart([MDPW, P.W_FINAL, env, b"", b"done"])
        assert _recv(c) == [MDPC, P.C_FINAL, b"slow", b"done"]
        # Still registered: the next request comes to it.
        c.send_multipart([MDPC, P.C_REQUEST, b"slow", b"again"])
        while (msg := _recv(w))[1] == P.W_HEARTBEAT:
            pass
        assert msg[1] == P.W_REQUEST and msg[4] == b"again", msg
        # Its client goes: nothing it runs has a client waiting, so its silence counts
        # again (a hung plain worker is still found).
        c.send_multipart([MDPC, P.C_DISCONNECT])
        while (msg := _recv(w))[1] != P.W_DISCONNECT:
            assert msg[1] in (P.W_HEARTBEAT, P.W_CANCEL), msg
    finally:
        w.close()
        c.close()
