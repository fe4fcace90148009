"""Multipart send and receive without pyzmq's per-frame Python layers, and a wait on
sockets by their descriptors.

`Socket.send_multipart` and `recv_multipart` go, for every frame, through the sugar
`send`/`recv`, build `SNDMORE | flags` as an `IntFlag` (an enum construction each time) and
ask `getsockopt(RCVMORE)` through the option-name machinery.  For the 5 small frames of an
MDP request that costs 6.7 µs per send and 7.9 µs per receive on the test machine, against
1.8 µs and 2.7 µs here (`python -m bench.micro_protocol`, BENCHMARKS.md): a request crosses
six such sends and receives in three processes, most of them on its critical path.  Semantics are those
of `send_multipart(frames, flags, copy=False)` and `recv_multipart(copy=False)`: frames are
sent zero-copy above pyzmq's copy threshold, and received as `zmq.Frame` objects.

`Waiter` replaces `zmq_poll` in the loops (client, worker, broker): see its docstring.  It
relies on this module's three calls keeping track of which of its sockets are *quiet*, so
every send, receive or EVENTS on a socket a Waiter watches goes through them (or is
followed by `touched`).
"""
from __future__ import annotations

import ctypes
import errno
import math
import os
import secrets
import select
import socket
import struct
from typing import Any, Sequence

import zmq
from zmq.backend import Socket as _Base

from .frames import MDPC

__all__ = ["seed_routing_ids", "send_frames", "recv_frames", "sock_events", "monitor_event", "recv_monitor_event", "touched", "quiet_fd", "Waiter", "NOBLOCK", "tcp_liveness", "keepalive_plan", "DEAD_AFTER_BEATS",
           "tcp_counts", "TcpWatch", "out_of_resources", "warm_zero_copy", "MAX_WAIT_MS", "wait_ms", "MAX_FRAMES",
           "MAX_WORKER_FRAMES", "TooManyFrames"]

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_send = _Base.send
_recv = _Base.recv
_get = _Base.get
_EVENTS = int(zmq.EVENTS)
_FD = int(zmq.FD)
_POLLIN = int(zmq.POLLIN)

# Sockets some Waiter watches, and those of them that are quiet: the last libzmq call on it
# was an EVENTS that found no message (see Waiter).  Module-wide because quiet is a property
# of the socket, whoever asked: every call below keeps it true.
_WATCHED: set = set()
_QUIET: set = set()


#: The longest single wait handed to a poll, in milliseconds: `select.poll` and pyzmq's
#: `poll` take a C int of them (about 24.8 days), and a longer one raised OverflowError after
#: the request had gone out (a blocking client with `timeout=30 * 86400`, the timeouts hunt).
#: Every caller loops on its own deadline, so a longer wait is several of these.
MAX_WAIT_MS = 2**31 - 1


def wait_ms(seconds: float | None) -> int:
    """A wait of `seconds` (None: without a limit) as a poll's timeout: whole milliseconds,
    rounded up (truncated, the last fraction of one is a poll(0), and a loop on a deadline
    spins or ends early); -1 for None; at most `MAX_WAIT_MS`; 0 for none left."""
    if seconds is None:
        return -1
    if seconds <= 0:
        return 0
    return MAX_WAIT_MS if seconds >= MAX_WAIT_MS / 1000 else math.ceil(seconds * 1000)


