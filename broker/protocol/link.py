"""The local link: a worker's direct socket (docs/protocol.md section 10) for a client on the
same host, over a Unix ``SOCK_SEQPACKET`` socket instead of a libzmq ipc connection.

Why: every libzmq message crosses two I/O threads (the sender's and the receiver's), so a
pinned round trip over ipc wakes six threads; over the link it wakes two (the client's and
the worker's), each reading and writing the kernel socket itself.  A raw echo measured
18.5 µs against 66-79 µs p50 for a DEALER/ROUTER pair on the test machine
(`python -m bench.link_floor`; BENCHMARKS.md, "The local link").

What travels is exactly the direct socket's client sub-protocol (HELLO, REQUEST, CANCEL,
HEARTBEAT, DISCONNECT; PARTIAL, FINAL, FINALS back), one multipart message at a time:

    datagram = flags (1 byte: 0x00 the message ends here, 0x01 more datagrams follow)
               + a piece of the message
    message  = n (u16 LE), n frame sizes (u32 LE each), then the n frames back to back

A message that fits one datagram (`LINK_DATAGRAM` bytes, flag byte included) is one
datagram, written with one ``sendmsg`` of the frames as they are (no copy).  A client
sends nothing larger (the SDK sends a bigger request through the broker); a worker's reply
may span several datagrams, in order, the last one flagged 0x00: each written from views of
the frames, and read by the client straight into one buffer of the message's length (which
the first piece's size table gives), so a large inline tensor is copied by the kernel only.  SEQPACKET keeps
datagram boundaries and order and is reliable, so there is no other framing.  What the
kernel does not take at once (a reader behind, a message of several datagrams) waits in
the connection's outbox; its frames under pyzmq's copy threshold are copied first, as
pyzmq copies them, so a sender may reuse those buffers once `send` returned (`_kept`).

The worker's side (`LinkServer`) listens at ``<runtime dir>/w-<pid>-<start>-<hex>.link``
beside its ipc direct socket (mode 0600 in the 0700 runtime directory), accepts only peers of
its own uid (SO_PEERCRED), and gives every connection a routing id of 9 bytes starting with a
zero byte, a shape a libzmq ROUTER never makes itself (the worker drops what a ROUTER peer
sends under such an id it chose: gpu_worker.leases.DirectSocket), so a link connection
cannot be impersonated on the ipc direct socket.
It reads into an inbox the frames a ROUTER would have returned (``[routing id, MDPC02,
command, ...]``), and a connection that closes, or sends what is not a message, is ended with
a DISCONNECT of its own in that inbox (the worker then unbinds it, as for a DISCONNECT).
Sends never block (but for a stream's replies at the cap, which wait while the client reads:
`LinkServer.send`'s ``wait``): what the kernel does not take waits in the connection's outbox and
leaves when the socket is writable (``max_queue`` messages, counted whole whatever the
datagrams they span, and ``max_queue_bytes`` bytes; below both, a reply goes however large,
so the outbox holds at most the byte cap plus one message).  A reply that finds the outbox
at a cap *retires* the connection, where a ROUTER past its high-water mark would drop it
silently and leave its client waiting for a deadline: that reply and every later one are
dropped, the connection is shut for reading (the client's sends fail, so it sends through
the broker), what it sent and the worker had not taken is dropped, the worker gets its
DISCONNECT at once (it unbinds it), what the outbox holds still leaves, and then the
connection closes (what the client sent and nobody read is discarded first: a unix socket
closed with unread data resets its peer, which would lose its unread replies), so the
client reads the replies it was sent, then the end, and sends the calls still waiting
through the broker (client_sdk.pins, `pin_link_lost`).  A client that reads nothing for
`RETIRE_GRACE_S` after its connection retired has it ended with what was still waiting
(`LinkServer.expire`, from the worker's housekeeping).  Everything the worker must wait
for is behind one descriptor (`LinkServer.fileno`, an epoll set), readable whenever the
link has something to do.

The client's side (`LinkConn`) is one connection per lease; it reassembles multi-datagram
replies.  Neither side has a thread.
"""
from __future__ import annotations

import logging
import math
import os
import select
import socket
import struct
import time
from collections import deque
from itertools import accumulate
from typing import Any, Callable, Sequence

from .frames import C_DISCONNECT, MDPC

