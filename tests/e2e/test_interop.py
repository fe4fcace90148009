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

import random
import time

import numpy as np
import pytest
import zmq

import broker.protocol as P
from bench.hostile import mutate_frames
from client_sdk import Client
from tests.e2e.conftest import Proc, wait_service

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


def test_a_zproto_peer_is_named_in_the_log_and_left_unanswered(cluster):
    # zeromq/majordomo's libmajordomo (zproto) packs the protocol, command and service into
    # one binary frame (src/mdp_client_msg.c): not RFC 18's frames, nor RFC 7's.  Not
    # answered; the line says what it is.
    broker = cluster.broker()
    c = _dealer(cluster.frontend)
    try:
        c.send_multipart([b"\xaa\xa4\x01\x06MDPC02\x01\x03old", b"hello"])
        # Barrier: the broker handles one connection's messages in order.
        c.send_multipart([MDPC, P.C_REQUEST, b"mmi.service", b"old"])
        assert _recv(c) == [MDPC, P.C_FINAL, b"mmi.service", b"404"]
        broker.wait_log("sent a zproto-encoded message")
    finally:
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


# ------------------------------------------------------------------ MDP/0.1 (RFC 7, section 12.1)
#
# Before section 12.1, the broker never answered an MDP/0.1 peer (it logged one line): each
# test below waited out its first answer there (shown on the commit before it).

MDPC01, MDPW01 = b"MDPC01", b"MDPW01"


def _req(endpoint: str) -> zmq.Socket:
    """The zguide's mdcliapi: a REQ socket (it adds RFC 7's empty frame 0 and takes it off)."""
    s = zmq.Context.instance().socket(zmq.REQ)
    s.linger = 0
    s.connect(endpoint)
    return s


def _wait_mmi01(client: zmq.Socket, service: bytes, want: bytes, timeout: float = 10.0) -> None:
    """`mmi.service` in MDP/0.1 framing (the zguide's mmiecho) until the answer is `want`."""
    req = client.type == zmq.REQ
    head = [] if req else [b""]
    deadline = time.monotonic() + timeout
    while True:
        client.send_multipart([*head, MDPC01, b"mmi.service", service])
        reply = _recv(client)
        assert reply[:len(head) + 2] == [*head, MDPC01, b"mmi.service"], reply
        if reply[-1] == want:
            return
        assert time.monotonic() < deadline, f"mmi.service {service!r} still {reply[-1]!r}, not {want!r}"
        time.sleep(0.01)


def _worker_request(w: zmq.Socket) -> list[bytes]:
    """The next REQUEST to a raw MDP/0.2 worker (heartbeats answered): [envelope, body...]."""
    while True:
        msg = _recv(w)
        if msg[:2] == [MDPW, P.W_HEARTBEAT]:
            w.send_multipart([MDPW, P.W_HEARTBEAT])
            continue
        assert msg[:2] == [MDPW, P.W_REQUEST] and msg[3] == b"", msg
        return [msg[2], *msg[4:]]


def _nothing(s: zmq.Socket, what: str) -> None:
    assert not s.poll(0), f"{what}: {s.recv_multipart()}"


