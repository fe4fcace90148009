"""broker.protocol: round trips, validation, and that bad input is one typed error."""
from __future__ import annotations

import re

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from broker import protocol as P


def _shm_ref(name="x", dtype="<f4", shape=(2, 3), **kw):
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    loc = P.ShmLoc(
        segment=kw.get("segment", "zinf-1-2-0123456789abcdef"),
        offset=kw.get("offset", 4096),
        nbytes=kw.get("nbytes", nbytes),
        slot=kw.get("slot", 0),
        generation=kw.get("generation", 1),
    )
    return P.TensorRef(name=name, dtype=dtype, shape=list(shape), loc=loc)


def test_request_round_trip_all_locations():
    refs = [
        _shm_ref("a"),
        P.TensorRef(name="b", dtype="|u1", shape=[4], loc=P.InlineLoc(frame=0)),
        P.TensorRef(
            name="c", dtype="<f2", shape=[8], loc=P.CudaLoc(pool="p", offset=0, nbytes=16, device=0, handle=b"h" * 64, event=b"e" * 64)
        ),
    ]
    req = P.Request(id=7, priority=0, timeout_ms=12.5, host="h", pid=1, tensors=refs, meta={"k": [1, 2]})
    frame = P.encode_header(req)
    assert P.is_header(frame)
    # As a worker reads it: the client's fields, and the broker's (attempt) unset
    assert P.decode_request(frame, n_inline=1) == P.DispatchedRequest(**msgspec.structs.asdict(req))
    # As the broker reads it: `meta` stays bytes, and goes on to the worker as it came.
    routed = P.decode_request(frame, n_inline=1, routed=True)
    assert bytes(routed.meta) == msgspec.msgpack.encode(req.meta)
    assert P.encode_header(routed) == frame


def test_header_is_plain_msgpack_after_magic():
    """Another language reads the header with any msgpack library: a map with string keys."""
    req = P.Request(id=1, tensors=[_shm_ref()], host="h")
    frame = P.encode_header(req)
    assert frame[:4] == b"\xc1ZNF"
    m = msgspec.msgpack.decode(frame[4:])
    assert m["v"] == 1 and m["id"] == 1
    assert m["tensors"][0]["loc"]["kind"] == "shm"


def test_opaque_bodies_are_not_headers():
    for body in [b"", b"hello", msgspec.msgpack.encode({"a": 1}), b'{"json": 1}']:
        assert not P.is_header(body)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: m.update(v=2), "version 2"),
        (lambda m: m.update(priority=7), "priority"),
        (lambda m: m.update(id=-1), "unsigned"),
        (lambda m: m.update(id="x"), "id"),
        (lambda m: m.update(reply="carrier-pigeon"), "reply mode"),
        (lambda m: m["tensors"][0].update(dtype="|O"), "objects"),
        (lambda m: m["tensors"][0].update(dtype="float32"), "canonical"),
        (lambda m: m["tensors"][0].update(dtype="nonsense"), "unknown dtype"),
        (lambda m: m["tensors"][0].update(shape=[-1, 3]), "negative"),
        (lambda m: m["tensors"][0]["loc"].update(nbytes=5), "need 24"),
        (lambda m: m["tensors"][0]["loc"].update(kind="carrier"), "loc"),
        (lambda m: m.update(tensors=[m["tensors"][0], m["tensors"][0]]), "twice"),
        (lambda m: m.pop("host"), "host"),
        (lambda m: m["tensors"][0].update(shape=[1] * 40), "dimensions"),
    ],
)
def test_bad_request_headers_raise_protocol_error(mutate, match):
    m = msgspec.msgpack.decode(msgspec.msgpack.encode(P.Request(id=1, host="h", tensors=[_shm_ref()])))
    mutate(m)
    with pytest.raises(P.ProtocolError, match=match):
        P.decode_request(P.MAGIC + msgspec.msgpack.encode(m))


def test_inline_frame_index_and_size_checked():
    ref = P.TensorRef(name="b", dtype="<i4", shape=[3], loc=P.InlineLoc(frame=1))
    frame = P.encode_header(P.Request(id=1, tensors=[ref]))
    with pytest.raises(P.ProtocolError, match="inline frame 1"):
        P.decode_request(frame, n_inline=1)
    req = P.decode_request(frame, n_inline=2)
    with pytest.raises(P.ProtocolError, match="has 4 bytes"):
        P.check_inline_sizes(req.tensors, [b"", b"abcd"])
    P.check_inline_sizes(req.tensors, [b"", b"x" * 12])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_escapes_as_another_exception(data):
    for decoder in (P.decode_request, P.decode_reply, P.decode_ready, P.decode_cancel):
        for frame in (data, P.MAGIC + data):
            try:
                decoder(frame)
            except P.ProtocolError:
                pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=12), max_size=6))
def test_garbage_frames_never_escape(frames):
    for parser in (P.parse_client, P.parse_worker, P.parse_broker_to_client, P.parse_broker_to_worker):
        try:
            parser(frames)
        except P.ProtocolError:
            pass


