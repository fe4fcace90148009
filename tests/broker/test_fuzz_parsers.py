"""Fuzzing every parser in broker.protocol: whatever bytes a peer sends, the only exception
that comes out is `ProtocolError` (a 400 for that one message), and valid frames round-trip.

Two engines, both capped in time:
- hypothesis, for structure: random nested msgpack values as headers, valid headers with one
  field replaced by a random value, random dtype/shape claims checked against a reference
  model of what must be accepted, valid frame lists with frames replaced or dropped;
- a seeded mutation loop, for bytes: bit flips, truncation, insertion, interesting bytes
  (0xC1, huge msgpack lengths, deep container runs) and frame-level splicing of a corpus of
  valid messages, bounded by a count and by wall time.
"""
from __future__ import annotations

import random
import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from broker import protocol as P
from bench.hostile import mutate_bytes, mutate_frames
from broker.protocol import header as H

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- the corpus

SEG = "zinf-1-2-0123456789abcdef"


def _shm(name="s", dtype="<f4", shape=(2, 3)):
    nb = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return P.TensorRef(name=name, dtype=dtype, shape=list(shape),
                       loc=P.ShmLoc(segment=SEG, offset=4096, nbytes=nb, slot=1, generation=3))


def _request() -> tuple[P.Request, list[bytes]]:
    refs = [
        _shm(),
        P.TensorRef(name="i", dtype="|u1", shape=[4], loc=P.InlineLoc(frame=0)),
        P.TensorRef(name="c", dtype="<f2", shape=[8],
                    loc=P.CudaLoc(pool="p", offset=0, nbytes=16, device=0, handle=b"h" * 64, event=b"e" * 64)),
        P.TensorRef(name="e", dtype="<i8", shape=[0, 5], loc=P.InlineLoc(frame=1)),
    ]
    req = P.Request(id=4242, priority=0, timeout_ms=250.0, host="h/x", pid=7, tensors=refs,
                    meta={"k": [1, 2.5, "s", None, True, b"b"], "nested": {"a": {"b": [[]]}}},
                    reply_to="ipc:///tmp/zmq-infer-0/c-1-ab.ipc")
    return req, [b"abcd", b""]


def _reply() -> tuple[P.Reply, list[bytes]]:
    rep = P.Reply(id=4242, tensors=[P.TensorRef(name="o", dtype="<i4", shape=[2], loc=P.InlineLoc(frame=0)),
                                    _shm("so", "<f8", (3,))],
                  timing={"queue_ms": 0.5, "batch": 2.0}, seq=1)
    return rep, [b"\x01" * 8]


def _corpus() -> list[list[bytes]]:
    """Valid messages of every command, as the receiving parser sees them (no identity)."""
    req, inl = _request()
    rep, rinl = _reply()
    rh, ph = P.encode_header(req), P.encode_header(rep)
    env = P.token_envelope(99)
    ready = P.Ready(credit=8, max_batch=4, host="h/x", transports=["inline", "shm"], pid=5, welcome=True)
    welcome = P.Welcome(instance=b"\x01" * 8, heartbeat_interval=0.5, heartbeat_liveness=3)
    return [
        P.client_request("echo", [rh, *inl]),
        [b"", *P.client_request("echo", [rh, *inl])],
        P.client_request("echo", [b"opaque", b"body"]),
        P.client_request("mmi.service", [b"echo", b"tok"]),
        P.client_cancel("echo", 4242),
        P.client_heartbeat(),
        P.client_heartbeat(ask_route=True),
        P.client_disconnect(),
        P.worker_ready("echo"),
        P.worker_ready("echo", ready),
        P.worker_reply(env, True, [ph, *rinl]),
        P.worker_reply(env, False, [ph, *rinl]),
        P.worker_done([env, P.token_envelope(100)]),
        P.worker_heartbeat(),
        P.worker_disconnect(),
        P.to_worker_request(b"id", env, [rh, *inl])[1:],
        P.to_worker_cancel(b"id", env)[1:],
        P.to_worker_welcome(b"id", welcome)[1:],
        P.to_client(b"id", True, b"echo", [ph, *rinl])[1:],
        P.to_client(b"id", True, b"echo", P.error_body(4242, 400, "bad"))[1:],
        P.direct_finals(b"echo", [P.encode_header(P.Reply(id=i)) for i in (1, 2)]),
        P.broker_heartbeat(b"\x02" * 8, 3000),
        P.broker_heartbeat(b"\x02" * 8, 3000, b"\0\x80\0\0\x01"),
        # MDP/0.1 (RFC 7, docs/protocol.md section 12.1), as the zguide's clients and workers send them
        [b"", b"MDPC01", b"echo", rh, *inl],
        [b"", b"MDPC01", b"mmi.service", b"echo"],
        [b"", b"MDPW01", b"\x01", b"echo"],
        [b"", b"MDPW01", b"\x03", env, b"", ph, *rinl],
        [b"", b"MDPW01", b"\x04"],
        [b"", b"MDPW01", b"\x05"],
    ]


