"""docs/protocol.md as a peer written in another language meets it: raw pyzmq DEALER and REQ
sockets speaking MDP/0.2 frames against a real broker (no client_sdk, no gpu_worker), each
promise of the page that no other test holds on the wire (found by the protocol-docs hunt).

What is held here, by section:

- 2: a HEARTBEAT answer's frames (instance = the WELCOME's, the window in ms, u32 big endian;
  a route only when asked; frames past the flags ignored); a plain client never gets one;
  PARTIALs in order, then exactly one FINAL (a worker's second FINAL is not relayed); CANCEL
  of a queued request (499), of a running one (a worker CANCEL with no reason frame, the
  worker's FINAL relayed), `queued_only` of a running one (nothing), of an unknown id
  (nothing), `expired` (504 at once, the worker's CANCEL says 0x01, its late FINAL dropped);
  DISCONNECT (running: CANCEL 0x02 at the worker; queued: dropped; nothing to the client;
  the connection served afresh after it).
- 3: WELCOME only to a `Ready` that asked, with the broker's settings; a bare READY is
  credit 1 (a second request waits for the FINAL); envelopes are 8 bytes, new per dispatch; a
  registered worker's unknown command, foreign envelope or unknown DONE is dropped and it
  stays registered; DONE settles a request with a reply socket on the worker's host (nothing
  relayed, the credit back); a second
  READY is answered DISCONNECT; an empty service name is refused with the reason; STOPPING
  takes the worker out of `mmi.service` at once, its held request still relayed.
- 4: `mmi.*` other than `mmi.service` answers "501", a token echoed.
- 5: at dispatch the broker writes `pid` and `pid_start` (the kernel's, whatever the client
  wrote), `timeout_ms` (what is left), `queue_ms`, `backlog`, `returned`; passes `id`,
  `priority`, `deadline_at`, `host`, `meta`, `reply`, `reply_to`, a valid `traceparent`
  unchanged, drops an invalid one; a REQUEST header of another `v` is a 400 naming version
  1, a CANCEL's is dropped (the request runs on); a `traceparent` that is not a string is a
  400.
- 6: 421, 429, 499, 502 (a request given back unasked max_retries + 1 times), 503 and 504
  FINALs are one frame, a Reply header whose `id` is the request's (0 for a header whose id
  cannot be read).
- 2/6: malformed client messages (an unknown command, a REQUEST without a body, a
  broker-to-client command, another protocol) are dropped, the connection keeps working.
- 1: a REQ client's empty delimiter is accepted and echoed (MDP/0.2).
"""
from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq

from broker import protocol as P

from .test_interop import _mmi

pytestmark = pytest.mark.timeout(60)

MDPC, MDPW = P.MDPC, P.MDPW
WAIT = 10.0


def _sock(kind: int, endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)
    s.linger = 0
    s.connect(endpoint)
    return s


def _recv(s: zmq.Socket, timeout: float = WAIT) -> list[bytes]:
    assert s.poll(int(timeout * 1000)), f"nothing came within {timeout} s"
    return s.recv_multipart()


def _work(w: zmq.Socket, timeout: float = WAIT) -> list[bytes]:
    """The next message to a raw worker that is not a HEARTBEAT (those are answered)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = _recv(w, max(0.0, deadline - time.monotonic()))
        if msg == [MDPW, P.W_HEARTBEAT]:
            w.send_multipart([MDPW, P.W_HEARTBEAT])
            continue
        return msg


def _no_work(w: zmq.Socket, seconds: float) -> None:
    """Only HEARTBEATs reach the raw worker for `seconds` (answered)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if w.poll(int(left * 1000) + 1):
            msg = w.recv_multipart()
            assert msg == [MDPW, P.W_HEARTBEAT], f"the worker got {msg[:4]}"
            w.send_multipart([MDPW, P.W_HEARTBEAT])


_tokens = iter(range(1, 1 << 30))