def test_parse_client_commands():
    m = P.parse_client(P.client_request("echo", [b"body"]))
    assert (m.command, m.service, m.body, m.leading_empty) == (P.C_REQUEST, b"echo", (b"body",), False)
    m = P.parse_client([b"", *P.client_request("echo", [b"body"])])
    assert m.leading_empty and m.body == (b"body",)
    assert P.parse_client(P.client_heartbeat()).command == P.C_HEARTBEAT
    # The flags frame (bit 0: name my connection): its first byte, whatever follows it.
    assert P.parse_client(P.client_heartbeat(ask_route=True)).body == (bytes([P.HB_ASK_ROUTE]),)
    assert P.parse_client(P.client_heartbeat()).body == ()
    assert P.parse_client([P.MDPC, P.C_HEARTBEAT, b"\x03xyz", b"more"]).body == (b"\x03",)
    assert P.parse_client([P.MDPC, P.C_HEARTBEAT, b""]).body == ()
    m = P.parse_client(P.client_cancel("echo", 9))
    assert P.decode_cancel(m.body[0]).id == 9
    with pytest.raises(P.ProtocolError, match="MDPC02"):
        P.parse_client([b"MDPC03", b"\x01", b"echo", b"x"])
    with pytest.raises(P.ProtocolError, match="starts with an empty frame"):  # MDP/0.1 without RFC 7's frame 0
        P.parse_client([b"MDPC01", b"echo", b"x"])
    with pytest.raises(P.ProtocolError, match="unknown client command"):
        P.parse_client([b"MDPC02", b"\x09"])
    with pytest.raises(P.ProtocolError, match="body frame"):
        P.parse_client([b"MDPC02", b"\x01", b"echo"])


def test_mdp01_messages_are_read_as_the_mdp02_commands_they_mean():
    # docs/protocol.md section 12.1: a client's REQUEST (from a REQ socket, or a DEALER that
    # sends RFC 7's frame 0 itself); a worker's READY, REPLY, HEARTBEAT, DISCONNECT.
    m = P.parse_client([b"", b"MDPC01", b"echo", b"a", b"b"])
    assert (m.command, m.service, m.body, m.leading_empty) == (P.C_REQUEST, b"echo", (b"a", b"b"), True)
    for bad, match in (([b"", b"MDPC01", b"echo"], "at least one"), ([b"", b"MDPC01", b"", b"x"], "service name"),
                       ([b"", b"MDPC01", b"s" * 256, b"x"], "service name"), ([b"", b"MDPC01"], "at least 2")):
        with pytest.raises(P.ProtocolError, match=match):
            P.parse_client(bad)
    m = P.parse_worker([b"", b"MDPW01", b"\x01", b"echo"])
    assert (m.command, m.service, m.ready) == (P.W_READY, b"echo", None)  # a bare READY
    m = P.parse_worker([b"", b"MDPW01", b"\x03", b"env", b"", b"r1", b"r2"])
    assert (m.command, m.envelope, m.body) == (P.W_FINAL, b"env", (b"r1", b"r2"))  # 0x03 is 0.2's PARTIAL
    assert P.parse_worker([b"", b"MDPW01", b"\x04"]).command == P.W_HEARTBEAT  # 0x04 is 0.2's FINAL
    assert P.parse_worker([b"", b"MDPW01", b"\x05"]).command == P.W_DISCONNECT
    for bad, match in (([b"MDPW01", b"\x01", b"echo"], "empty frame"),
                       ([b"", b"MDPW01", b"\x01", b"echo", P.encode_header(P.Ready())], "nothing more"),
                       ([b"", b"MDPW01", b"\x01", b"mmi.x"], "reserved"),
                       ([b"", b"MDPW01", b"\x01", b"echo\n"], "not printable"),
                       ([b"", b"MDPW01", b"\x01", b"e\x1b[2Jcho"], "not printable"),
                       ([b"", b"MDPW01", b"\x02", b"env", b"", b"x"], "only a broker sends"),
                       ([b"", b"MDPW01", b"\x03", b"env", b"x"], "REPLY"),
                       ([b"", b"MDPW01", b"\x03", b"e" * 256, b""], "255"),
                       ([b"", b"MDPW01", b"\x06"], "unknown MDP/0.1")):
        with pytest.raises(P.ProtocolError, match=match):
            P.parse_worker(bad)


