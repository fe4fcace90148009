"""wire.Waiter: waiting for zmq sockets by descriptor, asking EVENTS only when needed.

The property that matters: a Waiter never sleeps while a watched socket holds a message,
whatever mix of sends, receives and EVENTS questions came before (through wire's calls),
and it never reports a socket that holds none."""
from __future__ import annotations

import contextlib
import os
import secrets
import select
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.protocol import wire
from broker.protocol.wire import Waiter, recv_frames, send_frames, sock_events, touched

WAIT_MS = 5000


@pytest.fixture
def pairs(tmp_path):
    """Two connected DEALER pairs: (peer, watched) each."""
    ctx = zmq.Context.instance()
    made = []
    for i in range(2):
        a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s in (a, b):
            s.linger = 0
        ep = f"ipc://{tmp_path}/w{i}.sock"
        a.bind(ep)
        b.connect(ep)
        made.append((a, b))
    yield made
    for a, b in made:
        a.close(0)
        b.close(0)


@pytest.fixture
def two_and_a_pipe(pairs):
    """A Waiter on both watched sockets of `pairs` and on the read end of a pipe:
    (waiter, (peer a, a), (peer b, b), pipe's write end)."""
    (pa, a), (pb, b) = pairs
    r, wfd = os.pipe()
    w = Waiter()
    w.add(a)
    w.add(b)
    w.add_fd(r)
    try:
        yield w, (pa, a), (pb, b), wfd
    finally:
        w.close()
        os.close(r)
        os.close(wfd)


def _settled(sock) -> None:
    """Wait until `sock` holds a message (outside any Waiter), then forget that we asked."""
    assert sock.poll(WAIT_MS)
    touched(sock)


def test_a_message_is_reported_and_a_quiet_socket_is_not_asked(pairs, monkeypatch):
    (pa, a), (pb, b) = pairs
    w = Waiter()
    w.add(a)
    w.add(b)
    try:
        assert w.wait(0) == []  # both asked once: now quiet
        asked = []
        real = wire.sock_events
        monkeypatch.setattr(wire, "sock_events", lambda s: asked.append(s) or real(s))
        assert w.wait(0) == []
        assert asked == []  # quiet sockets cost no question
        send_frames(pb, [b"hello"])
        t0 = time.monotonic()
        assert w.wait(WAIT_MS) == [b]
        assert time.monotonic() - t0 < WAIT_MS / 2000
        assert asked == [b]  # only the one whose descriptor signalled
        assert [bytes(f) for f in recv_frames(b)] == [b"hello"]
        assert not w.has_message(b)  # nothing left
        assert b in wire._QUIET  # and that question left it quiet again
    finally:
        w.close()
    assert a not in wire._WATCHED and b not in wire._QUIET


def test_a_send_makes_the_socket_asked_again(pairs, monkeypatch):
    (pa, a), _ = pairs
    w = Waiter()
    w.add(a)
    try:
        assert w.wait(0) == []
        send_frames(a, [b"out"])  # may process a's commands: not quiet any more
        asked = []
        real = wire.sock_events
        monkeypatch.setattr(wire, "sock_events", lambda s: asked.append(s) or real(s))
        assert w.wait(0) == []
        assert asked == [a]
    finally:
        w.close()


def test_a_pyzmq_call_behind_the_waiters_back_needs_touched(pairs):
    """Why `touched` exists: Socket.poll takes the descriptor's signal of a message that
    stays queued; a Waiter that trusted the socket as quiet would sleep past it."""
    (pa, a), _ = pairs
    w = Waiter()
    w.add(a)
    try:
        assert w.wait(0) == []  # quiet
        send_frames(pa, [b"m"])
        assert a.poll(WAIT_MS)  # pyzmq: the message is there, its signal consumed
        assert w.wait(50) == []  # the hazard: not seen
        touched(a)
        assert w.wait(0) == [a]
    finally:
        w.close()