FRAME_PARSERS = (P.parse_client, P.parse_worker, P.parse_broker_to_client, P.parse_broker_to_worker)


def _feed_frames(frames) -> None:
    """Every frame parser, then every header decoder on every frame: only ProtocolError."""
    for parse in FRAME_PARSERS:
        try:
            parse(frames)
        except P.ProtocolError:
            pass
    # What the broker writes for an MDP/0.1 client from a worker's FINAL (its body is the
    # worker's: it reads the error header, if any, for its text)
    out = P.to_client01(frames)
    assert out is None or (out[:2] == [b"", P.MDPC01] and len(out) >= 4)
    for i, f in enumerate(frames):
        _feed_header(f, frames[i + 1:])


def _feed_header(frame, rest=()) -> None:
    rest = list(rest)
    for decode in (P.decode_request, P.decode_reply):
        try:
            msg = decode(frame, len(rest))
        except P.ProtocolError:
            continue
        _check_accepted(msg)
        try:
            P.check_inline_sizes(msg.tensors, rest)
        except P.ProtocolError:
            pass
        try:
            P.check_inline_sizes(msg.tensors, [])  # a caller that forgot n_inline
        except P.ProtocolError:
            pass
    try:
        routed = P.decode_request(frame, len(rest), routed=True)
    except P.ProtocolError:
        pass
    else:
        # What the broker dispatches (with the keys it does not know) reads the same again.
        out = P.encode_routed(routed)
        assert P.encode_routed(P.decode_request(out, len(rest), routed=True)) == out
    for decode in (P.decode_cancel, P.decode_ready, P.decode_welcome):
        try:
            decode(frame)
        except P.ProtocolError:
            pass
    rid = P.lenient_request_id(frame)
    assert type(rid) is int and 0 <= rid < 1 << 64
    tok = P.envelope_token(frame)
    assert tok is None or 0 <= tok < 1 << 64
    assert P.is_header(frame) in (True, False)
    text = P.reply_error_text(frame)
    assert text is None or type(text) is str


def _depth(x, d=1) -> int:
    if isinstance(x, dict):
        return max([d, *(_depth(k, d + 1) for k in x), *(_depth(v, d + 1) for v in x.values())])
    if isinstance(x, (list, tuple)):
        return max([d, *(_depth(v, d + 1) for v in x)])
    return d - 1


def _check_accepted(msg) -> None:
    """What an accepted header guarantees every reader."""
    for t in msg.tensors:
        dt = P.parse_dtype(t.dtype)
        assert dt.itemsize > 0 and not dt.hasobject
        assert len(t.shape) <= P.MAX_NDIM and all(d >= 0 for d in t.shape)
        bound = dt.itemsize
        for d in t.shape:
            bound *= max(d, 1)
        assert bound <= P.MAX_TENSOR_BYTES
        assert P.tensor_nbytes(t) == dt.itemsize * int(np.prod(t.shape, dtype=object))
    if isinstance(msg, P.Request):
        assert _depth(msg.meta, 2) <= P.MAX_DEPTH