def test_mdp01_peers_get_what_the_broker_sends_in_rfc7_framing():
    # To a worker: REQUEST, HEARTBEAT and DISCONNECT exactly as RFC 7 writes them (no refusal
    # reason: the zguide's worker asserts on more); nothing for CANCEL, which 0.1 lacks.
    assert P.to_worker01(P.to_worker_request(b"id", b"env", [b"x", b"y"])) == [
        b"id", b"", b"MDPW01", b"\x02", b"env", b"", b"x", b"y"]
    assert P.to_worker01([b"id", *P.worker_heartbeat()]) == [b"id", b"", b"MDPW01", b"\x04"]
    refusal = P.error_body(0, P.ErrorCode.PROTOCOL_ERROR, "READY refused")
    assert P.to_worker01([b"id", *P.worker_disconnect(refusal)]) == [b"id", b"", b"MDPW01", b"\x05"]
    assert P.to_worker01(P.to_worker_cancel(b"id", b"env", P.CANCEL_EXPIRED)) is None
    # To a client: the FINAL only, from RFC 7's frame 0 on; an empty body as one empty frame;
    # an error as its header, then its text.
    assert P.to_client01(P.client_reply(True, b"echo", [b"a", b"b"])) == [b"", b"MDPC01", b"echo", b"a", b"b"]
    assert P.to_client01(P.client_reply(False, b"echo", [b"a"])) is None
    assert P.to_client01(P.client_reply(True, b"echo", [])) == [b"", b"MDPC01", b"echo", b""]
    assert P.to_client01(P.broker_heartbeat(b"i" * 8, 3000)) is None
    err = P.error_body(7, P.ErrorCode.SERVICE_UNAVAILABLE, "no live worker for 'x'")
    assert P.to_client01(P.client_reply(True, b"x", err)) == [
        b"", b"MDPC01", b"x", err[0], b"503 SERVICE_UNAVAILABLE: no live worker for 'x'"]
    result = P.encode_header(P.Reply(id=7))
    assert P.to_client01(P.client_reply(True, b"x", [result, b"t"])) == [b"", b"MDPC01", b"x", result, b"t"]
    assert P.reply_error_text(P.error_body(1, 777, "odd")[0]) == "777 ERROR: odd"
    assert P.reply_error_text(P.MAGIC + b"\xc1") is None and P.reply_error_text(b"503") is None


def test_parse_worker_commands():
    m = P.parse_worker(P.worker_ready("echo"))
    assert m.command == P.W_READY and m.service == b"echo" and m.ready is None
    caps = P.Ready(credit=8, max_batch=8, host="h", transports=["inline", "shm"], pid=3)
    m = P.parse_worker(P.worker_ready("echo", caps))
    assert m.ready == caps
    env = P.token_envelope(123456789)
    m = P.parse_worker(P.worker_reply(env, True, [b"a", b"b"]))
    assert m.command == P.W_FINAL and P.envelope_token(m.envelope) == 123456789 and m.body == (b"a", b"b")
    with pytest.raises(P.ProtocolError, match="reserved"):
        P.parse_worker(P.worker_ready("mmi.service"))
    with pytest.raises(P.ProtocolError, match="unknown transports"):
        P.parse_worker(P.worker_ready("echo", P.Ready(transports=["pigeon"])))
    with pytest.raises(P.ProtocolError, match="delimiter"):
        P.parse_worker([P.MDPW, P.W_FINAL, env, b"x", b"body"])


def test_broker_side_builders_round_trip():
    frames = P.to_worker_request(b"wid", P.token_envelope(5), [b"h"])
    assert frames[0] == b"wid"
    d = P.parse_broker_to_worker(frames[1:])
    assert d.command == P.W_REQUEST and P.envelope_token(d.envelope) == 5 and d.body == (b"h",)
    d = P.parse_broker_to_worker(P.to_worker_cancel(b"wid", P.token_envelope(5))[1:])
    assert d.command == P.W_CANCEL
    out = P.to_client(b"cid", True, b"echo", P.error_body(3, P.ErrorCode.QUEUE_FULL, "full"))
    r = P.parse_broker_to_client(out[1:])
    rep = P.decode_reply(r.body[0])
    assert r.command == P.C_FINAL and rep.id == 3 and rep.error.code == 429


@pytest.mark.parametrize(
    "dt", ["|u1", "|i1", "<i2", "<u4", "<i8", "<f2", "<f4", "<f8", "<c8", "<c16", "|b1", "<M8[ns]", "<m8[s]", "|S7", "<U3", "|V8"]
)
def test_dtypes_accepted(dt):
    assert P.parse_dtype(np.dtype(dt).str) == np.dtype(dt)


def test_host_id_is_stable():
    assert P.local_host_id() == P.local_host_id()
    assert "/" in P.local_host_id()


def test_broker_toml_config(tmp_path):
    from broker.server import BrokerConfig

    path = tmp_path / "broker.toml"
    path.write_text(
        'frontend = "ipc:///tmp/x-fe"\nbackend = "ipc:///tmp/x-be"\n'
        "[scheduler]\nheartbeat_interval = 0.5\nmax_queue = 7\npriority_weights = [4.0, 1.0, 0.25]\n"
    )
    cfg = BrokerConfig.from_toml(str(path))
    assert (cfg.frontend, cfg.backend) == ("ipc:///tmp/x-fe", "ipc:///tmp/x-be")
    assert cfg.scheduler.heartbeat_interval == 0.5 and cfg.scheduler.max_queue == 7
    assert cfg.scheduler.priority_weights == (4.0, 1.0, 0.25)
    path.write_text("[scheduler]\nno_such_option = 1\n")
    with pytest.raises(ValueError, match="no_such_option"):
        BrokerConfig.from_toml(str(path))


# ----------------------------------------------------------------------------- direct reply


def test_done_carries_envelopes_and_is_bounded():
    envs = [P.token_envelope(t) for t in (1, 2, 3)]
    m = P.parse_worker(P.worker_done(envs))
    assert m.command == P.W_DONE and m.body == tuple(envs)
    with pytest.raises(P.ProtocolError, match="DONE carries 0"):
        P.parse_worker([P.MDPW, P.W_DONE])
    with pytest.raises(P.ProtocolError, match="DONE carries"):
        P.parse_worker(P.worker_done([b"12345678"] * (P.MAX_DONE + 1)))
    with pytest.raises(P.ProtocolError, match="255"):
        P.parse_worker(P.worker_done([b"x" * 256]))


