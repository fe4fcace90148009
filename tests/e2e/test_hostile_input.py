"""Hostile input against live processes: zero-size dtypes with huge shapes, absurd claimed
shapes and deeply nested headers each get a typed 400 FINAL that names the problem, and harm
nobody else; a few thousand mutated MDP messages on both of the broker's sockets crash
nothing; the worker refuses the same headers itself when something hands them to it.

Every wait is a poll with a timeout; the only loop bounded by time is the mutation loop
(by a count and by 5 s of wall time)."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest
import zmq

from bench.hostile import mutate_frames
from broker import protocol as P
from client_sdk import Client
from tests.e2e.conftest import Proc, wait_service

pytestmark = pytest.mark.timeout(60)

SEG = "zinf-1-2-0123456789abcdef"


def _zero(name: str, where: str, dtype: str = "|V0") -> P.TensorRef:
    loc = (P.InlineLoc(frame=0) if where == "inline" else
           P.ShmLoc(segment=SEG, offset=0, nbytes=0, slot=0, generation=1))
    return P.TensorRef(name=name, dtype=dtype, shape=[1 << 40], loc=loc)


def _deep_meta(rid: int, levels: int = 10_000) -> bytes:
    """`{v: 1, id: rid, meta: {k: {k: ... nil}}}`, `levels` maps deep, with `id` up front as
    every encoder of ours writes it (so the error still names the request)."""
    return (P.MAGIC + b"\x83\xa1v\x01\xa2id\xcf" + rid.to_bytes(8, "big") + b"\xa4meta"
            + b"\x81\xa1k" * levels + b"\xc0")


def _hostile_requests(host: str) -> dict[int, tuple[list[bytes], str]]:
    """id -> (body frames after the service name, what the 400 must say)."""
    enc = P.encode_header
    huge = P.TensorRef(name="h", dtype="<f4", shape=[1 << 62],
                       loc=P.ShmLoc(segment=SEG, offset=0, nbytes=(1 << 64) - 1, slot=0, generation=1))
    empty_huge = P.TensorRef(name="e", dtype="<f4", shape=[0, 1 << 62], loc=P.InlineLoc(frame=0))
    return {
        1: ([enc(P.Request(id=1, tensors=[_zero("z", "inline")])), b""], "dtype '|V0' has item size 0"),
        2: ([enc(P.Request(id=2, host=host, tensors=[_zero("z", "shm")]))], "dtype '|V0' has item size 0"),
        3: ([enc(P.Request(id=3, tensors=[_zero(f"z{i}", "inline") for i in range(16)])), b""],
            "dtype '|V0' has item size 0"),
        4: ([enc(P.Request(id=4, host=host, tensors=[_zero("s", "shm", "|S0")]))], "dtype '|S0' has item size 0"),
        5: ([enc(P.Request(id=5, tensors=[_zero("u", "inline", "<U0")])), b""], "dtype '<U0' has item size 0"),
        6: ([_deep_meta(6)], "nests deeper than 32 levels"),
        7: ([enc(P.Request(id=7, host=host, tensors=[huge]))], "describe more than 1099511627776 bytes"),
        8: ([enc(P.Request(id=8, tensors=[empty_huge])), b""], "describe more than 1099511627776 bytes"),
        # (an input named "": echo failed to send it back, a 500 and a traceback; the interop audit)
        9: ([enc(P.Request(id=9, tensors=[P.TensorRef(name="", dtype="<f4", shape=[1], loc=P.InlineLoc(frame=0))])),
             b"\x00" * 4], "a tensor name may not be empty"),
        # 16 separate requests with a |V0 tensor each, sent together
        **{100 + i: ([enc(P.Request(id=100 + i, tensors=[_zero("z", "inline")])), b""], "item size 0")
           for i in range(16)},
    }


def _dealer(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(endpoint)
    return s


def _echo_round_trip(frontend: str, timeout: float = 5.0) -> None:
    """A legitimate client's request succeeds, promptly: the broker serves and the worker is
    neither dead nor spinning."""
    with Client(frontend, timeout=timeout) as c:
        wait_service(c, "echo", timeout=timeout)
        x = np.arange(1000, dtype=np.float32).reshape(10, 100)
        with c.infer("echo", {"x": x, "s": np.array([b"ab", b"c"])}, timeout=timeout) as out:
            np.testing.assert_array_equal(out["x"], x)
            assert out["s"].tolist() == [b"ab", b"c"]


def _stop_cleanly(*procs: Proc) -> None:
    """SIGTERM: each exits 0, and its log holds no traceback (no unmapped exception)."""
    for p in procs:
        assert p.p.poll() is None, f"{p.args} died: {p.stderr()}"
    for p in procs:
        rc = p.terminate()
        err = (p._err + p.p.stderr.read()).decode(errors="replace")
        assert rc == 0, f"{p.args} exited {rc}: {err[-2000:]}"
        assert "Traceback" not in err and "RecursionError" not in err, err[-3000:]


def test_zero_size_dtypes_absurd_shapes_and_deep_nesting_get_400s(cluster):
    broker = cluster.broker()
    worker = cluster.worker("echo")
    _echo_round_trip(cluster.frontend, timeout=20)
    cases = _hostile_requests(P.local_host_id())
    s = _dealer(cluster.frontend)
    try:
        for body, _ in cases.values():
            s.send_multipart(P.client_request("echo", body))
        got: dict[int, P.Reply] = {}
        while len(got) < len(cases):
            assert s.poll(5_000), f"no answer for {sorted(set(cases) - set(got))}"
            frames = s.recv_multipart()
            m = P.parse_broker_to_client(frames)
            assert m.command == P.C_FINAL and m.service == b"echo", frames[:3]
            rep = P.decode_reply(m.body[0])
            assert rep.id in cases and rep.id not in got, rep
            got[rep.id] = rep
        for rid, (_, why) in cases.items():
            err = got[rid].error
            assert err is not None and err.code == P.ErrorCode.PROTOCOL_ERROR, (rid, got[rid])
            assert why in err.message, (rid, err.message)
    finally:
        s.close()
    _echo_round_trip(cluster.frontend)
    _stop_cleanly(worker, broker)


def _client_corpus() -> list[list[bytes]]:
    ref = P.TensorRef(name="x", dtype="<i4", shape=[2, 2], loc=P.InlineLoc(frame=0))
    head = P.encode_header(P.Request(id=11, priority=2, timeout_ms=2000.0, tensors=[ref], meta={"a": [1, {"b": 2}]}))
    shm = P.encode_header(P.Request(id=12, host=P.local_host_id(), tensors=[
        P.TensorRef(name="y", dtype="<f4", shape=[4], loc=P.ShmLoc(segment=SEG, offset=0, nbytes=16, slot=0,
                                                                   generation=1))]))
    return [
        P.client_request("echo", [head, b"\x01" * 16]),
        P.client_request("echo", [shm]),
        P.client_request("echo", [b"opaque"]),
        P.client_request("echo", [_deep_meta(13, 40)]),
        P.client_request("mmi.service", [b"echo", b"token"]),
        P.client_cancel("echo", 11),
        P.client_heartbeat(),
        P.client_disconnect(),
    ]


def _worker_corpus() -> list[list[bytes]]:
    """A fake worker's messages, for a service nobody calls ("fuzz"): whatever the broker
    makes of them, it never routes a legitimate client's request to this socket."""
    rep = P.encode_header(P.Reply(id=11, tensors=[P.TensorRef(name="x", dtype="<i4", shape=[2], loc=P.InlineLoc(frame=0))]))
    ready = P.encode_header(P.Ready(credit=4, host=P.local_host_id(), transports=["inline", "shm"], welcome=True))
    env = P.token_envelope(1)
    return [
        P.worker_ready("fuzz"),
        P.worker_ready("fuzz", P.decode_ready(ready)),
        P.worker_reply(env, True, [rep, b"\x00" * 8]),
        P.worker_reply(env, False, [rep, b"\x00" * 8]),
        P.worker_done([env, P.token_envelope(2)]),
        P.worker_heartbeat(),
        P.worker_disconnect(),
    ]