def test_plain_descriptors_are_reported_and_never_asked(pairs):
    (pa, a), _ = pairs
    r, wfd = os.pipe()
    w = Waiter()
    w.add(a)
    w.add_fd(r)
    try:
        assert w.wait(0) == []
        os.write(wfd, b"x")
        assert w.wait(WAIT_MS) == [r]
        send_frames(pa, [b"m"])
        _settled(a)
        assert w.wait(WAIT_MS) == [a, r]  # a socket ready: the descriptors are looked at too, without waiting
        w.remove(r)
        assert w.wait(0) == [a]
    finally:
        w.close()
        os.close(r)
        os.close(wfd)


def test_a_socket_read_in_part_never_hides_a_quiet_one(pairs):
    """A caller that reads one socket only in part (a budget per pass) finds it ready
    before sleeping; the others must still be looked at, or a quiet one starves."""
    (pa, a), (pb, b) = pairs
    w = Waiter()
    w.add(a)
    w.add(b)
    try:
        assert w.wait(0) == []  # both quiet
        for _ in range(3):
            send_frames(pa, [b"m"])
        _settled(a)
        assert w.wait(WAIT_MS) == [a]
        recv_frames(a)  # one of three: a still holds two
        send_frames(pb, [b"m"])
        deadline = time.monotonic() + WAIT_MS / 1000
        seen = set()
        while b not in seen and time.monotonic() < deadline:
            seen.update(w.wait(WAIT_MS))
        assert seen == {a, b}
    finally:
        w.close()


def test_a_send_after_the_throttle_that_takes_the_signal_is_not_slept_past(pairs):
    """The hazard the marks exist for: a quiet socket gets a message, then a send on it
    (past libzmq's ~1 ms command throttle) processes its commands and so consumes the
    descriptor's signal; the send cleared the mark, so the Waiter asks before sleeping."""
    (pa, a), _ = pairs
    w = Waiter()
    w.add(a)
    try:
        assert w.wait(0) == []  # quiet
        send_frames(pa, [b"m"])
        deadline = time.monotonic() + WAIT_MS / 1000
        while not select.select([a.get(zmq.FD)], [], [], 0)[0]:  # its signal has come
            assert time.monotonic() < deadline
        time.sleep(0.01)  # past the send throttle: the send below processes commands (not a synchronisation)
        send_frames(a, [b"out"])
        t0 = time.monotonic()
        assert w.wait(WAIT_MS) == [a]
        assert time.monotonic() - t0 < 1.0
    finally:
        w.close()


def test_sockets_come_back_in_the_order_they_were_added(pairs, tmp_path):
    """Found before sleeping and after waking alike: the client reads the broker's socket
    after its reply sockets, the broker its workers first, by this order."""
    (pa, a), (pb, b) = pairs
    ctx = zmq.Context.instance()
    pc, c = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (pc, c):
        s.linger = 0
    pc.bind(f"ipc://{tmp_path}/c.sock")
    c.connect(f"ipc://{tmp_path}/c.sock")
    w = Waiter()
    for s in (a, b, c):
        w.add(s)
    try:
        assert w.wait(0) == []  # all quiet
        send_frames(pb, [b"m"])
        _settled(b)  # b: not quiet, holds a message (found before sleeping)
        send_frames(pa, [b"m"])
        send_frames(pc, [b"m"])  # a and c: quiet, their descriptors signal (found after)
        deadline = time.monotonic() + WAIT_MS / 1000
        got: list = []
        while len(got) < 3 and time.monotonic() < deadline:
            got = w.wait(WAIT_MS)
        assert got == [a, b, c]
    finally:
        w.close()
        pc.close(0)
        c.close(0)


def test_has_message_sees_a_message_that_came_since_the_last_wait(pairs):
    """Waiter.has_message is exact: a quiet socket's descriptor is looked at, so a message
    that came since the last wait is seen."""
    (pa, a), _ = pairs
    w = Waiter()
    w.add(a)
    try:
        assert w.wait(0) == []
        assert not w.has_message(a)
        send_frames(pa, [b"m"])
        deadline = time.monotonic() + WAIT_MS / 1000
        while not w.has_message(a):
            assert time.monotonic() < deadline, "a message that arrived was not seen"
        assert w.wait(0) == [a]
    finally:
        w.close()