def test_direct_reply_frames_are_what_the_broker_would_relay():
    body = [P.encode_header(P.Reply(id=7)), b"payload"]
    relayed = P.to_client(b"ident", True, b"echo", body)[1:]
    assert P.client_reply(True, b"echo", body) == relayed
    m = P.parse_broker_to_client(P.client_reply(True, b"echo", body))
    assert m.command == P.C_FINAL and m.service == b"echo" and list(m.body) == body


@pytest.mark.parametrize(
    "reply_to, host, match",
    [
        ("tcp://127.0.0.1:5555", "h", "absolute ipc"),
        ("ipc://relative/path", "h", "absolute ipc"),
        ("ipc:///tmp/" + "x" * 300, "h", "absolute ipc"),
        ("ipc:///tmp/a\x00b", "h", "absolute ipc"),
        ("ipc:///tmp/ok.ipc", None, "must name its host"),
    ],
)
def test_bad_reply_to_is_a_protocol_error(reply_to, host, match):
    head = P.encode_header(P.Request(id=1, host=host, reply_to=reply_to))
    with pytest.raises(P.ProtocolError, match=match):
        P.decode_request(head, n_inline=0)


def test_reply_to_round_trips():
    head = P.encode_header(P.Request(id=1, host="h", reply_to="ipc:///tmp/zmq-infer-0/c-1-ab.ipc"))
    assert P.decode_request(head, 0).reply_to == "ipc:///tmp/zmq-infer-0/c-1-ab.ipc"
    assert P.decode_request(P.encode_header(P.Request(id=1)), 0).reply_to is None


def test_finals_carry_several_headers():
    heads = [P.encode_header(P.Reply(id=i)) for i in (1, 2)]
    m = P.parse_broker_to_client(P.direct_finals(b"echo", heads))
    assert m.command == P.C_FINALS and m.service == b"echo" and list(m.body) == heads
    with pytest.raises(P.ProtocolError, match="FINALS"):
        P.parse_broker_to_client([P.MDPC, P.C_FINALS, b"echo"])


# ----------------------------------------------------------------------------- hostile sizes and nesting


@pytest.mark.parametrize("dt", ["|V0", "|S0", "<U0", ">U0"])
@pytest.mark.parametrize("where", ["inline", "shm"])
def test_zero_itemsize_dtypes_are_refused_in_requests_and_replies(dt, where):
    """A 0-byte item makes any shape 0 bytes: [2**40] of them would pass every size check and
    have a reader loop 2**40 times."""
    loc = (P.InlineLoc(frame=0) if where == "inline" else
           P.ShmLoc(segment="zinf-1-2-0123456789abcdef", offset=0, nbytes=0, slot=0, generation=1))
    ref = P.TensorRef(name="z", dtype=dt, shape=[1 << 40], loc=loc)
    with pytest.raises(P.ProtocolError, match=f"dtype '{re.escape(dt)}' has item size 0"):
        P.decode_request(P.encode_header(P.Request(id=1, host="h", tensors=[ref])), n_inline=1)
    with pytest.raises(P.ProtocolError, match="item size 0"):
        P.decode_reply(P.encode_header(P.Reply(id=1, tensors=[ref])), n_inline=1)
    with pytest.raises(P.ProtocolError, match="item size 0"):
        P.parse_dtype(dt)
    with pytest.raises(P.ProtocolError, match="item size 0"):
        P.tensor_nbytes(ref)


@pytest.mark.parametrize(
    "dtype, shape, ok",
    [
        ("|u1", [1 << 40], True),                    # exactly MAX_TENSOR_BYTES
        ("|u1", [(1 << 40) + 1], False),
        ("<f4", [1 << 38], True),
        ("<f4", [(1 << 38) + 1], False),
        ("<f8", [1 << 20, 1 << 20, 2], False),
        ("<f4", [0, 1 << 62], False),                # empty, but a dimension is absurd
        ("<f4", [0, 1 << 20], True),                 # empty and sane
        ("<f4", [0] * 31 + [(1 << 64) - 1], False),
        ("|u1", [1 << 13] * 4, False),               # 2**52 elements, no single dim over 2**40
        ("|S2147483647", [512], True),               # 2**40 - 512 bytes: a huge item is fine
        ("|S2147483647", [513], False),
    ],
)
def test_absurd_shapes_are_refused(dtype, shape, ok):
    assert P.MAX_TENSOR_BYTES == 1 << 40
    n = np.dtype(dtype).itemsize
    for d in shape:
        n *= d
    loc = P.ShmLoc(segment="zinf-1-2-0123456789abcdef", offset=0, nbytes=min(n, (1 << 64) - 1), slot=0, generation=1)
    ref = P.TensorRef(name="t", dtype=dtype, shape=shape, loc=loc)
    for frame, decode in ((P.encode_header(P.Request(id=1, host="h", tensors=[ref])), P.decode_request),
                          (P.encode_header(P.Reply(id=1, tensors=[ref])), P.decode_reply)):
        if ok:
            assert P.tensor_nbytes(decode(frame, 0).tensors[0]) == n
        else:
            with pytest.raises(P.ProtocolError, match="describe more than 1099511627776 bytes"):
                decode(frame, 0)