def seed_routing_ids() -> None:
    """Seed the C library's rand(), from which libzmq 4.3 draws the first routing id a ROUTER
    gives its peers (the next ones count up from it).  Unseeded, it is the same in every
    process (0x6b8b4567 with glibc): a peer that chose the ids coming next made libzmq abort
    the process at the next ordinary connection (an assertion on a duplicate id), and could
    take a dropped client's id, and with it that client's replies (found by the CURVE hunt).
    Call before creating a ROUTER socket."""
    try:
        ctypes.CDLL(None).srand(secrets.randbits(32))
    except (OSError, AttributeError):  # pragma: no cover - a libc without srand
        pass


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """`sock.send_multipart(frames, flags=flags, copy=False)`, faster.  `flags` is 0 or
    NOBLOCK; as with send_multipart, a full queue raises `zmq.Again` at the first frame
    (libzmq queues a multipart message whole or not at all).

    Never leaves the socket inside a message: a send that fails or is interrupted after its
    first frame went out still ends that message before the exception goes on, or the
    socket's next message was glued onto it (an innocent request lost, a worker's error
    reply read as part of the reply it followed).

    - A frame at or above pyzmq's copy threshold (64 KiB) is sent zero-copy, which needs
      pyzmq's garbage-collector thread, its context's two I/O threads, a few descriptors and
      its module (`warm_zero_copy` starts them; else the first such frame in the process
      does).  Out of descriptors, memory or threads at that moment (`out_of_resources`),
      that frame and the ones after it are sent copied, which needs none of that: the
      message goes out whole and nothing is raised.  Only if the copy fails too (out of
      memory) is the error raised, the message ended with an empty frame that no receiver
      takes for a whole one.
    - A signal handler's exception (Ctrl-C, an alarm-based timeout): Python runs the
      handler between any two bytecodes of the main thread and pyzmq runs them around each
      frame it sends.  Whether the frame it landed on went out cannot be told (pyzmq checks
      before and after the C send), so that frame and the ones after it are sent again
      (copied) before the exception goes on: the interrupted message goes out whole, or with
      that frame twice (then refused as malformed; the last frame twice is a one-frame
      message after it, refused too), and the next message starts a message of its own
      whatever happened."""
    _QUIET.discard(sock)  # a send may process the socket's commands (see Waiter)
    last = len(frames) - 1
    more = int(flags) | _SNDMORE
    i = 0
    try:
        for i, f in enumerate(frames):
            _send(sock, f, more if i < last else int(flags), False)
    except zmq.ZMQError as e:
        if e.errno not in _RESOURCE_ERRNOS:
            # Again at the first frame: nothing went out (a full queue).  At a later one the
            # peer's pipe went away mid-message: libzmq now drops frames until the message's
            # last, so the rest is sent (dropped) to end it, or the next message would be
            # dropped in its place; at the last frame libzmq ended the message itself, and a
            # frame sent now would start a stray one (both found by review).
            if i and (e.errno != zmq.EAGAIN or i < len(frames) - 1):
                _finish_message(sock, frames, i, int(flags))
            raise
        if not _finish_message(sock, frames, i, int(flags)):
            raise
    except BaseException as e:
        if 0 < i < 3 and frames[0] is _MDPC and not out_of_resources(e):
            # A client's message cut at its command or service frame: that frame twice
            # shifted the header out of its place, and the message was a valid opaque one
            # (a REQUEST to the service with the service name as its body, which an echo
            # answered and the client took as a plain worker's answer, failing another call
            # of that service: the interruption hunt).  Ended with a frame that makes it
            # malformed whether or not the frame it landed on went out instead.
            finished = _finish_message(sock, (_POISON,), 0, int(flags))
        else:
            finished = _finish_message(sock, frames, i, int(flags))
        if not finished or not out_of_resources(e):
            raise


#: What ends a client's message cut short at its command or service frame: as a command,
#: unknown; as a service name, too long (over 255 bytes); as a body, a header (the magic of
#: header.MAGIC) that does not decode (0xc1 is never used in msgpack), with no request id.
_POISON = b"\xc1ZNF" + b"\xc1" * 256
_MDPC = MDPC


#: errno values that mean "this process or host is out of descriptors or memory"
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def out_of_resources(e: BaseException) -> bool:
    """Whether `e` says that this process is out of descriptors, memory or threads (EMFILE,
    ENFILE, ENOMEM from libzmq or the OS, MemoryError, the RuntimeError of a thread that
    cannot start): this moment's condition, not the value's fault."""
    if isinstance(e, (zmq.ZMQError, OSError)):
        return e.errno in _RESOURCE_ERRNOS
    if isinstance(e, MemoryError):
        return True
    return isinstance(e, RuntimeError) and "can't start new thread" in str(e)


#: times `_finish_message` sends one frame again that signal handlers' exceptions keep
#: interrupting, before it goes on to the next
_RETRIES = 8