# ----------------------------------------------------------------------------- round trips


def test_valid_frames_round_trip():
    req, inl = _request()
    rep, rinl = _reply()
    m = P.parse_client(P.client_request("echo", [P.encode_header(req), *inl]))
    assert (m.command, m.service) == (P.C_REQUEST, b"echo")
    got = P.decode_request(m.body[0], len(m.body) - 1)
    P.check_inline_sizes(got.tensors, m.body[1:])
    # read as a worker reads it: the client's fields, and none of the broker's (attempt)
    assert got == P.DispatchedRequest(**msgspec.structs.asdict(req)) and got.attempt is None
    w = P.parse_worker(P.worker_reply(P.token_envelope(99), True, [P.encode_header(rep), *rinl]))
    assert P.envelope_token(w.envelope) == 99 and P.decode_reply(w.body[0], len(w.body) - 1) == rep
    b = P.parse_broker_to_worker(P.to_worker_welcome(b"id", P.Welcome(instance=b"\x01" * 8, heartbeat_interval=0.5,
                                                                       heartbeat_liveness=3))[1:])
    assert b.body[0].instance == b"\x01" * 8
    assert P.parse_broker_to_client(P.broker_heartbeat(b"\x02" * 8, 3000)).body == (b"\x02" * 8, 3000, None)
    assert P.parse_broker_to_client(P.broker_heartbeat(b"\x02" * 8, 3000, b"\0ab")).body == (b"\x02" * 8, 3000, b"\0ab")
    # frames past the route are a later extension's: ignored
    assert P.parse_broker_to_client([*P.broker_heartbeat(b"\x02" * 8, 3000, b"r"), b"later"]).body[2] == b"r"
    for bad_route in (b"", b"r" * 256):  # 1 to 255 bytes
        with pytest.raises(P.ProtocolError):
            P.parse_broker_to_client(P.broker_heartbeat(b"\x02" * 8, 3000, bad_route))
    for frames in _corpus():  # every valid message parses with at least one parser, and its headers re-encode
        ok = 0
        for parse in FRAME_PARSERS:
            try:
                parse(frames)
                ok += 1
            except P.ProtocolError:
                pass
        assert ok, frames
        for i, f in enumerate(frames):
            if P.is_header(f):
                for decode in (P.decode_request, P.decode_reply):
                    try:
                        msg = decode(f, len(frames) - i - 1)
                    except P.ProtocolError:
                        continue
                    assert decode(P.encode_header(msg)) == msg


# ----------------------------------------------------------------------------- hypothesis

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                     st.text(max_size=8), st.binary(max_size=8))
_values = st.recursive(_scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                         st.dictionaries(st.text(max_size=4), kids, max_size=4)),
                       max_leaves=40)
_HEADER_KEYS = ["v", "id", "priority", "timeout_ms", "host", "pid", "reply", "tensors", "meta", "queue_ms",
                "reply_to", "error", "timing", "seq", "credit", "max_batch", "transports", "welcome", "instance",
                "heartbeat_interval", "heartbeat_liveness", "name", "dtype", "shape", "loc", "kind", "frame",
                "segment", "offset", "nbytes", "slot", "generation", "pool", "device", "handle", "event"]


@SETTINGS
@given(_values)
def test_random_msgpack_values_as_headers(value):
    _feed_header(P.MAGIC + msgspec.msgpack.encode(value))


@SETTINGS
@given(st.dictionaries(st.sampled_from(_HEADER_KEYS), _values, max_size=8))
def test_random_maps_with_header_keys(m):
    _feed_header(P.MAGIC + msgspec.msgpack.encode(m), [b"x" * 4] * 2)