def test_deep_meta_is_a_protocol_error_with_the_id_still_readable():
    for n in (40, 1_000, 20_000):
        frame = P.MAGIC + b"\x83\xa1v\x01\xa2id\x2a\xa4meta\x81\xa1k" + b"\x81\xa1k" * n + b"\xc0"
        with pytest.raises(P.ProtocolError, match="nests deeper than 32 levels"):
            P.decode_request(frame, 0)
        assert P.lenient_request_id(frame) == 42
    ok = P.Request(id=1, meta={"a": [[{"b": [1, 2]}]], "c": 1.5, "d": {(1, 2): "tuple key"}})
    assert P.decode_request(P.encode_header(ok)) == P.DispatchedRequest(**msgspec.structs.asdict(ok))


def test_header_id_reads_the_id_a_relay_checks_a_reply_against():
    for rid in (0, 5, 127, 128, 65535, 1 << 32, (1 << 64) - 1):
        assert P.header_id(P.encode_header(P.Reply(id=rid, error=P.ErrorInfo(code=500, message="x")))) == rid
    # Another encoder's key order, a header without an id or one that does not decode (0:
    # what `lenient_request_id` reads), and frames that are not headers (None).
    assert P.header_id(P.MAGIC + msgspec.msgpack.encode({"seq": 3, "id": 77, "v": 1})) == 77
    assert P.header_id(P.MAGIC + msgspec.msgpack.encode({"v": 1})) == 0
    assert P.header_id(P.MAGIC + b"\xff\xff") == 0
    assert P.header_id(b"opaque body") is None and P.header_id(b"") is None
    # Every prefix of our header, cut anywhere (a worker's bug): an id or 0, never an
    # exception (the broker reads it in the middle of its actions).
    whole = P.encode_header(P.Reply(id=300, error=P.ErrorInfo(code=500, message="x")))
    for n in range(len(whole) + 1):
        assert P.header_id(whole[:n]) in (None, 0, 300), n


def test_meta_is_bounded_and_the_broker_never_decodes_it():
    """A 1 MiB header could hold a million empty arrays in `meta`: 70 MB of Python objects
    and a tenth of a second decoded, per queued request (the resource hunt took a broker to
    2.8 GB with 40).  `meta` is at most MAX_META_BYTES; the broker reads it as bytes."""
    big = P.encode_header(P.Request(id=5, meta={"m": [[]] * (P.MAX_META_BYTES + 10)}))
    for routed in (False, True):
        with pytest.raises(P.ProtocolError, match=f"the limit is {P.MAX_META_BYTES}"):
            P.decode_request(big, routed=routed)
    assert P.lenient_request_id(big) == 5
    fits = {"m": [[]] * (P.MAX_META_BYTES - 16)}
    frame = P.encode_header(P.Request(id=6, meta=fits))
    routed = P.decode_request(frame, routed=True)
    assert type(routed.meta) is msgspec.Raw and P.encode_header(routed) == frame
    assert P.decode_request(frame).meta == fits
    # Not a map: refused by both (the broker looks at its first byte only).
    bad = P.MAGIC + msgspec.msgpack.encode({"v": 1, "id": 7, "meta": [1, 2]})
    for routed in (False, True):
        with pytest.raises(P.ProtocolError, match="meta"):
            P.decode_request(bad, routed=routed)
    assert P.decode_request(P.encode_header(P.Request(id=8))).meta == {}


def test_inline_sizes_checked_against_frames_actually_there():
    ref = P.TensorRef(name="b", dtype="<i4", shape=[3], loc=P.InlineLoc(frame=2))
    with pytest.raises(P.ProtocolError, match="inline frame 2"):
        P.check_inline_sizes([ref], [b"x" * 12])


def test_busy_round_trips_and_a_bad_one_is_a_protocol_error():
    for busy in (True, False):
        msg = P.parse_worker(P.worker_busy(busy))
        assert msg.command == P.W_BUSY and msg.info is busy
    for bad in ([P.MDPW, P.W_BUSY], [P.MDPW, P.W_BUSY, b"\x02"], [P.MDPW, P.W_BUSY, b"\x01", b"x"]):
        with pytest.raises(P.ProtocolError, match="BUSY"):
            P.parse_worker(bad)


def test_the_protocol_frame_is_found_after_a_req_peers_empty_delimiter():
    # What tells a client on the backend (or a worker on the frontend) apart from garbage:
    # a REQ-based MDP peer puts an empty frame before the protocol frame.
    from broker.server import _protocol_frame

    assert _protocol_frame([b"id", P.MDPC, b"\x02"]) == P.MDPC
    assert _protocol_frame([b"id", b"", P.MDPW, b"\x01"]) == P.MDPW
    assert _protocol_frame([b"id"]) == b"" and _protocol_frame([b"id", b"", b""]) == b""