__all__ = ["LINK_DATAGRAM", "LinkError", "LinkConn", "LinkServer", "encode", "decode",
           "link_route"]

#: bytes of one datagram at most, its flag byte included (well under the default socket
#: buffer of about 208 KiB, so one always fits an empty buffer)
LINK_DATAGRAM = 65536
#: frames of one message at most (an MDP request has 5 plus one per inline tensor)
MAX_FRAMES = 4096
_LAST = b"\x00"
_MORE = b"\x01"
_PREFIXES: dict[int, struct.Struct] = {}
_SIZES: dict[int, struct.Struct] = {}
_U16 = struct.Struct("<H")
# MSG_NOSIGNAL: a peer gone (or a retired connection, shut for reading) is EPIPE, not a
# SIGPIPE that an embedding application may not ignore
_DONTWAIT = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
log = logging.getLogger("broker.protocol.link")
_PEERCRED = struct.Struct("3i")


class LinkError(ValueError):
    """A datagram that is not a link message (section 10, "the local link")."""


def _head(frames: Sequence[Any]) -> tuple[bytes, int]:
    """A message's first bytes (the flag of a single datagram, the frame count and sizes)
    and the whole datagram's length.  Frames: bytes, memoryview, zmq.Frame, contiguous
    numpy arrays..."""
    sizes = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
    n = len(sizes)
    if n > MAX_FRAMES:
        raise LinkError(f"a link message holds at most {MAX_FRAMES} frames, not {n}")
    st = _PREFIXES.get(n)
    if st is None:
        st = _PREFIXES[n] = struct.Struct(f"<cH{n}I")
    return st.pack(_LAST, n, *sizes), st.size + sum(sizes)


#: pyzmq's: a frame under it is copied when queued, a larger one is the message's own (the
#: sender hands it over, as to zmq.Socket.send(copy=False))
COPY_THRESHOLD = 1 << 16


def _kept(frames: Sequence[Any]) -> list[Any]:
    """``frames`` as a message kept for later must hold them: what pyzmq would copy (frames
    under COPY_THRESHOLD) copied, so the sender may reuse those buffers once `send`
    returned, as it may with zmq (a model refilling its output buffer sent queued replies
    with a later request's values: found by the data hunt); larger ones as they are."""
    return [f if type(f) is bytes or memoryview(f).nbytes >= COPY_THRESHOLD else bytes(f) for f in frames]


def encode(frames: Sequence[Any]) -> list[list[Any]]:
    """The datagrams of one message, each a buffer list for ``sendmsg``: one datagram, the
    frames as they are, when it fits; else the message cut in pieces, each a list of views
    of the frames (nothing is copied either way)."""
    head, total = _head(frames)
    if total <= LINK_DATAGRAM:
        return [[head, *frames]]
    step = LINK_DATAGRAM - 1
    out: list[list[Any]] = []
    piece: list[Any] = [_MORE]
    room = step
    for f in (memoryview(head)[1:], *frames):
        v = f if type(f) is memoryview else memoryview(f)
        v = v.cast("B") if v.format != "B" or v.ndim != 1 else v
        while len(v):
            if not room:
                out.append(piece)
                piece, room = [_MORE], step
            take = v[:room]
            piece.append(take)
            room -= len(take)
            v = v[len(take):]
    piece[0] = _LAST
    out.append(piece)
    return out


def decode(buf: bytes, start: int = 1) -> list[memoryview]:
    """The frames of one whole message (``buf[start:]``), as views of ``buf``."""
    end = len(buf)
    if end - start < 2:
        raise LinkError("a link message starts with its frame count (2 bytes)")
    (n,) = _U16.unpack_from(buf, start)
    at = start + 2 + 4 * n
    if n > MAX_FRAMES or at > end:
        raise LinkError(f"a link message of {n} frames needs {4 * n} bytes of sizes")
    st = _SIZES.get(n)
    if st is None:
        st = _SIZES[n] = struct.Struct(f"<{n}I")
    ends = list(accumulate(st.unpack_from(buf, start + 2), initial=at))
    if ends[-1] != end:
        raise LinkError(f"the frame sizes add up to {ends[-1] - at} bytes, the message holds {end - at}")
    view = memoryview(buf)
    return [view[a:b] for a, b in zip(ends, ends[1:])]


