"""A signal handler's exception (Ctrl-C, an alarm-based timeout) in the middle of a multipart
send or receive (broker.protocol.wire): Python runs handlers between bytecodes and pyzmq
around each frame, so one could stop a message half sent, and the socket's next message
was glued onto it (an innocent request lost), or half read, and its rest read as a message
of its own.  Real sockets (an inproc pair); the interruption placed at a chosen frame, and
real timer signals landing wherever they land."""
from __future__ import annotations

import itertools
import time

import pytest
import zmq

from broker.protocol import wire
from tests.alarms import alarm

MSG = [b"F0", b"F1", b"F2", b"F3", b"F4"]
NEXT = [b"N0", b"N1", b"N2", b"N3", b"N4"]


_PAIRS = itertools.count()


@pytest.fixture
def pair():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.linger = b.linger = 0
    a.sndhwm = b.rcvhwm = 0
    a.bind(f"inproc://wire-signals-{next(_PAIRS)}")  # not id(a): a closed one's may be held yet
    b.connect(a.LAST_ENDPOINT.decode())
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _read_all(sock) -> list[list[bytes]]:
    out = []
    while sock.poll(200):
        out.append(sock.recv_multipart())
    return out


def _send_cut(monkeypatch, sock, frames, at: int, after: bool) -> None:
    """`wire.send_frames(sock, frames)` with a KeyboardInterrupt at frame ``at``: before its
    send, or (``after``) once it went out."""
    real = wire._send
    n = {"i": 0}

    def send(sock, f, flags, copy):
        i = n["i"]
        n["i"] += 1
        if i == at and not after:
            raise KeyboardInterrupt  # the handler ran before this frame's send
        real(sock, f, flags, copy)
        if i == at and after:
            raise KeyboardInterrupt  # ... or after it

    monkeypatch.setattr(wire, "_send", send)
    with pytest.raises(KeyboardInterrupt):
        wire.send_frames(sock, frames)
    monkeypatch.setattr(wire, "_send", real)


@pytest.mark.parametrize("at", [0, 1, 2, 4])
@pytest.mark.parametrize("after", [False, True], ids=["before-the-frame", "after-the-frame"])
def test_a_send_cut_short_by_a_signal_leaves_the_next_message_intact(pair, monkeypatch, at, after):
    a, b = pair
    _send_cut(monkeypatch, a, MSG, at, after)
    wire.send_frames(a, NEXT)
    got = _read_all(b)
    assert got[-1] == NEXT  # never glued onto the interrupted one
    if not after:
        assert got[:-1] == [MSG]  # whole
    elif at < len(MSG) - 1:
        assert got[:-1] == [MSG[:at + 1] + MSG[at:]]  # that frame twice: refused downstream
    else:
        assert got[:-1] == [MSG, MSG[-1:]]  # whole, then its last frame alone: refused downstream


@pytest.mark.timeout(60)
def test_real_signals_never_glue_two_messages(pair):
    # An interval timer whose handler raises, landing wherever it lands during sends (until
    # it landed in 1000 of them, a fifth of a second here, or 1.5 s have passed: every
    # message sent is read and checked after, about 10 s for 1.5 s of sends): whatever each
    # interrupted send left, the message after it starts a message of its own, and every
    # message sent whole arrives whole.
    a, b = pair

    class Boom(Exception):
        pass

    armed = [False]

    def handler(*_):
        if armed[0]:
            armed[0] = False
            raise Boom

    sent = interrupted = 0
    with alarm(handler, 0.0002, 0.0002):  # (pytest-timeout's alarm kept: tests/alarms.py)
        end = time.monotonic() + 1.5
        while interrupted < 1000 and time.monotonic() < end:
            try:
                armed[0] = True
                wire.send_frames(a, MSG)
                armed[0] = False
                sent += 1
            except Boom:
                interrupted += 1
    wire.send_frames(a, NEXT)
    got = _read_all(b)
    assert interrupted > 10, "the timer never landed in a send"
    for m in got[:-1]:
        # A frame twice is what an interrupted send may leave (refused downstream); a frame
        # number going down is the next message glued on.
        numbers = [int(f[1:]) for f in m]
        assert all(x <= y for x, y in zip(numbers, numbers[1:])), f"glued: {m}"
    assert got[-1] == NEXT
    assert sum(1 for m in got if m == MSG) >= sent


@pytest.mark.parametrize("at", [0, 2, 4])
def test_a_receive_cut_short_by_a_signal_drops_that_message_not_the_next(pair, monkeypatch, at):
    a, b = pair
    a.send_multipart(MSG)
    a.send_multipart(NEXT)
    assert b.poll(1000)
    real = wire._recv
    n = {"i": 0}

    def recv(sock, flags, copy):
        f = real(sock, flags, copy)
        i = n["i"]
        n["i"] += 1
        if i == at:
            raise KeyboardInterrupt  # the frame just read goes with it, as in pyzmq
        return f

    monkeypatch.setattr(wire, "_recv", recv)
    with pytest.raises(KeyboardInterrupt):
        wire.recv_frames(b)
    monkeypatch.setattr(wire, "_recv", real)
    assert [bytes(f) for f in wire.recv_frames(b, zmq.NOBLOCK)] == NEXT


@pytest.mark.parametrize("at", [1, 2], ids=["command", "service"])
@pytest.mark.parametrize("after", [False, True], ids=["before-the-frame", "after-the-frame"])
def test_a_client_request_cut_at_its_command_or_service_frame_is_refused_not_opaque(pair, monkeypatch, at, after):
    """Sent again from the frame it landed on, a REQUEST cut at its service frame carried it
    twice: a valid opaque request to that service (its name as the body), which an echo
    answered and the client took as a plain worker's answer to another call of that
    service (the interruption hunt).  Whatever went out now is refused by the broker."""
    from broker import protocol as P

    a, b = pair
    head = P.encode_header(P.Request(id=5, tensors=[P.TensorRef(name="x", dtype="<i4", shape=[1],
                                                                 loc=P.InlineLoc(frame=0))]))
    msg = P.client_request("echo", [head, b"\x01\x00\x00\x00"])
    _send_cut(monkeypatch, a, msg, at, after)
    wire.send_frames(a, NEXT)
    got = _read_all(b)
    assert got[-1] == NEXT and len(got) == 2
    try:
        parsed = P.parse_client(got[0])
    except P.ProtocolError:
        return  # refused as it arrived
    # Parsed as a REQUEST: its body is a header the broker refuses (not an opaque body).
    assert parsed.command == P.C_REQUEST and P.is_header(parsed.body[0])
    with pytest.raises(P.ProtocolError):
        P.decode_request(parsed.body[0], frames=parsed.body[1:], routed=True)
    assert not P.lenient_request_id(parsed.body[0])  # answered to no call of the client's