def test_a_reply_whose_error_does_not_parse_is_not_counted_as_a_result():
    # The broker's outcome counts: a FINAL with a malformed `error` (its client raises on it)
    # was counted as "ok" (found by the docs-as-contract hunt).
    import msgspec

    from broker.protocol.header import _UNKNOWN_CODE

    enc = msgspec.msgpack.encode
    assert P.reply_error_code(P.encode_header(P.Reply(id=1))) == 0
    assert P.reply_error_code(P.error_body(1, 422, "no")[0]) == 422
    assert P.reply_error_code(b"opaque") == 0
    for bad in ({"v": 1, "id": 1, "error": {"code": "x", "message": "m"}},
                {"v": 1, "id": 1, "error": {"code": 422}},
                [1, 2, 3]):
        assert P.reply_error_code(P.MAGIC + enc(bad)) == _UNKNOWN_CODE, bad


def test_may_be_error_passes_over_our_results_and_never_over_an_error():
    """The broker's congestion rule reads the code of every FINAL it relays; `may_be_error`
    skips the decode for a result as our encoder writes it (its `error` key, nil), and for
    nothing else: an error, a header without the key (another implementation), a frame it
    cannot read."""
    import msgspec

    t = P.TensorRef(name="error", dtype="<f4", shape=[2], loc=P.InlineLoc(frame=0))  # a tensor named so
    for result in (P.Reply(id=1), P.Reply(id=2, tensors=[t], timing={"compute_ms": 1.0}), P.Reply(id=3, seq=4)):
        head = P.encode_header(result)
        assert not P.may_be_error(head) and not P.may_be_error(memoryview(head)), result
        assert P.reply_error_code(head) == 0
    for code in (504, 422, 500):
        head = P.error_body(9, code, "not run: 3 ms were left")[0]
        assert P.may_be_error(head) and P.may_be_error(bytearray(head))
        assert P.reply_error_code(head) == code
    assert P.may_be_error(P.MAGIC + msgspec.msgpack.encode({"v": 1, "id": 1}))  # no key: decoded (a result)
    assert P.may_be_error(object())


# ----------------------------------------------------------------------------- unknown keys


def _routed_dispatch(frame: bytes) -> bytes:
    """What the broker's dispatch sends the worker for `frame`: decoded as the broker reads
    it, the keys it owns rewritten (broker/server.py, `_on_request` and `_dispatch`), and
    encoded again."""
    req = P.decode_request(frame, routed=True)
    req.pid, req.pid_start, req.host = 4242, 77, None
    req.timeout_ms, req.queue_ms, req.returned, req.backlog, req.priority = 12.5, 0.25, 2, 0, 0
    return P.encode_routed(req)


def test_a_broker_forwards_header_keys_it_does_not_know_and_its_own_keys_win():
    """A newer client's option for a newer worker (a top-level key this version does not
    know) crosses the broker unchanged, as the msgpack bytes it came in; the keys the broker
    writes are the broker's, whatever the client put there (docs/protocol.md section 5)."""
    enc = msgspec.msgpack.encode
    future = {"a": [1, 2.5, {"b": b"\x00\xff"}], "c": None}
    frame = P.MAGIC + enc({"v": 1, "id": 9, "future_option": future, "pid": 1, "pid_start": 5, "host": "h",
                           "queue_ms": 1e9, "backlog": 99, "returned": 7, "timeout_ms": 5000.0, "priority": 2,
                           "meta": {"k": 1}, "zz": "last"})
    out = _routed_dispatch(frame)
    got = msgspec.msgpack.decode(out[4:])
    raw = msgspec.msgpack.Decoder(dict[str, msgspec.Raw]).decode(out[4:])
    assert got["future_option"] == future and got["zz"] == "last", got
    assert bytes(raw["future_option"]) == enc(future)  # the bytes as they came
    assert (got["pid"], got["pid_start"], got["host"]) == (4242, 77, None), got
    assert (got["timeout_ms"], got["queue_ms"], got["returned"], got["backlog"], got["priority"]) == (
        12.5, 0.25, 2, 0, 0), got
    assert got["meta"] == {"k": 1} and got["id"] == 9, got
    # Each key once (a map with a key twice is read differently by different decoders).
    assert out[4] == 0xDE and int.from_bytes(out[5:7], "big") == len(raw)
    assert sorted(raw) == sorted(set(P.RoutedRequest.__struct_encode_fields__) | {"future_option", "zz"})
    # The worker reads it as any request, ignoring what it does not know.
    req = P.decode_request(out)
    assert req.id == 9 and req.pid == 4242 and req.meta == {"k": 1}
    # Forwarded again (a RECALL, a retry on another worker): the same keys.
    again = P.decode_request(frame, routed=True)
    assert P.encode_routed(again)[4:].count(b"future_option") == 1


def test_the_known_keys_path_is_unchanged():
    """A header with only keys this version knows: the plain RoutedRequest, encoded as
    before (nothing to forward)."""
    frame = P.encode_header(P.Request(id=3, priority=0, timeout_ms=10.0, meta={"k": [1]}))
    routed = P.decode_request(frame, routed=True)
    assert type(routed) is P.RoutedRequest
    assert P.encode_routed(routed) == P.encode_header(routed) == frame


