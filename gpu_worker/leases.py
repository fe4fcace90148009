"""The worker's side of leases (pinned streams, docs/protocol.md section 10).

A worker started with ``--direct`` binds a ROUTER, its *direct socket*, names it in
``Ready.direct``, and takes leases from the broker: a lease lets one client send requests
straight to this worker (two hops instead of three) for as long as the broker says.  Two
parts live here:

* `LeaseTable` - pure bookkeeping (no socket, no clock): the grants the broker sent
  (LEASE), the direct connections bound to them (HELLO with the grant's secret), and the
  requests each lease has in flight, which its ``slots`` bound.  It decides what a direct
  REQUEST is answered when it may not run (not bound: 400; the lease's slots all in flight:
  429; the lease ended or the worker is stopping: 503, to be sent through the broker) and
  forgets leases when they end (LEASE_END from the broker, or `stop` on SIGTERM).
* `DirectSocket` - the ROUTER itself, bound to ``ipc://<runtime dir>/w-<pid>-<random>.ipc``
  (the runtime directory is mode 0700, the socket file 0600, as a client's reply socket:
  only this user's processes can connect), unlinked at close; and beside it the *local link*
  (``w-<pid>-<random>.link``, `broker.protocol.link.LinkServer`): the same sub-protocol over
  a Unix SOCK_SEQPACKET socket, without libzmq's I/O threads, which near clients use instead.
  Both read into the same loop: a link connection is one more routing id (9 bytes, the
  first zero: never a ROUTER's).

The worker loop (`gpu_worker.worker`) runs an admitted request like a brokered one (same
checks, same batcher, same planes); only its replies take another route: on the direct
socket, to the connection that sent it, and nothing about it goes to the broker (no DONE).

Invariants a maintainer must keep: every request `admit` took is given to `finish` exactly
once (its FINAL was sent, or it was dropped because its client is gone), so a lease's
in-flight count never leaks a slot; a connection is bound to at most one lease; the secret
is compared in constant time.
"""
from __future__ import annotations

import enum
import hmac
import itertools
import logging
import os
import socket
import struct
import time
from collections import OrderedDict
from typing import NamedTuple

import zmq

from broker import protocol as P
from broker.protocol.link import LinkServer
from broker.protocol.wire import (DEAD_AFTER_BEATS, MAX_FRAMES, NOBLOCK, TooManyFrames, dup_socket, recv_frames,
                                  seed_routing_ids, send_frames, sock_events, tcp_liveness, touched)

__all__ = ["Lease", "Refusal", "LeaseTable", "DirectSocket", "DirectSocketError", "direct_socket_path", "Unsent",
           "NOT_BOUND", "WORKER_STOPPING", "LONG_BATCH_S", "MAX_ROUTES", "runs_long"]

log = logging.getLogger("gpu_worker")
_POLLIN = int(zmq.POLLIN)
_EAGAIN = zmq.EAGAIN

#: the start of the 400 a REQUEST on a connection without a lease gets
NOT_BOUND = "not bound to a lease: send HELLO first"
#: LeaseEnd.reason for the leases a stopping worker ends (SIGTERM)
WORKER_STOPPING = "worker_stopping"
#: LeaseEnd.reason after which a lease's running requests are cancelled and queued ones dropped
CLIENT_GONE = "client_gone"
#: seconds a request would still wait behind a running batch (or stream) beyond which a
#: round trip elsewhere is the cheaper choice: the broker's default ``recall_after``
LONG_BATCH_S = 0.005
#: connections bound to one lease at once, the latest kept: a ROUTER never says that a
#: connection closed, so a bound one is forgotten only at its lease's end, or when the
#: lease's connections pass this (the oldest is unbound).  Our SDK binds one connection per
#: lease; a leaseholder that opened connections in a loop, each saying HELLO, grew the table
#: by one entry each for as long as it held its lease (the churn hunt)
MAX_ROUTES = 64