def _finish_message(sock: zmq.Socket, frames: Sequence[Any], start: int, flags: int) -> bool:
    """Send frames[start:] of a message a failure or a signal handler's exception cut short,
    copied (a copy needs neither pyzmq's garbage-collector thread nor its socket), without
    blocking; whether they all went out.  libzmq takes every later frame once it took the
    first; if the first was not taken (a full queue), it is refused again, and nothing of
    the message went out.  A frame that cannot be sent (out of memory for its copy, a socket
    closed) ends the message with an empty frame instead: the socket is at a message
    boundary whatever happened, and what went out is malformed, refused by its receiver.
    Another handler's exception meanwhile does not stop it (the first one goes on): the
    frame it landed on is sent again (twice, perhaps: refused as malformed)."""
    last = len(frames) - 1
    more = flags | _SNDMORE | _NOBLOCK
    j = start
    tries = 0
    while j <= last:
        try:
            _send(sock, frames[j], more if j < last else flags | _NOBLOCK, True)
        except zmq.ZMQError:
            if j == 0:
                return False  # the first frame was not taken: nothing went out
            break
        except BaseException as e:  # noqa: BLE001 - a handler's exception, or no memory for the copy
            if out_of_resources(e):
                if j == 0:
                    return False  # nothing of the message went out: nothing to end
                break
            tries += 1
            if tries < _RETRIES:
                continue  # a handler's: the frame may not have gone out, send it again
        j += 1
        tries = 0
    else:
        return True
    for _ in range(_RETRIES):
        try:
            _send(sock, b"", flags | _NOBLOCK, True)
            break
        except zmq.ZMQError:
            break  # a closed socket: nothing will be delivered anyway
        except BaseException:  # noqa: BLE001 - a handler's exception: end the message all the same
            pass
    return False


def warm_zero_copy() -> None:
    """Start what pyzmq's zero-copy sends need (its garbage-collector thread, that thread's
    context with its two I/O threads and its sockets), now rather than at the first frame of
    64 KiB or more, when the process may be out of descriptors or threads (`send_frames`
    then copies such frames instead).  Raises what starting them raises (ZMQError or OSError
    EMFILE, RuntimeError: no thread); next to nothing once they run (a check and a frame)."""
    zmq.Frame(b"\0", copy=False)  # made zero-copy whatever its size, and dropped at once


#: The most frames a message from a peer may have (`recv_frames`' ``max_frames``): ours have
#: a handful, a REQUEST a header and up to MAX_TENSORS (256) tensors, a DONE up to MAX_DONE
#: (4096) envelopes; a plain MDP body of many frames has room too.  A message of empty frames
#: costs its sender 2 bytes a frame and its reader a Python object each: 500,000 of them, in
#: one message of 1 MB, held the broker's loop for 0.9 s and took 60 MB (the hostile hunt).
MAX_FRAMES = 8192
#: a worker's: its reply echoes a client's body (`echo` a plain MDP request of MAX_FRAMES,
#: with the reply's own frames around it), so a client's largest message never makes its
#: worker's reply too long (the review: one such request disconnected worker after worker)
MAX_WORKER_FRAMES = MAX_FRAMES + 64


class TooManyFrames(Exception):
    """A message of more than ``max_frames`` frames was read and dropped (`recv_frames`):
    ``ident`` is its first frame (a ROUTER's peer), ``frames`` how many it had."""

    def __init__(self, first: Any, frames: int, limit: int = MAX_FRAMES):
        super().__init__(f"a message of {frames} frames (at most {limit})")
        self.first = first  # its first frame (a zmq.Frame: it says which connection it came on)
        self.ident = bytes(first.bytes)
        self.frames = frames