def test_mdp01_clients_on_req_and_dealer_sockets_get_one_reply_per_request(cluster):
    # The zguide's mdcliapi (REQ) and mdcliapi2 (DEALER) against an MDP/0.2 worker, beside
    # an MDP/0.2 client of the same worker: each 0.1 request gets one reply, the FINAL (a
    # streaming worker's PARTIALs are not sent to it), an empty body as one empty frame,
    # and errors as the header plus its text.
    cluster.broker("--service-grace", "0.3")
    w, c2 = _dealer(cluster.backend), _dealer(cluster.frontend)
    r, d = _req(cluster.frontend), _dealer(cluster.frontend)
    try:
        w.send_multipart([MDPW, P.W_READY, b"svc"])
        _mmi(c2, b"svc", b"200")
        r.send_multipart([MDPC01, b"mmi.service", b"svc"])  # mmiecho, on a REQ socket
        assert _recv(r) == [MDPC01, b"mmi.service", b"200"]
        r.send_multipart([MDPC01, b"mmi.service", b"nobody"])
        assert _recv(r) == [MDPC01, b"mmi.service", b"404"]

        # REQ: the worker streams; the client gets the FINAL alone.
        r.send_multipart([MDPC01, b"svc", b"hello", b"two"])
        env, *body = _worker_request(w)
        assert body == [b"hello", b"two"]
        w.send_multipart([MDPW, P.W_PARTIAL, env, b"", b"part"])
        w.send_multipart([MDPW, P.W_FINAL, env, b"", b"done"])
        assert _recv(r) == [MDPC01, b"svc", b"done"]
        # An empty FINAL: one empty body frame (RFC 7's REPLY has at least one).
        r.send_multipart([MDPC01, b"svc", b"again"])
        env, *body = _worker_request(w)
        w.send_multipart([MDPW, P.W_FINAL, env, b""])
        assert _recv(r) == [MDPC01, b"svc", b""]

        # DEALER (mdcliapi2): RFC 7's frame 0 sent and answered; an MDP/0.2 client's stream
        # through the same worker meanwhile is untouched.
        d.send_multipart([b"", MDPC01, b"svc", b"x"])
        env1, *body = _worker_request(w)
        assert body == [b"x"]
        c2.send_multipart([MDPC, P.C_REQUEST, b"svc", b"y"])
        w.send_multipart([MDPW, P.W_PARTIAL, env1, b"", b"x-part"])
        w.send_multipart([MDPW, P.W_FINAL, env1, b"", b"x-done"])
        env2, *body = _worker_request(w)
        assert body == [b"y"]
        w.send_multipart([MDPW, P.W_PARTIAL, env2, b"", b"y-part"])
        w.send_multipart([MDPW, P.W_FINAL, env2, b"", b"y-done"])
        assert _recv(c2) == [MDPC, P.C_PARTIAL, b"svc", b"y-part"]
        assert _recv(c2) == [MDPC, P.C_FINAL, b"svc", b"y-done"]
        assert _recv(d) == [b"", MDPC01, b"svc", b"x-done"]

        # Errors: the broker's 503 (no worker within the service grace), its 400 (a header
        # that does not parse): the typed header, then its text.
        d.send_multipart([b"", MDPC01, b"nobody", b"x"])
        reply = _recv(d)
        assert reply[:3] == [b"", MDPC01, b"nobody"] and len(reply) == 5, reply
        assert P.reply_error_code(reply[3]) == 503 and reply[4].startswith(b"503 SERVICE_UNAVAILABLE: "), reply
        r.send_multipart([MDPC01, b"svc", P.MAGIC + b"\x81\xa1v\x01"])  # a header without its id
        reply = _recv(r)
        assert reply[:2] == [MDPC01, b"svc"] and P.reply_error_code(reply[2]) == 400, reply
        assert reply[3].startswith(b"400 PROTOCOL_ERROR: "), reply
        # Nothing more came to anyone (the PARTIALs were not sent late).
        d.send_multipart([b"", MDPC01, b"mmi.service", b"svc"])
        assert _recv(d) == [b"", MDPC01, b"mmi.service", b"200"]
        _nothing(r, "the REQ client")
        # mdcliapi gives up on a slow reply by closing its socket (then sends again on a new
        # one): the close ends the request, cancelled at its worker (client gone).
        r.send_multipart([MDPC01, b"svc", b"slow"])
        env, *body = _worker_request(w)
        r.close()
        while (msg := _recv(w))[:2] == [MDPW, P.W_HEARTBEAT]:
            pass
        assert msg == [MDPW, P.W_CANCEL, env, bytes([P.CANCEL_CLIENT_GONE])], msg
    finally:
        for s in (w, c2, r, d):
            s.close()