def runs_long(elapsed: float, predicted: float | None, long: float = LONG_BATCH_S) -> bool:
    """The head-of-line rule of leases (docs/protocol.md section 10.3), pure: whether a
    batch that has run ``elapsed`` seconds of the ``predicted`` ones (None: unknown, as a
    stream's) keeps what waits behind it for long: at least ``long`` more by its prediction,
    or already past both its prediction and ``long`` (mispredicted: nothing says it ends
    soon).  The worker then tells the broker BUSY (leased requests in the batch or not) and
    sends another lease's requests that would wait behind it through the broker."""
    if predicted is None:
        return elapsed >= long
    return predicted - elapsed >= long or elapsed >= max(predicted, long)


class Lease:
    """One lease the broker granted: its grant, the connections bound to it, and the keys
    (the worker's job envelopes) of the requests it has in flight."""

    __slots__ = ("grant", "routes", "in_flight")

    def __init__(self, grant: P.LeaseGrant):
        self.grant = grant
        self.routes: dict[bytes, None] = {}  # oldest first (at most MAX_ROUTES)
        self.in_flight: set[bytes] = set()

    @property
    def id(self) -> bytes:
        return self.grant.lease

    @property
    def slots(self) -> int:
        return self.grant.slots


class Refusal(NamedTuple):
    """Why a direct REQUEST does not run: the FINAL error it is answered with."""

    code: int
    message: str