def test_a_retry_carries_its_attempt_and_a_clients_attempt_is_dropped():
    """`attempt` is the broker's (`DispatchedRequest`): written at dispatch for a retry
    only (a first attempt's header, an SDK's here, goes on byte for byte), read by the
    worker, beside the keys forwarded; one a client sends is dropped, never forwarded (the
    broker's value is the only one)."""
    req = P.Request(id=3, priority=0, timeout_ms=10.0, meta={"k": [1]})
    frame = P.encode_header(req)
    routed = P.decode_request(frame, routed=True)
    assert P.encode_routed(routed, None) == frame
    again = P.encode_routed(routed, 2)
    got = P.decode_request(again)
    assert got.attempt == 2 and got.id == 3 and got.meta == {"k": [1]}
    assert P.decode_request(frame).attempt is None
    # A client's attempt, beside a key this version does not know: the latter goes on, the
    # former does not, and the broker's (none, then 1) is what the worker reads.
    raw = msgspec.msgpack.decode(frame[4:])
    sent = P.MAGIC + msgspec.msgpack.encode({**raw, "attempt": 7, "future_option": [1, 2]})
    routed = P.decode_request(sent, routed=True)
    assert not any(k == "attempt" for k in msgspec.msgpack.decode(P.encode_routed(routed)[4:]))
    first = msgspec.msgpack.decode(P.encode_routed(routed)[4:])
    assert first["future_option"] == [1, 2] and "attempt" not in first
    retry = P.encode_routed(routed, 1)
    assert msgspec.msgpack.decode(retry[4:])["attempt"] == 1
    assert P.decode_request(retry).attempt == 1 and P.decode_request(P.encode_routed(routed)).attempt is None
    with pytest.raises(P.ProtocolError):  # typed as the rest: not a number
        P.decode_request(P.MAGIC + msgspec.msgpack.encode({**raw, "attempt": "x"}))


def _map_of(entries: list[bytes]) -> bytes:
    n = len(entries)
    head = bytes([0x80 | n]) if n < 16 else (b"\xde" + n.to_bytes(2, "big") if n < 1 << 16
                                              else b"\xdf" + n.to_bytes(4, "big"))
    return P.MAGIC + head + b"".join(entries)


def _kv(key: bytes, value: bytes) -> bytes:
    return bytes([0xA0 | len(key)]) + key + value


def test_hostile_unknown_keys_are_a_400_or_forwarded_bounded():
    head = [_kv(b"v", b"\x01"), _kv(b"id", b"\x2a")]
    # Thousands of unknown keys: refused without building them, the id still readable.
    many = _map_of(head + [_kv(b"k%d" % i, b"\xc0") for i in range(5000)])
    with pytest.raises(P.ProtocolError, match=f"at most {P.MAX_FORWARD_KEYS}"):
        P.decode_request(many, routed=True)
    assert P.lenient_request_id(many) == 42
    assert P.decode_request(many).id == 42  # a worker (a leaseholder's) ignores them, as before
    fits = _map_of(head + [_kv(b"k%d" % i, b"\xc0") for i in range(P.MAX_FORWARD_KEYS)])
    assert msgspec.msgpack.decode(_routed_dispatch(fits)[4:])["k63"] is None
    over = _map_of(head + [_kv(b"k%d" % i, b"\xc0") for i in range(P.MAX_FORWARD_KEYS + 1)])
    with pytest.raises(P.ProtocolError, match=f"at most {P.MAX_FORWARD_KEYS}"):
        P.decode_request(over, routed=True)
    # Bytes: at most MAX_FORWARD_BYTES of them, keys and values.
    big = b"\xc6" + (P.MAX_FORWARD_BYTES).to_bytes(4, "big") + b"x" * P.MAX_FORWARD_BYTES
    with pytest.raises(P.ProtocolError, match=f"the limit is {P.MAX_FORWARD_BYTES}"):
        P.decode_request(_map_of(head + [_kv(b"blob", big)]), routed=True)
    ok = b"\xc6" + (P.MAX_FORWARD_BYTES - 64).to_bytes(4, "big") + b"x" * (P.MAX_FORWARD_BYTES - 64)
    assert len(msgspec.msgpack.decode(_routed_dispatch(_map_of(head + [_kv(b"blob", ok)]))[4:])["blob"]) == (
        P.MAX_FORWARD_BYTES - 64)
    # Deep nesting in an unknown key's value: skipped unread and forwarded as its bytes, up to
    # the decoder's recursion limit (docs/protocol.md section 5, "Nesting"); past it, a 400.
    shallow = b"\x91" * 40 + b"\x01"
    assert msgspec.msgpack.Decoder(dict[str, msgspec.Raw]).decode(
        _routed_dispatch(_map_of(head + [_kv(b"deep", shallow)]))[4:])["deep"] == msgspec.Raw(shallow)
    with pytest.raises(P.ProtocolError, match="nests deeper than 32 levels"):
        P.decode_request(_map_of(head + [_kv(b"deep", b"\x91" * 20_000 + b"\x01")]), routed=True)
    # A key that is not a string, or not UTF-8: 400 (section 5: string keys).
    for bad in (_map_of(head + [b"\x01\x02"]), _map_of(head + [b"\xa2\xff\xfe\x01"]),
                _map_of(head + [b"\xa1x\x01", b"\xc4\x01x\x01"])):
        with pytest.raises(P.ProtocolError, match="bad request header"):
            P.decode_request(bad, routed=True)
    # A key twice: a known one's last value is read (and the broker's own overwrite it); an
    # unknown one goes once, its last value.  Never a key twice in what the worker gets.
    dup = _map_of(head + [_kv(b"pid", b"\x01"), _kv(b"x", b"\x01"), _kv(b"pid", b"\x02"), _kv(b"x", b"\x02"),
                          _kv(b"priority", b"\x02"), _kv(b"priority", b"\x00")])
    routed = P.decode_request(dup, routed=True)
    assert routed.priority == 0 and routed.pid == 2
    out = _routed_dispatch(dup)
    pairs = msgspec.msgpack.Decoder(dict[str, msgspec.Raw]).decode(out[4:])
    assert out[4] == 0xDE and int.from_bytes(out[5:7], "big") == len(pairs)  # no key twice
    assert msgspec.msgpack.decode(out[4:])["x"] == 2 and P.decode_request(out).pid == 4242