def test_any_message_never_misses_one_that_waits(two_and_a_pipe):
    """Waiter.any_message (the worker's lone-request check): False only when no watched
    socket holds a message and no plain descriptor is readable; quiet sockets are not asked."""
    w, (pa, a), (pb, b), wfd = two_and_a_pipe
    assert w.wait(0) == [] and not w.any_message()
    send_frames(pb, [b"m"])
    deadline = time.monotonic() + WAIT_MS / 1000
    while not w.any_message():  # b is quiet: its descriptor tells
        assert time.monotonic() < deadline, "a message that arrived was not seen"
    assert w.wait(0) == [b]
    recv_frames(b)  # not quiet now: any_message asks it
    assert not w.any_message() and w.wait(0) == []
    os.write(wfd, b"x")
    assert w.any_message()


def test_any_message_without_descriptors_ignores_them_and_polls_only_for_quiet_sockets(two_and_a_pipe, monkeypatch):
    """``any_message(descriptors=False)`` (the worker's check when no link is open): a
    readable plain descriptor (the monitor's) does not count; a socket that was just asked
    costs no poll syscall; a quiet socket's message is still seen through its descriptor."""
    w, (pa, a), (pb, b), wfd = two_and_a_pipe
    assert w.wait(0) == []  # both quiet
    os.write(wfd, b"x")
    assert w.any_message() and not w.any_message(descriptors=False)
    send_frames(pb, [b"m"])
    deadline = time.monotonic() + WAIT_MS / 1000
    while not w.any_message(descriptors=False):  # b is quiet: its descriptor tells
        assert time.monotonic() < deadline, "a message that arrived was not seen"
    assert w.wait(0)[0] is b
    recv_frames(b)
    touched(a)  # neither quiet now: both are asked, and nothing is polled
    polls = []
    real = w._poll

    class Counted:
        def poll(self, ms):
            polls.append(ms)
            return real.poll(ms)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(w, "_poll", Counted())
    assert not w.any_message(descriptors=False) and polls == []
    send_frames(pa, [b"n"])
    _settled(a)
    assert w.any_message(descriptors=False) and polls == []
    monkeypatch.undo()  # the fixture's close unregisters through the real poll object


def test_no_marks_outlive_a_client(tmp_path):
    """A closed Client, or one dropped without close(), leaves no socket in wire's marks."""
    import gc

    from client_sdk import Client

    ep = f"ipc://{tmp_path}/nobroker.sock"
    before = set(wire._WATCHED)
    c = Client(ep, timeout=1)
    assert len(wire._WATCHED - before) >= 1
    c.close()
    assert wire._WATCHED - before == set()
    c = Client(ep, timeout=1)
    socks = wire._WATCHED - before
    assert socks
    del c
    gc.collect()
    assert wire._WATCHED - before == set()
    for s in socks:
        s.close(0)


def test_adding_a_socket_twice_watches_it_once(pairs):
    (pa, a), _ = pairs
    w = Waiter()
    w.add(a)
    w.add(a)
    w.remove(a)
    try:
        assert w.sockets() == []
        assert a not in wire._WATCHED
    finally:
        w.close()