class LeaseTable:
    """Leases held by this worker (see the module docstring).  ``remember``: how many
    connections whose lease ended (or whose HELLO was refused) are remembered, for the
    message their next REQUEST gets; older ones get the plain "not bound" answer."""

    def __init__(self, *, remember: int = 4096):
        self.leases: dict[bytes, Lease] = {}
        self.stopping = False
        self._remember = max(1, int(remember))
        self._routes: dict[bytes, Lease] = {}                   # bound connection -> its lease
        self._ended: OrderedDict[bytes, str] = OrderedDict()    # connection -> why its lease ended
        self._refused: OrderedDict[bytes, None] = OrderedDict()  # connections whose last HELLO was refused
        self._keys: dict[bytes, tuple[Lease, bytes, int]] = {}  # key -> (lease, connection, request id)
        self._requests: dict[tuple[bytes, int], bytes] = {}     # (connection, request id) -> key

    def __len__(self) -> int:
        return len(self.leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self.leases

    # ------------------------------------------------------------------ the broker's side

    def grant(self, grant: P.LeaseGrant) -> str | None:
        """Take a lease (LEASE); None when taken, else why it is refused."""
        if self.stopping:
            return "the worker is stopping"
        if grant.lease in self.leases:
            return f"lease {grant.lease.hex()} is held already"
        self.leases[grant.lease] = Lease(grant)
        return None

    def end(self, lease_id: bytes, reason: str) -> Lease | None:
        """Forget a lease (LEASE_END) and unbind its connections; their next REQUEST is
        told to go through the broker.  Returns the lease (None if unknown): the requests in
        its ``in_flight`` are still the worker's to finish (or drop, ``client_gone``)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        for route in lease.routes:
            if self._routes.get(route) is lease:
                del self._routes[route]
                self._remember_route(self._ended, route, reason)
        lease.routes = {}
        return lease

    def stop(self) -> list[bytes]:
        """The worker is stopping: end every lease (``worker_stopping``); from now on every
        REQUEST is refused with 503 and every grant and HELLO refused.  Returns the ended
        leases' ids, for the LEASE_ENDs the broker must be told."""
        self.stopping = True
        ids = list(self.leases)
        for lid in ids:
            self.end(lid, WORKER_STOPPING)
        return ids

    def reset(self, why: str) -> None:
        """The broker connection was lost (the worker reconnects and drops what it held):
        every lease is over, since its broker presumes this worker gone or is a new one
        that never granted it.  As at `end`, the requests in flight stay until `finish`:
        their clients keep waiting on their connections for those this worker still runs
        (after a broker restart nobody else will answer them), and a CANCEL still finds
        them (`find`); those it drops unstarted it answers 503 (the worker's
        `_fail_pending`)."""
        for lid in list(self.leases):
            self.end(lid, why)

    # ------------------------------------------------------------------ the client's side

    def hello(self, route: bytes, lease_id: bytes, secret: bytes) -> str | None:
        """Bind connection ``route`` to a lease (HELLO); None when bound, else why not (the
        connection is then bound to nothing)."""
        lease = None if self.stopping else self.leases.get(lease_id)
        ok = lease is not None and hmac.compare_digest(lease.grant.secret, bytes(secret))
        old = self._routes.pop(route, None)
        if old is not None:
            old.routes.pop(route, None)
        if not ok:
            self._remember_route(self._refused, route, None)
            if self.stopping:
                return "the worker is stopping"
            return "unknown lease" if lease is None else "wrong secret"
        self._refused.pop(route, None)
        self._ended.pop(route, None)
        self._routes[route] = lease
        routes = lease.routes
        routes[route] = None  # the newest (popped above if it was bound already)
        if len(routes) > MAX_ROUTES:
            oldest = next(iter(routes))
            del routes[oldest]
            del self._routes[oldest]  # unbound: its next REQUEST is told to say HELLO
        return None

    def unbind(self, route: bytes) -> list[bytes]:
        """Connection ``route`` said DISCONNECT: it is bound to nothing.  The keys of the
        requests it has in flight (its client left: they run for nobody)."""
        lease = self._routes.pop(route, None)
        if lease is not None:
            lease.routes.pop(route, None)
        keys = self._keys
        return [k for k, (_, r, _) in keys.items() if r == route] if keys else []

    def lease_of(self, route: bytes) -> Lease | None:
        return self._routes.get(route)

    def admit(self, route: bytes, request_id: int, key: bytes) -> Lease | Refusal:
        """Whether a REQUEST (id ``request_id``) on connection ``route`` may run: its lease,
        with the request counted in flight under ``key`` until `finish`, or the `Refusal`
        to answer it with."""
        if self.stopping:
            return Refusal(int(P.ErrorCode.SERVICE_UNAVAILABLE),
                           f"the worker is stopping and its leases ended ({WORKER_STOPPING}); resend this "
                           "request through the broker (it did not run)")
        lease = self._routes.get(route)
        if lease is None:
            why = self._ended.get(route)
            if why is not None:
                return Refusal(int(P.ErrorCode.SERVICE_UNAVAILABLE),
                               f"this connection's lease ended ({why}); resend this request through the broker "
                               "(it did not run)")
            extra = (" (this connection's HELLO was refused: unknown lease or wrong secret)"
                     if route in self._refused else "")
            return Refusal(int(P.ErrorCode.PROTOCOL_ERROR), NOT_BOUND + extra)
        if (route, request_id) in self._requests:
            return Refusal(int(P.ErrorCode.PROTOCOL_ERROR),
                           f"request id {request_id} is already in flight on this connection; ids must be unique "
                           "among a client's outstanding requests")
        if len(lease.in_flight) >= lease.slots:
            return Refusal(int(P.ErrorCode.QUEUE_FULL),
                           f"all {lease.slots} slots of this lease are in flight; wait for a reply before sending "
                           "more, or send this one through the broker")
        lease.in_flight.add(key)
        self._keys[key] = (lease, route, request_id)
        self._requests[(route, request_id)] = key
        return lease

    def find(self, route: bytes, request_id: int) -> bytes | None:
        """The key of request ``request_id`` in flight from connection ``route`` (CANCEL),
        whether or not its lease has ended since."""
        return self._requests.get((route, request_id))

    def finish(self, key: bytes) -> bool:
        """The request under ``key`` is done (its FINAL went, or it was dropped): its slot
        is free again.  False for a key not in flight (a no-op)."""
        entry = self._keys.pop(key, None)
        if entry is None:
            return False
        lease, route, rid = entry
        lease.in_flight.discard(key)
        self._requests.pop((route, rid), None)
        return True

    def holds(self, route: bytes) -> bool:
        """Whether connection ``route`` has a request in flight (whether or not its lease
        ended since): its client waits on it for that answer.  O(requests in flight), which
        the leases' slots bound: for a rare path (a connection found not reading)."""
        return any(entry[1] == route for entry in self._keys.values())

    def in_flight(self, lease_id: bytes) -> int:
        lease = self.leases.get(lease_id)
        return 0 if lease is None else len(lease.in_flight)

    # ------------------------------------------------------------------ internals

    def _remember_route(self, table: OrderedDict, route: bytes, value) -> None:
        table[route] = value
        table.move_to_end(route)
        while len(table) > self._remember:
            table.popitem(last=False)


#: largest frame the direct socket takes: the broker's default --max-frame-mb
MAX_FRAME_BYTES = 256 << 20
#: the local link's connections at once, at least (`link_conns`): the worker asks for
#: twice its credit when that is more, since the broker grants it at most one lease per slot
#: of its credit, and each leaseholder on its host holds one connection (and may leave one
#: retiring): 300 near leaseholders of one lease slot each, and the link closed every
#: connection past the 256th at once; those clients churned (a lease, a reset, the lease
#: given back, a backoff: 47 resets, 29 still unpinned after 60 s) while the ipc direct
#: socket beside it had room (the second scale hunt)
LINK_CONNS = 256

class Unsent(enum.Enum):
    """Why `DirectSocket.send` did not queue a reply.  Falsy, as the False it replaces, so
    that ``if not sent`` still reads "it did not go"."""

    #: the connection is gone (EHOSTUNREACH; a link connection ended, or retired at its cap):
    #: nothing will ever reach its client on it
    GONE = "gone"
    #: the connection's queue is full (EAGAIN): its client is alive but not reading now
    FULL = "full"

    def __bool__(self) -> bool:
        return False


class DirectSocketError(RuntimeError):
    """The direct socket cannot be bound (the message says why and what to change)."""


#: sun_path holds 108 bytes
_MAX_IPC_PATH = 100


def direct_socket_path(runtime_dir: str | None = None) -> str:
    """A fresh path for this process's direct socket: ``<runtime dir>/w-<pid>-<start>-<random>.ipc``
    (named like clients' reply sockets, so the broker sweeps it after a SIGKILL)."""
    return P.direct_socket_path(runtime_dir)


_ENDS_NAMES = itertools.count()  # DirectSocket monitors' inproc names


class DirectSocket:
    """The worker's direct socket: a ROUTER on an ipc path only this user can reach, or on a
    tcp address (``tcp``) as a CurveZMQ server that admits only the keys of the clients that
    hold a lease of this worker (`allow`; ``curve`` None: plain tcp, ``--insecure``).  Sends
    never block (but a running stream's, for its client to read: `send`'s ``wait``): a
    reply to a connection that is gone is dropped (and logged, rate-limited); one that
    finds a connection's queue full is not queued, and `send` says so (`Unsent.FULL`): the
    worker holds a FINAL for such a client (docs/protocol.md section 10.3)."""

    #: replies queued per connection before further ones are dropped
    sndhwm = 10_000
    #: messages read ahead from one connection before libzmq stops reading it (backpressure):
    #: a leaseholder has at most its lease's slots in flight (more are refused), and a peer
    #: sending faster than the worker refuses it held 100,000 of its requests (about 120 MB)
    #: per connection (the churn hunt); the broker's default for its clients
    rcvhwm = 4096
    #: connections remembered by `note_refused` and `end_connection`
    REMEMBER = 4096

    def __init__(self, ctx: zmq.Context, *, path: str | None = None, link: bool = True, tcp: str | None = None,
                 curve: tuple[bytes, bytes] | None = None, heartbeat_s: float | None = None,
                 link_conns: int = LINK_CONNS):
        if tcp is not None:
            path, link = "", False  # no file, and no local link: local clients are placed on ipc workers
        try:
            path = path if path is not None else direct_socket_path()
        except OSError as e:  # the runtime directory (RuntimeDirError is one)
            raise DirectSocketError(f"cannot take leases (--direct): {e}") from None
        if len(path.encode()) > _MAX_IPC_PATH:
            raise DirectSocketError(f"cannot take leases (--direct): the direct socket's path {path!r} is longer "
                                    f"than an ipc path may be ({_MAX_IPC_PATH} bytes); set XDG_RUNTIME_DIR to a "
                                    "shorter directory of your own")
        seed_routing_ids()  # libzmq's own ids for the peers: unpredictable (broker.protocol.wire)
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.rcvhwm = self.rcvhwm
        sock.sndhwm = self.sndhwm
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable or full: an error we count, not a silent drop
        # A frame no larger than the broker takes by default (--max-frame-mb): a leaseholder
        # reaches this socket without the broker, which bounds what reaches a worker
        # otherwise (the CURVE hunt had one 512 MiB frame buffered whole, before any HELLO).
        sock.maxmsgsize = MAX_FRAME_BYTES
        if tcp is not None:
            # What an unauthenticated connection holds (a descriptor, a frame buffered whole
            # before the handshake) it holds 5 s at most, not libzmq's 30 (the tcp fuzz audit).
            sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        self.tcp = tcp is not None
        self.public_key: bytes | None = None  # ours, for Ready.direct_key (tcp with CurveZMQ)
        self.allowed: frozenset[bytes] = frozenset()  # the leaseholders' public keys (z85), tcp with CurveZMQ
        self._auth = None
        self._bad = P.RateLimitedLog(log)
        if tcp is not None and curve is not None:
            try:
                self._auth = _LeaseKeys.start(ctx, self)
            except zmq.ZMQError as e:
                sock.close(linger=0)
                raise DirectSocketError(f"cannot take leases on {tcp}: cannot start the ZAP handler ({e}); another "
                                        "CurveZMQ server in this process uses the same zmq.Context") from None
        try:
            if tcp is None:
                sock.bind("ipc://" + path)
                os.chmod(path, 0o600)  # only this user's processes may connect (the directory is 0700 too)
            else:
                if curve is not None:
                    sock.curve_server = True
                    sock.curve_publickey, sock.curve_secretkey = curve
                    sock.zap_domain = _ZAP_DOMAIN.encode()
                    sock.zap_enforce_domain = True  # never admit unchecked, even without a ZAP handler
                    self.public_key = curve[0]
                if heartbeat_s:
                    # A leaseholder unreachable (a partition, its host died) has its
                    # connection closed after DEAD_AFTER_BEATS heartbeats, instead of holding
                    # it and its queued replies for as long as TCP retries; by then the broker
                    # has ended its lease (it heard nothing for its client window either).
                    tcp_liveness(sock, DEAD_AFTER_BEATS * heartbeat_s)
                P.ipv6_for(sock, tcp)
                sock.bind(tcp)
        except (zmq.ZMQError, OSError) as e:
            sock.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            if tcp is None:
                _unlink_quietly(path)
            raise DirectSocketError(f"cannot take leases (--direct): cannot bind {tcp or path}: {e}") from None
        self.sock = sock
        # Its connections' ends, counted at housekeeping (`closed_connections`): a ROUTER says
        # nothing of them, and libzmq keeps each one's buffers in the C heap (`heap.ClosesSeen`).
        # A receiving queue without bound: libzmq's I/O thread waits on a full monitor queue,
        # and with it every connection of the socket (2,000 ends between two looks stopped
        # the socket); an end waits there as a message of some 100 bytes until the next look.
        # A name of its own in the process (not id(self): a closed socket's successor may get
        # its address while libzmq's reaper thread still holds the old monitor's name).
        ends_at = f"inproc://direct-socket-ends-{os.getpid()}-{next(_ENDS_NAMES)}"
        sock.monitor(ends_at, zmq.EVENT_DISCONNECTED)
        self._ends = ctx.socket(zmq.PAIR)
        self._ends.linger = 0
        self._ends.rcvhwm = 0
        self._ends.connect(ends_at)
        self.path = path
        # what Ready.direct names
        self.endpoint = "ipc://" + path if tcp is None else sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = None if tcp is None else int(self.endpoint.rsplit(":", 1)[1])  # (`_same_peer`)
        self.dropped = 0                  # replies that could not be queued
        self.impostors = 0                # ROUTER messages dropped for a link-shaped routing id
        self.ended = 0                    # connections ended for not reading their replies (`end_connection`)
        self._refused_conns: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # route -> (fd, inode)
        self._ended_routes: OrderedDict[bytes, None] = OrderedDict()
        self.link: LinkServer | None = None
        link_path = (path[:-4] if path.endswith(".ipc") else path) + ".link"
        if link and len(link_path.encode()) > _MAX_IPC_PATH:
            log.warning("no local link: its path %r would be longer than %d bytes; near clients use the ipc direct "
                        "socket (set XDG_RUNTIME_DIR to a shorter directory for it)", link_path, _MAX_IPC_PATH)
        elif link:
            try:
                self.link = LinkServer(link_path, max_conns=link_conns)  # what Ready.link names
            except OSError as e:
                log.warning("no local link at %s (%s): near clients use the ipc direct socket", link_path, e)

    def send(self, frames, wait: float = 0.0, tick=None) -> "bool | Unsent":
        """Queue one message (``[routing id, ...]``); True when queued, else why not:
        `Unsent.GONE` (the connection is gone; dropped) or `Unsent.FULL` (its queue is full:
        the client is alive but not reading; the caller decides whether to keep the reply
        for later).  ``wait``: how long it may block for the client to read, and ``tick``
        what runs about every 0.1 s meanwhile: on the local link, for as long as some of its
        backlog leaves every ``wait`` seconds (`LinkServer.send`); on the ROUTER, which says
        nothing of a connection's progress, ``wait`` seconds in all."""
        route = frames[0]
        if len(route) == 9 and route[0] == 0:  # a link connection's (next_message keeps ROUTER peers off them)
            if self.link.send(route, frames[1:], wait, tick):
                return True
            self.dropped += 1
            self._bad.warning("a reply on the local link was dropped: its client is gone or not reading")
            return Unsent.GONE  # (at its cap the link retires the connection: gone too)
        try:
            send_frames(self.sock, frames, NOBLOCK)
            return True
        except zmq.ZMQError as e:
            sent = Unsent.FULL if e.errno == _EAGAIN else Unsent.GONE
        if sent is Unsent.FULL and wait > 0:
            sent = self._wait_room(frames, wait, tick)
        if sent is Unsent.GONE:
            self.dropped += 1
            self._bad.warning("a reply on the direct socket was dropped: its client is gone")
        return sent

    def note_refused(self, route: bytes, frame) -> None:
        """A request on ROUTER connection ``route`` was refused (it never ran); ``frame``: a
        frame of it, read just now.  The first time, the connection's descriptor and socket
        inode are noted, for `end_connection` (a frame of the local link, which retires its
        own connections, notes nothing).  Bounded: the latest `REMEMBER` connections.

        libzmq hands over what a connection sent before it closed after it closed its
        descriptor, whose number the process may have given to something else meanwhile
        (the lowest free one): the socket under that number is noted only if it is a
        connection to this socket, of the peer libzmq recorded for the message
        (`_same_peer`); else nothing is, and the connection is never ended by us."""
        known = self._refused_conns
        if route in known or route in self._ended_routes:
            return
        try:
            fd = frame.get(zmq.SRCFD)
            peer = frame.get("Peer-Address")
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            return
        if fd is None or fd < 0:
            return
        conn = dup_socket(fd)
        if conn is None:
            return
        with conn:
            try:
                if not self._same_peer(conn, peer):
                    return
                ino = os.fstat(conn.fileno()).st_ino
            except OSError:
                return
        known[route] = (fd, ino)
        while len(known) > self.REMEMBER:
            known.popitem(last=False)

    def _same_peer(self, conn: socket.socket, peer: str) -> bool:
        """Whether ``conn`` is a connection accepted by this socket (its local address the
        socket's own, not listening) from ``peer``, libzmq's Peer-Address of a message: an
        ipc peer's "host:uid:gid:pid" (the same process: the kernel's word), a tcp one's
        address (the same host: libzmq records no port, so another connection from that
        address that took the number in between passes).  OSError from the socket calls."""
        if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        if not self.tcp:
            if conn.family != socket.AF_UNIX or conn.getsockname() != self.path:
                return False
            pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
            return peer.split(":")[-3:] == [str(uid), str(gid), str(pid)]
        if conn.family not in (socket.AF_INET, socket.AF_INET6) or conn.getsockname()[1] != self._port:
            return False
        return conn.getpeername()[0] == peer

    def end_connection(self, route: bytes) -> bool:
        """Shut down ROUTER connection ``route``, whose queue was just found full, and
        whose descriptor `note_refused` noted: libzmq sees it end, closes it and frees what
        waits in its queue (it keeps a connected peer's queue until the connection ends), as
        the broker ends a client's that stopped reading.  libzmq owns the descriptor: only
        the connection is ended, through a copy of it, and only if it is still the socket
        noted (same inode: libzmq reuses a closed connection's number for the next it
        accepts), itself checked to be a connection of the peer that sent the refused
        request when it was noted.  Whether it was; a connection is ended once (what it sent
        before, read after, finds it ended: `ended_route`)."""
        noted = self._refused_conns.pop(route, None)
        if noted is None:
            return False
        fd, ino = noted
        conn = dup_socket(fd)
        if conn is None:
            return False
        with conn:
            try:
                if os.fstat(conn.fileno()).st_ino != ino:
                    return False
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                return False
        ended = self._ended_routes
        ended[route] = None
        while len(ended) > self.REMEMBER:
            ended.popitem(last=False)
        self.ended += 1
        return True

    def closed_connections(self) -> int:
        """Connections to the ROUTER that ended since the last call: its monitor's DISCONNECTED
        events, read without waiting (never polled: a housekeeping look reads what came)."""
        ends, n = self._ends, 0
        while True:
            try:
                ends.recv_multipart(NOBLOCK)
            except zmq.Again:
                return n
            n += 1

    def ended_route(self, route: bytes) -> bool:
        """Whether `end_connection` ended ``route`` (its latest `REMEMBER`)."""
        return route in self._ended_routes

    def _wait_room(self, frames, wait: float, tick) -> "bool | Unsent":
        """Send ``frames`` blocking, for up to ``wait`` seconds in all: libzmq wakes a
        blocked send when the connection's queue has room again (its reader took a batch of
        messages), so this waits on that, not on a timer.  Tries of 0.1 s at most, running
        ``tick`` between (the worker's heartbeats).  True when it went, else as `send`."""
        sock = self.sock
        end = time.monotonic() + wait
        try:
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    return Unsent.FULL
                sock.sndtimeo = max(1, int(min(left, 0.1) * 1000))
                try:
                    send_frames(sock, frames, 0)
                    return True
                except zmq.ZMQError as e:
                    if e.errno != _EAGAIN:
                        return Unsent.GONE
                if tick is not None:
                    tick()
        finally:
            sock.sndtimeo = -1

    def next_message(self, router: bool = True, link: bool = True) -> list | None:
        """One message read (``[routing id, ...]``) from the ROUTER or the link, without
        waiting; None when neither holds one (``router``/``link``: which to look at)."""
        while router and sock_events(self.sock) & _POLLIN:
            try:
                frames = recv_frames(self.sock, 0, MAX_FRAMES)
            except TooManyFrames as e:  # a leaseholder's (or a stranger's): read and dropped whole
                self._bad.warning("dropped a message of %d frames on the direct socket (at most %d)", e.frames,
                                  MAX_FRAMES)
                continue
            route = frames[0]  # a zmq.Frame
            if len(route) != 9 or bytes(route)[0] != 0:
                return frames
            # A ROUTER peer may choose its routing id (ZMQ_ROUTING_ID): one shaped like a
            # link connection's would speak for it (its lease, its requests).  Dropped.
            self.impostors += 1
            self._bad.warning("dropped a message on the direct socket whose routing id is shaped like a local "
                              "link connection's (a peer chose it)")
        ln = self.link
        if link and ln is not None:
            inbox = ln.inbox
            if inbox or ln.pump():
                return inbox.popleft()
        return None

    def has_message(self) -> bool:
        """Whether a message waits on either."""
        if sock_events(self.sock) & _POLLIN:
            return True
        return self.link is not None and self.link.has_message()

    def wait(self, ms: float) -> bool:
        """Wait up to ``ms`` milliseconds for a message on either; whether one came."""
        if self.link is not None and self.link.inbox:
            return True
        if self.link is None:
            ready = bool(self.sock.poll(ms))
        else:
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            poller.register(self.link.fileno(), zmq.POLLIN)
            ready = bool(poller.poll(ms))
        touched(self.sock)  # a pyzmq poll (see wire.Waiter)
        return ready

    def close(self, linger_ms: int = 0) -> None:
        """Close (replies already queued keep ``linger_ms`` to leave; the link's, what the
        kernel takes now) and unlink the files."""
        if self.link is not None:
            self.link.close(linger_ms)
        if not self._ends.closed:
            self.sock.disable_monitor()
            self._ends.close(linger=0)
        self.sock.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if not self.tcp:
            _unlink_quietly(self.path)

    def allow(self, principals) -> None:
        """The leases held now are those of ``principals`` (`LeaseGrant.principal`): a tcp
        direct socket with CurveZMQ admits exactly their keys (``curve:<z85 key>``) at the
        handshake; a connection already made keeps its lease's rules (an ended lease's
        requests are answered 503)."""
        self.allowed = frozenset(p[6:].encode() for p in principals if isinstance(p, str) and p.startswith("curve:"))


_ZAP_DOMAIN = "direct"


class _LeaseKeys:
    """The ZAP handler of a tcp direct socket: admits a CurveZMQ client whose key holds a
    lease of this worker (`DirectSocket.allowed`, a frozenset swapped whole by the loop: the
    handler's thread only reads it)."""

    def __init__(self, ds: "DirectSocket"):
        self._ds = ds
        self._refused = P.RateLimitedLog(log)  # its own: a handshake flood must not silence the loop's warnings

    @classmethod
    def start(cls, ctx: zmq.Context, ds: "DirectSocket"):
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx, log=logging.getLogger("gpu_worker.zap"))
        try:
            auth.start()
        except zmq.ZMQError:
            auth.stop()
            raise
        auth.configure_curve_callback(_ZAP_DOMAIN, cls(ds))
        return auth

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._ds.allowed:
            return True
        self._refused.warning("refused a connection to the tcp direct socket: CURVE key %s holds no lease here",
                              key.decode(errors="replace"))
        return False


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