def recv_frames(sock: zmq.Socket, flags: int = 0, max_frames: int | None = None) -> list[zmq.Frame]:
    """`sock.recv_multipart(flags, copy=False)`, faster.

    A signal handler's exception (Ctrl-C, an alarm) in the middle of a message loses that
    message (pyzmq runs the handlers after each frame it receives, and the frame it had
    just read goes with the exception): the rest of it is read and dropped before the
    exception goes on, so that the socket's next read starts a message (it had been read
    as a malformed one of its own).

    ``max_frames``: a message with more is read to its end without keeping its frames
    (libzmq hands a message over whole: it is in memory already, and only reading it frees
    it) and raises `TooManyFrames`."""
    _QUIET.discard(sock)
    try:
        f = _recv(sock, flags, False)
        parts = [f]
        while f.more:
            if max_frames is not None and len(parts) >= max_frames:
                break
            f = _recv(sock, flags, False)
            parts.append(f)
        else:
            return parts
    except zmq.ZMQError:
        raise
    except BaseException:
        _drop_rest(sock)  # (RCVMORE: whether the last frame read, or lost, had more after it)
        raise
    raise TooManyFrames(parts[0], len(parts) + _discard(sock), max_frames)


def _discard(sock: zmq.Socket) -> int:
    """Read what is left of the message being received, keeping nothing (bytes, not
    frames: no Python object outlives its read); how many frames that was.  A signal
    handler's exception meanwhile (Ctrl-C) is raised once the message is read."""
    n = 0
    raised = None
    while True:
        try:
            if not _get(sock, _RCVMORE):
                break
            _recv(sock, _NOBLOCK, True)
            n += 1
        except zmq.ZMQError:
            break
        except BaseException as e:  # noqa: BLE001 - a signal handler's: the message first
            if raised is None:
                raised = e
    if raised is not None:
        raise raised
    return n


def _drop_rest(sock: zmq.Socket) -> None:
    """Read and drop what is left of the message being received (libzmq delivers a
    message's frames together: none of these reads waits), to its end (it stopped at
    65,536 frames, and the rest was read as messages of their own); another handler's
    exception meanwhile is dropped (the one on its way out is the caller's)."""
    try:
        _discard(sock)
    except BaseException:  # noqa: BLE001
        pass


def sock_events(sock: zmq.Socket) -> int:
    """`sock.get(zmq.EVENTS)` without the sugar layer's Python call (the loops ask this once
    per message and once more to find the queue empty)."""
    ev = _get(sock, _EVENTS)
    if ev & _POLLIN:
        _QUIET.discard(sock)
    elif sock in _WATCHED:
        _QUIET.add(sock)
    return ev


_MONITOR_HEAD = struct.Struct("=HI")  # libzmq's first event format: event id, value; no padding


def monitor_event(frames: Sequence[Any]) -> dict:
    """A socket monitor's message as {"event", "value", "endpoint"} (ints, and the endpoint's
    bytes): libzmq's first event format, a 6-byte frame (the event's 16-bit id, its 32-bit
    value: a descriptor, an errno, a protocol error code) and the endpoint.  pyzmq's
    `zmq.utils.monitor` reads the same, but that module imports asyncio (through
    zmq.asyncio): 20-50 ms of the start of every broker, worker and blocking client, which
    have no other use for it.  ValueError for any other message."""
    if len(frames) != 2 or len(frames[0]) != 6:
        raise ValueError(f"not a socket monitor's event: {len(frames)} frame(s)")
    event, value = _MONITOR_HEAD.unpack(frames[0])
    return {"event": event, "value": value, "endpoint": bytes(frames[1])}


def recv_monitor_event(sock: zmq.Socket, flags: int = 0) -> dict:
    """The next event of monitor socket ``sock`` (`monitor_event`)."""
    return monitor_event(sock.recv_multipart(flags))


#: heartbeat intervals a tcp peer may stay unreachable before `tcp_liveness(sock, ...)`, given
#: no explicit span, drops its connection
DEAD_AFTER_BEATS = 10