def _drain(s: zmq.Socket) -> None:
    while s.poll(0):
        s.recv_multipart(zmq.NOBLOCK)


def test_mutated_messages_on_both_sockets_crash_nothing(cluster):
    broker = cluster.broker()
    worker = cluster.worker("echo")
    _echo_round_trip(cluster.frontend, timeout=20)
    rng = random.Random(1129)
    c_corpus, w_corpus = _client_corpus(), _worker_corpus()
    c, w = _dealer(cluster.frontend), _dealer(cluster.backend)
    sent = 0
    try:
        deadline = time.monotonic() + 5.0
        while sent < 3000 and time.monotonic() < deadline:
            for sock, corpus in ((c, c_corpus), (w, w_corpus)):
                frames = mutate_frames(rng, corpus) or [b""]
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass
            sent += 1
            if sent % 64 == 0:
                _drain(c)
                _drain(w)
    finally:
        c.close()
        w.close()
    assert sent >= 300, sent
    # The broker read all of it (an MMI answer is a barrier for this client's messages, and
    # the broker reads its two sockets in turn), and everyone still serves.
    _echo_round_trip(cluster.frontend, timeout=10)
    _stop_cleanly(worker, broker)


def test_the_worker_refuses_hostile_headers_itself(cluster):
    """Handed the same requests by a broker that did not check them (a fake one here: a
    ROUTER the worker registers with), the worker answers each with a 400 FINAL and then
    serves a real request at once: it neither hangs nor spins on a 0-byte item."""
    endpoint = f"ipc://{cluster.tmp}/fake-broker.ipc"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.linger = 0
    router.bind(endpoint)
    worker = Proc(["-m", "gpu_worker", "--broker", endpoint, "--model", "echo", "--heartbeat-interval", "0.2",
                   "--out-capacity-mb", "16"])
    cluster.procs.append(worker)
    try:
        worker.wait_ready()
        assert router.poll(10_000), "no READY from the worker"
        ident, *ready = router.recv_multipart()
        assert P.parse_worker(ready).command == P.W_READY

        def send(frames):
            router.send_multipart([ident, *frames])

        def finals(want: set[bytes], timeout: float = 5.0) -> dict[bytes, list[bytes]]:
            """FINALs by envelope, heartbeating meanwhile (the worker's window is 0.6 s)."""
            out: dict[bytes, list[bytes]] = {}
            end = time.monotonic() + timeout
            while want - set(out):
                assert time.monotonic() < end, f"no FINAL for {sorted(want - set(out))}"
                send(P.worker_heartbeat())
                if router.poll(100):
                    _, *frames = router.recv_multipart()
                    m = P.parse_worker(frames)
                    if m.command in (P.W_FINAL, P.W_PARTIAL):
                        assert m.command == P.W_FINAL
                        out[m.envelope] = list(m.body)
            return out

        cases = _hostile_requests(P.local_host_id())
        for rid, (body, _) in cases.items():
            send(P.to_worker_request(ident, P.token_envelope(rid), body)[1:])
        got = finals({P.token_envelope(r) for r in cases})
        for rid, (_, why) in cases.items():
            rep = P.decode_reply(got[P.token_envelope(rid)][0])
            assert rep.error is not None and rep.error.code == 400 and why in rep.error.message, (rid, rep)
        x = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
        good = P.encode_header(P.Request(id=5000, reply="inline", tensors=[
            P.TensorRef(name="x", dtype=x.dtype.str, shape=list(x.shape), loc=P.InlineLoc(frame=0))]))
        t0 = time.monotonic()
        send(P.to_worker_request(ident, P.token_envelope(5000), [good, x.tobytes()])[1:])
        body = finals({P.token_envelope(5000)}, timeout=10.0)[P.token_envelope(5000)]
        rep = P.decode_reply(body[0], len(body) - 1)
        assert rep.error is None and rep.id == 5000, rep
        assert body[1 + rep.tensors[0].loc.frame] == x.tobytes()
        # At once (milliseconds): seconds of slack for a loaded machine, none for a hang.
        assert time.monotonic() - t0 < 5.0
        _stop_cleanly(worker)
    finally:
        router.close()