def _mdp01_worker(cluster, service: str, *extra: str) -> Proc:
    p = Proc(["-m", "mdp01_worker", cluster.backend, service, *extra])
    cluster.procs.append(p)
    p.wait_ready()
    return p


def test_an_mdp02_req_client_of_a_streaming_service_gets_each_request_s_own_final(cluster):
    # A REQ socket takes the first reply that comes after its next send as that request's
    # answer: a stream's later PARTIALs reached it, and the next request got the previous
    # one's PARTIAL, one reply out of step for good (the interop audit).  It gets the FINAL.
    cluster.broker()
    w, r = _dealer(cluster.backend), _req(cluster.frontend)
    try:
        w.send_multipart([MDPW, P.W_READY, b"svc"])
        _mmi(r, b"svc", b"200")
        for n in range(3):
            r.send_multipart([MDPC, P.C_REQUEST, b"svc", b"ask%d" % n])
            env, *body = _worker_request(w)
            assert body == [b"ask%d" % n]
            w.send_multipart([MDPW, P.W_PARTIAL, env, b"", b"p0"])
            w.send_multipart([MDPW, P.W_PARTIAL, env, b"", b"p1"])
            w.send_multipart([MDPW, P.W_FINAL, env, b"", b"done%d" % n])
            assert _recv(r) == [MDPC, P.C_FINAL, b"svc", b"done%d" % n]
        # A DEALER that leads with the empty frame (majortomo's client) reads streams: it
        # gets every PARTIAL, the broker telling the two apart by their announced socket type.
        d = _dealer(cluster.frontend)
        try:
            d.send_multipart([b"", MDPC, P.C_REQUEST, b"svc", b"ask"])
            env, *body = _worker_request(w)
            w.send_multipart([MDPW, P.W_PARTIAL, env, b"", b"p0"])
            w.send_multipart([MDPW, P.W_FINAL, env, b"", b"done"])
            assert _recv(d) == [b"", MDPC, P.C_PARTIAL, b"svc", b"p0"]
            assert _recv(d) == [b"", MDPC, P.C_FINAL, b"svc", b"done"]
        finally:
            d.close(0)
    finally:
        w.close(0)
        r.close(0)


def test_a_zguide_mdp01_worker_heartbeats_and_serves_mdp02_and_mdp01_clients(cluster):
    # tests/e2e/mdp01_worker.py does what the zguide's mdwrkapi does, asserts included.  It
    # stays registered across many liveness windows of heartbeats both ways, and serves an
    # MDP/0.2 client and both kinds of MDP/0.1 client.
    # A 1.5 s liveness window (0.3 s x 5): wide enough that a loaded machine's scheduling
    # does not take the worker for dead, which would fail the last assert.
    cluster.broker("--heartbeat-interval", "0.3", "--heartbeat-liveness", "5")
    worker = _mdp01_worker(cluster, "zg", "--heartbeat-ms", "150")
    c2, r = _dealer(cluster.frontend), _req(cluster.frontend)
    try:
        _mmi(c2, b"zg", b"200")
        worker.wait_log("HEARTBEAT 11\n")  # >= 3 s of the broker's heartbeats: two windows
        _mmi(c2, b"zg", b"200")
        c2.send_multipart([MDPC, P.C_REQUEST, b"zg", b"from", b"0.2"])
        assert _recv(c2) == [MDPC, P.C_FINAL, b"zg", b"from", b"0.2"]
        r.send_multipart([MDPC01, b"zg", b"from 0.1"])
        assert _recv(r) == [MDPC01, b"zg", b"from 0.1"]
        worker.wait_log("REQUEST 2 [b'from 0.1']")
        assert worker.p.poll() is None
        assert b"RECONNECT" not in worker._err and b"DISCONNECT" not in worker._err, worker._err
    finally:
        c2.close()
        r.close()