def tcp_liveness(sock: zmq.Socket, dead_after_s: float) -> None:
    """Close the tcp connections `sock` makes or accepts from now on whose peer stopped
    acknowledging for about `dead_after_s` seconds, with the messages queued to them: TCP
    keepalive probes on an idle connection (the first after a third of the span, then every
    third, three of them; more of them, further apart, on a span of over a day:
    `keepalive_plan`) and TCP_USER_TIMEOUT (libzmq's ZMQ_TCP_MAXRT) on data or probes
    left unacknowledged.  A peer behind a partition, or whose host died, otherwise holds a
    half-open connection and its queue for as long as TCP retries, many minutes.

    Acknowledgements come from the peer's kernel: an idle peer that is alive, one busy in
    its own code, or a slow link moving a large frame all keep their connections (ZMTP's
    own PING/PONG would not do: libzmq counts only whole frames as an answer, so one frame
    that takes longer than the timeout to cross would cut a working connection).  No effect
    on ipc, whose peer's death closes its connection by itself."""
    idle, probes, maxrt = keepalive_plan(dead_after_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, idle)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, probes)
    sock.setsockopt(zmq.TCP_MAXRT, maxrt)


#: Linux's bounds (include/net/tcp.h): TCP_KEEPIDLE and TCP_KEEPINTVL take at most 32767 s,
#: TCP_KEEPCNT at most 127 probes.  libzmq applies them to each connection it accepts or
#: makes, and one it cannot set (EINVAL) is closed at once: past them, no tcp connection of
#: the socket ever came up, and nothing said why.
MAX_KEEPALIVE_S = 32767
MAX_KEEPALIVE_PROBES = 127


def keepalive_plan(dead_after_s: float) -> tuple[int, int, int]:
    """`tcp_liveness`'s settings for a span: (seconds idle before the first probe, which is
    also the interval between probes; probes; TCP_MAXRT in ms).  A third of the span each
    and three probes; a span too long for a third of it to be a probe interval Linux takes
    (over about 27 hours: a client liveness window of more than half a day, doubled; a
    client's heartbeat interval of more than 5.5 hours, times 5) is covered by more probes
    at the longest interval (up to about 48 days), and TCP_MAXRT, a C int of milliseconds,
    is at most `MAX_WAIT_MS` (about 24.8 days; more raised OverflowError)."""
    span = min(float(dead_after_s), 1e9)  # (finite: a NaN or an infinity is the longest)
    if not span >= 0:
        span = 1e9
    third = max(1, round(span / 3))  # keepalive takes whole seconds
    idle = min(third, MAX_KEEPALIVE_S)
    probes = min(MAX_KEEPALIVE_PROBES, max(3, math.ceil((span - idle) / idle)))
    return idle, probes, min(MAX_WAIT_MS, max(1000, int(span * 1000)))


# struct tcp_info (linux/tcp.h): tcpi_unacked (u32) at 24; tcpi_bytes_acked and
# tcpi_bytes_received (u64) at 120 and 128 (Linux 4.1); tcpi_notsent_bytes (u32) at 144 (4.6).
_TCP_INFO_LEN = 160
# Acknowledged bytes count as an upload under way only past this much since the previous
# look: a hung peer's kernel still acknowledges our heartbeats (tens of bytes each).
UPLOAD_MIN_BYTES = 16 << 10
_SRCFD = int(zmq.SRCFD)


def tcp_counts(fd: int) -> tuple[int, int, bool] | None:
    """What the kernel counts of the TCP connection on descriptor `fd`: (bytes the peer
    acknowledged, bytes received from it, whether bytes of ours wait to be sent or
    acknowledged).  None when `fd` is no TCP socket (ipc, closed) or the kernel does not
    count bytes (Linux before 4.1).  Reads a duplicate of the descriptor, so the socket's
    owner (libzmq's I/O thread) is not disturbed: closing the duplicate does not close the
    connection."""
    got = _tcp_state(fd)
    return None if got is None else got[1]