def test_a_message_of_too_many_frames_is_dropped_whole_and_its_sender_cut_off(cluster):
    """Any number of frames: 500,000 empty ones (1 MB) held the broker's loop 0.9 s each and
    took 60 MB of it while kept (16 of them: 0.95 GB, a 7 s stall, workers presumed dead:
    the hostile hunt).  Past wire.MAX_FRAMES a message is read to its end and dropped, its
    sender's requests dropped and its connection ended; the worker's direct socket too."""
    from broker.protocol.wire import MAX_FRAMES, MAX_WORKER_FRAMES

    broker = cluster.broker()
    worker = cluster.worker("echo", "--direct")
    _echo_round_trip(cluster.frontend, timeout=20)
    n = MAX_FRAMES * 2
    c, w = _dealer(cluster.frontend), _dealer(cluster.backend)
    events = c.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        c.send_multipart([P.MDPC, P.C_HEARTBEAT] + [b""] * n)
        w.send_multipart([b"", P.MDPW, P.W_HEARTBEAT] + [b""] * n)
        broker.wait_log(f"sent a message of {n + 3} frames (at most {MAX_FRAMES}): dropped unread; its "
                        f"requests dropped and its connection ended", timeout=20)  # (its routing id counts)
        broker.wait_log(f"sent a message of {n + 4} frames (at most {MAX_WORKER_FRAMES}): dropped unread; "
                        f"disconnected", timeout=20)
        assert events.poll(10_000), "the broker did not end the connection"
    finally:
        c.disable_monitor()
        events.close(0)
        c.close()
        w.close()
    # A leaseholder's (or a stranger's) on the worker's direct socket: dropped there.
    d = _dealer(worker.field("direct"))
    try:
        d.send_multipart([b"\x01"] + [b""] * n)
        worker.wait_log(f"dropped a message of {n + 2} frames on the direct socket", timeout=20)
    finally:
        d.close()
    _echo_round_trip(cluster.frontend, timeout=10)
    _stop_cleanly(worker, broker)


def test_the_longest_plain_request_a_client_may_send_comes_back_from_echo(cluster):
    """A plain MDP request of the most body frames the frontend takes, echoed: its worker's
    reply is longer by its own frames, and the backend's bound leaves room for them (the
    same bound on both sides disconnected worker after worker over one such request)."""
    from client_sdk.core import MAX_BODY_FRAMES

    broker = cluster.broker()
    worker = cluster.worker("echo")
    with Client(cluster.frontend, timeout=20) as c:
        wait_service(c, "echo")
        body = [bytes([i % 256]) for i in range(MAX_BODY_FRAMES)]
        assert c.request("echo", body) == body
    _stop_cleanly(worker, broker)