def test_a_sigkilled_mdp01_worker_s_request_runs_on_another(cluster):
    # The zguide's worker is silent while it works (a bare READY: not presumed dead for
    # that, section 3); killed, its request goes to the next worker of the service.
    cluster.broker()
    first = _mdp01_worker(cluster, "zg", "--heartbeat-ms", "150", "--hang")
    d = _dealer(cluster.frontend)
    try:
        _wait_mmi01(d, b"zg", b"200")
        d.send_multipart([b"", MDPC01, b"zg", b"job"])
        first.wait_log("REQUEST 1 [b'job']")
        second = _mdp01_worker(cluster, "zg", "--heartbeat-ms", "150")
        first.kill()
        assert _recv(d) == [b"", MDPC01, b"zg", b"job"]
        second.wait_log("REQUEST 1 [b'job']")
    finally:
        d.close()


def test_an_mdp01_worker_is_told_disconnect_in_rfc7_framing_and_registers_again(cluster):
    # After a broker restart the worker's first HEARTBEAT reaches a broker that does not
    # know it: DISCONNECT, exactly RFC 7's three frames (an MDP/0.2 one would trip the
    # zguide's asserts), and it registers again.  Its own silence timer is long here, so
    # that only the DISCONNECT can bring it back.  Raw sockets: a refused READY (an `mmi.`
    # name) and a worker's message in the framing it did not register in.
    broker = cluster.broker()
    worker = _mdp01_worker(cluster, "zg", "--heartbeat-ms", "150", "--liveness", "400")
    r = _req(cluster.frontend)
    w = _dealer(cluster.backend)
    try:
        _wait_mmi01(r, b"zg", b"200")
        broker.terminate()
        cluster.broker()
        worker.wait_log("DISCONNECT 1 [b'', b'MDPW01', b'\\x05']")
        _wait_mmi01(r, b"zg", b"200")
        r.send_multipart([MDPC01, b"zg", b"after"])
        assert _recv(r) == [MDPC01, b"zg", b"after"]
        assert worker.p.poll() is None and b"RECONNECT" not in worker._err, worker._err

        w.send_multipart([b"", MDPW01, b"\x01", b"mmi.x"])  # refused: a reserved name
        assert _recv(w) == [b"", MDPW01, b"\x05"]
        w.close()
        w = _dealer(cluster.backend)
        w.send_multipart([b"", MDPW01, b"\x01", b"raw"])
        _wait_mmi01(r, b"raw", b"200")
        r.send_multipart([MDPC01, b"raw", b"q"])
        msg = _recv(w)
        while msg == [b"", MDPW01, b"\x04"]:  # heartbeats meanwhile
            msg = _recv(w)
        assert msg[:3] == [b"", MDPW01, b"\x02"] and msg[4:] == [b"", b"q"], msg
        env = msg[3]
        # MDP/0.2's FINAL (0x04, 0.1's HEARTBEAT) from a 0.1 worker: dropped, never relayed.
        w.send_multipart([MDPW, P.W_FINAL, env, b"", b"wrong framing"])
        w.send_multipart([b"", MDPW01, b"\x03", env, b"", b"right"])
        assert _recv(r) == [MDPC01, b"raw", b"right"]
        w.send_multipart([b"", MDPW01, b"\x01", b"raw"])  # a second READY: DISCONNECT
        msg = _recv(w)
        while msg == [b"", MDPW01, b"\x04"]:
            msg = _recv(w)
        assert msg == [b"", MDPW01, b"\x05"]
        _wait_mmi01(r, b"raw", b"404")
    finally:
        r.close()
        w.close()