def _bytes_of(dgrams: list[list[Any]]) -> int:
    """The bytes of a message's datagrams (what its outbox entries hold)."""
    return sum(len(b) if type(b) is bytes else memoryview(b).nbytes for d in dgrams for b in d)


def link_route(counter: int) -> bytes:
    """The routing id of link connection number ``counter``: 9 bytes, the first zero."""
    return b"\x00" + counter.to_bytes(8, "big")


class LinkConn:
    """A client's connection to a worker's link.  Not thread-safe (one per lease, used by the
    thread that owns the client)."""

    __slots__ = ("sock", "path", "closed", "_whole", "_at", "_fd")

    def __init__(self, path: str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.setblocking(False)
            sock.connect(path)  # a Unix socket connects at once, or fails (EAGAIN: its backlog is full)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self.path = path
        self.closed = False
        self._whole: bytearray | None = None  # a message in pieces, as they come (one copy: the kernel's)
        self._at = 0                          # ... filled up to here
        self._fd = sock.fileno()

    def fileno(self) -> int:
        return self._fd

    @property
    def partial(self) -> bool:
        """Whether a message in pieces has begun to arrive, and its next piece not yet."""
        return self._whole is not None

    def readable_within(self, timeout: float) -> bool:
        """Whether something (a piece, the end) comes within ``timeout`` seconds."""
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        return bool(p.poll(max(0, math.ceil(timeout * 1000))))  # (whole ms, rounded up, as wire.wait_ms)

    def send(self, frames: Sequence[Any]) -> bool:
        """Send one message of a single datagram without blocking; False when it was not
        sent (too large for one datagram, the socket full, or the connection gone)."""
        if self.closed:
            return False
        head, total = _head(frames)
        if total > LINK_DATAGRAM:
            return False
        try:
            self.sock.sendmsg([head, *frames], (), _DONTWAIT)
            return True
        except BlockingIOError:
            return False
        except OSError:  # EPIPE, ECONNRESET: the worker is gone
            return False

    def recv(self) -> list[memoryview] | None:
        """One whole message, or None when none is there (yet).  Raises EOFError when the
        worker closed the connection (or it broke), LinkError for what is not a message."""
        while True:
            if self._whole is not None:  # a message in pieces: the next one straight into its buffer
                done = self._recv_piece()
                if done is None:
                    return None
                if done:
                    whole, self._whole = self._whole, None
                    return decode(whole, 0)
                continue
            d = self._recv(LINK_DATAGRAM)
            if d is None:
                return None
            flag = d[0]
            if flag == 0:
                return decode(d)
            if flag != 1:
                raise LinkError(f"datagram flag {flag:#x}")
            # The first piece holds the frame count and sizes (at most 16 KiB), so the message's
            # length: its buffer is made once, and each later piece is read into it (one copy,
            # the kernel's).
            (n,) = _U16.unpack_from(d, 1) if len(d) >= 3 else (-1,)
            if not 0 <= n <= MAX_FRAMES or len(d) < 3 + 4 * n:
                raise LinkError("a first piece without its frame count and sizes")
            total = 2 + 4 * n + sum(struct.unpack_from(f"<{n}I", d, 3))
            if total < len(d) - 1:
                raise LinkError("a first piece longer than its message")
            self._whole = bytearray(total)
            self._whole[:len(d) - 1] = memoryview(d)[1:]
            self._at = len(d) - 1

    def _recv(self, n: int) -> bytes | None:
        try:
            d = self.sock.recv(n)
        except BlockingIOError:
            return None
        except ConnectionResetError:
            # A worker that exited with requests of ours unread resets the connection: said
            # once, before the replies it sent, which are still queued (`_reset_then`).
            d = self._reset_then(lambda: self.sock.recv(n))
            if d is None:  # (a reset socket reads its queue, then end of file: never this)
                raise EOFError("the link connection was reset") from None
        except OSError as e:
            raise EOFError(f"the link connection broke ({e})") from None
        if not d:
            raise EOFError("the worker closed the link connection")
        return d

    def _recv_piece(self) -> bool | None:
        """Read the next piece of the message in ``_whole`` into it: None when none is there
        yet, True when it was the last one, False when more follow."""
        whole = self._whole
        flag = bytearray(1)
        try:
            nbytes, _, msg_flags, _ = self.sock.recvmsg_into([flag, memoryview(whole)[self._at:]])
        except BlockingIOError:
            return None
        except ConnectionResetError:
            got = self._reset_then(lambda: self.sock.recvmsg_into([flag, memoryview(whole)[self._at:]]))
            if got is None:  # (a reset socket reads its queue, then end of file: never this)
                raise EOFError("the link connection was reset") from None
            nbytes, _, msg_flags, _ = got
        except OSError as e:
            raise EOFError(f"the link connection broke ({e})") from None
        if nbytes == 0:
            raise EOFError("the worker closed the link connection")
        if msg_flags & socket.MSG_TRUNC or flag[0] > 1:
            raise LinkError("a piece that runs past its message, or a bad flag")
        self._at += nbytes - 1
        if flag[0] == 1:
            return False
        if self._at != len(whole):
            raise LinkError(f"a message in pieces ended at {self._at} of its {len(whole)} bytes")
        return True

    def _reset_then(self, read: Any) -> Any:
        """``read`` once more after the kernel said the connection was reset (it says so once):
        what the worker sent before its end, or its end of file.  Its answers were lost with
        the reset before: the calls went through the broker again, run twice, and a stream's
        partials were cut."""
        try:
            return read()
        except BlockingIOError:
            return None
        except OSError as e:
            raise EOFError(f"the link connection broke ({e})") from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


#: bytes in one connection's outbox past which it is retired (`LinkServer`'s default
#: ``max_queue_bytes``, module docstring): a client that stops reading holds at most this
#: much of the worker's memory, plus one message
LINK_QUEUE_BYTES = 64 << 20


#: seconds a retired connection's outbox may take to leave before the connection is ended
#: with what it still holds (`LinkServer.expire`): a client that never reads again must not
#: keep the worker's memory and a descriptor for good; its calls go through the broker
RETIRE_GRACE_S = 10.0
#: seconds a connection may stay without sending a message before it is ended
#: (`LinkServer.expire`): a client says HELLO as soon as it connects, and connections that
#: said nothing held the link's `max_conns` for good (same-user processes only: a fresh
#: leaseholder then could not use the link, and sent through the ipc direct socket)
SILENT_GRACE_S = 5.0


class _Peer:
    __slots__ = ("sock", "fd", "route", "outbox", "writing", "queued", "queued_bytes", "retiring", "retired_at",
                 "since", "heard")

    def __init__(self, sock: socket.socket, route: bytes):
        self.sock = sock
        self.fd = sock.fileno()
        self.route = route
        # Datagrams the kernel has not taken: (buffer list for sendmsg, its bytes, whether
        # it ends a message).
        self.outbox: deque = deque()
        self.writing = False          # EPOLLOUT asked
        self.queued = 0               # messages with a datagram in the outbox
        self.queued_bytes = 0         # their bytes still there
        self.retiring = False         # over a cap: its outbox leaves, then it closes (module docstring)
        self.retired_at = 0.0         # when it began to retire (monotonic)
        self.since = time.monotonic()  # when it was accepted
        self.heard = False            # a message read from it


def _discard_unread(sock: socket.socket, most: int = 100_000) -> None:
    """Read and drop what the client sent and nobody will read: a unix socket closed with
    unread data resets its peer, whose unread replies would then be lost with it.  The
    socket is shut for reading first, so the client cannot add more meanwhile (its sends
    fail: it sends through the broker instead); one byte a read (SEQPACKET drops the rest of
    a datagram)."""
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    for _ in range(most):
        try:
            if not sock.recv(1):
                return
        except OSError:  # nothing more (EAGAIN), or the client is gone
            return


class LinkServer:
    """A worker's link listener and its connections (see the module docstring).  One thread
    at a time (the worker's loop, or the heartbeat thread while it holds the sockets)."""

    def __init__(self, path: str, *, max_conns: int = 256, max_queue: int = 10_000,
                 max_queue_bytes: int = LINK_QUEUE_BYTES, uid: int | None = None):
        self.path = path
        self.max_conns = max_conns
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self.uid = os.geteuid() if uid is None else uid
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            lsock.bind(path)
            os.chmod(path, 0o600)
            lsock.listen(128)
            lsock.setblocking(False)
        except OSError:
            lsock.close()
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        self._lsock = lsock
        self._lfd = lsock.fileno()
        self._ep = select.epoll()
        self._ep.register(self._lfd, select.EPOLLIN)
        self._peers: dict[int, _Peer] = {}       # fd -> connection
        self._routes: dict[bytes, _Peer] = {}    # routing id -> connection
        self._count = 0
        self._spare: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # for EMFILE (`_accept`)
        self.inbox: deque[list[Any]] = deque()   # [routing id, frames...] read and not yet taken
        self.dropped = 0                         # replies dropped (connection gone, or its outbox full)
        self.retired = 0                         # connections retired for an outbox at a cap
        self.refused = 0                         # connections refused (another uid, too many)
        self.malformed = 0                       # connections ended for sending what is not a message
        self.silent = 0                          # connections ended for saying nothing (`expire`)
        self.closed = False

    # ------------------------------------------------------------------ reading

    def fileno(self) -> int:
        """A descriptor readable whenever the link has something to do (`pump`)."""
        return self._ep.fileno()

    def __contains__(self, route: object) -> bool:
        return route in self._routes

    def __len__(self) -> int:
        return len(self._peers)

    def pump(self, most: int = 1) -> bool:
        """Do what is ready without waiting (accept, read at most ``most`` messages from each
        connection, write what waits); whether the inbox holds a message.  One message a
        connection by default: the next pump finds the rest (epoll is level-triggered), and a
        read that finds nothing costs an exception."""
        if self.closed:
            return False
        for fd, ev in self._ep.poll(0):
            if fd == self._lfd:
                self._accept()
                continue
            peer = self._peers.get(fd)
            if peer is None:
                continue
            if ev & select.EPOLLOUT:
                self._flush(peer)
            if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and peer.fd in self._peers:
                if peer.retiring:
                    if ev & (select.EPOLLHUP | select.EPOLLERR):
                        self._end(peer)  # the client is gone: what waited for it with it
                    continue
                self._read(peer, most)
        return bool(self.inbox)

    def has_message(self) -> bool:
        return bool(self.inbox) or self.pump()

    def recv(self) -> list[Any] | None:
        """The next message read (``[routing id, frames...]``), or None."""
        inbox = self.inbox
        if inbox or self.pump():
            return inbox.popleft()
        return None

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # EMFILE and the like: the queued connection cannot be taken, and a
                # level-triggered listener would wake the loop at once, forever.  The spare
                # descriptor kept for this takes it and closes it (its client sees the end,
                # and goes through the broker), then is taken again.
                # (With no descriptor free, accept says EMFILE whether or not one is queued.)
                if self._spare is None:
                    return
                os.close(self._spare)
                self._spare = None
                took = False
                try:
                    sock, _ = self._lsock.accept()
                    sock.close()
                    took = True
                    self.refused += 1
                except OSError:  # nothing queued after all (EAGAIN)
                    pass
                try:
                    self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    pass
                if not took:
                    return
                continue
            try:
                _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            except OSError:
                uid = -1
            if uid != self.uid or len(self._peers) >= self.max_conns:
                self.refused += 1
                sock.close()
                continue
            sock.setblocking(False)
            self._count += 1
            peer = _Peer(sock, link_route(self._count))
            self._peers[peer.fd] = peer
            self._routes[peer.route] = peer
            self._ep.register(peer.fd, select.EPOLLIN)
            self._read(peer, 1)  # a HELLO may be there already: epoll reports this connection next time only

    def _read(self, peer: _Peer, most: int) -> None:
        sock = peer.sock
        inbox = self.inbox
        reset = False
        for _ in range(most):
            try:
                d = sock.recv(LINK_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                if reset:  # (a reset socket reads its queue, then end of file: never this)
                    self._end(peer)
                return
            except ConnectionResetError:
                # A client that closed with replies it had not read resets the connection:
                # the kernel says so once, at the next read, and the requests it sent before
                # are still queued behind that.  Read on to its end of file: ending here
                # lost them uncounted (they were neither run nor answered as client_gone).
                reset = True
                continue
            except OSError:
                self._end(peer)
                return
            if not d:
                self._end(peer)
                return
            if d[0] != 0:  # a client sends single-datagram messages only
                self.malformed += 1
                self._end(peer)
                return
            try:
                frames = decode(d)
            except LinkError:
                self.malformed += 1
                self._end(peer)
                return
            frames.insert(0, peer.route)
            inbox.append(frames)
            peer.heard = True

    def _end(self, peer: _Peer) -> None:
        """The connection is over: forgotten, closed, and a DISCONNECT of its own queued (a
        retiring one's was queued when it began to retire)."""
        if self._peers.pop(peer.fd, None) is None:
            return
        self._routes.pop(peer.route, None)
        try:
            self._ep.unregister(peer.fd)
        except OSError:
            pass
        if peer.retiring:
            _discard_unread(peer.sock)
        peer.sock.close()
        if not peer.retiring:
            self.inbox.append([peer.route, MDPC, C_DISCONNECT])

    def _retire(self, peer: _Peer) -> None:
        """A reply found ``peer``'s outbox at a cap (module docstring): no more replies go to
        it and nothing more is read from it; the worker gets its DISCONNECT now; the outbox
        still leaves (`_flush` closes it once empty)."""
        peer.retiring = True
        peer.retired_at = time.monotonic()
        self.retired += 1
        route = peer.route
        self._routes.pop(route, None)
        try:
            self._ep.modify(peer.fd, select.EPOLLOUT)
            peer.writing = True
            # The client's sends fail from now on (it sends through the broker instead), and
            # what it sent before is all there is to discard at the end (`_end`).
            peer.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        log.warning("a link client stopped reading (%d replies, %d bytes waiting for it): its connection ends "
                    "once they have left; its calls still waiting go through the broker",
                    peer.queued, peer.queued_bytes)
        # What it sent and the worker has not taken yet is not run here: the client sends it
        # through the broker once it reads the end.
        inbox = self.inbox
        if any(m[0] == route for m in inbox):
            keep = [m for m in inbox if m[0] != route]
            inbox.clear()
            inbox.extend(keep)
        inbox.append([route, MDPC, C_DISCONNECT])

    def expire(self, now: float | None = None, grace: float = RETIRE_GRACE_S,
               silent_grace: float = SILENT_GRACE_S) -> int:
        """End the retiring connections whose outbox has not left within ``grace`` seconds
        of their retirement, dropping what it still holds (counted in `dropped`): their
        client stopped reading for good, or is too slow to be waited for.  It then reads
        what reached its socket, then the end, and sends the calls still waiting through
        the broker, as for any retired connection.  And the connections that have sent no
        message within ``silent_grace`` seconds of their accept (counted in `silent`; each
        gets its DISCONNECT, as one that closed).  For the owner's housekeeping (the link
        has no timers); the number ended."""
        now = time.monotonic() if now is None else now
        late, quiet = [], []
        for peer in self._peers.values():
            if peer.retiring:
                if now - peer.retired_at >= grace:
                    late.append(peer)
            elif not peer.heard and now - peer.since >= silent_grace:
                quiet.append(peer)
        for peer in late:
            self.dropped += peer.queued
            peer.outbox.clear()
            peer.queued = peer.queued_bytes = 0
            self._end(peer)
        if late:
            log.warning("%d link connection(s) ended: their client read nothing of what waited for it for %.0f s",
                        len(late), grace)
        ended = 0
        for peer in quiet:
            if peer.fd in self._peers:
                self._read(peer, 1)  # a HELLO the loop had no time to read yet (a long batch) still counts
            if peer.fd in self._peers and not peer.heard:
                self.silent += 1
                ended += 1
                self._end(peer)
        if ended:
            log.warning("%d link connection(s) ended: they sent nothing within %.0f s of connecting (a client says "
                        "HELLO at once)", ended, silent_grace)
        return len(late) + ended

    # ------------------------------------------------------------------ writing

    def send(self, route: bytes, frames: Sequence[Any], wait: float = 0.0,
             tick: Callable[[], None] | None = None) -> bool:
        """Queue one message to connection ``route`` without blocking; False when it was
        dropped (the connection is gone, or retired: its outbox was at a cap).  ``wait``: if
        the outbox is at a cap, this send may block for the client to read it below, for as
        long as some of it leaves every ``wait`` seconds, 4 x ``wait`` at most (a stream's
        replies: the model may yield faster than a reading client takes them); `tick` runs
        about every 0.1 s meanwhile."""
        peer = self._routes.get(route)
        if peer is None:
            self.dropped += 1
            return False
        if peer.outbox:
            # Whole messages count, whatever datagrams they span.  Dropped only once the
            # backlog is at a cap already: a reader that keeps up never loses a reply for
            # its size (two large ones in a row still both go), and memory stays bounded by
            # the cap plus one message.
            if self._at_cap(peer) and not (wait > 0 and self._wait_below(peer, wait, tick)):
                self.dropped += 1
                if self._routes.get(route) is peer:  # (not ended while it waited: its client left)
                    self._retire(peer)
                return False
            dgrams = encode(_kept(frames))
            self._queue(peer, dgrams, _bytes_of(dgrams))
            if not peer.writing:  # a wait above wrote the whole outbox (and stopped asking for EPOLLOUT)
                self._flush(peer)
            return True
        dgrams = encode(frames)
        if len(dgrams) == 1:
            try:
                peer.sock.sendmsg(dgrams[0], (), _DONTWAIT)
                return True
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self.dropped += 1
                self._end(peer)
                return False
        dgrams = encode(_kept(frames))
        self._queue(peer, dgrams, _bytes_of(dgrams))
        self._flush(peer)
        return True

    def _at_cap(self, peer: _Peer) -> bool:
        return peer.queued >= self.max_queue or peer.queued_bytes >= self.max_queue_bytes

    def _wait_below(self, peer: _Peer, wait: float, tick: Callable[[], None] | None) -> bool:
        """Block, writing ``peer``'s outbox as its client reads, until it is under the caps
        again: True then; False when the connection ended, when nothing of the outbox left
        for ``wait`` seconds (its client stopped reading), or after 4 x ``wait`` in all (it
        reads too slowly to be waited for: the caller's other work waits meanwhile)."""
        now = time.monotonic()
        last_gone, most = now, now + 4 * wait
        left_bytes = peer.queued_bytes
        poller = select.poll()
        poller.register(peer.fd, select.POLLOUT)
        while self._at_cap(peer):
            now = time.monotonic()
            if peer.queued_bytes < left_bytes:
                left_bytes, last_gone = peer.queued_bytes, now
            ends = min(last_gone + wait, most)
            if now >= ends or self._routes.get(peer.route) is not peer:
                return False
            if poller.poll(min(ends - now, 0.1) * 1000):
                self._flush(peer)
            if tick is not None:
                tick()
        return self._routes.get(peer.route) is peer

    @staticmethod
    def _queue(peer: _Peer, dgrams: list[list[Any]], nbytes: int) -> None:
        last = len(dgrams) - 1
        out = peer.outbox
        for i, d in enumerate(dgrams):
            out.append((d, sum(map(len, d)) if last else nbytes, i == last))
        peer.queued += 1
        peer.queued_bytes += nbytes

    def _flush(self, peer: _Peer) -> None:
        out = peer.outbox
        sock = peer.sock
        while out:
            d, nbytes, ends = out[0]
            try:
                sock.sendmsg(d, (), _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.dropped += 1
                self._end(peer)
                return
            out.popleft()
            peer.queued_bytes -= nbytes
            if ends:
                peer.queued -= 1
        if peer.retiring:
            if not out:
                self._end(peer)  # all it was sent has left: now its client reads the end
            return
        want = bool(out)
        if want != peer.writing:
            peer.writing = want
            self._ep.modify(peer.fd, select.EPOLLIN | (select.EPOLLOUT if want else 0))

    # ------------------------------------------------------------------ closing

    def close(self, linger_ms: float = 0) -> None:
        """Close every connection and the listener; unlink the path.  Replies still in the
        outboxes get up to ``linger_ms`` to leave (as a zmq socket's linger: a client that
        stopped reading does not hold the close up longer)."""
        if self.closed:
            return
        deadline = time.monotonic() + max(0.0, linger_ms) / 1000.0
        while True:
            waiting = [peer for peer in self._peers.values() if peer.outbox]
            for peer in waiting:
                self._flush(peer)
            waiting = [peer for peer in waiting if peer.outbox and peer.fd in self._peers]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            p = select.poll()
            for peer in waiting:
                p.register(peer.fd, select.POLLOUT)
            p.poll(left * 1000.0)
        self.closed = True
        for peer in list(self._peers.values()):
            _discard_unread(peer.sock)  # a close with unread data would reset the client: its replies lost
            peer.sock.close()
        self._peers.clear()
        self._routes.clear()
        self._ep.close()
        self._lsock.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        try:
            os.unlink(self.path)
        except OSError:
            pass