def dup_socket(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of descriptor `fd` (close it: the original stays
    open), or None when `fd` is not an open socket (no duplicate is left behind)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:  # not a socket
        os.close(dup)
        return None


def _tcp_state(fd: int) -> tuple[Any, tuple[int, int, bool]] | None:
    """(the peer's address, `tcp_counts`) of descriptor `fd`, through one duplicate."""
    s = dup_socket(fd)
    if s is None:
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        peer = s.getpeername()
    except OSError:
        return None
    finally:
        s.close()
    if len(info) < 136:
        return None
    acked, received = struct.unpack_from("=QQ", info, 120)
    (unacked,) = struct.unpack_from("=I", info, 24)
    notsent = struct.unpack_from("=I", info, 144)[0] if len(info) >= 148 else 0
    return peer, (acked, received, bool(unacked or notsent))


class TcpWatch:
    """Whether bytes are moving on one peer's TCP connection: the liveness of a peer whose
    message takes longer to cross than its heartbeats allow.

    Heartbeats are messages, and a message counts only once whole: behind a 32 MiB tensor
    on a 40 Mbit/s link (7 s) the peer's heartbeats wait, and its silence by messages says
    nothing of its health.  The kernel counts bytes.  A look (`look`) reads the connection's
    counts (`tcp_counts`, a few µs) and, when they moved since the previous look, notes the
    time: bytes received from the peer, or bytes of ours it acknowledged while more of ours
    waited to go, more than heartbeats make (`UPLOAD_MIN_BYTES`: an upload under way; a
    heartbeat's acknowledgement is given by the kernel of a peer whose process hangs too).
    A hung peer's kernel moves bytes for at most as long as its buffers take to fill or
    drain, so silence resumes after.  A message noted starts the next looks afresh.

    The connection is the one the last message noted (`note`: its ZMQ_SRCFD); a descriptor
    that now carries another connection (its number reused) or no TCP at all never moves."""

    __slots__ = ("fd", "moved_at", "_peer", "_counts", "_off")

    def __init__(self) -> None:
        self.fd = -1  # the connection's descriptor in this process (libzmq's I/O thread owns it)
        self.moved_at = -math.inf  # monotonic time of the last look that saw bytes move
        self._peer: Any = None
        self._counts: tuple[int, int] | None = None
        self._off = True  # no connection, or none to learn from (not TCP, closed, reused)

    def note(self, frame: Any) -> None:
        """The connection `frame` (a received zmq.Frame) came on is the peer's now."""
        try:
            fd = frame.get(_SRCFD)
        except (zmq.ZMQError, AttributeError):
            return
        if fd != self.fd or self._off:
            self.use(fd)  # another connection, or one a look could not read (reconnected)
        else:
            self._counts = None  # a message came: the next silence's looks start afresh

    def use(self, fd: int) -> None:
        """Watch descriptor `fd` from now on (the counts start afresh)."""
        self.fd = fd
        self._peer = None
        self._counts = None
        self._off = fd < 0

    def look(self, now: float) -> float:
        """Read the counts at `now`; the last time they were seen to move (-inf: never)."""
        if self._off:
            return self.moved_at
        got = _tcp_state(self.fd)
        if got is None:
            self._off = True  # not TCP, or gone: nothing more to learn from it
            return self.moved_at
        peer, counts = got
        if self._peer is None:
            self._peer = peer
        elif peer != self._peer:  # another connection under the same number
            self._off = True
            return self.moved_at
        acked, received, backlog = counts
        last = self._counts
        self._counts = (acked, received)
        if last is not None and (received != last[1] or (acked - last[0] >= UPLOAD_MIN_BYTES and backlog)):
            self.moved_at = now
        return self.moved_at


def quiet_fd(sock: zmq.Socket) -> int | None:
    """The descriptor (ZMQ_FD) of a watched socket that is quiet (the last libzmq call on it
    was an EVENTS that found no message, see Waiter), so that its next message signals it;
    None for a socket that is not, whose descriptor may stay silent over a message that
    waits.  For a thread that waits on a socket it may not call: it sleeps on this
    descriptor, and reads the socket only once it holds it again."""
    if sock not in _QUIET:
        return None
    return _get(sock, _FD)


def touched(sock: zmq.Socket) -> None:
    """Say that a pyzmq call other than this module's (`Socket.poll`, `send_multipart`,
    `recv`...) was made on `sock`: it may have taken the signal of a message that waits,
    so a Waiter must ask EVENTS again before it sleeps."""
    _QUIET.discard(sock)


class Waiter:
    """Waits for messages on zmq sockets, and for plain descriptors to be readable, asking a
    socket its EVENTS only when the answer may have changed.

    `zmq_poll` asks every socket its EVENTS (a getpid and a poll syscall in libzmq, about
    2 µs from Python here) before it sleeps and again after it wakes, whichever socket
    woke it: six questions for three sockets, around a wait that is usually for one
    message on one of them.  A Waiter sleeps in `select.poll` on the sockets' descriptors
    (ZMQ_FD) and asks only:
      - before it sleeps, the sockets that are not *quiet*.  A socket is quiet when the last
        libzmq call on it was an EVENTS (`sock_events`, this class) that
        found no message: libzmq then signals its descriptor when the next message comes
        (the descriptor is edge-triggered: it signals a change, not a state).  Any other
        call (a send, a receive) may consume that signal while leaving a message queued,
        so `send_frames` and `recv_frames` clear the mark, and other pyzmq calls on a
        watched socket must be followed by `touched`;
      - after it wakes, the sockets whose descriptor signalled.
    So a loop that sends a request on one socket and waits for the reply asks EVENTS
    twice per message (before it sleeps and on waking) instead of 2 x sockets, and its
    drain's last question (the queue is empty) doubles as the next wait's.

    `wait` returns the sockets that hold a message in the order they were added, then the
    plain descriptors that are readable, in theirs (callers rely on the order: the client
    reads the broker's socket after its reply sockets, the broker its workers first).  A
    wake-up for a socket command that brought no message returns nothing before the
    timeout, where zmq_poll would wait on: callers loop on their own deadlines.  Every call
    looks at every descriptor (a poll without waiting when a socket is found ready first),
    so a socket read in part by its caller never hides the others.  One thread per Waiter;
    a socket watched by one Waiter only.
    """

    __slots__ = ("_poll", "_by_fd", "_fd_of", "_socks", "_fds", "_single")

    def __init__(self) -> None:
        self._poll = select.poll()
        self._by_fd: dict[int, Any] = {}       # ZMQ_FD -> socket
        self._fd_of: dict[Any, int] = {}       # socket -> ZMQ_FD
        self._socks: list[Any] = []            # in the order they were added (the order `wait` lists them)
        self._fds: list[int] = []              # plain descriptors
        self._single: dict[Any, Any] = {}      # socket -> a poll of its descriptor alone (has_message)

    def add(self, sock: zmq.Socket) -> None:
        if sock in self._fd_of:
            return
        fd = sock.get(zmq.FD)  # no command processing: the socket stays as it is
        if fd in self._by_fd:  # a socket closed without remove(), its number reused
            raise ValueError(f"descriptor {fd} is already watched: remove() a socket before closing it")
        self._poll.register(fd, select.POLLIN)
        self._by_fd[fd] = sock
        self._fd_of[sock] = fd
        self._socks.append(sock)
        _WATCHED.add(sock)
        _QUIET.discard(sock)  # not known to be quiet: the first wait asks

    def add_fd(self, fd: int) -> None:
        if fd in self._fds:
            return
        self._poll.register(fd, select.POLLIN)
        self._fds.append(fd)

    def remove(self, what: Any) -> None:
        """Stop watching a socket (before it is closed) or a plain descriptor."""
        if isinstance(what, int):
            if what in self._fds:
                self._fds.remove(what)
                self._poll.unregister(what)
            return
        fd = self._fd_of.pop(what, None)
        if fd is None:
            return
        del self._by_fd[fd]
        self._socks.remove(what)
        self._single.pop(what, None)
        self._poll.unregister(fd)
        _WATCHED.discard(what)
        _QUIET.discard(what)

    def sockets(self) -> list[Any]:
        """The sockets watched, in the order they were added."""
        return list(self._socks)

    def __contains__(self, what: Any) -> bool:
        return what in self._fd_of if not isinstance(what, int) else what in self._fds

    def close(self) -> None:
        for sock in list(self._socks):
            self.remove(sock)
        for fd in list(self._fds):
            self.remove(fd)

    def has_message(self, sock: zmq.Socket) -> bool:
        """Whether watched `sock` holds a message now: EVENTS, unless it is quiet and its
        descriptor has not signalled since (one poll syscall instead of two)."""
        if sock in _QUIET:
            single = self._single.get(sock)
            if single is None:
                single = self._single[sock] = select.poll()
                single.register(self._fd_of[sock], select.POLLIN)
            if not single.poll(0):
                return False
            _QUIET.discard(sock)
        return bool(sock_events(sock) & _POLLIN)

    def any_message(self, descriptors: bool = True) -> bool:
        """Whether any watched socket may hold a message or any plain descriptor is readable,
        without waiting: EVENTS of the sockets that are not quiet, then one poll of every
        descriptor (a quiet socket whose descriptor signalled counts, unasked).  May answer
        True for nothing (a signal for a socket command); never False for a message.
        ``descriptors=False``: the plain descriptors do not count, and when every socket was
        asked (none quiet) the poll syscall is left out."""
        quiet = _QUIET
        any_quiet = False
        for sock in self._socks:
            if sock in quiet:
                any_quiet = True
            elif sock_events(sock) & _POLLIN:
                return True
        if not descriptors:
            if not any_quiet:
                return False
            by_fd = self._by_fd
            return any(fd in by_fd for fd, _ in self._poll.poll(0))
        return bool(self._poll.poll(0))

    def _select(self, ms: float) -> list[tuple[int, int]]:
        """`self._poll.poll(ms)` to the microsecond, for a wait with a fraction of a
        millisecond (`wait`)."""
        fds = [*self._by_fd, *self._fds]
        try:
            readable, _, _ = select.select(fds, (), (), ms / 1000.0)
        except (ValueError, OSError):
            # A descriptor beyond select's FD_SETSIZE (ValueError, before any sleep), or one
            # closed while watched (poll reports it; select raises): the whole milliseconds
            # that cover the wait, as poll counts them.
            return self._poll.poll(math.ceil(ms))
        return [(fd, select.POLLIN) for fd in readable]

    def wait(self, ms: float) -> list[Any]:
        """Wait up to `ms` milliseconds (negative: without a limit, 0: not at all); the
        sockets holding a message and the readable plain descriptors.  At most
        `MAX_WAIT_MS` at once, whatever `ms` says.

        `select.poll` counts whole milliseconds, so a wait with a fraction of one (a
        batcher's window that ends 0.4 or 4.3 ms from now) sleeps in `select.select`
        instead, whose timeout is in microseconds: truncated, its last fraction would turn
        the caller's loop into a spin (on a small machine the spin takes the CPU that the
        clients it waits for need); rounded up, it would end late."""
        if ms > MAX_WAIT_MS:  # (a poll's C int: the caller loops on its deadline)
            ms = MAX_WAIT_MS
        quiet = _QUIET
        ready = [sock for sock in self._socks if sock not in quiet and sock_events(sock) & _POLLIN]
        if ready:
            # Not without looking at the rest, without waiting: a quiet socket whose
            # descriptor signalled (and the plain descriptors) must not starve behind one
            # that a caller reads only in part (a budget per pass).
            ms = 0
        if ms > 0 and ms != int(ms):  # (int() of NaN or infinity raises below, as it always did)
            signalled = self._select(ms)
        else:
            signalled = self._poll.poll(-1 if ms < 0 else int(ms))
        if not signalled:
            return ready
        by_fd = self._by_fd
        fds = None
        for fd, _ in signalled:
            sock = by_fd.get(fd)
            if sock is None:
                if fd in self._fds:
                    if fds is None:
                        fds = []
                    fds.append(fd)
            elif sock in quiet:
                # quiet until now: its descriptor says something changed; ask
                quiet.discard(sock)
                if sock_events(sock) & _POLLIN:
                    ready.append(sock)
            elif sock not in ready and sock_events(sock) & _POLLIN:
                ready.append(sock)
        if len(ready) > 1:  # in the order added, however they were found
            found = set(ready)
            ready = [s for s in self._socks if s in found]
        if fds is not None:
            if len(fds) > 1:
                fds = [fd for fd in self._fds if fd in fds]
            ready += fds
        return ready