def _as_plain(msg) -> dict:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg))


def _paths(x, prefix=()):
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*prefix, i))


@SETTINGS
@given(st.data())
def test_valid_headers_with_one_field_replaced(data):
    """A valid request/reply/ready/welcome with one value anywhere in it replaced."""
    req, inl = _request()
    rep, rinl = _reply()
    which = data.draw(st.sampled_from([
        (req, inl), (rep, rinl), (P.Ready(credit=2, transports=["shm"]), []), (P.Cancel(id=3), []),
        (P.Welcome(instance=b"\x01" * 8, heartbeat_interval=0.5, heartbeat_liveness=3), []),
    ]))
    m = _as_plain(which[0])
    paths = [p for p in _paths(m) if p]
    path = data.draw(st.sampled_from(paths))
    node = m
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = data.draw(st.one_of(_values, st.integers(-(1 << 63), (1 << 64) - 1),
                                         st.sampled_from(["|V0", "|S0", "<U0", "|O", "T", "<f4", "x" * 100])))
    _feed_header(P.MAGIC + msgspec.msgpack.encode(m), which[1])


_DTYPES = ["|V0", "|S0", "<U0", ">U0", "|V8", "|S3", "<U2", "<f4", "|u1", "<c16", "<M8[ns]", "|b1",
           "|O", "T", "float32", "<f12", "|S2147483647", "", "\x00", "<U" + "9" * 40]
_DIMS = st.one_of(st.integers(0, 8), st.integers(-3, (1 << 64) - 1), st.sampled_from([1 << 40, 1 << 62, (1 << 63) - 1]))


@SETTINGS
@given(st.sampled_from(_DTYPES), st.lists(_DIMS, max_size=6), st.sampled_from(["inline", "shm"]), st.booleans())
def test_dtype_and_shape_claims_match_the_model(dtype, shape, where, reply):
    """Accepted iff the dtype is canonical plain data of nonzero item size, no dimension is
    negative, and itemsize x prod(max(d, 1)) <= MAX_TENSOR_BYTES; never another exception."""
    try:
        dt = np.dtype(dtype)
        dtype_ok = dt.str == dtype and not dt.hasobject and dt.itemsize > 0
    except Exception:
        dtype_ok = False
    bound = dt.itemsize if dtype_ok else 0
    for d in shape:
        bound *= max(d, 1)
    nbytes = 0 if not dtype_ok or 0 in shape else bound
    expect = dtype_ok and all(d >= 0 for d in shape) and bound <= P.MAX_TENSOR_BYTES
    loc = {"kind": "inline", "frame": 0} if where == "inline" else {
        "kind": "shm", "segment": SEG, "offset": 0, "nbytes": min(nbytes, (1 << 64) - 1), "slot": 0, "generation": 1}
    m = {"v": 1, "id": 5, "host": "h", "tensors": [{"name": "t", "dtype": dtype, "shape": shape, "loc": loc}]}
    frame = P.MAGIC + msgspec.msgpack.encode(m)
    for decode in (P.decode_request, P.decode_reply):
        try:
            msg = decode(frame, 1)
        except P.ProtocolError as e:
            assert not expect, f"{dtype} {shape} refused: {e}"
            if dtype in ("|V0", "|S0", "<U0", ">U0"):
                assert "item size 0" in str(e)
            continue
        assert expect, f"{dtype} {shape} accepted"
        _check_accepted(msg)
        assert P.tensor_nbytes(msg.tensors[0]) == nbytes
    assert P.lenient_request_id(frame) == 5


