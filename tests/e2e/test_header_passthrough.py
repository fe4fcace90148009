"""A REQUEST header's top-level keys that the broker does not know reach the worker unchanged
(docs/protocol.md section 5): during a rolling upgrade a newer client's option for a newer
worker crosses an older broker.  Raw pyzmq sockets against a real broker: a DEALER client
sends a header with a key no version knows, a raw MDP worker receives the dispatched REQUEST
and reads its header; the keys the broker owns are the broker's whatever the client wrote;
hostile variants are 400s that harm nobody; and a real worker (echo) ignores the key and
answers.  Replies are relayed as they came, unknown keys included.

Every wait is a poll with a timeout."""
from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
import zmq

from broker import protocol as P
from shm.segment import self_identity

from .test_interop import _mmi
from .test_protocol_docs import _recv, _work

pytestmark = pytest.mark.timeout(60)

MDPC, MDPW = P.MDPC, P.MDPW
WAIT = 10.0
_RAW = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
enc = msgspec.msgpack.encode


def _sock(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(endpoint)
    return s


def _keys_once(header: bytes) -> bool:
    """No key twice in the header's map: its entry count is its number of distinct keys."""
    t = header[4]
    n = t & 0x0F if 0x80 <= t <= 0x8F else int.from_bytes(header[5:7] if t == 0xDE else header[5:9], "big")
    return n == len(_RAW.decode(header[4:]))


def _error(msg: list[bytes], service: bytes, rid: int) -> str:
    assert msg[:3] == [MDPC, P.C_FINAL, service] and len(msg) == 4, msg
    rep = P.decode_reply(msg[3])
    assert rep.id == rid and rep.error is not None and rep.error.code == 400, rep
    return rep.error.message


def test_unknown_header_keys_reach_the_worker_and_the_brokers_own_keys_win(cluster):
    broker = cluster.broker("--heartbeat-liveness", "50")
    echo = cluster.worker("echo")
    w, c = _sock(cluster.backend), _sock(cluster.frontend)
    try:
        w.send_multipart(P.worker_ready("svc", P.Ready(credit=1, welcome=True)))
        assert _recv(w)[:2] == [MDPW, P.W_WELCOME]
        _mmi(c, b"svc", b"200", 20.0)
        future = {"mode": "fast", "knobs": [1, 2.5, {"deep": b"\x00\xff"}]}
        head = P.MAGIC + enc({"v": 1, "id": 1, "timeout_ms": 5000.0, "pid": 1, "pid_start": 5, "queue_ms": 1e9,
                              "backlog": 99, "returned": 7, "future_option": future, "meta": {"k": 1},
                              "future_flag": True})
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", head, b"extra frame"])
        msg = _work(w)
        assert msg[:2] == [MDPW, P.W_REQUEST] and msg[3] == b"" and msg[5:] == [b"extra frame"], msg
        raw = _RAW.decode(msg[4][4:])
        assert "future_option" in raw and "future_flag" in raw, f"the worker got {sorted(raw)}"
        assert bytes(raw["future_option"]) == enc(future) and bytes(raw["future_flag"]) == b"\xc3"
        got = msgspec.msgpack.decode(msg[4][4:])
        # The broker's keys: the kernel's pid, what is left of the budget, its own counts.
        assert got["pid"] == os.getpid() and got["pid_start"] == self_identity()[1], got
        assert 0 < got["timeout_ms"] <= 5000 and 0 <= got["queue_ms"] < 1e9, got
        assert got["backlog"] == 0 and got.get("returned") is None and got["meta"] == {"k": 1}, got
        assert P.decode_request(msg[4]).id == 1  # a worker reads it, ignoring what it does not know
        # A reply's unknown keys reach the client too: relayed as it came.
        answer = P.MAGIC + enc({"v": 1, "id": 1, "future_reply": [1, 2]})
        w.send_multipart([MDPW, P.W_FINAL, msg[2], b"", answer])
        assert _recv(c) == [MDPC, P.C_FINAL, b"svc", answer]

        # Hostile variants: a 400 naming the problem, and the next request still goes.
        many = P.MAGIC + b"\xde" + (5002).to_bytes(2, "big") + b"\xa1v\x01\xa2id\x02" + b"".join(
            b"\xa5k%04d\xc0" % i for i in range(5000))
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", many])
        assert f"at most {P.MAX_FORWARD_KEYS}" in _error(_recv(c), b"svc", 2)
        not_str = P.MAGIC + b"\x83\xa1v\x01\xa2id\x03\x01\x02"
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", not_str])
        assert "str" in _error(_recv(c), b"svc", 3)
        # A known key twice (the broker's own): one key at the worker, the broker's value.
        dup = P.MAGIC + b"\x85\xa1v\x01\xa2id\x04\xa3pid\x01\xa1x\x05\xa3pid\x02"
        c.send_multipart([MDPC, P.C_REQUEST, b"svc", dup])
        msg = _work(w)
        got = msgspec.msgpack.decode(msg[4][4:])
        assert got["id"] == 4 and got["x"] == 5 and got["pid"] == os.getpid(), got
        assert _keys_once(msg[4]), msg[4]
        w.send_multipart([MDPW, P.W_FINAL, msg[2], b"", P.encode_header(P.Reply(id=4))])
        assert P.decode_reply(_recv(c)[3]).id == 4

        # A real worker ignores the key and answers.
        _mmi(c, b"echo", b"200", 20.0)
        x = np.arange(4, dtype="<f4")
        head = P.MAGIC + enc({"v": 1, "id": 5, "timeout_ms": 5000.0, "future_option": future, "tensors": [
            {"name": "x", "dtype": "<f4", "shape": [4], "loc": {"kind": "inline", "frame": 0}}]})
        c.send_multipart([MDPC, P.C_REQUEST, b"echo", head, x.tobytes()])
        m = P.parse_broker_to_client(_recv(c))
        rep = P.decode_reply(m.body[0], frames=m.body[1:])
        assert m.command == P.C_FINAL and rep.id == 5 and rep.error is None, rep
        assert bytes(m.body[1 + rep.tensors[0].loc.frame]) == x.tobytes()
    finally:
        w.close()
        c.close()
    for p in (echo, broker):
        assert p.p.poll() is None, p.stderr()