def test_an_mdp01_client_against_our_gpu_worker(cluster):
    # Our worker with the `echo` model takes opaque bodies and sends them back; a request
    # it refuses itself (a shared-memory reference to a segment nobody has) comes back as
    # its typed error, with the text.
    cluster.broker()
    cluster.worker("echo")
    r = _req(cluster.frontend)
    try:
        _wait_mmi01(r, b"echo", b"200", timeout=20)
        r.send_multipart([MDPC01, b"echo", b"opaque", b"", b"\xc1 not ours"])
        assert _recv(r) == [MDPC01, b"echo", b"opaque", b"", b"\xc1 not ours"]
        ref = P.TensorRef(name="x", dtype="<f4", shape=[4], loc=P.ShmLoc(
            segment="zinf-1-2-0123456789abcdef-3", offset=0, nbytes=16, slot=0, generation=1))
        head = P.encode_header(P.Request(id=77, host=P.local_host_id(), tensors=[ref], timeout_ms=5000.0))
        r.send_multipart([MDPC01, b"echo", head])
        reply = _recv(r)
        assert reply[:2] == [MDPC01, b"echo"] and len(reply) == 4, reply
        rep = P.decode_reply(reply[2])
        assert rep.id == 77 and rep.error is not None and rep.error.code == 400, rep
        assert reply[3] == f"400 PROTOCOL_ERROR: {rep.error.message}".encode(), reply
    finally:
        r.close()


def test_malformed_mdp01_input_harms_no_mdp02_client(cluster):
    # Mutated MDP/0.1 messages on both sockets (bench.hostile's mutators, the corpus
    # written to the zguide's framing) while an MDP/0.2 client's requests run through our
    # worker: every one of them answered right, the broker alive, and a well-formed 0.1
    # question still answered after each burst.
    broker = cluster.broker()
    cluster.worker("echo")
    rng = random.Random(2026_12_06)
    env = (7).to_bytes(8, "big")
    c_corpus = [[b"", MDPC01, b"fz", b"body"], [b"", MDPC01, b"mmi.service", b"fz"],
                [b"", MDPC01, b"fz", P.encode_header(P.Request(id=5)), b"x"]]
    w_corpus = [[b"", MDPW01, b"\x01", b"fz"], [b"", MDPW01, b"\x03", env, b"", b"r"], [b"", MDPW01, b"\x04"],
                [b"", MDPW01, b"\x05"]]
    fc, fw, q = _dealer(cluster.frontend), _dealer(cluster.backend), _dealer(cluster.frontend)
    x = np.arange(64, dtype=np.float32)
    try:
        with Client(cluster.frontend, timeout=10) as client:
            wait_service(client, "echo")
            deadline = time.monotonic() + 3.0
            sent = rounds = 0
            while time.monotonic() < deadline or rounds < 3:
                for _ in range(100):
                    for sock, corpus in ((fc, c_corpus), (fw, w_corpus)):
                        try:
                            sock.send_multipart(mutate_frames(rng, corpus) or [b""], zmq.NOBLOCK)
                        except zmq.Again:
                            pass
                    sent += 1
                with client.infer("echo", {"x": x + rounds}, timeout=10) as out:
                    np.testing.assert_array_equal(out["x"], x + rounds)
                q.send_multipart([b"", MDPC01, b"mmi.service", b"echo"])
                assert _recv(q) == [b"", MDPC01, b"mmi.service", b"200"]
                for sock in (fc, fw):
                    while sock.poll(0):
                        sock.recv_multipart()
                rounds += 1
        assert sent >= 300
        # The broker's lines about bad input share one rate limit (a line a second, the first
        # three held back shown), and the client's mutants, sent first in each round, could
        # take every slot of the burst: a malformed worker message, now alone, is said.
        deadline = time.monotonic() + 15.0
        while True:
            fw.send_multipart([b"", MDPW01, b"\x7f"], zmq.NOBLOCK)  # a command MDP/0.1 does not have
            try:
                broker.wait_log("malformed worker message", timeout=0.5)
                break
            except TimeoutError:
                assert time.monotonic() < deadline, "the broker never said it met a malformed worker message"
        assert broker.p.poll() is None
    finally:
        for s in (fc, fw, q):
            s.close()