# One step of a random interleaving: (what, which pair)
_OPS = st.lists(st.tuples(st.sampled_from(["peer_sends", "we_send", "recv", "events", "wait0"]),
                          st.integers(0, 1)), max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_never_sleeps_while_a_message_waits_and_never_reports_an_empty_socket(tmp_path, ops):
    with _pairs(tmp_path) as pairs:
        _run_ops(pairs, ops)


@contextlib.contextmanager
def _pairs(where):
    """Fresh connected pairs for one example (a failed example leaves nothing for the next)."""
    ctx = zmq.Context.instance()
    made = []
    try:
        for _ in range(2):
            a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
            made.append((a, b))
            for s in (a, b):
                s.linger = 0
            ep = f"ipc://{where}/p{secrets.token_hex(4)}.sock"
            a.bind(ep)
            b.connect(ep)
        yield made
    finally:
        for a, b in made:
            a.close(0)
            b.close(0)


def _run_ops(pairs, ops) -> None:
    watched = [b for _, b in pairs]
    w = Waiter()
    for b in watched:
        w.add(b)
    held = [0, 0]  # messages sent to each watched socket and not yet received
    try:
        for what, i in ops:
            peer, sock = pairs[i]
            if what == "peer_sends":
                send_frames(peer, [b"m"])
                held[i] += 1
            elif what == "we_send":
                send_frames(sock, [b"x"])
            elif what == "recv":
                if w.has_message(sock):
                    recv_frames(sock)
                    held[i] -= 1
            elif what == "events":
                sock_events(sock)
            else:
                for s in w.wait(0):
                    assert held[watched.index(s)] > 0
            # Whatever came before: every socket that holds a message is reported, at once
            # if it is there, or when it arrives (it may still be on its way).
            due = {j for j in (0, 1) if held[j]}
            seen: set[int] = set()
            deadline = time.monotonic() + WAIT_MS / 1000
            while due - seen and time.monotonic() < deadline:
                for s in w.wait(int((deadline - time.monotonic()) * 1000) + 1):
                    j = watched.index(s)
                    assert held[j] > 0, "reported a socket that holds nothing"
                    seen.add(j)
            assert due <= seen, f"slept past a waiting message: held={held}"
    finally:
        w.close()


class _PollSpy:
    """Stands in for a Waiter's `select.poll` object, recording the timeouts it is given."""

    def __init__(self, real):
        self.real = real
        self.timeouts: list = []

    def poll(self, ms=None):
        self.timeouts.append(ms)
        return self.real.poll(ms)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def selects(monkeypatch):
    """The timeouts (seconds) `select.select` is called with, through wire."""
    got: list = []
    real = wire.select.select

    def spy(r, w, x, timeout=None):
        got.append(timeout)
        return real(r, w, x, timeout)

    monkeypatch.setattr(wire.select, "select", spy)
    return got


def test_a_wait_with_a_fraction_of_a_millisecond_sleeps_it_to_the_microsecond(two_and_a_pipe, selects):
    """`select.poll` counts whole milliseconds: a 0.6 ms wait truncated to 0 returns at once
    (a loop waiting for a batcher's window to end spins through it), and 4.3 ms rounded up
    ends late.  The Waiter sleeps such waits in `select.select`, to the microsecond; whole
    ones stay with poll; and a message or a readable descriptor still ends the wait."""
    w, (pa, a), (pb, b), wfd = two_and_a_pipe
    assert w.wait(0) == []  # both sockets quiet
    spy = w._poll = _PollSpy(w._poll)
    assert w.wait(0.6) == [] and w.wait(4.3) == []
    assert selects == [pytest.approx(0.0006), pytest.approx(0.0043)] and spy.timeouts == []
    assert w.wait(2) == [] and w.wait(0) == [] and spy.timeouts == [2, 0] and len(selects) == 2
    send_frames(pb, [b"m"])
    deadline = time.monotonic() + WAIT_MS / 1000
    got: list = []
    while not got and time.monotonic() < deadline:  # the message crosses libzmq's I/O thread
        got = w.wait(0.9)
    assert got == [b] and [bytes(f) for f in recv_frames(b)] == [b"m"]
    os.write(wfd, b"x")
    assert w.wait(0.6) == [w._fds[0]]


def test_a_fractional_wait_falls_back_to_whole_milliseconds_when_select_cannot_take_it(pairs, monkeypatch):
    """select() takes descriptors below FD_SETSIZE (1024) only, and raises for one closed
    while watched where poll reports it: then the wait is a poll of the whole milliseconds
    that cover it, never a spin and never an error."""
    (pa, a), _ = pairs
    w = Waiter()
    w.add(a)
    try:
        assert w.wait(0) == []
        for error in (ValueError("filedescriptor out of range in select()"), OSError(9, "Bad file descriptor")):
            def fails(*args, error=error):
                raise error

            monkeypatch.setattr(wire.select, "select", fails)
            spy = w._poll = _PollSpy(w._poll)
            assert w.wait(0.3) == [] and w.wait(2.5) == []
            assert spy.timeouts == [1, 3]
            w._poll = spy.real
    finally:
        w.close()


def test_nan_is_no_timeout(pairs):
    (pa, a), _ = pairs
    w = Waiter()
    w.add(a)
    try:
        with pytest.raises(ValueError):
            w.wait(float("nan"))
    finally:
        w.close()
