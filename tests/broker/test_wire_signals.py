"""A signal handler's exception (Ctrl-C, an alarm-based timeout) in the middle of a multipart
send or receive (broker.protocol.wire): pyzmq runs Python's handlers after each frame, so
one could stop a message half sent, and the socket's next message was glued onto it (an
innocent request lost), or half read, and its rest read as a message of its own.  Real
sockets (an inproc pair); the interruption is placed at a chosen frame."""
from __future__ import annotations

import pytest
import zmq

from broker.protocol import wire

MSG = [b"MDPC02", b"\x02", b"svc", b"header", b"data"]
NEXT = [b"MDPC02", b"\x02", b"svc", b"next", b"x"]


@pytest.fixture
def pair():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.linger = b.linger = 0
    a.bind(f"inproc://wire-signals-{id(a)}")
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


@pytest.mark.parametrize("at", [1, 2, 4])
@pytest.mark.parametrize("inside", [False, True], ids=["between-frames", "inside-pyzmq"])
def test_a_send_cut_short_by_a_signal_goes_out_whole_and_the_next_is_intact(pair, monkeypatch, at, inside):
    a, b = pair
    real = wire._send
    n = {"i": 0}

    def send(sock, f, flags, copy):
        i = n["i"]
        n["i"] += 1
        if i == at and not inside:
            raise KeyboardInterrupt  # at a bytecode boundary, before this frame's send
        real(sock, f, flags, copy)
        if i == at and inside:
            raise KeyboardInterrupt  # as pyzmq's signal check after the C send raises it

    monkeypatch.setattr(wire, "_send", send)
    monkeypatch.setattr(wire, "_raised_in_zmq", lambda e: inside)
    with pytest.raises(KeyboardInterrupt) as info:
        wire.send_frames(a, MSG)
    assert info.value.zinf_sent is True
    monkeypatch.setattr(wire, "_send", real)
    wire.send_frames(a, NEXT)
    assert _read_all(b) == [MSG, NEXT]


def test_a_signal_before_the_first_frame_sends_nothing(pair, monkeypatch):
    a, b = pair

    def send(sock, f, flags, copy):
        raise KeyboardInterrupt

    real = wire._send
    monkeypatch.setattr(wire, "_send", send)
    with pytest.raises(KeyboardInterrupt) as info:
        wire.send_frames(a, MSG)
    assert info.value.zinf_sent is False
    monkeypatch.setattr(wire, "_send", real)
    wire.send_frames(a, NEXT)
    assert _read_all(b) == [NEXT]


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