@SETTINGS
@given(st.data())
def test_valid_frame_lists_with_frames_replaced_dropped_or_added(data):
    frames = list(data.draw(st.sampled_from(_corpus())))
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["replace", "drop", "insert", "empty"]))
        i = data.draw(st.integers(0, max(len(frames) - 1, 0)))
        if op == "replace" and frames:
            frames[i] = data.draw(st.one_of(st.binary(max_size=40),
                                            st.builds(lambda v: P.MAGIC + msgspec.msgpack.encode(v), _values)))
        elif op == "drop" and frames:
            del frames[i]
        elif op == "insert":
            frames.insert(i, data.draw(st.binary(max_size=300)))
        elif frames:
            frames[i] = b""
    _feed_frames(frames)


@pytest.mark.parametrize("n", [0, 1, 2, P.MAX_DONE, P.MAX_DONE + 1, 20_000])
def test_frame_counts_at_the_bounds(n):
    extra = [P.token_envelope(i) for i in range(n)]
    for head in ([P.MDPW, P.W_DONE], [P.MDPC, P.C_FINALS, b"echo"], [P.MDPW, P.W_READY, b"echo"],
                 [P.MDPC, P.C_REQUEST, b"echo"], [P.MDPW, P.W_FINAL, b"e", b""]):
        for parse in FRAME_PARSERS:
            try:
                parse([*head, *extra])
            except P.ProtocolError:
                pass
    if 1 <= n <= P.MAX_DONE:
        assert P.parse_worker([P.MDPW, P.W_DONE, *extra]).body == tuple(extra)
    else:
        with pytest.raises(P.ProtocolError, match="DONE carries"):
            P.parse_worker([P.MDPW, P.W_DONE, *extra])


# ----------------------------------------------------------------------------- nesting


def _nested(kind: bytes, n: int, leaf: bytes = b"\xc0") -> bytes:
    return (kind * n) + leaf


@pytest.mark.parametrize("n", [10, 5_000, 100_000])  # past msgspec's recursion limit on 3.11 and 3.12
@pytest.mark.parametrize("where", ["meta", "unknown", "tensors", "key"])
def test_deep_nesting_is_a_protocol_error_never_a_recursion_error(n, where):
    if where == "meta":
        body = b"\x83\xa1v\x01\xa2id\xcd\x01\x00\xa4meta\x81\xa1k" + _nested(b"\x81\xa1k", n)
    elif where == "unknown":  # unknown keys are skipped, but not at any depth
        body = b"\x83\xa1v\x01\xa2id\xcd\x01\x00\xa4junk" + _nested(b"\x91", n)
    elif where == "tensors":
        body = b"\x83\xa1v\x01\xa2id\xcd\x01\x00\xa7tensors" + _nested(b"\x91", n)
    else:  # an array as a map key inside meta decodes to nested tuples
        body = b"\x83\xa1v\x01\xa2id\xcd\x01\x00\xa4meta\x81\xa1k\x81" + _nested(b"\x91", n, b"\x01") + b"\x01"
    frame = P.MAGIC + body
    if len(frame) > P.MAX_HEADER_BYTES:
        pytest.skip("over the header size limit")
    for decode in (P.decode_request, P.decode_reply, P.decode_ready, P.decode_cancel, P.decode_welcome):
        if n == 10:  # shallow: refused, if at all, for other reasons than nesting
            try:
                decode(frame)
            except P.ProtocolError as e:
                assert "nest" not in str(e)
            continue
        with pytest.raises(P.ProtocolError) as info:
            decode(frame)
        if where != "tensors":  # there msgspec's type check stops it first ("Expected `object`")
            assert "nests deeper than 32 levels" in str(info.value)
    if n == 10 and where != "tensors":
        P.decode_request(frame)
    # The error still reaches the right call: the id precedes the deep part.
    assert P.lenient_request_id(frame) == 256
    for parse in (P.parse_client, P.parse_worker):
        try:
            parse([b"MDPC02", b"\x01", b"echo", frame]) if parse is P.parse_client else parse(
                [b"MDPW02", b"\x01", b"echo", frame])
        except P.ProtocolError:
            pass