def _barrier(c: zmq.Socket) -> None:
    """An MMI question with a token: its answer is the next message, so nothing else came
    (the broker handles one connection's messages in order)."""
    token = b"t%d" % next(_tokens)
    c.send_multipart([MDPC, P.C_REQUEST, b"mmi.service", b"x", token])
    got = _recv(c)
    assert got == [MDPC, P.C_FINAL, b"mmi.service", b"404", token], f"before the barrier's answer: {got}"


def _head(**fields) -> bytes:
    """A request header as another language's msgpack library writes it."""
    return P.MAGIC + msgspec.msgpack.encode({"v": 1, **fields})


def _error(msg: list[bytes], service: bytes, rid: int, code: int) -> str:
    """`msg` is a FINAL for `service` whose body is one Reply header: request `rid`, error
    `code` (section 6).  Its message."""
    assert msg[:3] == [MDPC, P.C_FINAL, service] and len(msg) == 4, msg
    rep = P.decode_reply(msg[3])
    assert rep.id == rid and rep.error is not None and rep.error.code == code, rep
    return rep.error.message


def _starttime() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22


def test_a_plain_peer_meets_the_frames_sections_2_to_6_promise(cluster, tmp_path):
    # A liveness window of 10 s (0.2 s x 50): the raw workers below answer heartbeats only
    # when they read, and no check here is about a death.
    cluster.broker("--heartbeat-liveness", "50", "--service-grace", "0.3", "--max-queue", "1")
    fe, be = cluster.frontend, cluster.backend
    w, pw, c, h, d, r = (_sock(zmq.DEALER, be), _sock(zmq.DEALER, be), _sock(zmq.DEALER, fe),
                         _sock(zmq.DEALER, fe), _sock(zmq.DEALER, fe), _sock(zmq.REQ, fe))
    try:
        # ---- 3: WELCOME to a Ready that asked, with the broker's settings
        # (its host: a DONE is plausible only for a request with a reply socket on it)
        w.send_multipart(P.worker_ready("svc", P.Ready(credit=1, welcome=True, host=P.local_host_id())))
        msg = _recv(w)
        assert msg[:2] == [MDPW, P.W_WELCOME] and len(msg) == 3, msg
        welcome = msgspec.msgpack.decode(msg[2][4:])
        assert msg[2][:4] == P.MAGIC and welcome["v"] == 1 and len(welcome["instance"]) == 8, welcome
        assert welcome["heartbeat_interval"] == 0.2 and welcome["heartbeat_liveness"] == 50, welcome
        assert welcome.get("stopping") is True and not welcome.get("metrics"), welcome  # no --http
        pw.send_multipart([MDPW, P.W_READY, b"plain"])  # bare: no WELCOME (checked by _work below)
        _mmi(c, b"svc", b"200")
        _mmi(c, b"plain", b"200")

        # ---- 2: HEARTBEAT answers
        window = (int(0.2 * 50 * 1000)).to_bytes(4, "big")
        h.send_multipart([MDPC, P.C_HEARTBEAT])
        assert _recv(h) == [MDPC, P.C_HEARTBEAT, welcome["instance"], window]
        h.send_multipart([MDPC, P.C_HEARTBEAT, b"\x01", b"a later extension's frame"])
        named = _recv(h)
        assert named[:4] == [MDPC, P.C_HEARTBEAT, welcome["instance"], window] and len(named) == 5, named
        assert len(named[4]) == 8, named
        h.send_multipart([MDPC, P.C_HEARTBEAT, b"\x00"])
        assert _recv(h) == [MDPC, P.C_HEARTBEAT, welcome["instance"], window]

        # ---- 4: other mmi.* names
        c.send_multipart([MDPC, P.C_REQUEST, b"mmi.nothing", b"svc"])
        assert _recv(c) == [MDPC, P.C_FINAL, b"mmi.nothing", b"501"]
        c.send_multipart([MDPC, P.C_REQUEST, b"mmi.nothing", b"svc", b"tok"])
        assert _recv(c) == [MDPC, P.C_FINAL, b"mmi.nothing", b"501", b"tok"]

        # ---- 2/3: a plain request to a bare READY: credit 1, PARTIALs in order, one FINAL
        c.send_multipart([MDPC, P.C_REQUEST, b"plain", b"a", b"", b"c"])
        msg = _work(pw)
        assert msg[:2] == [MDPW, P.W_REQUEST] and len(msg[2]) == 8 and msg[3:] == [b"", b"a", b"", b"c"], msg
        env1 = msg[2]
        c.send_multipart([MDPC, P.C_REQUEST, b"plain", b"second"])
        _barrier(c)
        _no_work(pw, 0.15)  # credit 1: the second waits for the first's FINAL
        for cmd, body in ((P.W_PARTIAL, b"p0"), (P.W_PARTIAL, b"p1"), (P.W_FINAL, b"f"), (P.W_FINAL, b"again")):
            pw.send_multipart([MDPW, cmd, env1, b"", body])
        assert _recv(c) == [MDPC, P.C_PARTIAL, b"plain", b"p0"]
        assert _recv(c) == [MDPC, P.C_PARTIAL, b"plain", b"p1"]
        assert _recv(c) == [MDPC, P.C_FINAL, b"plain", b"f"]
        msg = _work(pw)
        assert msg[:2] == [MDPW, P.W_REQUEST] and msg[3:] == [b"", b"second"] and msg[2] != env1, msg
        pw.send_multipart([MDPW, P.W_FINAL, msg[2], b"", b"s"])
        assert _recv(c) == [MDPC, P.C_FINAL, b"plain", b"s"]  # not b"again", nor a heartbeat
        _barrier(c)

        # ---- 1: a REQ client (MDP/0.2): its delimiter accepted and echoed
        r.send_multipart([MDPC, P.C_REQUEST, b"plain", b"from req"])
        msg = _work(pw)
        assert msg[3:] == [b"", b"from req"], msg
        pw.send_multipart([MDPW, P.W_FINAL, msg[2], b"", b"to req"])
        assert _recv(r) == [MDPC, P.C_FINAL, b"plain", b"to req"]

        # ---- 5: the header at dispatch
        host = P.local_host_id()
        tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
        deadline_at = time.monotonic() + 3600.0  # later than receipt + timeout_ms: not the deadline
        reply_to = f"ipc://{tmp_path}/c-reply.ipc"
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(
            id=11, priority=2, timeout_ms=5000, deadline_at=deadline_at, host=host, pid=1, pid_start=5,
            reply="inline", meta={"k": [1, "two"]}, traceparent=tp, reply_to=reply_to,
            queue_ms=12345.0, backlog=99, returned=7), b"extra frame"])
        msg = _work(w)
        assert msg[:2] == [MDPW, P.W_REQUEST] and msg[3] == b"" and msg[5:] == [b"extra frame"], msg
        got = msgspec.msgpack.decode(msg[4][4:])
        assert got["id"] == 11 and got["priority"] == 2 and got["reply"] == "inline", got
        assert got["pid"] == os.getpid() and got["pid_start"] == _starttime(), got  # the kernel's, not 1 and 5
        assert 0 < got["timeout_ms"] <= 5000 and 0 <= got["queue_ms"] < 12345, got
        assert got["backlog"] == 0 and got.get("returned") is None, got
        assert got["deadline_at"] == deadline_at and got["host"] == host and got["reply_to"] == reply_to, got
        assert got["meta"] == {"k": [1, "two"]} and got["traceparent"] == tp, got
        answer = P.encode_header(P.Reply(id=11, timing={"compute_ms": 1.0}))
        w.send_multipart([MDPW, P.W_FINAL, msg[2], b"", answer])
        assert _recv(c) == [MDPC, P.C_FINAL, b"svc", answer]  # relayed unchanged
        # A traceparent that is not one is dropped (the request runs); not a string: 400.
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=12, traceparent="00-not-a-traceparent")])
        msg = _work(w)
        got = msgspec.msgpack.decode(msg[4][4:])
        assert got["id"] == 12 and got.get("traceparent") is None, got
        w.send_multipart([MDPW, P.W_FINAL, msg[2], b"", P.encode_header(P.Reply(id=12))])
        assert P.decode_reply(_recv(c)[3]).id == 12
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=13, traceparent=5)])
        _error(_recv(c), b"svc", 13, 400)
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", P.MAGIC + msgspec.msgpack.encode({"v": 2, "id": 14})])
        assert "version 1" in _error(_recv(c), b"svc", 14, 400)
        # Section 6: a malformed header is answered even when no id can be read (id 0).
        for bad in (_head(priority=1), P.MAGIC, P.MAGIC + msgspec.msgpack.encode([1, 2])):
            c.send_multipart([MDPC, P.C_REQUEST, b"svc", bad])
            _error(_recv(c), b"svc", 0, 400)

        # ---- 2/6: CANCEL, 429 (max-queue 1), 504
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=21, timeout_ms=WAIT * 1000)])
        run21 = _work(w)
        for rid in (22, 23):
            c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=rid, timeout_ms=WAIT * 1000)])
        _error(_recv(c), b"svc", 23, 429)
        c.send_multipart(P.client_cancel("svc", 999))  # unknown: ignored
        c.send_multipart(P.client_cancel("svc", 21, queued_only=True))  # running: left to run
        _barrier(c)
        c.send_multipart(P.client_cancel("svc", 22))  # queued
        _error(_recv(c), b"svc", 22, 499)
        c.send_multipart(P.client_cancel("svc", 21))  # running: at its worker, no reason frame
        assert _work(w) == [MDPW, P.W_CANCEL, run21[2]]
        err = P.error_body(21, P.ErrorCode.CANCELLED, "cancelled")
        w.send_multipart([MDPW, P.W_FINAL, run21[2], b"", *err])
        assert _recv(c) == [MDPC, P.C_FINAL, b"svc", *err]
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=24, timeout_ms=WAIT * 1000)])
        run24 = _work(w)
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=25, timeout_ms=50)])  # queued: its deadline
        _error(_recv(c), b"svc", 25, 504)
        c.send_multipart(P.client_cancel("svc", 24, expired=True))  # running, expired: 504 now
        _error(_recv(c), b"svc", 24, 504)
        assert _work(w) == [MDPW, P.W_CANCEL, run24[2], bytes([P.CANCEL_EXPIRED])]
        w.send_multipart([MDPW, P.W_FINAL, run24[2], b"", P.encode_header(P.Reply(id=24))])  # late: dropped
        # ---- 2: DISCONNECT: its running request cancelled (client gone), its queued one dropped
        d.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=26, timeout_ms=WAIT * 1000)])
        run26 = _work(w)
        d.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=27, timeout_ms=WAIT * 1000)])
        d.send_multipart([MDPC, P.C_DISCONNECT])
        assert _work(w) == [MDPW, P.W_CANCEL, run26[2], bytes([P.CANCEL_CLIENT_GONE])]
        w.send_multipart([MDPW, P.W_FINAL, run26[2], b"", *P.error_body(26, 499, "cancelled")])
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=28, timeout_ms=WAIT * 1000)])
        msg = _work(w)  # 28, not the dropped 27
        assert msgspec.msgpack.decode(msg[4][4:])["id"] == 28, msg
        w.send_multipart([MDPW, P.W_FINAL, msg[2], b"", P.encode_header(P.Reply(id=28))])
        assert P.decode_reply(_recv(c)[3]).id == 28  # (not 24's late FINAL)
        _barrier(d)  # nothing came to the client that said DISCONNECT
        _barrier(c)
        # ... and its connection is served afresh after it.
        d.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=29, timeout_ms=WAIT * 1000, host=P.local_host_id(),
                                                            reply_to=f"ipc://{tmp_path}/d-reply.ipc")])
        run29 = _work(w)
        assert msgspec.msgpack.decode(run29[4][4:])["id"] == 29, run29
        # ---- 5: a CANCEL header of another version has no answer: logged, dropped, the request runs on
        d.send_multipart([MDPC, P.C_CANCEL, b"svc", P.MAGIC + msgspec.msgpack.encode({"v": 2, "id": 29})])
        _barrier(d)
        # ---- 3: DONE settles a request that named a reply socket on the worker's host: nothing
        # relayed, the credit back (and no CANCEL came); one that named none is a 400
        # (tests/e2e/test_buggy_worker.py)
        w.send_multipart(P.worker_done([run29[2]]))
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=32, timeout_ms=WAIT * 1000)])
        msg = _work(w)
        assert msg[:2] == [MDPW, P.W_REQUEST] and msgspec.msgpack.decode(msg[4][4:])["id"] == 32, msg
        # RETURNED unasked is a refusal, a failed attempt: max_retries (2) + 1 of them, 502.
        for attempt in range(3):
            if attempt:
                msg = _work(w)
                assert msg[:2] == [MDPW, P.W_REQUEST], msg
            w.send_multipart(P.worker_returned([msg[2]]))
        _error(_recv(c), b"svc", 32, 502)
        _barrier(d)  # 29 ended with the DONE: nothing relayed
        _barrier(c)

        # ---- 6: 503, to a plain client too
        c.send_multipart([MDPC, P.C_REQUEST, b"nobody", _head(id=30)])
        _error(_recv(c), b"nobody", 30, 503)
        c.send_multipart([MDPC, P.C_REQUEST, b"nobody", b"opaque"])  # a plain client's: the typed header too
        _error(_recv(c), b"nobody", 0, 503)
        # 421: shared-memory references, and no worker of the service takes them here
        ref = {"name": "x", "dtype": "<f4", "shape": [4], "loc": {
            "kind": "shm", "segment": "zinf-1-2-0123456789abcdef-3", "offset": 0, "nbytes": 16, "slot": 0,
            "generation": 1}}
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=33, host=host, tensors=[ref])])
        _error(_recv(c), b"svc", 33, 421)

        # ---- 2/6: malformed client messages: dropped; the connection and the others unharmed
        for bad in ([MDPC, b"\x7f", b"x"], [MDPC, P.C_REQUEST, b"svc"], [MDPC, P.C_FINAL, b"svc", b"x"],
                    [b"MDPC09", P.C_REQUEST, b"svc", b"x"], [MDPC], [MDPC, P.C_CANCEL, b"svc", b"not a header"]):
            c.send_multipart(bad)
        _barrier(c)
        # ---- 3: a registered worker's unknown command, foreign envelope, unknown DONE: dropped
        w.send_multipart([MDPW, b"\x7f"])
        w.send_multipart([MDPW, P.W_FINAL, b"abc", b"", b"x"])
        w.send_multipart(P.worker_done([P.token_envelope(987654)]))
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=31, timeout_ms=WAIT * 1000)])
        msg = _work(w)
        assert msg[:2] == [MDPW, P.W_REQUEST], msg  # still registered, and told nothing else
        w.send_multipart([MDPW, P.W_FINAL, msg[2], b"", P.encode_header(P.Reply(id=31))])
        assert P.decode_reply(_recv(c)[3]).id == 31
        # A second READY: DISCONNECT, and the service is gone.
        pw.send_multipart([MDPW, P.W_READY, b"plain"])
        assert _work(pw) == [MDPW, P.W_DISCONNECT]
        _mmi(c, b"plain", b"404")
        # ---- 3: STOPPING (WELCOME said `stopping`): not a live worker of its service at once;
        # what it holds is still its own, relayed; then its DISCONNECT.
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", _head(id=34, timeout_ms=WAIT * 1000)])
        msg = _work(w)
        w.send_multipart([MDPW, P.W_STOPPING])
        _mmi(c, b"svc", b"404")  # (polled: the two sockets' messages are not ordered)
        w.send_multipart([MDPW, P.W_FINAL, msg[2], b"", P.encode_header(P.Reply(id=34))])
        assert P.decode_reply(_recv(c)[3]).id == 34
        w.send_multipart([MDPW, P.W_DISCONNECT])
        # An empty service name: refused, with the reason.
        e = _sock(zmq.DEALER, be)
        try:
            e.send_multipart([MDPW, P.W_READY, b""])
            msg = _recv(e)
            assert msg[:2] == [MDPW, P.W_DISCONNECT] and len(msg) == 3, msg
            assert P.decode_reply(msg[2]).error.code == 400, msg
        finally:
            e.close()
    finally:
        for s in (w, pw, c, h, d, r):
            s.close()