def _header_of(nbytes: int, n: int = 64) -> bytes:
    """A client's request header of exactly ``nbytes`` (long tensor names)."""
    def build(extra: int) -> bytes:
        names = [f"{i:03d}" + "n" * (extra if i == 0 else 0) for i in range(n)]
        base = (nbytes - 6000) // n
        names = [nm + "m" * base for nm in names]
        req = P.Request(id=7, timeout_ms=100, tensors=[P.TensorRef(nm, "<f4", [1], P.InlineLoc(frame=i))
                                                       for i, nm in enumerate(names)])
        return P.encode_header(req)
    first = build(0)
    head = build(nbytes - len(first))
    assert len(head) == nbytes
    return head


def test_a_header_at_the_limit_still_reaches_the_worker_after_the_brokers_rewrites():
    """A client header of MAX_HEADER_BYTES passes the broker, whose rewrites (its pid and
    start, queue_ms, returned, backlog, timeout_ms, a retry's attempt) make it longer: the
    worker reads a brokered header up to ROUTED_HEADROOM over the limit (before, the retry
    of such a request was refused 400 at the next worker), and a client's own (a lease's)
    at the limit."""
    head = _header_of(P.MAX_HEADER_BYTES)
    req = P.decode_request(head, 64, routed=True)
    req.pid, req.pid_start = 2**31 - 1, 2**63 - 1
    req.queue_ms, req.timeout_ms = 123456.789, 0.5
    req.returned, req.backlog = 2**31 - 1, 2**31 - 1
    routed = P.encode_routed(req, 2**31 - 1)
    assert P.MAX_HEADER_BYTES < len(routed) <= P.MAX_HEADER_BYTES + P.ROUTED_HEADROOM
    got = P.decode_request(routed, 64, brokered=True)
    assert got.attempt == 2**31 - 1 and got.pid == 2**31 - 1 and len(got.tensors) == 64
    with pytest.raises(P.ProtocolError, match="limit"):
        P.decode_request(routed, 64)  # not from a broker: the client's limit
    with pytest.raises(P.ProtocolError, match="limit"):
        P.decode_request(b"x" * (P.MAX_HEADER_BYTES + P.ROUTED_HEADROOM + 1), 0, brokered=True)


def test_a_service_name_that_is_not_utf8_is_a_protocol_error():
    """Every such name read as one with U+FFFD in it: a worker registered under b'\\xff' took
    the requests sent to b'\\xfe' (the hostile hunt)."""
    for bad in (b"\xff", b"\xfe", b"ok\xc0"):
        with pytest.raises(P.ProtocolError, match="service name must be UTF-8"):
            P.parse_client([P.MDPC, P.C_REQUEST, bad, b"body"])
        with pytest.raises(P.ProtocolError, match="service name must be UTF-8"):
            P.parse_worker([b"", P.MDPW, P.W_READY, bad])
        with pytest.raises(P.ProtocolError, match="service name must be UTF-8"):
            P.parse_client([b"", P.MDPC01, bad, b"body"])
    assert P.parse_client([P.MDPC, P.C_REQUEST, "écho".encode(), b"body"]).service == "écho".encode()


@pytest.mark.parametrize("second", [b"\xa2id", b"\xd9\x02id", b"\xda\x00\x02id", b"\xdb\x00\x00\x00\x02id"],
                         ids=["fixstr", "str8", "str16", "str32"])
def test_header_id_reads_a_repeated_id_as_a_client_decodes_it(second):
    # A reply header that names `id` twice: the broker's relay check read the first, the
    # client's decoder keeps the last (the interop audit; a longer string format for the
    # second key slipped past the first fix: found by review).
    body = b"\x84\xa1v\x01\xa2id\x05" + second + b"\x07\xa7tensors\x90"
    frame = P.MAGIC + body
    assert P.decode_reply(frame).id == 7
    assert P.header_id(frame) == 7
    assert P.header_id(P.MAGIC + b"\x82\xa1v\x01\xa2id\x05") == 5  # once: the fast path's answer
