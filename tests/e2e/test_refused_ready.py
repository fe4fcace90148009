"""A READY the broker refuses, and a worker the broker does not know (docs/protocol.md
section 3), with real processes (found by the docs-as-contract hunt).

- A malformed READY (a credit over 65536, an `mmi.` name, a `Ready` of another version) was
  only logged: nothing went back, the worker took itself for registered, its next HEARTBEAT
  got DISCONNECT as an unknown worker, it sent READY again, refused again, forever, while
  `python -m gpu_worker` printed READY and its health probe said ready.  Now the refusal is a
  DISCONNECT carrying the reason, and our worker stops there (exit 2).
- A worker the broker does not know got DISCONNECT only for a HEARTBEAT or BUSY; a FINAL, a
  DONE, STATS and the like were dropped in silence.
"""
from __future__ import annotations

import time

import pytest
import zmq

from broker import protocol as P
from client_sdk import Client
from tests.children import read_rest_within
from tests.e2e.conftest import Proc, wait_service

WAIT_MS = 10_000


def _raw_worker(backend: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(backend)
    return s


def _answer(s: zmq.Socket) -> P.BrokerToWorker:
    assert s.poll(WAIT_MS), "the broker said nothing"
    return P.parse_broker_to_worker(s.recv_multipart())


@pytest.mark.parametrize("ready, why", [
    (P.worker_ready("echo", P.Ready(credit=70000)), "credit 70000 must be between 1 and 65536"),
    ([P.MDPW, P.W_READY, b"mmi.x"], "'mmi.' are reserved"),
    ([P.MDPW, P.W_READY, b"echo\r\n"], "not printable"),
    ([P.MDPW, P.W_READY, b"echo", P.MAGIC + b"\x81\xa1v\x02"], "version"),
])
def test_a_refused_ready_is_answered_with_the_reason(cluster, ready, why):
    cluster.broker()
    s = _raw_worker(cluster.backend)
    try:
        s.send_multipart(ready)
        msg = _answer(s)
        assert msg.command == P.W_DISCONNECT and len(msg.body) == 1
        err = P.decode_reply(msg.body[0]).error
        assert err.code == P.ErrorCode.PROTOCOL_ERROR and "READY refused" in err.message and why in err.message, err
    finally:
        s.close()


def test_a_worker_the_broker_does_not_know_is_told_to_register_whatever_it_sends(cluster):
    cluster.broker()
    for frames in ([P.MDPW, P.W_FINAL, P.token_envelope(7), b"", b"x"],
                   P.worker_done([P.token_envelope(7)]),
                   [P.MDPW, P.W_LEASED, b"\x00" * 8],
                   [P.MDPW, P.W_FINAL]):  # malformed, from nobody known
        s = _raw_worker(cluster.backend)
        try:
            s.send_multipart(frames)
            msg = _answer(s)
            assert msg.command == P.W_DISCONNECT and msg.body == (), frames
        finally:
            s.close()
    # A registered worker is not disturbed: it serves.
    cluster.worker("echo")
    with Client(cluster.frontend, timeout=10) as c:
        wait_service(c, "echo")
        with c.infer("echo", {"x": __import__("numpy").arange(3)}) as r:
            assert list(r["x"]) == [0, 1, 2]


def test_a_worker_whose_ready_is_refused_exits_2_without_saying_ready(cluster):
    # A worker whose own checks allow what the broker refuses (here: one that allows credits
    # up to 2**20, as a newer version might): it says why and exits 2, never READY.
    b = cluster.broker()
    code = ("import runpy, sys; import broker.protocol as P; P.MAX_CREDIT = 1 << 20; "
            "sys.argv = ['gpu_worker', *sys.argv[1:]]; runpy.run_module('gpu_worker', run_name='__main__')")
    w = Proc(["-c", code, "--broker", cluster.backend, "--model", "echo", "--credit", "70000", "--no-warmup",
              "--heartbeat-interval", "0.2"])
    try:
        assert w.p.wait(30) == 2
        out = read_rest_within(w.p.stdout, 10, "the end of the refused worker's stdout").decode()
        err = w.stderr(tail=None)
        assert "READY" not in out, out
        assert "the broker refused to register this worker: READY refused: credit 70000" in err, err[-2000:]
        assert b.p.poll() is None
    finally:
        w.close()


def test_a_worker_that_reconnects_at_once_on_a_refusal_is_answered_at_most_once_an_interval(cluster):
    # A worker that takes the refusal for a plain DISCONNECT (a plain MDP worker, or one of
    # ours from before the reason was sent) reconnects at once and sends its READY again:
    # answered each time, the pair looped thousands of times a second, half a core of the
    # broker (found by the version-skew hunt).  The broker answers a peer's refused READY at
    # most once a heartbeat interval (0.5 s here) and drops the others, as brokers before did.
    cluster.procs.append(Proc(["-m", "broker", "--frontend", cluster.frontend, "--backend", cluster.backend,
                               "--heartbeat-interval", "0.5"]))
    cluster.procs[-1].wait_ready()
    ready = P.worker_ready("echo", P.Ready(credit=70000))
    answered = tries = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.6:
        s = _raw_worker(cluster.backend)
        try:
            s.send_multipart(ready)
            tries += 1
            if s.poll(100):
                assert P.parse_broker_to_worker(s.recv_multipart()).command == P.W_DISCONNECT
                answered += 1
        finally:
            s.close()
    assert tries > answered and 1 <= answered <= 5, (tries, answered)