def _meta_depth_frame(levels: int, kind: str) -> bytes:
    """A request whose deepest container is at level `levels` (the header map is level 1)."""
    x: object = 1
    for _ in range(levels - 2):
        x = [x] if kind == "list" else {"k": x}
    return P.MAGIC + msgspec.msgpack.encode({"v": 1, "id": 9, "meta": {"m": x}})


@pytest.mark.parametrize("kind", ["list", "map"])
def test_nesting_bound_is_exact(kind):
    assert P.MAX_DEPTH == 32
    req = P.decode_request(_meta_depth_frame(P.MAX_DEPTH, kind))
    assert _depth(req.meta, 2) == P.MAX_DEPTH
    with pytest.raises(P.ProtocolError, match="nests deeper than 32 levels"):
        P.decode_request(_meta_depth_frame(P.MAX_DEPTH + 1, kind))
    assert P.lenient_request_id(_meta_depth_frame(P.MAX_DEPTH + 1, kind)) == 9


def test_lenient_request_id_never_raises():
    rng = random.Random(11)
    for frame in [b"", b"\xc1", P.MAGIC, P.MAGIC + b"\xdf\xff\xff\xff\xff", P.MAGIC + b"\x81\xa2id\xcf\xff",
                  P.MAGIC + b"\x82\xa1v\x01\xa2id" + b"\x91" * 200_000, P.MAGIC + b"\x81\xa2id\xa1x",
                  P.MAGIC + b"\x82\xa1v\xdb\xff\xff\xff\xff\xa2id\x05", bytearray(P.MAGIC + b"\x81\xa2id\x07"),
                  memoryview(P.MAGIC + b"\x81\xa2id\x07"), 12, None, "str", P.MAGIC + b"\x00" * (P.MAX_HEADER_BYTES + 1)]:
        rid = P.lenient_request_id(frame)
        assert type(rid) is int and 0 <= rid < 1 << 64
    assert P.lenient_request_id(P.MAGIC + b"\x81\xa2id\x07") == 7
    assert P.lenient_request_id(P.MAGIC + b"\x83\xa1v\x01\xa4host\xa1h\xa2id\xcf" + (2**64 - 1).to_bytes(8, "big")
                                + b"\x91" * 5000) == 2**64 - 1
    for _ in range(2000):
        b = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        assert 0 <= H._scan_id(b) < 1 << 64
        assert 0 <= P.lenient_request_id(P.MAGIC + b) < 1 << 64


# ----------------------------------------------------------------------------- seeded mutation loop

# The mutators are bench.hostile's (the chaos run's hostile peer uses them live).


def test_seeded_mutation_loop_only_protocol_errors():
    """Mutated valid messages into every parser: bounded by 30,000 messages and 3 s."""
    rng = random.Random(20261129)
    corpus = _corpus()
    deadline = time.monotonic() + 3.0
    n = 0
    while n < 30_000 and time.monotonic() < deadline:
        _feed_frames(mutate_frames(rng, corpus))
        n += 1
    assert n >= 500  # the loop really ran


def test_seeded_mutation_loop_on_headers_accepts_only_sane_ones():
    """Mutated request headers straight into the decoders; whatever is accepted is sane (and
    some of them are: the mutations are small)."""
    rng = random.Random(7)
    req, inl = _request()
    rep, rinl = _reply()
    seeds = [(P.encode_header(req), inl), (P.encode_header(rep), rinl)]
    deadline = time.monotonic() + 3.0
    n = accepted = 0
    while n < 30_000 and time.monotonic() < deadline:
        head, rest = rng.choice(seeds)
        frame = P.MAGIC + mutate_bytes(rng, head[4:])
        for decode in (P.decode_request, P.decode_reply):
            try:
                msg = decode(frame, len(rest))
            except P.ProtocolError:
                continue
            accepted += 1
            _check_accepted(msg)
        assert 0 <= P.lenient_request_id(frame) < 1 << 64
        n += 1
    assert n >= 500 and accepted > 0
