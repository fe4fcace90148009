"""The broker's ZeroMQ loop: frames in, scheduler events, actions, frames out.

This module makes no scheduling decision (that is `broker.state`), and every frame it sends
or reads is built or parsed by `broker.protocol`.  What it does: poll two ROUTER sockets, turn each
message into one scheduler event stamped with the monotonic clock, turn the returned actions
into frames, and sleep until the scheduler's next wake-up.

Hot path: a tensor request is one msgspec decode of its header (needed for priority,
deadline and locality), one re-encode at dispatch (the remaining budget and the queue time
for the worker), and frames forwarded by reference (`copy=False`): an inline 64 MB tensor
crosses this process without being copied.  Replies are relayed untouched, and a same-host
client's replies usually do not cross the broker at all (direct reply: the worker sends the
FINAL to the client and a DONE here, docs/protocol.md section 8).

A malformed message is logged (rate-limited) and answered with a typed error when it names a
request id, otherwise dropped; it never raises out of the loop.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import itertools
import logging
import math
import os
import secrets
import select
import socket
import stat
import struct
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from broker import protocol as P
from broker.protocol import logs
from broker.protocol import wire
from broker.names import ServiceNames
from broker.protocol.heap import TRIM_AFTER_CLOSES, BurstSeen, start_trim
from broker.protocol.limits import (TCP_BACKLOG, Headroom, default_reserve, listen_backlog, memory_limit, move_aside,
                                    nofile_limit, put_back)
from broker.protocol.wire import (MAX_FRAMES, MAX_WORKER_FRAMES, TooManyFrames, Waiter, recv_frames,
                                  recv_monitor_event, send_frames, sock_events)
from shm import gc as shm_gc
from shm.errors import OutOfResources
from shm.names import ClockPeers, boot_offset_ticks, pid_exists, proc_starttime, process_alive

from broker.connections import WorkerConnections
from broker import security

from broker.leases import DRAIN, LeaseEndToClient, LeaseEndToWorker, LeaseRefused, LeaseToClient, LeaseToWorker
from broker.state import (
    CLIENT_GONE,
    ClientError,
    CancelAtWorker,
    RecallAtWorker,
    Config,
    DisconnectWorker,
    LAST_WORKER,
    Dispatch,
    HeartbeatWorker,
    Scheduler,
    LateToClient,
    ToClient,
    cuda_key,
)

log = logging.getLogger("broker")

# Messages drained from one socket before looking at the other and at the timers: large
# enough to amortise the poll, small enough that a flood of clients cannot starve workers.
_DRAIN = 64
# Backend drains (of _DRAIN messages) before the timers run: a heartbeat of each of 1024
# workers that a stall left unread.
_TICK_DRAINS = 16
# The longest a closed worker's verdict waits for the backend to hold nothing more (its last
# messages read first): a flood from other workers must not keep a dead one alive.
GONE_WAIT_S = 0.1
# TRIM_AFTER_CLOSES (broker.protocol.heap): connections closed (clients and workers) after
# which the once-a-second housekeeping gives the C heap's free memory back (`heap.trim_heap`).
# Seconds between sweeps for shared-memory segments of dead processes.
_GC_INTERVAL = 1.0
#: what a tcp handshake's protocol error most likely means (`Broker._mismatch`)
_HANDSHAKE_ERRORS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: (
        "it and this endpoint disagree on CurveZMQ (a peer without the broker's public key against "
        "--curve-secret, or one with keys against --insecure)"),
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: (
        "its CurveZMQ hello does not decrypt: it was given another server key than this broker's "
        "(server_key=, --server-key)"),
}
#: a loop pass this many seconds later than its wait allowed means the broker did not run
#: (stopped, frozen, starved): its peers' silence meanwhile is not counted (`_resumed`)
_PAUSED_S = 0.25
#: the soonest a sweep asked for by a worker's disconnect follows the one before (seconds)
_SWEEP_SOON_S = 0.1
#: how long the frontend's last messages may take to leave after a standalone broker's drain
_DRAINED_LINGER_MS = 1000
#: how long a worker that said DISCONNECT is listed as leaving (its drain grace and more)
_LEAVING_KEPT_S = 600.0
_POLLIN = int(zmq.POLLIN)
_LEASE_ACTIONS = frozenset({LeaseToWorker, LeaseToClient, LeaseRefused, LeaseEndToClient, LeaseEndToWorker})
_MAX_CLIENT_PIDS = 1 << 16
_MAX_SERVICES = 1024  # service names remembered for the HTTP endpoint (as broker.metrics.MAX_SERVICES)
#: a request header this long or shorter is not counted against its client's byte cap (the
#: request count bounds what such headers hold: `max_client_requests` x 4 KiB)
_SHORT_HEADER = 4096
#: what a client and a worker whose CurveZMQ key left its allow-list are told (403)
_FORBIDDEN = ("this client's CurveZMQ key was removed from the broker's client allow-list (--client-keys): "
              "it is not served any more")
_FORBIDDEN_WORKER = ("this worker's CurveZMQ key was removed from the broker's worker allow-list (--worker-keys): "
                     "it is not served any more")
#: frames to a client at least this long are sent tracked (`_track_unread`): what libzmq
#: holds of smaller ones is bounded by their count (`client_hwm`)
_TRACK_BYTES = 64 << 10
#: seconds a client may let no big frame go (libzmq writes each whole) before, with all
#: clients' unread replies over the broker-wide cap, it counts as one that stopped reading
_UNREAD_QUIET_S = 1.0
#: bytes a second a reader is expected to take a big frame at, at least (`_Unread.quiet_for`)
_SLOW_READ_BPS = 16 << 20
#: seconds between two broker-wide looks from the send path (`_all_unread`: it settles them all)
_UNREAD_LOOK_S = 0.1


def _collect_legacy_shm() -> None:
    try:
        for name in shm_gc.collect():
            log.info("unlinked a /dev/shm segment file an earlier version left: %s", name)
    except Exception:  # never let housekeeping stop the broker
        log.exception("collecting the /dev/shm files an earlier version left failed")


class _Unread:
    """Big frames sent to one client that libzmq may still hold (`Broker._track_unread`)."""

    __slots__ = ("q", "total", "principal", "went_at", "looked_at", "all")

    def __init__(self, principal: object = None, now: float = 0.0, all_: list | None = None):
        self.q: deque = deque()  # (tracker, bytes), in the order sent
        self.total = 0
        #: whom its client counts as when it is not its own principal (`Broker._conn_principal`)
        self.principal = principal
        self.went_at = now  # when libzmq last let one of its frames go (or it was made)
        self.looked_at = now  # its own previous look (`Broker._track_unread`)
        #: [bytes] of all clients' entries together (the broker's), kept as frames come and go
        self.all = [0] if all_ is None else all_

    def add(self, tracked: list, now: float) -> None:
        """Frames just sent (tracker, bytes).  Sent to a client that held nothing, its quiet
        starts now (it had read all it was sent)."""
        q = self.q
        if not q:
            self.went_at = now
        n = 0
        for t in tracked:
            q.append(t)
            n += t[1]
        self.total += n
        self.all[0] += n

    def settle(self, now: float) -> int:
        """Forget the frames libzmq let go of (in order: one connection writes in order); how
        many."""
        q = self.q
        n = 0
        freed = 0
        while q and q[0][0].done:
            freed += q.popleft()[1]
            n += 1
        if n:
            self.total -= freed
            self.all[0] -= freed
            self.went_at = now
        return n

    def quiet_for(self) -> float:
        """Seconds without a frame let go after which, with all clients over the broker-wide
        cap, this one counts as not reading (`Broker._all_unread`): a second, or as long as
        its oldest frame takes at `_SLOW_READ_BPS` (libzmq lets a frame go only once all of
        it is written: a reader of a 256 MiB frame over a slow link looked quiet)."""
        q = self.q
        return max(_UNREAD_QUIET_S, q[0][1] / _SLOW_READ_BPS) if q else _UNREAD_QUIET_S
#: the interpreter's switch interval while the HTTP threads run (`_open_http`)
HTTP_SWITCH_S = 0.0005
_LIVE_WITHIN_S = 2.0  # live: the loop passed this recently (it passes at least every 100 ms)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_NOBLOCK = int(zmq.NOBLOCK)
#: how long a tcp peer's handshake may take (ms): what an unauthenticated connection holds (a
#: descriptor, a frame buffered as large as its size claims) it holds this long at most
#: (libzmq's default is 30 s).  A CurveZMQ handshake is two round trips.
HANDSHAKE_MS = 5000
#: a worker's reply frame over a tcp backend may be this many times --max-frame-mb (and 1 GiB
#: at least): bounded, for what an unauthenticated peer can make the broker buffer
REPLY_FRAME_FACTOR = 4
#: default largest client frame: the largest inline tensor a deployment expects, and then some
DEFAULT_MAX_FRAME = 256 << 20
#: default messages queued towards one client before it counts as not reading
DEFAULT_CLIENT_HWM = 4096  # = the default max_client_requests: a client within its cap is never dropped for pipelining


def default_total_bytes() -> int:
    """The broker-wide cap on outstanding requests' bytes when none is given: half the memory
    this process may use (its cgroup's limit, else the machine's: `memory_limit`).  The
    broker's own memory and its unread replies (`default_unread_bytes`) need the rest.  (It
    was at least one client's cap, 512 MiB: the whole of a 512 MiB broker's cgroup, and one
    client's queued requests got it OOM-killed: the memory audit.)"""
    limit = memory_limit()
    if limit is None:
        return 1 << 50
    return max(1 << 20, min(1 << 50, limit // 2))


def default_unread_bytes() -> int | None:
    """The broker-wide cap on big replies waiting unread for all clients together when none
    is given: a quarter of the memory this process may use (None: no limit known).  Each
    client's own cap (--max-client-mb) let four stopped readers of 300 MiB replies take a
    1 GiB broker's cgroup, and the OOM killer took the broker (the memory audit)."""
    limit = memory_limit()
    if limit is None:
        return None
    return max(1 << 20, min(1 << 50, limit // 4))


def _peer_pid(frame: Any) -> int | None:
    """SO_PEERCRED's pid for the unix-domain connection a received frame came from; None
    where the frame's descriptor is another connection's by now (`_said_pid`)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError):
        return None
    pid = _fd_peer_pid(fd)
    if pid is not None:
        said = _said_pid(frame)
        if said is not None and said != pid:
            return None
    return pid


def _said_pid(frame: Any) -> int | None:
    """The pid libzmq read for the connection a received frame came on, or None where it
    says none (tcp, a frame not received, a libzmq built without SO_PEERCRED).

    ZMQ_SRCFD names a descriptor *number*, which libzmq's I/O thread closes and reuses on
    its own: a message read after its connection closed (libzmq keeps up to the high-water
    mark of them) names a number that may be a newer connection's, another process's, by
    then (the fuzz audit: a dropped client's left-behind requests were dispatched under a
    victim's pid).  libzmq also asks SO_PEERCRED once, when it takes the connection, and
    puts the answer in every message's "Peer-Address" (``<address>:<uid>:<gid>:<pid>`` on
    a unix socket): tied to the connection itself, so it is the check on the number."""
    try:
        addr = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError, ValueError, KeyError):
        return None
    if not isinstance(addr, str):
        return None
    parts = addr.split(":")  # (an IPv6 peer's address has colons of its own: not 4 parts, or not digits)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[3])


#: client commands that only end work: applied even when left behind by a closed connection
_ENDINGS = frozenset({P.C_CANCEL, P.C_DISCONNECT, P.C_LEASE_END})


class _LeftBehind(Exception):
    """A client message read after its connection had closed and its descriptor number was
    taken by another connection (`Broker._client_pid`): dropped, for nobody reads its answer."""


def _fd_peer_pid(fd: int) -> int | None:
    """SO_PEERCRED's pid for the unix-domain connection on descriptor `fd` (None: closed,
    not unix-domain, or a peer in a pid namespace we cannot see)."""
    s = wire.dup_socket(fd)
    if s is None:
        return None
    try:
        if s.family != socket.AF_UNIX:
            return None
        pid = _PEERCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
        return pid or None  # 0: the peer is in a pid namespace we cannot see
    except OSError:
        return None
    finally:
        s.close()


#: getsockopt: a pidfd for the process that made a unix-domain connection (Linux 6.5)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def _boot_ticks() -> int:
    """Now, in the clock ticks after boot that /proc/<pid>/stat's start times count (as
    `proc_starttime` reads them: this process's time namespace's boottime offset off)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _CLK_TCK) - boot_offset_ticks()


_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: errors of SO_PEERPIDFD that mean the connecting process has exited: ESRCH, and EINVAL
#: from Linux 6.5 to 6.15 (a reaped peer); 6.16 on gives a pidfd that polls as exited
_PEER_EXITED = frozenset({errno.ESRCH, errno.EINVAL, errno.ENODATA})


def _principal_text(principal) -> str | None:
    """A lease grant's ``principal``: a tcp client's key (``curve:...``), an ipc client's
    process as ``pid:start`` (``pid`` where its start is unknown)."""
    if principal is None:
        return None
    if type(principal) is tuple:
        pid, start = principal
        return str(pid) if start is None else f"{pid}:{start}"
    return str(principal)


def _fd_peer(fd: int, accepted: int | None = None) -> tuple[int, int | None] | None:
    """(pid, start time) of the process that made the unix-domain connection on descriptor
    ``fd``; None when closed, not unix-domain, a peer in a pid namespace we cannot see, or
    that process has exited.  ``accepted``: when the connection was accepted (`_boot_ticks`),
    if known.

    SO_PEERCRED keeps the pid of the process that connected after it exits, and a connection
    outlives it in a child it forked: once the pid is reused, a stale pid would let the
    child's requests name the new process's memory.  The start time (the pid's
    `proc_starttime`, read while a pidfd from SO_PEERPIDFD shows the connecting process
    still alive, so it is that process's) goes with the pid to the worker, which checks
    both.  Before Linux 6.5 (no SO_PEERPIDFD) the start time cannot be confirmed that way;
    a process that started after the connection was accepted cannot have made it, which
    ``accepted`` catches (the pid reused before the first message, whenever that is).  None
    for the start time when it cannot be read (out of descriptors): the worker then checks
    the pid alone, as before."""
    s = wire.dup_socket(fd)
    if s is None:
        return None
    pidfd = None
    try:
        if s.family != socket.AF_UNIX:
            return None
        pid = _PEERCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
        if not pid:
            return None  # 0: the peer is in a pid namespace we cannot see
        try:
            pidfd = s.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError as e:
            if e.errno in _PEER_EXITED:
                return None  # it has exited
        try:
            start = proc_starttime(pid)
        except OutOfResources:
            start = -1
        if pidfd is not None and _exited(pidfd):
            return None
        if start == -1:
            return pid, None
        if start is None or (accepted is not None and start > accepted + 1):
            return None  # gone, or a later process under its pid
        return pid, start
    except OSError:
        return None
    finally:
        if pidfd is not None:
            os.close(pidfd)
        s.close()


def _exited(pidfd: int) -> bool:
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def _nbytes(frames) -> int:
    """Bytes in a message body: what a queued request holds of the broker's memory."""
    n = 0
    for f in frames:
        n += len(f)
    return n


def sweep_reply_sockets(directory: str | None = None) -> list[str]:
    """Unlink the reply-socket files that dead clients left behind (libzmq leaves the file
    of a bound ipc socket on close, and a SIGKILLed client never gets to); returns them."""
    return ReplySocketSweep().sweep(directory)


class ReplySocketSweep:
    """`sweep_reply_sockets`, remembering the owners it found alive: a file whose owner was
    seen alive (pid and start time, from /proc) is looked at again by its pid alone (one
    `kill(pid, 0)`, about a microsecond), and fully once `RECHECK_S` passed.  A sweep read
    /proc for every client's file, about 11 µs each: with 2000 clients 22 ms of the broker's
    loop, once a second and again at every worker disconnect (the scale hunt).  A pid reused
    between two looks keeps a dead client's file until the full look (a stale socket file:
    nothing connects to a socket that no process serves)."""

    RECHECK_S = 60.0

    def __init__(self) -> None:
        self._alive: dict[str, float] = {}  # file name -> when its owner was last seen alive in full

    def sweep(self, directory: str | None = None, now: float | None = None) -> list[str]:
        directory = directory or P.default_runtime_dir()
        now = time.monotonic() if now is None else now
        gone: list[str] = []
        try:
            names = os.listdir(directory)
        except OSError:
            return gone
        seen = self._alive
        alive: dict[str, float] = {}
        for name in names:
            owner = P.parse_reply_socket_name(name)
            if owner is None:
                continue
            checked = seen.get(name)
            if checked is not None and now - checked < self.RECHECK_S:
                if pid_exists(owner[0]):
                    alive[name] = checked
                    continue
            elif process_alive(*owner):
                alive[name] = now
                continue
            try:
                os.unlink(os.path.join(directory, name))
                gone.append(name)
            except OSError:
                pass
        self._alive = alive  # the files still there, and only those
        return gone


@dataclass
class BrokerConfig:
    frontend: str = ""
    backend: str = ""
    scheduler: Config = field(default_factory=Config)
    security: security.SecurityConfig = field(default_factory=security.SecurityConfig)
    #: largest frame a client may send (bytes; ZMQ_MAXMSGSIZE, which libzmq checks per
    #: frame): libzmq drops the connection of a client that announces more, before
    #: buffering it.  A message of n frames can still hold n times this; the per-client byte
    #: cap refuses it once read.  Workers (few, authenticated) are not limited.
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    #: largest frame a worker may send over a tcp backend (before its handshake, anyone who
    #: reaches the port is such a peer: libzmq buffers a frame as its size claims).  None:
    #: 4 x ``max_frame_bytes``, 1 GiB at least.  Told to the workers in WELCOME, which answer a
    #: request whose inline output is larger with an error (a frame over it would end the
    #: worker's connection).  Ipc backends: no limit.
    max_reply_frame_bytes: int | None = None
    #: bytes of big replies all clients together may have waiting unread (each is bounded by
    #: the per-client byte cap too); over it the reader holding the most, among those that read
    #: none of theirs for a while, is dropped as one that stopped reading, and past twice it,
    #: the one holding the most.  None: a quarter of the memory the broker may use
    max_unread_bytes: int | None = None
    #: messages the broker queues towards one client; a client whose queue is full has
    #: stopped reading: its requests are dropped as if it had disconnected.  None: the
    #: request cap (``max_client_requests``), and at least `DEFAULT_CLIENT_HWM`, so that a
    #: client that pipelines within its cap is never taken for one that stopped reading
    client_hwm: int | None = None
    #: ``HOST:PORT`` (or ``PORT``: loopback) of the HTTP endpoint for /metrics and the health
    #: paths (broker.http); empty: none, and nothing is counted
    http: str = ""

    @classmethod
    def from_toml(cls, path: str) -> "BrokerConfig":
        from broker import config as deploy_file

        # Unknown keys (here, in [broker], [scheduler]) and values of the wrong type: a
        # ConfigError naming the key.  [[pool]] and [launcher] are the launcher's.
        data = deploy_file.read_toml(path)
        deploy_file.check_broker_keys(data, path, cls)
        b = data.get("broker", data)
        sched = Config()
        for key, value in b.get("scheduler", {}).items():
            if not hasattr(sched, key):
                raise ValueError(f"{path}: unknown scheduler option {key!r}")
            if key == "priority_weights":
                value = tuple(value)
            setattr(sched, key, value)
        sec = security.SecurityConfig.from_table(b.get("security", {}), path, os.path.dirname(os.path.abspath(path)))
        limits = {}
        for key, (lo, hi) in LIMITS.items():
            if key in b:
                if type(b[key]) is not int or not lo <= b[key] <= hi:
                    raise ValueError(f"{path}: {key} must be an integer from {lo} to {hi}")
                limits[key] = b[key]
        try:
            Scheduler.check(sched)
        except ValueError as e:
            raise ValueError(f"{path}: [scheduler] {e}") from None
        if "http" in b:
            if not isinstance(b["http"], str):
                raise ValueError(f"{path}: http must be a string, HOST:PORT")
            if b["http"]:
                # Checked here, naming the file: the check at the bind said "--http 'abc': ...",
                # a flag nobody had passed (the configuration hunt).
                from broker.http import parse_address

                try:
                    parse_address(b["http"])
                except ValueError as e:
                    raise ValueError(f"{path}: http {str(e).partition(' ')[2]}") from None
            limits["http"] = b["http"]
        return cls(frontend=b.get("frontend", ""), backend=b.get("backend", ""), scheduler=sched, security=sec,
                   **limits)


#: what a deploy file's [broker] limits may be: a frame limit under 64 KiB dropped every
#: client; a queue of more than 2**31 messages overflowed libzmq's option (the command-line hunt)
LIMITS = {"max_frame_bytes": (1 << 16, 1 << 40), "max_reply_frame_bytes": (1 << 16, 1 << 42),
          "max_unread_bytes": (1 << 16, 1 << 50), "client_hwm": (1, (1 << 31) - 1)}


class _Payload(msgspec.Struct, array_like=True):
    """What the scheduler carries for one request (it never looks inside)."""

    header: Any          # P.Request, or None for an opaque MDP body
    body: tuple          # frames after the header (or the whole opaque body)


def _names_slots(body) -> bool:
    """Whether a worker's reply body names slots lent to its client (shared memory, CUDA):
    what a late reply is forwarded for (LateToClient).  Decoded on that rare path only."""
    if not body or not P.is_header(body[0]):
        return False
    try:
        rep = P.decode_reply(body[0], frames=body[1:])
    except P.ProtocolError:
        return False
    return any(type(t.loc) is not P.InlineLoc for t in rep.tensors)


def _ipc_served(path: str) -> bool:
    """Whether a process may still serve the unix socket at ``path``: only a refused
    connection (nobody listens: a stale file, or not a socket) or a file gone meanwhile says
    no.  Anything else says yes: a connection made, another user's socket, and a listener
    whose backlog is full (EAGAIN at once: a broker stopped or stalled while clients
    reconnect is still that broker)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        s.close()


def _signature(decl) -> tuple:
    """A Ready's inputs or outputs declaration, hashable and in name order."""
    if not decl:
        return ()
    return tuple(sorted((name, dt, None if shape is None else tuple(shape)) for name, (dt, shape) in decl.items()))


def _show_sig(decl) -> str:
    if not decl:
        return "(none)"
    return ", ".join(f"{name}:{dt or '*'}{list(shape) if shape is not None else '[*]'}"
                     for name, (dt, shape) in sorted(decl.items()))


def _protocol_frame(frames) -> bytes:
    """The MDP protocol frame of a message a ROUTER read (after the identity, and the empty
    delimiter a REQ peer puts first), for telling a client from a worker; b"" if none."""
    for f in frames[1:3]:
        b = bytes(f)
        if b:
            return b
    return b""


def _foreign(frames) -> str | None:
    """What a message a ROUTER read speaks, when it is not MDP but something an operator can
    act on: zeromq/majordomo's zproto encoding; None otherwise.  (MDP/0.1 is served: its
    messages parse, docs/protocol.md section 12.1.)"""
    proto = _protocol_frame(frames)
    if proto[:1] == b"\xaa" and len(proto) > 2 and proto[1] & 0xF0 == 0xA0:
        return ("a zproto-encoded message (zeromq/majordomo's libmajordomo packs MDP into one binary "
                "frame): this broker speaks RFC 18's frames (MDPC02, MDPW02) and RFC 7's (MDPC01, MDPW01); "
                "not answered")
    return None


#: the protocol frames of each side, for naming a peer on the wrong socket
_CLIENT_PROTOCOLS = (P.MDPC, P.MDPC01)
_WORKER_PROTOCOLS = (P.MDPW, P.MDPW01)


def _peer_key(frame: Any, ident: bytes) -> int | str | bytes:
    """Who sent ``frame``: its process's pid on ipc, its address over tcp, else its routing
    id (`_Peer`, and `_refuse_ready`'s once-an-interval key)."""
    pid = _peer_pid(frame)
    if pid is not None:
        return pid
    try:
        addr = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        addr = None
    return addr or ident


class _Peer:
    """Names the peer a received frame came from, in a log line (`_peer_key`).  Looked up
    only if the line is written (a throttled one may not be)."""

    __slots__ = ("frame", "ident")

    def __init__(self, frame: Any, ident: bytes):
        self.frame, self.ident = frame, ident

    def __str__(self) -> str:
        key = _peer_key(self.frame, self.ident)
        if isinstance(key, int):
            return f"pid {key}"
        return key if isinstance(key, str) else repr(key[:16])


def _command_frame(frames) -> bytes:
    """The command frame of a message a ROUTER read (after the identity, the empty delimiter
    a REQ-era peer puts first, and the protocol frame); b"" if none."""
    i = 1 if len(frames) > 1 and len(frames[1]) else 2
    return bytes(frames[i + 1]) if len(frames) > i + 1 else b""


def _ipc_file(path: str | None) -> tuple[int, int, int] | None:
    """What tells one socket file from another made later at the same path: (device, inode,
    change time); None for no file.  (An inode number alone does not: ext4 gives a new file
    the number of one just removed.)"""
    if path is None:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _unlink_ipc(endpoints, ours: dict) -> None:
    """Remove the socket files of these endpoints (the ipc ones with a path) that are still
    ``ours`` (path -> `_ipc_file` of the file this broker bound there): a broker started on the
    same paths the moment this one's sockets closed (a supervisor's overlapping restart, a
    handover) has bound files of its own there, which removing by path took from it (no
    client could connect to it again, and nothing said why)."""
    for ep in endpoints:
        path = ep[len("ipc://") :] if ep.startswith("ipc://") and not ep.startswith("ipc://@") else None
        got = _ipc_file(path)
        if got is not None and got == ours.get(path):
            try:
                os.unlink(path)
            except OSError:
                pass


_HTTP_LINKS = itertools.count()  # the inproc names of Broker._open_http


class Broker:
    """MDP/0.2 broker.  `Broker(cfg).serve(stop_event)`; a context manager that closes sockets."""

    def __init__(self, cfg: BrokerConfig | None = None, *, ctx: zmq.Context | None = None):
        self.cfg = cfg or BrokerConfig()
        # Raising the request cap alone left this at 4096: a client with 30,000 requests in
        # flight, answered together while its loop was busy, was dropped (the second scale hunt).
        self._client_hwm = (self.cfg.client_hwm if self.cfg.client_hwm is not None
                            else max(DEFAULT_CLIENT_HWM, self.cfg.scheduler.max_client_requests))
        # New at every start: clients see it in heartbeat answers and resend what a previous
        # broker process held (docs/protocol.md section 2).
        self.instance = secrets.token_bytes(P.INSTANCE_LEN)
        self._route_key = secrets.token_bytes(16)  # names clients' connections (HEARTBEAT answers)
        # (The runtime directory is checked, and created, only when a default is used.)
        fe, be = ("", "") if self.cfg.frontend and self.cfg.backend else P.default_endpoints()
        self.frontend_ep = self.cfg.frontend or fe
        self.backend_ep = self.cfg.backend or be
        # CURVE on tcp endpoints, or a refusal to start (broker.security), before anything binds.
        self._curve_plan = security.plan(self.cfg.security, self.frontend_ep, self.backend_ep)
        self._ctx_given = ctx is not None
        self.ctx = ctx or zmq.Context.instance()
        # Metrics are counted only when someone can read them (--http): otherwise the
        # request path pays nothing for them (broker.metrics).
        self.metrics = None
        if self.cfg.http:
            from broker.metrics import Metrics

            self.metrics = Metrics()
        sc = self.cfg.scheduler
        if sc.max_total_bytes is None:  # not given: half the memory it may use (the caller's config untouched)
            sc = dataclasses.replace(sc, max_total_bytes=default_total_bytes())
        self.sched = Scheduler(sc, on_direct=self.metrics.final if self.metrics is not None else None)
        # Registered at some point (404 vs 503), bounded, retired once without a worker for
        # RETAIN_S (ServiceNames)
        self._seen_services = ServiceNames(_MAX_SERVICES)
        #: live services whose name found the lists full at their READY (counted under
        #: _other, a 404 for readiness): added once there is room, not at their next READY,
        #: which a long-lived worker never sends (the HTTP audit)
        self._unlabelled: set[str] = set()
        # False while a launcher (broker.launcher) starts its pools: /v2/health/ready says
        # 503 until every pool's workers were ready once (its READY line), not as soon as
        # the fastest pool registered (the docs hunt: clients let in then met 503s).
        self.pools_ready = True
        self._reply_sweep = ReplySocketSweep()
        self._sweep_soon = False  # a worker was disconnected: sweep within _SWEEP_SOON_S (serve)
        self._swept_at = 0.0
        # ident -> (service, pid, inputs, host, outputs, whether the kernel said the pid)
        self._worker_info: dict[bytes, tuple] = {}
        self._sig_warned: set = set()  # (service, signature, signature) said (_check_signature)
        self._here = P.local_host_id()
        # (pids of the registered workers on this host, {pid: when} of those that said
        # goodbye (DISCONNECT) lately, the loop's clock then), remade once a second and replaced whole
        # (a launcher reads it from its own thread): a launcher's worker missing from the
        # first for long is hung, one in the second is leaving on its own (broker.launcher).
        # The kernel's word for the pid on ipc, else the READY's when its host is this one.
        self.worker_pids: tuple[frozenset, dict, float] = (frozenset(), {}, time.monotonic())
        self._leaving: dict[int, float] = {}  # pid -> when it said DISCONNECT
        self._client_window_ms = max(1, min(int(self.sched.client_window * 1000), (1 << 32) - 1))
        sc = self.cfg.scheduler
        # The scheduler's congestion rule reads the deadlines workers miss (their 504s: "not
        # run"), counting or not: the codes of the FINALs relayed and of the DONEs.
        self._outcomes = self.sched.reads_misses
        self._welcome = P.Welcome(instance=self.instance, heartbeat_interval=sc.heartbeat_interval,
                                  heartbeat_liveness=sc.heartbeat_liveness, metrics=bool(self.cfg.http),
                                  stopping=True, outcomes=self._outcomes)
        wire.seed_routing_ids()  # libzmq's own ids for the peers: unpredictable
        self.frontend = self.ctx.socket(zmq.ROUTER)
        self.backend = self.ctx.socket(zmq.ROUTER)
        for s in (self.frontend, self.backend):
            s.linger = 0
        # Clients are limited: a worker's reply may be as large as its model makes it (a
        # client asking for a large inline output must not get the worker cut off).  But a
        # tcp backend takes connections from anyone who can reach it, and libzmq buffers a
        # frame whole as its size claims, before the handshake authenticates the peer: one
        # unauthenticated connection claiming 2 GiB held 2.1 GB of the broker (the tcp fuzz
        # audit).  There, a frame may be at most REPLY_FRAME_FACTOR x --max-frame-mb (1 GiB
        # at the default); and on every tcp endpoint a handshake gets HANDSHAKE_MS, not
        # libzmq's 30 s, to hold what it holds.
        self.frontend.maxmsgsize = self.cfg.max_frame_bytes
        for sock, ep in ((self.frontend, self.frontend_ep), (self.backend, self.backend_ep)):
            if ep.startswith("tcp://"):
                sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        if self.backend_ep.startswith("tcp://"):
            self.backend.maxmsgsize = (self.cfg.max_reply_frame_bytes or
                                       max(REPLY_FRAME_FACTOR * self.cfg.max_frame_bytes, 1 << 30))
            # Told to the workers, which answer a reply over it with an error instead: a
            # frame over it ended the worker's connection, so that the request was retried
            # on every worker in turn, each losing its connection (and its other requests'
            # replies went again elsewhere).
            self._welcome.max_reply_frame = self.backend.maxmsgsize
        # Workers are few and ours: deep queues.  Clients are many: each gets client_hwm
        # messages each way, and a client that lets its replies pile up to that is told
        # apart (ROUTER_MANDATORY turns "queue full" into EAGAIN instead of a silent drop).
        self.backend.rcvhwm = self.backend.sndhwm = 100_000
        self.frontend.rcvhwm = self.frontend.sndhwm = self._client_hwm
        self.frontend.router_mandatory = 1
        # Connections the kernel queued before the frontend pauses (`_accepted`) are accepted
        # all the same: at most half the descriptors' reserve (libzmq's default of 100 is
        # more than the whole reserve under a limit of 800 or so).
        self.frontend.backlog = listen_backlog(default_reserve(nofile_limit()))
        self.backend.backlog = self.frontend.backlog  # (the same for workers' connections: the resource audit)
        for sock, ep in ((self.frontend, self.frontend_ep), (self.backend, self.backend_ep)):
            if ep.startswith("tcp://"):
                sock.backlog = TCP_BACKLOG  # (no pause there: a restart's storm of redials fits)
        # A tcp peer unreachable behind a partition (or with its host) is dropped after twice
        # the window in which the broker presumes such a peer dead, DEAD_AFTER_BEATS
        # heartbeats at least, with the replies queued to it: TCP alone keeps a half-open
        # connection and its queue for many minutes (wire.tcp_liveness; docs/protocol.md).
        hb = sc.heartbeat_interval
        for sock, ep, window in ((self.frontend, self.frontend_ep, self.sched.client_window),
                                 (self.backend, self.backend_ep, hb * sc.heartbeat_liveness)):
            if ep.startswith("tcp://"):
                wire.tcp_liveness(sock, max(2 * window, wire.DEAD_AFTER_BEATS * hb))
        self._curve = security.ServerCurve(self.ctx, self._curve_plan)
        # The connection monitors are attached before the bind: a peer that connects at once
        # (workers and clients redialling a restarted broker) must not have its ACCEPTED
        # event lost (the headroom's count, a connection's accept time for attestation).
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        self._backend_events = self.backend.get_monitor_socket(events)
        self._frontend_events = self.frontend.get_monitor_socket(events)
        bound = []
        #: path -> `_ipc_file` of the socket files bound here (or moved aside): removed at
        #: close only while they are still these (`_unlink_ipc`)
        self._ipc_files: dict[str, tuple] = {}
        try:
            self._curve.start()
            self._curve.configure(self.frontend, "frontend")
            self._curve.configure(self.backend, "backend")
            if self.frontend_ep == self.backend_ep and not self.frontend_ep.endswith((":0", "ipc://*")):
                # (it said "a running process serves it (another broker?)": its own frontend)
                raise RuntimeError(f"the frontend and the backend are both {self.frontend_ep}: give two endpoints")
            self._bind(self.frontend, self.frontend_ep)
            bound.append(self.frontend.getsockopt_string(zmq.LAST_ENDPOINT))  # (ipc://* is a path now)
            self._own_ipc(bound[-1])
            self._bind(self.backend, self.backend_ep)
            self._own_ipc(self.backend.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException:
            for s, events in ((self.frontend, self._frontend_events), (self.backend, self._backend_events)):
                s.disable_monitor()
                events.close(linger=0)
                s.close(linger=0)
            self._curve.stop()
            # The frontend's socket file, when only the backend failed: libzmq removes it
            # from its I/O thread, which the exit that follows does not wait for.
            _unlink_ipc(bound, self._ipc_files)
            raise
        # Resolve wildcard ports so callers (tests, bench) can connect.
        self.frontend_ep = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend_ep = self.backend.getsockopt_string(zmq.LAST_ENDPOINT)
        # (an abstract ipc://@name too, which any local user reaches: it was served without
        # a word; the security audit)
        insecure = [ep for ep in (self.frontend_ep, self.backend_ep) if not security.kernel_guarded(ep)
                    and not (ep.startswith("tcp://") and self._curve_plan.enabled)]
        if insecure:
            log.warning("INSECURE: serving %s without authentication (--insecure): no keys, no encryption; "
                        "any process that can reach it can act as a client or a worker", " and ".join(insecure))
        # Whether a client's connection is tcp (learned once per client, as its pid is): tcp
        # peers may not name shared memory, CUDA memory or a reply socket.  Only a frontend
        # that is not ipc can have any.
        self._tcp_frontend = not self.frontend_ep.startswith("ipc://")
        #: every client connection is tcp: a descriptor number found to be anything else is
        #: another connection's by reuse (a message read after its own closed)
        self._tcp_only = self.frontend_ep.startswith("tcp://")
        #: a key left the client allow-list (`_apply_revocations`): tcp clients' REQUESTs and
        #: LEASEs are looked up in it from then on (never before: until a key leaves, every
        #: connection's key is on its list, the handshake checked it).  One for each list: a
        #: worker's key removed adds nothing to the clients' messages (an ipc frontend's
        #: have no key to look up, and asking cost each REQUEST an exception)
        self._revoking = False
        #: the same for the worker allow-list: workers' READYs are looked up
        self._revoking_workers = False
        self._curve_backend = self._curve_plan.domain_of("backend") is not None
        #: a tcp worker's CurveZMQ key (its ZAP User-Id), learned at its READY, for a removal
        self._worker_keys: dict[bytes, str] = {}
        # Peers silent by messages whose tcp connection still moves bytes (a large message
        # crossing a slow link holds their heartbeats back) are alive: `_look_at_quiet`.  So
        # is a client whose ipc connection is open: the kernel closes it when the process
        # ends, however it ends, so silence there is a busy program (a blocking `Client` not
        # called into), not a dead one.
        self._ipc_frontend = self.frontend_ep.startswith("ipc://")
        self._look_clients = self._ipc_frontend or self.frontend_ep.startswith("tcp://")
        self._look_workers = self.backend_ep.startswith("tcp://")
        self._watches: dict[tuple[str, bytes], wire.TcpWatch] = {}
        self._client_tcp: dict[bytes, bool] = {}
        # A worker whose connection closes is dead now, not after heartbeat_liveness silent
        # intervals (broker.connections): the backend's monitor says which connection closed.
        self._worker_conns = WorkerConnections()
        self._gone: dict[bytes, float] = {}  # workers whose connection closed -> when: their verdict waits (`_settle_gone`)
        self._closed_conns = 0  # connections closed since the C heap was last trimmed (`trim_heap`)
        self._trimming: threading.Thread | None = None
        # Housekeeping rounds left that trim the C heap whatever the closes (`_stalled`):
        # what a reader that stopped held in libzmq's queue, freed by its I/O thread
        self._trim_rounds = 0
        self._burst = BurstSeen()  # big frames moved: a burst's memory trimmed once it is over
        self._client_pids: dict[bytes, tuple | None] = {}  # client identity -> attested (pid, start)
        # pid -> the start time last read for it: a principal's start where a connection's
        # could not be read (out of descriptors), so one process stays one principal
        self._pid_starts: dict[int, int] = {}
        # attested (pid, start) -> whether that process reads our CLOCK_MONOTONIC (`_on_our_clock`)
        self._clock_peers = ClockPeers(_MAX_CLIENT_PIDS)
        # What is learned about a client's connection (its pid, whether it is tcp) is
        # forgotten when that connection closes: a client chooses its routing id, and a
        # later connection reusing the id must not inherit the earlier one's pid (the
        # frontend's monitor, attached before the bind).
        # Never out of descriptors: libzmq's ipc listener aborts the process when accept()
        # fails with EMFILE (its tcp listener spins on it).  Near the limit the frontend stops
        # listening until connections close (`_accepted`, `_headroom_tick`).
        self._headroom = Headroom(nofile_limit())
        self._hidden: str | None = None  # the frontend's socket file, moved aside (`_accepted`)
        self._hidden_backend: str | None = None  # the backend's, the same
        self._accept_ticks: dict[int, int] = {}  # a frontend connection's fd -> when it was accepted (_boot_ticks)
        self._client_conn: dict[bytes, int] = {}  # client identity -> the fd it was learned on
        # Quiet ipc clients whose connection the look has checked (client -> descriptor):
        # its peer is the pid learned for the client (`_look_at_quiet`).  A message its closed
        # connection left behind, read after the close, learns the closed descriptor (or
        # whatever connection reuses its number) as the client's; the check keeps that
        # from keeping a dead client alive.  Forgotten with the connection.
        self._kept_conns: dict[bytes, int] = {}
        self._conn_clients: dict[int, list[bytes]] = {}  # fd -> identities learned on it
        # Each frontend descriptor's latest event, numbered: positive when accepted, negative
        # when closed (`_on_frontend_events`).  A message's descriptor number tells which
        # connection it came on only together with these: libzmq reuses the number of a
        # closed connection for the next one it accepts.  Bounded by the descriptor limit.
        self._fd_state: dict[int, int] = {}
        self._fd_events = 0
        # Clients whose connection's close ended their requests (`_conn_closed`) -> the
        # descriptor and its closed state then, oldest first (bounded): a message of theirs
        # read later is one the closed connection left in libzmq's queue, for nobody
        # (`_from_closed`).
        self._closed_clients: collections.OrderedDict[bytes, tuple[int, int]] = collections.OrderedDict()
        self._req_clients: set[bytes] = set()  # REQ-style clients want the empty delimiter back
        #: those of them whose socket is a REQ (ZMTP's Socket-Type): one reply per request,
        #: so no PARTIAL (a DEALER that leads with the delimiter reads streams)
        self._req_sockets: set[bytes] = set()
        # Clients that sent an MDP/0.1 request (docs/protocol.md section 12.1): what goes to
        # them is written in MDP/0.1 (`_send_client`).  A subset of `_req_clients` (a 0.1
        # message leads with the empty frame), forgotten with it.
        self._v01_clients: set[bytes] = set()
        # Workers that lead their messages with an empty frame (MDP/0.1's delimiter, which some
        # MDP/0.2 workers kept: majortomo's) and read only messages that do: what goes to them
        # gets one too (`send_to_worker`).  Bounded: pruned to registered workers when full.
        self._delimited: set[bytes] = set()
        # Of those, workers that speak MDP/0.1 (`_framing01`): what goes to them is written in
        # MDP/0.1 (`send_to_worker`).  A subset of `_delimited`, pruned with it.
        self._v01_workers: set[bytes] = set()
        self._opaque_ids = 0
        self._bad = P.RateLimitedLog(log)
        self._refused_at: dict[object, float] = {}  # a refused READY's peer -> when it was told why (_refuse_ready)
        self._told_unknown: dict[bytes, float] = {}  # an unknown worker -> when it was told to register (_tell_unknown)
        self._stall_log = P.RateLimitedLog(log)  # its own throttle: a flood of junk cannot hide it
        self._deaths = P.RateLimitedLog(log)  # workers presumed dead (their own throttle, as above)
        self._lost = P.RateLimitedLog(log)  # ... the last live one of a service
        self._worker_failed = P.RateLimitedLog(log)  # requests failed WORKER_FAILED (their own throttle too)
        self._oops = P.RateLimitedLog(log)  # unexpected exceptions: a traceback a second at most
        # The once-a-second collection that fails (out of descriptors, say): once a minute.
        self._gc_oops = P.RateLimitedLog(log, every=60.0)
        self._paused_log = P.RateLimitedLog(log)  # the broker's own stops (`_resumed`)
        # failed tcp handshakes (`_mismatch`), by side and cause: libzmq retries each 10 times a second
        self._handshakes = {(peer, code): P.RateLimitedLog(log, every=10.0)
                            for peer in ("client", "worker") for code in (*_HANDSHAKE_ERRORS, None)}
        self._throttles = (self._bad, self._stall_log, self._deaths, self._lost, self._worker_failed, self._oops,
                           self._gc_oops, self._paused_log, *self._handshakes.values())
        self._doomed: dict[bytes, None] = {}  # clients a send found stalled or gone, to drop
        # Big frames sent to each client that libzmq may still hold (`_track_unread`), and how
        # many bytes of them a client may have waiting: its byte cap's worth.
        self._unread: dict[bytes, _Unread] = {}
        #: principal -> its connections in `_unread` (only principals that are not a
        #: connection of their own): what one principal's connections hold together is
        #: bounded by the same cap (`_track_unread`)
        self._unread_by: dict[object, set[bytes]] = {}
        #: the CurveZMQ principal of each tcp client connection seen with one (`_tcp_principal`)
        self._client_keys: dict[bytes, str] = {}
        self._max_unread = max(self.cfg.scheduler.max_client_bytes, 4 * _TRACK_BYTES)
        self._max_unread_all = (self.cfg.max_unread_bytes if self.cfg.max_unread_bytes is not None
                                else default_unread_bytes())  # (None: no limit known)
        self._unread_all = [0]  # bytes of every `_unread` entry together (`_Unread.all`)
        self._unread_look = -math.inf  # the last broker-wide look (`_all_unread`)
        self._dropping = False
        self.malformed = 0
        self._log_levels()  # whether request lines are logged (read again every _GC_INTERVAL)
        self.stalled_clients = 0  # clients dropped because they stopped reading their replies
        self._closed = False
        self._drained = False  # the loop ended after a drain (`_hold`): close() lets the last replies go
        self.http = None
        self._http_loop = None
        self.last_pass = time.monotonic()  # the loop's last pass (the HTTP liveness probe reads it)
        if self.cfg.http:
            try:
                self._open_http()
            except BaseException:
                self.close()
                raise

    def _open_http(self) -> None:
        """The HTTP endpoint's threads and the inproc PAIR on which they ask this loop."""
        from broker.http import HttpFront, LoopLink, host_port, parse_address

        address = parse_address(self.cfg.http)
        self._switch_was = sys.getswitchinterval()  # put back by close()
        # Not id(self): a closed broker's successor may get its address while libzmq's reaper
        # thread still holds the old name (a bind then fails: Address already in use).
        name = f"inproc://broker-http-{os.getpid()}-{next(_HTTP_LINKS)}"
        self._http_loop = self.ctx.socket(zmq.PAIR)
        self._http_loop.linger = 0
        self._http_loop.bind(name)
        try:
            self._http_link = LoopLink(self.ctx, name)
            self.http = HttpFront(address, self._http_link,
                                  alive=lambda: time.monotonic() - self.last_pass < _LIVE_WITHIN_S)
        except OSError as e:
            raise RuntimeError(f"--http {self.cfg.http}: cannot listen: {e}") from None
        self.http_address = host_port(*self.http.address)
        # The HTTP threads share the interpreter with this loop, and a scrape's render holds
        # it for milliseconds (a page of ~120 lines a service).  CPython makes a thread that
        # wants it wait up to the switch interval (5 ms by default) before asking the holder
        # to let go: with the loop waking several times per request, a request met by a
        # render waited that long at each wake-up.  A short interval bounds each wait
        # (`python -m bench.scrape_load`); with no render running, nothing contends and
        # nothing changes.
        sys.setswitchinterval(HTTP_SWITCH_S)

    @staticmethod
    def _bind(sock: zmq.Socket, ep: str) -> None:
        """Bind ``ep``; RuntimeError with one line saying why not (a directory that does
        not exist, an address in use, ...).  An ipc socket file left by a dead broker is
        replaced; one that a running process still serves is not taken from it."""
        problem = P.tcp_port_problem(ep) or P.endpoint_text_problem(ep)
        if problem is not None:
            raise RuntimeError(f"cannot bind {problem}")
        if ep.startswith("ipc://") and not ep.startswith("ipc://@"):
            path = ep[len("ipc://") :]
            if os.path.lexists(path):
                try:
                    mode = os.lstat(path).st_mode
                except OSError:
                    mode = None
                if mode is not None and not stat.S_ISSOCK(mode):
                    # Never removed: an operator's typo must not delete a file (found by the
                    # command-line hunt: a regular file at the path was unlinked).
                    raise RuntimeError(f"cannot bind {ep}: {path} exists and is not a socket; choose another path")
                if _ipc_served(path):
                    raise RuntimeError(f"cannot bind {ep}: a running process serves it (another broker?)")
                try:
                    os.unlink(path)  # a stale socket file from a dead broker
                except OSError:
                    pass
        file = ep.startswith("ipc://") and not ep.startswith("ipc://@")
        # An ipc socket file is made 0600 from its creation on: made with the process's umask
        # and chmodded after, it was open to a permissive umask's other users in between
        # (the security audit).  libzmq binds an ipc listener in the calling thread.
        # (Not for ipc://*: libzmq makes a fresh directory for it, 0700 by the usual umask,
        # which 0177 would make unsearchable, and the bind would fail for a user other than
        # root: found by review.  The umask is the process's: an embedding program's other
        # threads making files during the bind would get it too.)
        old_mask = os.umask(0o177) if file and ep != "ipc://*" else None
        try:
            P.ipv6_for(sock, ep)
            sock.bind(ep)
        except zmq.ZMQError as e:
            raise RuntimeError(f"cannot bind {ep}: {e.strerror}") from None
        finally:
            if old_mask is not None:
                os.umask(old_mask)
        if file:
            # Only this user may connect (the runtime directory is 0700 as well; an explicit
            # path may be elsewhere).
            os.chmod(sock.getsockopt_string(zmq.LAST_ENDPOINT)[len("ipc://") :], 0o600)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.http is not None:
            self.http.close()
            sys.setswitchinterval(self._switch_was)
        if self._http_loop is not None:
            self._http_loop.close(linger=0)
        self.backend.disable_monitor()
        self._backend_events.close(linger=0)
        self.frontend.disable_monitor()
        self._frontend_events.close(linger=0)
        # After a drain, the replies it relayed last may still be in libzmq's queue: a
        # moment for them to go (a peer gone takes none of it: a ROUTER drops its messages).
        # A linger is kept only by the context's termination (the process's exit does not
        # wait for it: 32 of 50 large messages reached a slow reader), so the context is
        # terminated then, from a thread given the linger and a little more.
        self.frontend.close(linger=_DRAINED_LINGER_MS if self._drained else 0)
        self.backend.close(linger=0)
        self._curve.stop()
        if self._drained and not self._ctx_given:  # (a context the caller gave is the caller's)
            t = threading.Thread(target=self.ctx.term, name="drained-term", daemon=True)
            t.start()
            t.join(_DRAINED_LINGER_MS / 1000 + 0.5)
        _unlink_ipc((self.frontend_ep, self.backend_ep), self._ipc_files)
        for hidden in (self._hidden, self._hidden_backend):
            if hidden is not None:
                _unlink_ipc(("ipc://" + hidden,), self._ipc_files)

    def serve(self, stop: threading.Event | None = None) -> None:
        """Run until `stop` is set (checked at least every 100 ms, and at once when `stop`
        has a ``wake_fd`` that turns readable: a pipe written when it is set, as python -m
        broker's signal-set stop has)."""
        waiter = Waiter()
        try:
            self._serve(waiter, stop)
        finally:
            waiter.close()

    def _serve(self, waiter: Waiter, stop: threading.Event | None) -> None:
        fe, be = self.frontend, self.backend
        # The two sockets are waited for by descriptor (wire.Waiter: EVENTS asked only of a
        # socket that may have changed, where zmq_poll asks each before and after).  The
        # connection monitors and the HTTP threads' PAIR are plain descriptors to it, never
        # asked: whatever touches one of them reads it until its EVENTS say nothing is left
        # or finds nothing (`_on_backend_events`, `_on_frontend_events`, `_on_http`), so its
        # descriptor signals again on the next message; they are read once now for the same
        # reason.
        events = self._backend_events.get(zmq.FD)
        fe_events = self._frontend_events.get(zmq.FD)
        waiter.add_fd(events)
        waiter.add(be)
        waiter.add_fd(fe_events)
        waiter.add(fe)
        http = None
        if self._http_loop is not None:
            http = self._http_loop.get(zmq.FD)
            waiter.add_fd(http)
            self._on_http()
        # A stop that a signal sets says so on a descriptor too (`wake_fd`: python -m
        # broker's, which the C-level handler writes to): the wait ends at once, and the
        # loop's condition sees the flag.
        stop_fd = getattr(stop, "wake_fd", None)
        if stop_fd is not None:
            waiter.add_fd(stop_fd)
        self._on_backend_events()
        self._on_frontend_events()
        # The /dev/shm files an earlier version left (it named its segments there; this one
        # uses memfds, which go with their process): looked for once, on a thread.  Looked for
        # each second in the loop, 100,000 files planted by any user held it 0.45 s each time
        # (the shm audit); `python -m shm gc` does it on demand.
        threading.Thread(target=_collect_legacy_shm, name="legacy-shm-gc", daemon=True).start()
        wait = waiter.wait
        monotonic = time.monotonic
        sched = self.sched
        on_worker, on_client = self.on_worker, self.on_client
        removals = self._curve.removals
        wake = sched.next_wakeup(monotonic())
        next_gc = monotonic()
        # Two looks fit in the shortest window (a fresh watch needs one to count from).
        sc = self.cfg.scheduler
        look_every = min(sc.heartbeat_interval / 2, sc.heartbeat_interval * sc.heartbeat_liveness / 4,
                         sched.client_window / 4)
        next_look = monotonic() + look_every if self._look_clients or self._look_workers else math.inf
        # A pass that begins this much later than the one before it began plus its wait: the
        # broker did not run meanwhile (`_resumed`).  A quarter of the shortest liveness
        # window at most.
        paused_after = min(_PAUSED_S, sc.heartbeat_interval * sc.heartbeat_liveness / 4, sched.client_window / 4)
        due = monotonic()  # when this pass was to begin at the latest
        drain_by = None  # a drain's end at the latest (`_hold`)
        while stop is None or not stop.is_set():
            now = self.last_pass = monotonic()
            if drain_by is None and getattr(stop, "drain_asked", False):
                drain_by = self._hold(now, stop.drain_s)
            if drain_by is not None:
                left = sched.at_workers()
                if not left or now >= drain_by:
                    if left:
                        log.warning("%d request(s) still at workers after %g s of drain: exiting anyway (their "
                                    "clients send them again to the next broker)", left, stop.drain_s)
                    log.info("drained: exiting, %d request(s) left queued for their clients to send to the next "
                             "broker", sched.live - left)
                    self._drained = True
                    break
            if now - due > paused_after:
                self._resumed(now - due, now)
            if now >= next_look:
                try:
                    self._look_at_quiet(now, look_every)
                except Exception:  # a look is an optimisation of liveness: never the loop's end
                    self._oops.exception("looking at quiet peers' connections failed")
                next_look = now + look_every
            if now >= next_gc or (self._sweep_soon and now >= self._swept_at + _SWEEP_SOON_S):
                # The broker outlives clients and workers on this host: it reaps the shared
                # memory of those that died without cleaning up (SIGKILL, OOM).
                self._collect_shm()
            if now >= next_gc:
                next_gc = now + _GC_INTERVAL
                self._log_levels()
                self._prune_workers()
                self._headroom_tick()
                self._settle_unread()
                if self._doomed:  # a principal's quiet connection dropped there
                    self._drop_doomed()
                for throttle in self._throttles:
                    throttle.flush()  # what a burst held back is said within a second or so
                trimming = self._trimming is not None and self._trimming.is_alive()
                # (a burst's look only when a trim could start: a trim it asked for is not lost)
                due = not trimming and self._burst.due(now)
                due = due or self._closed_conns >= TRIM_AFTER_CLOSES or self._trim_rounds > 0
                if due and not trimming:
                    # libzmq's buffers of the connections that left, back to the kernel, on a
                    # thread of its own (ctypes lets go of the GIL): freeing 80 MB took 12 ms,
                    # during which the loop runs, though a malloc of its own from the arena
                    # being trimmed waits for it (glibc holds the arena's lock meanwhile).
                    self._closed_conns = 0
                    self._trim_rounds = max(0, self._trim_rounds - 1)
                    self._trimming = start_trim()  # (None: no thread to be had, skipped)
            if wake is not None and now >= wake:
                self._run_timers(now)
                wake = sched.next_wakeup(now)
            if removals:  # keys left an allow-list (the allow-list watcher's find)
                self._apply_revocations(now)
            if sched.has_leases and sched.draining:
                # drain() may come from the launcher's thread: leases end here, on the loop.
                self._act(sched.end_leases(DRAIN, now), now)
            timeout = 100 if wake is None else max(0, min(100, int((wake - now) * 1000.0 + 0.999)))
            if next_look < math.inf:
                timeout = max(0, min(timeout, int((next_look - now) * 1000.0 + 0.999)))
            if self._gone:  # a closed worker's verdict waits for its last messages: look again soon
                timeout = min(timeout, 10)
            if drain_by is not None:
                timeout = max(0, min(timeout, int((drain_by - now) * 1000.0 + 0.999)))
            # Counted from the pass's start, so that a stop anywhere in the pass is seen: from
            # the wait's own start, a stop that came before it (in a timer run, say: the
            # moment a request was just handled) went unseen, and the peers stopped with the
            # broker were presumed dead at the next timer run.
            due = now + timeout / 1000.0
            for sock in wait(timeout):  # the sockets (backend first), then the descriptors
                # Workers first: a reply frees credit for the requests that follow.
                if sock is be:
                    self._drain(be, on_worker)
                elif sock is fe:
                    self._drain(fe, on_client)
                elif sock == events:
                    self._on_backend_events()
                elif sock == fe_events:
                    self._on_frontend_events()
                    if self._doomed:  # clients whose connection's close ended their requests
                        self._drop_doomed()
                elif sock == http:
                    self._on_http()
                elif sock == stop_fd:
                    logs.drain_pipe(stop_fd)
            if self._gone:
                self._settle_gone(monotonic())
            wake = sched.next_wakeup(monotonic())
        self._collect_shm()

    def _hold(self, now: float, drain_s: float) -> float:
        """A standalone broker's SIGTERM (python -m broker): nothing new is dispatched
        (`Scheduler.hold`), what the workers hold runs to its end and its replies go out, and
        the loop ends once they are all in, ``drain_s`` seconds from now at the latest.
        Returns that time."""
        sched = self.sched
        sched.hold()
        log.info("shutting down (SIGTERM or SIGINT): nothing new goes to the workers; the %d request(s) they hold finish first "
                 "(at most %g s); the %d queued stay queued, for their clients to send to the next broker (a "
                 "restart); another signal exits now", sched.at_workers(), drain_s, sched.live - sched.at_workers())
        return now + drain_s

    def _resumed(self, lost: float, now: float) -> None:
        """The loop began a pass ``lost`` seconds later than the pass before it began plus
        its wait: the process was stopped (SIGSTOP, a job-control stop, a frozen container),
        starved of CPU, or held by one long step.  The peers' silence meanwhile does not
        count against them (`Scheduler.resumed`): those stopped with the broker sent
        nothing, and would all be presumed dead at the thaw."""
        self._paused_log.warning("the broker did not run for %.3f s (its process was stopped or starved of CPU, or "
                                 "one step of its loop took that long); its peers' silence meanwhile does not count "
                                 "against them", lost)
        self._act(self.sched.resumed(lost, now), now)

    def _settle_unread(self) -> None:
        """Once a second: forget the clients whose big frames libzmq has all let go of (a
        client that asked for nothing more since is not looked at otherwise)."""
        unread = self._unread
        now = time.monotonic()
        for ident, u in list(unread.items()):
            u.settle(now)
            if not u.q:
                self._drop_unread(ident)
        for principal, conns in list(self._unread_by.items()):
            if len(conns) > 1:  # (a principal's connections that are all quiet now, sent nothing since)
                self._principal_unread(principal, None, 0, now)
        cap = self._max_unread_all
        if cap is not None and self._unread_all[0] > cap:
            self._all_unread(now, cap)  # (readers that went quiet since the last send)

    def _drop_unread(self, ident: bytes) -> None:
        """Forget what ``ident`` was sent tracked (its connection ended, or libzmq let all of
        it go)."""
        u = self._unread.pop(ident, None)
        if u is not None:
            u.all[0] -= u.total
            u.total = 0
            u.q.clear()
        if u is not None and u.principal is not None:
            conns = self._unread_by.get(u.principal)
            if conns is not None:
                conns.discard(ident)
                if not conns:
                    del self._unread_by[u.principal]

    def _prune_workers(self) -> None:
        """Once a second: what is kept per worker, for the workers that are registered only
        (a launcher that restarts and rolls workers for months would otherwise keep an entry
        per worker ever seen): the metrics' gauges, whether or not anyone scrapes (with
        --http for probes only), and what each READY said (`_worker_info`)."""
        has = self.sched.has_worker
        now = time.monotonic()
        gone = self._seen_services.sweep(self.sched.holds_service, now)
        if gone:
            self._sig_warned = {k for k in self._sig_warned if k[0] not in gone}
        if self.metrics is not None:
            self.metrics.prune(has)
            self.metrics.sweep(self.sched.holds_service, now)
        room = bool(self._unlabelled) and (self._seen_services.has_room(now) or (
            self.metrics is not None and self.metrics.known.has_room(now)))  # (once a pass: O(names) when full)
        for service in list(self._unlabelled):
            if self.sched.holds_service(service):
                if not room:
                    continue
                self._seen_services.add(service, now)
                if self.metrics is not None:
                    self.metrics.register(service, now)
                if service not in self._seen_services or (self.metrics is not None
                                                          and service not in self.metrics.known):
                    continue  # still no room
            self._unlabelled.discard(service)
        if len(self._worker_info) > 64:
            self._worker_info = {w: v for w, v in self._worker_info.items() if has(w)}
        if len(self._worker_keys) > 64:
            self._worker_keys = {w: k for w, k in self._worker_keys.items() if has(w)}
        here = self._here
        now = time.monotonic()
        if self._leaving:
            self._leaving = {pid: t for pid, t in self._leaving.items() if now - t < _LEAVING_KEPT_S}
        self.worker_pids = (frozenset(v[1] for w, v in self._worker_info.items()
                                      if v[1] is not None and (v[5] or v[3] == here) and has(w)),
                            dict(self._leaving), now)  # a copy: never changed once published

    def _run_timers(self, now: float) -> None:
        """The scheduler's timers that are due.  After a stall (a long collection, a burst
        of sends), what the workers sent meanwhile is read first, before the timers judge
        any of them silent: a heartbeat each, up to _TICK_DRAINS drains, so that a flood
        cannot hold the timers back for long."""
        be = self.backend
        for _ in range(_TICK_DRAINS):
            if not sock_events(be) & _POLLIN:
                break
            self._drain(be, self.on_worker)
        self._act(self.sched.tick(now), now)

    def _look_at_quiet(self, now: float, quiet_for: float) -> None:
        """Peers on tcp not heard from for `quiet_for` seconds whose connection moved bytes
        since the previous look are heard from now: a message of theirs, or ours to them,
        still crossing a slow link (their heartbeats wait behind it; wire.TcpWatch).  The
        looks start at `quiet_for` and come every `quiet_for` (a quarter of the shortest
        liveness window at most), so a window holds the two a fresh watch needs.

        On an ipc frontend, a quiet client whose connection is still open (the frontend's
        monitor forgets it when it closes: `_on_frontend_events`) is heard from now: its
        process lives.  A client presumed dead by silence alone would lose what it has
        in flight to a pause of its own (a blocking `Client` heartbeats only from inside
        its calls), and a process that died closed its connection."""
        sched = self.sched
        clients, workers = sched.quiet(now, quiet_for)  # both, cheap: a pass over the peers
        watches, kept = self._watches, {}
        for kind, idents, fd_of, seen in (
                ("c", clients if self._look_clients else (), self._client_conn.get, sched.client_seen),
                ("w", workers if self._look_workers else (), self._worker_conns.fd_of, sched.worker_seen)):
            for ident in idents:
                fd = fd_of(ident)
                if fd is None:
                    continue
                if kind == "c" and self._ipc_frontend:
                    if self._kept_conns.get(ident) != fd:
                        who = self._client_pids.get(ident)
                        if who is None or _fd_peer_pid(fd) != who[0]:
                            continue  # closed, or another process's now: its silence counts
                        self._kept_conns[ident] = fd
                    self._act(sched.client_kept(ident, now), now)
                    continue
                key = (kind, ident)
                watch = watches.get(key)
                if watch is None or watch.fd != fd:
                    watch = wire.TcpWatch()
                    watch.use(fd)
                kept[key] = watch
                if watch.look(now) >= now:
                    self._act(seen(ident, now), now)
        self._watches = kept  # only the peers still quiet: bounded by them

    def _on_http(self) -> None:
        """Answer the HTTP threads' questions (broker.http) with copies of the loop's state."""
        sock = self._http_loop
        while sock_events(sock) & _POLLIN:
            n, what, arg = sock.recv_pyobj()
            try:
                answer = self._http_answer(what, arg)
            except Exception:
                self._oops.exception("could not answer an HTTP question %r", what)
                answer = None
            self._http_link.answer(sock, n, answer)  # never waits for the HTTP side

    def _http_answer(self, what: str, arg: str):
        sched = self.sched
        if what == "live":
            return True
        if what == "ready":
            # Not while draining (SIGTERM to the launcher: new requests are refused then; to a
            # standalone broker: nothing new is dispatched), nor while a launcher starts its pools.
            return not sched.draining and not sched.holding and self.pools_ready and sched.live_services() > 0
        if what == "model_ready":
            if sched.draining or sched.holding:
                return "unavailable"
            if sched.has_service(arg):
                return "ready"
            return "unavailable" if arg in self._seen_services else "unknown"
        if what == "model":
            # A live service past the names' cap (1024: they bound the metrics' labels) is
            # still one: it was a 404 "unknown service" (the scale hunt).
            if arg not in self._seen_services and not sched.has_service(arg):
                return {}
            info = sched.service_info(arg) or {"queued": {"urgent": 0, "normal": 0, "background": 0},
                                               "in_flight": 0, "workers": []}
            workers, inputs, outputs = [], None, None
            for w in info["workers"]:
                _, pid, sig, _, outs, _ = self._worker_info.get(w["worker"], (arg, None, None, None, None, False))
                inputs = inputs or sig
                outputs = outputs or outs
                workers.append({"pid": pid, "host": w["host"], "transports": w["transports"],
                                "credit": w["credit"], "in_flight": w["in_flight"], "stopping": w["stopping"]})
            live = [w for w in workers if not w["stopping"]]  # (draining ones finish, take nothing new)
            return {
                "name": arg,
                # (as /v2/models/{name}/ready says: not while the broker drains or holds; the
                # HTTP audit found this true then)
                "ready": bool(live) and not (sched.draining or sched.holding),
                "platform": "zmq-infer",
                "workers": workers,
                "hosts": sorted({w["host"] for w in live if w["host"]}),
                "transports": sorted({t for w in live for t in w["transports"]}),
                "credit": sum(w["credit"] for w in live),
                "in_flight": info["in_flight"],
                "queue": info["queued"],
                "inputs": [{"name": k, "datatype": v[0], "shape": v[1]} for k, v in (inputs or {}).items()],
                "outputs": [{"name": k, "datatype": v[0], "shape": v[1]} for k, v in (outputs or {}).items()],
            }
        if what == "metrics":
            m = self.metrics
            snap = None
            if m is not None:
                snap = m.snapshot(alive=sched.has_worker)
            return snap, sched.stats(), list(m.known if m is not None else ())
        return None

    def _collect_shm(self) -> None:
        self._sweep_soon = False
        self._swept_at = time.monotonic()
        try:
            for name in self._reply_sweep.sweep():
                log.info("unlinked the reply socket of a dead client: %s", name)
        except Exception:  # never let housekeeping stop the broker
            self._gc_oops.exception("shared-memory garbage collection failed")

    def _drain(self, sock: zmq.Socket, handler) -> None:
        # Poll said a message is there; after it, ask EVENTS rather than catch zmq.Again
        # (an exception per wake-up is measurable at this rate).
        for _ in range(_DRAIN):
            try:
                frames = recv_frames(sock, 0, MAX_FRAMES if sock is self.frontend else MAX_WORKER_FRAMES)
            except TooManyFrames as e:
                try:
                    self._too_many_frames(sock, e)
                except Exception:  # the loop must survive any one message
                    self._oops.exception("unexpected error while dropping a message of too many frames")
                return  # (the loop's other work before this socket's next message: it took a while)
            try:
                handler(frames)
                if self._doomed:  # a client a direct answer (heartbeat, MMI, 400) found stalled
                    self._drop_doomed()
            except _LeftBehind:
                self._count_left_behind(frames)
                if self._doomed:  # (closes read on the way: `_client_pid`)
                    self._drop_doomed()
            except Exception:  # the loop must survive any one message
                self.malformed += 1
                self._oops.exception("unexpected error while handling a message; dropped it")
            if not sock_events(sock) & _POLLIN:
                return

    def _too_many_frames(self, sock: zmq.Socket, e: TooManyFrames) -> None:
        """A message of more frames than any of ours has, read and dropped whole
        (`wire.recv_frames`).  Its sender is cut off: a client as one that stopped reading
        (its requests dropped, its connection ended: each such message held the loop for
        about a microsecond a frame), a worker as one that failed (its requests go to the
        others)."""
        self.malformed += 1
        if sock is self.frontend:
            self._bad.warning("a client (%r) sent a message of %d frames (at most %d): dropped unread; its "
                              "requests dropped and its connection ended", e.ident[:16], e.frames, MAX_FRAMES)
            try:
                self._client_pid(e.ident, e.first)  # its connection, if its first message
            except _LeftBehind:  # (its connection has closed already)
                if self._doomed:
                    self._drop_doomed()
                return
            self._doomed[e.ident] = None
            self._end_connection(e.ident)
            self._drop_doomed()
        else:
            self._bad.warning("a worker (%r) sent a message of %d frames (at most %d): dropped unread; "
                              "disconnected", e.ident[:16], e.frames, MAX_WORKER_FRAMES)
            now = time.monotonic()
            if self.sched.has_worker(e.ident):
                self._act(self.sched.worker_disconnect(e.ident, now), now)
            self.send_to_worker([e.ident, *P.worker_disconnect()])

    # ------------------------------------------------------------------ clients

    def on_client(self, frames: list) -> None:
        """One message from the frontend: the client's identity, then its frames."""
        ident = frames[0].bytes
        now = time.monotonic()
        try:
            msg = P.parse_client(frames[1:])
        except P.ProtocolError as e:
            self.malformed += 1
            proto = _protocol_frame(frames)
            if proto in _WORKER_PROTOCOLS:
                self._bad.warning("a worker (%s) sent to the frontend %s: workers connect to the backend %s "
                                  "(python -m gpu_worker --broker %s)", proto.decode(), self.frontend_ep,
                                  self.backend_ep, self.backend_ep)
                return
            foreign = _foreign(frames)
            if foreign is not None:
                self._bad.warning("a client (%s) on %s sent %s", _Peer(frames[1], ident), self.frontend_ep,
                                  foreign)
                return
            if proto == P.MDPC and _command_frame(frames) == P.C_PARTIAL:
                e = P.ProtocolError(f"{e}: 0x02 is PARTIAL, which only a broker sends; a client's REQUEST "
                                    f"is 0x01 (RFC 18; majortomo's Client numbers client commands as worker ones)")
            self._bad.warning("malformed client message from %r: %s", ident[:16], e)
            return
        if ident[0] and sock_events(self._frontend_events) & _POLLIN:
            # A routing id the client chose may have been another connection's, even one on
            # the same descriptor number (`_client_pid` catches a different one).  libzmq
            # queues a connection's DISCONNECTED before it closes the descriptor, and attaches
            # a new connection under a taken id only once the old one's last message was read,
            # so that earlier connection's close is already here: apply it before trusting
            # what was learned under the id (its pid, its REQ-ness, its requests).  (libzmq's
            # own ids start with a zero byte and count up from a random start; a client that
            # names one of those could only guess it.)
            self._on_frontend_events()
            if self._doomed:  # that close ended the id's requests: before this message
                self._drop_doomed()
        closed = self._closed_clients
        if closed and ident in closed and msg.command not in _ENDINGS and self._from_closed(ident, frames[1]):
            # A message a closed connection left behind: nobody reads its answer.  (What
            # only ends work, a CANCEL, a DISCONNECT or a LEASE_END, is still applied: a
            # client that heartbeats is otherwise left to its liveness window.)
            if msg.command == P.C_REQUEST and self.metrics is not None and not msg.service.startswith(b"mmi."):
                self.metrics.final(msg.service.decode(errors="replace"), CLIENT_GONE, None, None, now)
            return
        if msg.leading_empty:
            self._req_clients.add(ident)
            try:
                if frames[1].get("Socket-Type") == "REQ":
                    self._req_sockets.add(ident)
            except (zmq.ZMQError, AttributeError, TypeError, ValueError):
                pass
            if _protocol_frame(frames) == P.MDPC01:
                self._v01_clients.add(ident)  # answered in MDP/0.1 from now on
            if ident not in self._client_conn and not (closed and ident in closed):
                # Its connection, learned: a REQ client never says DISCONNECT, so the
                # connection's close is when it is forgotten (`_on_frontend_events`).  (Not
                # for an ending left behind by a closed one: `_ENDINGS`.)
                self._client_pid(ident, frames[1])
        sched = self.sched
        cmd = msg.command
        if cmd == P.C_REQUEST:
            sched.client_seen(ident, now)
            if self._revoking and (key := self._key_removed(frames[1])):
                self._forbid(ident, msg, now, key)
                return
            self._on_request(ident, msg, now)
        elif cmd == P.C_HEARTBEAT:
            if self._look_clients and ident not in self._client_conn:
                self._client_pid(ident, frames[1])  # learns its connection, for `_look_at_quiet`
            self._act(sched.client_heartbeat(ident, now), now)
            route = None
            if msg.body and msg.body[0][0] & P.HB_ASK_ROUTE:
                # A name of the connection, and of the broker's record of the client on it,
                # not its identity: a keyed hash, so that what a client learns is "same or
                # not", not how many connections came before it.  A client presumed gone and
                # heard again (silent past its window: a program that did not call into a
                # blocking client, over tcp) gets a new record, so a new name: it sends what
                # it still waits for again, as after a new connection.
                epoch = sched.client_epoch(ident) or 0
                route = hashlib.blake2b(ident + epoch.to_bytes(8, "big"), digest_size=8, key=self._route_key).digest()
            self._send_client(ident, P.broker_heartbeat(self.instance, self._client_window_ms, route))
        elif cmd == P.C_CANCEL:
            sched.client_seen(ident, now)
            try:
                cancel = P.decode_cancel(msg.body[0])
            except P.ProtocolError as e:
                self.malformed += 1
                self._bad.warning("bad CANCEL from %r: %s", ident[:16], e)
                return
            self._act(sched.client_cancel(ident, cancel.id, now, cancel.queued_only, cancel.expired), now)
        elif cmd == P.C_DISCONNECT:
            self._forget_client(ident)
            self._act(sched.client_disconnect(ident, now), now)
        elif cmd == P.C_LEASE:
            if self._revoking and (key := self._key_removed(frames[1])):
                self._forbid(ident, msg, now, key)
                return
            self._on_lease(ident, msg, now)
        elif cmd == P.C_LEASE_END:
            sched.client_seen(ident, now)
            try:
                end = P.decode_lease_end(msg.body[0])
            except P.ProtocolError as e:
                self.malformed += 1
                self._bad.warning("bad LEASE_END from %r: %s", ident[:16], e)
                return
            self._act(sched.client_lease_end(ident, P.lease_number(end.lease), now), now)

    def _key_removed(self, frame: Any) -> str | None:
        """The CurveZMQ key (Z85) of a client message's tcp connection if that key has left
        the client allow-list since its handshake, else None."""
        try:
            uid = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            return None
        return uid if uid and not self._curve.allowed("frontend", uid) else None

    def _forbid(self, ident: bytes, msg: P.ClientMessage, now: float, key: str) -> None:
        """Refuse a REQUEST (MMI included) or LEASE of a client whose key was removed: 403.
        The line names the key, as the handshake's refusal does (the connection's routing id
        says nothing to whoever removed it: the ops audit)."""
        service = msg.service
        self._bad.warning("refused a %s from tcp client %r, key %s: its CurveZMQ key was removed from the "
                          "client allow-list", "LEASE" if msg.command == P.C_LEASE else "request", ident[:16], key)
        first = msg.body[0] if msg.body else b""
        rid = P.lenient_request_id(first) if first and P.is_header(first) else 0
        body = P.error_body(rid, P.ErrorCode.FORBIDDEN, _FORBIDDEN)
        if msg.command == P.C_LEASE:
            self._send_client(ident, P.client_leased(service, body))
            return
        if service.startswith(b"mmi."):
            self._mmi(ident, service, msg.body, b"403")
            return
        self._send_client(ident, P.client_reply(True, service, body))
        if self.metrics is not None:
            self.metrics.final(service.decode(errors="replace"), int(P.ErrorCode.FORBIDDEN), None, None, now)

    def _apply_revocations(self, now: float) -> None:
        """Keys left an allow-list (`security.ServerCurve`'s watcher): a handshake is checked
        once, so what a removed key's connection holds is ended here.  A client's leases end
        (its calls on them come back through the broker, refused); a worker is told why and
        forgotten, its requests going to the service's other workers as at its death.  From
        now on a client's REQUEST and LEASE (a client key removed), or a worker's READY (a
        worker key removed), are looked up."""
        removals = self._curve.removals
        while removals:
            role, keys = removals.popleft()
            if role == "frontend":
                self._revoking = True
                for key in keys:
                    self._act(self.sched.principal_revoked(f"curve:{key.decode()}", now, _FORBIDDEN), now)
                continue
            self._revoking_workers = True
            gone = {k.decode() for k in keys}
            for ident, uid in list(self._worker_keys.items()):
                if uid not in gone:
                    continue
                del self._worker_keys[ident]
                if not self.sched.has_worker(ident):
                    continue
                log.warning("disconnecting worker %r: its CurveZMQ key was removed from the worker allow-list",
                            ident[:16])
                self.send_to_worker([ident, *P.worker_disconnect(
                    P.error_body(0, P.ErrorCode.FORBIDDEN, _FORBIDDEN_WORKER))])
                self._act(self.sched.worker_disconnect(ident, now), now)

    def _on_lease(self, ident: bytes, msg: P.ClientMessage, now: float) -> None:
        """A client asks to be pinned to a worker (docs/protocol.md section 10): the scheduler
        places it; the grant carries what only the broker knows of the client (the kernel's
        pid of its connection, its principal) and a secret made here."""
        first = msg.body[0]
        service = msg.service
        try:
            ask = P.decode_lease_ask(first)
        except P.ProtocolError as e:
            self.malformed += 1
            self._bad.warning("bad LEASE from %r: %s", ident[:16], e)
            self._send_client(ident, P.client_leased(service, P.error_body(P.lenient_request_id(first), e.code, str(e))))
            return
        host, transports = ask.host, frozenset(ask.transports)
        remote = self._tcp_frontend and (self._tcp_only or security.peer_is_tcp(first, unknown=True))
        if remote:
            host, transports = None, frozenset({"inline"})  # as its requests: inline only
        who = self._client_pid(ident, first)
        pid, start = who if who is not None else (None, None)
        principal = self._principal(who) if pid is not None else self._tcp_principal(first, ident)  # see _client_request
        self._act(self.sched.client_lease(ident, principal, ask.id, service.decode(errors="replace"), now,
                                          slots=ask.slots, host=host, transports=transports,
                                          secret=secrets.token_bytes(16), pid=pid, start=start,
                                          remote=remote), now)

    def _forget_client(self, ident: bytes) -> None:
        self._drop_unread(ident)
        self._kept_conns.pop(ident, None)
        self._client_pids.pop(ident, None)
        self._client_tcp.pop(ident, None)
        self._client_keys.pop(ident, None)
        self._client_conn.pop(ident, None)
        self._req_clients.discard(ident)
        self._req_sockets.discard(ident)
        self._v01_clients.discard(ident)

    def _on_request(self, ident: bytes, msg: P.ClientMessage, now: float) -> None:
        service = msg.service
        body = msg.body
        if service.startswith(b"mmi."):
            self._mmi(ident, service, body)
            return
        first = body[0]
        if P.is_header(first):
            rest = body[1:]
            try:
                # `meta` left as bytes: only the model reads it (P.RoutedRequest).
                req = P.decode_request(first, frames=rest, routed=True)
            except P.ProtocolError as e:
                self.malformed += 1
                rid = P.lenient_request_id(first)
                self._bad.warning("bad request header from %r: %s", ident[:16], e)
                self._send_client(ident, P.client_reply(True, service, P.error_body(rid, e.code, str(e))))
                if self.metrics is not None:
                    self.metrics.final(service.decode(errors="replace"), int(e.code), None, None, now)
                return
            if self._tcp_frontend:
                tcp = True if self._tcp_only else self._client_tcp.get(ident)
                if tcp is None:  # learned once per client, as its pid is; bounded the same way
                    if len(self._client_tcp) >= _MAX_CLIENT_PIDS:
                        self._client_tcp.clear()
                    tcp = security.peer_is_tcp(first, unknown=None)
                    if tcp is None:  # cannot tell now (out of descriptors): tcp, not remembered
                        tcp = True
                    else:
                        self._client_tcp[ident] = tcp
                if tcp and security.names_local_memory(req):
                    self._bad.warning("refused a request from tcp client %r: %s", ident[:16], security.TCP_REFS)
                    self._send_client(ident, P.client_reply(True, service, P.error_body(
                        req.id, P.ErrorCode.PROTOCOL_ERROR, security.TCP_REFS)))
                    if self.metrics is not None:
                        self.metrics.final(service.decode(errors="replace"), int(P.ErrorCode.PROTOCOL_ERROR),
                                           None, None, now)
                    return
                if tcp:
                    # A worker on the client's host would answer a same-host client through
                    # its output ring; a tcp client gets its outputs inline, like its inputs.
                    req.host = None
            # Workers reclaim a dead client's output slots by this pid, so it is never the
            # header's claim (a client could name another's pid and pin slots for good): for
            # an ipc client the kernel says whose connection it is; over tcp nobody can, and
            # such a client gets its outputs inline.
            who = self._client_pid(ident, first)
            if who is None:
                req.pid = pid = req.pid_start = None
            else:
                req.pid, req.pid_start = pid, _ = who
            if self._log_debug:
                log.debug("request received", extra={**logs.tensor_fields(req), "service": service.decode(errors="replace"),
                                                     "priority": req.priority, "timeout_ms": req.timeout_ms})
            local = None
            if req.host is not None:
                for t in req.tensors:
                    kind = type(t.loc)
                    if kind is P.CudaLoc:
                        local = cuda_key(req.host)  # needs a worker that maps CUDA IPC
                        break
                    if kind is P.ShmLoc:
                        local = req.host
            deadline = None if req.timeout_ms is None else now + req.timeout_ms / 1000.0
            at = req.deadline_at
            if at is not None and deadline is not None and at < deadline and who is not None and self._on_our_clock(who):
                # A client on our clock: its deadline as it is, not its budget again from our
                # receipt, which came late when this loop was stalled (a request that waited
                # in our input past its deadline ran for a caller long gone: the timeouts hunt).
                deadline = at
            if req.dropped and self.metrics is not None:
                self.metrics.dropped(service.decode(errors="replace"), req.dropped)
            # A long header counts too (it may fill its 1 MiB, and the broker keeps it: `meta`
            # is a view of it); short ones are bounded by the request count, and the usual
            # shared-memory request counts nothing (no byte bookkeeping).
            size = (len(first) if len(first) > _SHORT_HEADER else 0) + (_nbytes(rest) if rest else 0)
            if size >= _TRACK_BYTES:
                self._burst.moved += size
            actions = self.sched.client_request(
                ident,
                req.id,
                service.decode(errors="replace"),
                now,
                payload=_Payload(req, rest),
                priority=req.priority,
                deadline=deadline,
                local_host=local,
                size=size,
                # The process, not its pid alone: (pid, start time), so that a new process
                # that reuses a pid is not counted as the old one (its caps, its remembered
                # turns: broker/state.py "Connections and principals").
                principal=self._principal(who) if pid is not None else self._tcp_principal(first, ident),
                stream=req.dropped is not None,
            )
        else:
            # A plain MDP/0.2 request: opaque body, relayed as is.  Its id lives in a
            # namespace (negative numbers) that no client id can collide with.
            self._opaque_ids += 1
            who = self._client_pid(ident, first)
            pid = None if who is None else who[0]
            actions = self.sched.client_request(
                ident, -self._opaque_ids, service.decode(errors="replace"), now, payload=_Payload(None, body),
                size=_nbytes(body), principal=self._principal(who) if pid is not None else self._tcp_principal(first, ident),
            )
        self._act(actions, now)

    def _principal(self, who: tuple) -> tuple:
        """The principal of an attested ipc client, its process: (pid, start time), the start
        last read for that pid where this connection's could not be (out of descriptors: one
        process, one share; `who` itself keeps None, which the worker's ownership checks
        take as unknown)."""
        if who[1] is None:
            start = self._pid_starts.get(who[0])
            if start is not None:
                return (who[0], start)
        return who

    def _tcp_principal(self, frame: Any, ident: bytes) -> str | None:
        """Whom the caps and the round-robin count a tcp client as: its CurveZMQ key (the
        ZAP User-Id), whichever connection it uses.  None (the connection is its own
        principal) without CURVE, or when the frame says nothing.  Kept for ``ident``
        (`_conn_principal`)."""
        if not self._tcp_frontend:
            return None
        try:
            uid = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            return None
        if not uid:
            return None
        p = f"curve:{uid}"
        keys = self._client_keys
        if keys.get(ident) != p:
            if len(keys) >= _MAX_CLIENT_PIDS:  # bounded as the pids are
                keys.clear()
            keys[ident] = p
        return p

    def _conn_principal(self, ident: bytes) -> object:
        """Whom client connection ``ident`` counts as, as its requests do: its attested
        process, its CurveZMQ key, or None (the connection is its own principal)."""
        who = self._client_pids.get(ident)
        if who is not None:
            return self._principal(who)
        return self._client_keys.get(ident)

    def _mmi(self, ident: bytes, service: bytes, body: tuple, code: bytes | None = None) -> None:
        """Answer an MMI question (RFC 8); ``code``: the answer decided already (403)."""
        if code is None and service == b"mmi.service":
            try:
                name = bytes(body[0]).decode()
            except UnicodeDecodeError:  # (no service is named so: names are UTF-8)
                name = None
            code = b"200" if name is not None and self.sched.has_service(name) else b"404"
        elif code is None:
            code = b"501"
        # A second frame of up to 64 bytes is the asker's correlation token: echoed after the
        # code (docs/protocol.md section 4), so answers cannot be mistaken for one another.
        token = [bytes(body[1])] if len(body) == 2 and len(body[1]) <= P.MAX_MMI_TOKEN else []
        self._send_client(ident, P.client_reply(True, service, [code, *token]))

    # The two send seams: every frame the broker sends leaves through one of these (the
    # hot-path bench replaces them to time the broker's own work without sockets).
    def send_to_client(self, frames: list) -> None:
        """Send one message on the frontend; `frames` start with the client's identity.
        Never blocks: `zmq.Again` when the client's queue is full (it stopped reading),
        EHOSTUNREACH when the client is gone."""
        send_frames(self.frontend, frames, _NOBLOCK)

    def send_to_worker(self, frames: list) -> None:
        """Send one message on the backend; `frames` start with the worker's identity (and
        the empty delimiter goes after it to a worker that sends one)."""
        if self._delimited and frames[0] in self._delimited:
            if frames[0] in self._v01_workers:
                frames = P.to_worker01(frames)
                if frames is None:  # a command MDP/0.1 does not have (CANCEL)
                    return
            else:
                frames = [frames[0], b"", *frames[1:]]
        send_frames(self.backend, frames)

    def _send_client(self, ident: bytes, frames: list) -> bool:
        """`frames` start at MDPC02; the identity (and a REQ client's delimiter) go first.
        False: nothing went (the client's connection is gone, or being dropped)."""
        doomed = self._doomed
        if doomed and ident in doomed:
            return False  # being dropped: nothing more goes to it
        if ident in self._req_clients:
            if ident in self._v01_clients:
                # An MDP/0.1 client: its one reply, the FINAL, from the empty frame on (so the
                # body starts at frame 3 here too); nothing else goes to it.
                frames = P.to_client01(frames)
                if frames is None:
                    return True
                head = [ident]
            else:
                if frames[1] == P.C_PARTIAL and ident in self._req_sockets:
                    # A REQ socket takes one reply per request, and takes the first that comes
                    # after its next send for that one's: a stream's later PARTIALs answered
                    # its next request, one reply out of step for good (the interop audit).
                    # It gets the FINAL only, as an MDP/0.1 client does.  (A DEALER that
                    # leads with the delimiter, majortomo's client, reads them all.)
                    return True
                head = [ident, b""]
        else:
            head = [ident]
        tracked = None
        last = len(frames)
        if last > 4 or (last == 4 and len(frames[3]) >= _TRACK_BYTES):
            # (MDPC02, the command and the service are short, and so is the one frame after
            # them of most messages: a reply header, a heartbeat's window.)
            for i in range(3, last):
                f = frames[i]
                n = len(f)
                if n >= _TRACK_BYTES:
                    # Sent through a tracked, zero-copy wrapper: we learn when libzmq let it go.
                    if tracked is None:
                        frames = list(frames)
                        tracked = []
                    t = zmq.Frame(f.buffer if type(f) is zmq.Frame else f, copy=False, track=True)
                    frames[i] = t
                    tracked.append((t.tracker, n))
        try:
            self.send_to_client(head + frames)
        except zmq.Again:
            # client_hwm messages wait for it already: it does not read what it asked for.
            self._stalled(ident, f"{self._client_hwm} replies waiting")
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                # A client that went away: nothing to deliver to, and nothing wrong (a client
                # closes right after its last heartbeat's answer was sent: the metrics hunt
                # saw WARNINGs from clients that closed normally).
                log.debug("client %r is gone: dropped a message to it", ident[:16])
            else:
                self._bad.warning("could not send to client %r: %s", ident[:16], e)
            doomed[ident] = None
            return False
        if tracked is not None:
            self._track_unread(ident, tracked)
        return True

    def _track_unread(self, ident: bytes, tracked: list) -> None:
        """Big frames just sent to ``ident`` (their trackers, their sizes): what libzmq still
        holds of its replies is the frames whose tracker is not done (libzmq lets a frame go
        once it has written all of it to the connection), and a client that holds more than
        its byte cap there is not reading them.  libzmq bounds a peer's queue in messages
        only: 100 unread inline replies of 16 MiB held 1.6 GB within the default 4096 (the
        resource hunt).  A client is taken for one that stopped reading only when what it had
        been sent before is over its cap and none of it went since the previous look: a
        client that reads keeps its trackers finishing, however much it pulls at once (one
        reply over its cap, several in flight over it: found by review)."""
        now = time.monotonic()
        u = self._unread.get(ident)
        if u is None:
            u = self._unread[ident] = _Unread(self._conn_principal(ident), now, self._unread_all)
            if u.principal is not None:
                self._unread_by.setdefault(u.principal, set()).add(ident)
        u.settle(now)
        went = u.went_at > u.looked_at  # since its own previous look, whoever settled it since
        u.looked_at = now
        held = u.total  # of what was sent before this message
        u.add(tracked, now)
        self._burst.moved += u.total - held
        if held > self._max_unread and not went:
            self._stalled(ident, f"{held >> 20} MiB of replies unread")
        elif u.principal is not None and len(self._unread_by[u.principal]) > 1:
            self._principal_unread(u.principal, ident, held, now)
        cap = self._max_unread_all
        if cap is not None and self._unread_all[0] > cap and now - self._unread_look >= _UNREAD_LOOK_S:
            self._all_unread(now, cap)

    def _all_unread(self, now: float, cap: int) -> None:
        """What all clients have waiting unread is over the broker-wide cap
        (`BrokerConfig.max_unread_bytes`): the reader holding the most of those that libzmq
        let no frame of go for a while (`_Unread.quiet_for`: a second, longer for a big frame)
        is dropped as one that stopped reading, and
        the next, until it is under; past twice the cap, the one holding the most whatever, of
        several (a slow reader is dropped rather than the broker killed by its cgroup: its SDK sends
        its calls again on a new connection).  A client that reads lets its frames go as it
        reads them (one frame at a time: a reader of one huge frame looks quiet for as long
        as it takes, hence the hard line at twice the cap)."""
        self._unread_look = now
        unread, doomed = self._unread, self._doomed
        for o in unread.values():
            o.settle(now)
        while True:
            # (again after each drop: ending a connection reads the frontend's events, which
            # may forget other connections' entries)
            live = [(o.total, ident) for ident, o in unread.items() if ident not in doomed and o.total]
            total = sum(c[0] for c in live)
            if total <= cap:
                return
            quiet = [c for c in live if now - unread[c[1]].went_at >= unread[c[1]].quiet_for()]
            # (one client alone is bounded by its own cap: the hard line is for several)
            pick = max(quiet) if quiet else max(live) if len(live) > 1 and total > 2 * cap else None
            if pick is None:
                return
            held, ident = pick
            self._stalled(ident, f"{held >> 20} MiB of replies unread, {total >> 20} MiB for all clients together "
                                 f"(the broker's --max-unread-mb: {cap >> 20})")

    def _principal_unread(self, principal: object, ident: bytes | None, held: int, now: float) -> None:
        """The cap is the principal's, whichever connections it reads on: one that opened N
        connections and read none of them held N caps' worth in the broker (the security
        audit).  Over it, of the principal's connections that libzmq has let no frame of go
        for the client liveness window, the one holding the most is taken for one that
        stopped reading.  (A window, not the previous look: a connection that reads one
        large frame lets it go only once it is all written, and its siblings' sends look
        often; found by review.)  ``ident``: the connection being sent to, ``held`` what it
        held before (None: the once-a-second look)."""
        total, worst, most = 0, None, 0
        unread, doomed = self._unread, self._doomed
        quiet = self.sched.client_window
        for other in list(self._unread_by[principal]):
            if other in doomed:
                continue  # being dropped: what it holds goes with it
            o = unread[other]
            if other == ident:
                n = held
            else:
                o.settle(now)
                n = o.total
            total += n
            if n > most and now - o.went_at >= quiet:
                worst, most = other, n
        if total > self._max_unread and worst is not None:
            self._stalled(worst, f"{most >> 20} MiB of replies unread, {total >> 20} MiB on all the connections of "
                                 f"its principal")

    def _stalled(self, ident: bytes, why: str) -> None:
        """``ident`` does not read what it asked for.  Drop it as if it had disconnected
        (its queued requests go, its running ones are cancelled at their workers), so that
        nobody else waits behind it, and close its connection, so that what waits for it in
        libzmq's queue (replies it will never read) is freed: libzmq keeps a connected
        peer's queue until the connection ends.  Were it to read again, it finds its
        calls unanswered (and our SDK, a new connection: it sends them again)."""
        self.stalled_clients += 1
        self._stall_log.warning("client %r stopped reading its replies (%s); dropped its requests and its "
                                "connection", ident[:16], why)
        self._doomed[ident] = None
        self._end_connection(ident)
        # What its queue held (up to its byte cap of replies, in big frames) stays with glibc
        # once libzmq's I/O thread frees it, 62 MiB of 64 once for good (CI): trimmed in the
        # next two rounds (the I/O thread frees it after it sees the connection end, most often
        # before the first).
        self._trim_rounds = 2

    def _end_connection(self, ident: bytes) -> None:
        """Shut down the connection ``ident`` came on.  libzmq owns the descriptor (and
        closes it): only the connection is ended, through a copy of the descriptor, and its
        engine, seeing that, frees its queue.  The number may be another connection's by
        then (libzmq's I/O thread closes and accepts on its own): a close queued is applied
        first and again once the copy is made, and on ipc the copy's peer must be the
        process attested for ``ident``; in doubt, nothing is shut down."""
        if sock_events(self._frontend_events) & _POLLIN:
            self._on_frontend_events()
        fd = self._client_conn.get(ident)
        if fd is None:
            return
        conn = wire.dup_socket(fd)  # (None: closed, or a file's by now: no copy left open)
        if conn is None:
            return
        with conn:
            if sock_events(self._frontend_events) & _POLLIN:
                self._on_frontend_events()
                if self._client_conn.get(ident) != fd:
                    return
            who = self._client_pids.get(ident)
            try:
                if who is not None and conn.family == socket.AF_UNIX:
                    pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                    if pid != who[0]:
                        return
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _send_late(self, ident: bytes, frames: list) -> None:
        """A late reply (LateToClient): to a client still there and reading; one gone, or
        not reading, is not worth a warning or a drop (it was answered already).  Never to
        a REQ socket (it would take it for the answer to its next request)."""
        if ident in self._doomed:
            return
        try:
            self.send_to_client([ident, *frames])
        except zmq.ZMQError:  # Again (not reading), EHOSTUNREACH (gone)
            pass

    def _drop_doomed(self) -> None:
        """Drop the clients a send found stalled or gone.  Run after the actions being sent
        (never in the middle of them: a CANCEL must not overtake the REQUEST it cancels)."""
        if self._dropping:
            return  # the outer call's loop takes whoever was added meanwhile
        self._dropping = True
        try:
            self._drop_doomed_loop()
        finally:
            self._dropping = False

    def _drop_doomed_loop(self) -> None:
        doomed = self._doomed
        while doomed:
            ident = next(iter(doomed))
            self._forget_client(ident)
            now = time.monotonic()
            actions = self.sched.client_disconnect(ident, now)
            del doomed[ident]
            self._act(actions, now)

    # ------------------------------------------------------------------ workers

    def on_worker(self, frames: list) -> None:
        """One message from the backend: the worker's identity, then its frames."""
        ident = frames[0].bytes
        now = time.monotonic()
        sched = self.sched
        if len(frames) > 1 and not len(frames[1]):
            self._delimit(ident)
            v01 = _protocol_frame(frames) == P.MDPW01
            if (v01 or ident in self._v01_workers) and not self._framing01(ident, v01, frames, now):
                return
        elif self._delimited:
            if ident in self._v01_workers and not self._framing01(ident, False, frames, now):
                return
            self._delimited.discard(ident)
        try:
            msg = P.parse_worker(frames[1:])
        except P.ProtocolError as e:
            self.malformed += 1
            proto = _protocol_frame(frames)
            if proto in _CLIENT_PROTOCOLS:
                self._bad.warning("a client (%s) sent to the backend %s: clients connect to the frontend %s",
                                  proto.decode(), self.backend_ep, self.frontend_ep)
                return
            foreign = _foreign(frames)
            if foreign is not None:
                # Not even a DISCONNECT, which such a worker could not read (RFC 18: drop
                # invalid messages).
                self._bad.warning("a worker (%s) on %s sent %s", _Peer(frames[1], ident), self.backend_ep,
                                  foreign)
                return
            if _command_frame(frames) == P.W_READY:
                self._refuse_ready(ident, frames[1], str(e), now)
                return
            self._bad.warning("malformed worker message from %r: %s", ident[:16], e)
            if sched.has_worker(ident):
                sched.worker_seen(ident, now)
            else:
                self._tell_unknown(ident, now)  # DISCONNECT: reconnect, READY again
            return
        cmd = msg.command
        if (cmd != P.W_HEARTBEAT and cmd != P.W_READY and cmd != P.W_DISCONNECT
                and not sched.has_worker(ident)):
            # MDP: a worker the broker does not know (presumed dead, or the broker restarted)
            # is told to reconnect and send READY.  Its replies go on to the scheduler,
            # which drops them (counted as dropped_late); anything else is dropped here.
            self._tell_unknown(ident, now)
            if cmd != P.W_FINAL and cmd != P.W_PARTIAL and cmd != P.W_DONE:
                return
        if cmd == P.W_FINAL or cmd == P.W_PARTIAL:
            token = P.envelope_token(msg.envelope)
            if token is None:
                self._bad.warning("worker %r replied with an envelope that is not ours", ident[:16])
                sched.worker_seen(ident, now)
                return
            if cmd == P.W_FINAL:
                body = msg.body
                code = (P.reply_error_code(body[0]) if body and (self.metrics is not None or (
                    self._outcomes and P.may_be_error(body[0]))) else 0)
                actions = sched.worker_final(ident, token, now, msg.body, code)
            else:
                actions = sched.worker_partial(ident, token, now, msg.body)
            self._act(actions, now)
        elif cmd == P.W_DONE:
            tokens = []
            info = None
            if msg.info is not None and (self.metrics is not None or self._outcomes):
                try:
                    info = P.decode_done_info(msg.info, len(msg.body))
                except P.ProtocolError as e:
                    self._bad.warning("worker %r sent a DONE whose outcomes do not parse (%s); counted as results",
                                      ident[:16], e)
            codes = ages = None
            if info is not None:
                codes, ages = [], []
            undelivered = None
            for i, env in enumerate(msg.body):
                token = P.envelope_token(env)
                if token is None:
                    self._bad.warning("worker %r sent DONE with an envelope that is not ours", ident[:16])
                elif not self._may_reply_direct(ident, sched.held_payload(ident, token)):
                    if undelivered is None:
                        undelivered = []
                    undelivered.append(token)
                else:
                    tokens.append(token)
                    if info is not None:
                        c = int(info.codes[i])
                        codes.append(c if c >= 0 else 1 << 20)  # negatives are the broker's own (client_gone)
                        age = info.ages_ms[i]
                        ages.append(age / 1000.0 if math.isfinite(age) and 0.0 <= age < 3.6e6 else 0.0)
            self._act(sched.worker_done(ident, tokens, now, codes, ages), now)
            if undelivered:
                self._undelivered(ident, undelivered, now)
        elif cmd == P.W_STATS:
            sched.worker_seen(ident, now)
            known = self._worker_info.get(ident)
            if self.metrics is not None and known is not None:
                label = f"{known[1]}@{known[3] or '-'}"  # pid@host: pids repeat across pods
                if not self.metrics.worker_stats(ident, known[0], label, msg.info):
                    self._bad.warning("worker %r sent STATS that do not add up; ignored", ident[:16])
        elif cmd == P.W_RETURNED:
            tokens = [t for t in map(P.envelope_token, msg.body) if t is not None]
            kept = [t for t in map(P.envelope_token, msg.info) if t is not None]
            self._act(sched.worker_returned(ident, tokens, now, kept), now)
        elif cmd == P.W_LEASED:
            sched.worker_seen(ident, now)
            why = ""
            if msg.info is not None:
                try:
                    err = P.decode_reply(msg.info).error
                    why = err.message if err is not None else ""
                except P.ProtocolError:
                    why = "(an unreadable reason)"
            self._act(sched.worker_leased(ident, P.lease_number(msg.envelope), now, ok=msg.info is None,
                                          message=why), now)
        elif cmd == P.W_LEASE_END:
            sched.worker_seen(ident, now)
            try:
                end = P.decode_lease_end(msg.info)
                if end.lease != msg.envelope:
                    raise P.ProtocolError("its header names another lease than its id frame")
            except P.ProtocolError as e:
                self.malformed += 1
                self._bad.warning("bad LEASE_END from worker %r: %s", ident[:16], e)
                return
            self._act(sched.worker_lease_end(ident, P.lease_number(msg.envelope), now, reason=end.reason), now)
        elif cmd == P.W_HEARTBEAT:
            self._act(sched.worker_seen(ident, now), now)
        elif cmd == P.W_BUSY:
            self._act(sched.worker_busy(ident, msg.info, now), now)
        elif cmd == P.W_STOPPING:
            info = self._worker_info.get(ident)
            log.info("worker %s is stopping (draining): nothing new goes to it",
                     f"pid {info[1]}" if info is not None and info[1] is not None else repr(ident[:16]))
            self._act(sched.worker_stopping(ident, now), now)
        elif cmd == P.W_READY:
            # Connection events first: libzmq queues a connection's DISCONNECTED before it
            # closes the descriptor, so an event for an earlier holder of this READY's
            # descriptor is already waiting and must be applied before the new binding.
            self._on_backend_events()
            if self._curve_backend:
                try:
                    uid = frames[1].get("User-Id")
                except (zmq.ZMQError, AttributeError, TypeError, ValueError):
                    uid = None
                if uid:
                    if self._revoking_workers and not self._curve.allowed("backend", uid):
                        self._refuse_ready(ident, frames[1], _FORBIDDEN_WORKER, now)
                        return
                    if len(self._worker_keys) >= _MAX_CLIENT_PIDS:
                        self._worker_keys = {w: k for w, k in self._worker_keys.items() if sched.has_worker(w)}
                    self._worker_keys[ident] = uid
            self._bind_connection(ident, frames[1], now)
            r = msg.ready
            if r is None:  # a plain MDP worker: it may be silent while it runs a request
                actions = sched.worker_ready(ident, msg.service.decode(errors="replace"), now, quiet_busy=True)
                if not any(type(a) is DisconnectWorker and a.worker == ident for a in actions):
                    self._note_worker(ident, msg.service.decode(errors="replace"), None, frames[1])
            else:
                actions = sched.worker_ready(
                    ident,
                    msg.service.decode(errors="replace"),
                    now,
                    credit=r.credit,
                    host=r.host,
                    transports=frozenset(r.transports),
                    recall=r.recall,
                    direct=r.direct,
                    link=r.link,
                    direct_key=r.direct_key,
                )
                refused = any(type(a) is DisconnectWorker and a.worker == ident for a in actions)
                if not refused:
                    self._note_worker(ident, msg.service.decode(errors="replace"), r, frames[1])
                if r.welcome and not refused:
                    # Registered: say so, with this process's instance and the liveness
                    # settings both sides must use (one place configures them: here).
                    self.send_to_worker(P.to_worker_welcome(ident, self._welcome))
            self._act(actions, now)
        elif cmd == P.W_DISCONNECT:  # said goodbye: it finished what it held
            known = self._worker_info.get(ident)
            if (known is not None and known[1] is not None and (known[5] or known[3] == self._here)
                    and sched.has_worker(ident) and len(self._leaving) < _MAX_CLIENT_PIDS):
                self._leaving[known[1]] = now  # for a launcher: it leaves on its own, not hung
            self._act(sched.worker_disconnect(ident, now, failed=False), now)

    def _framing01(self, ident: bytes, v01: bool, frames: list, now: float) -> bool:
        """The framing ``ident`` speaks, MDP/0.1 (``v01``, this message's) or MDP/0.2: kept in
        `_v01_workers` for what the broker sends it.  A registered worker's is the one it
        registered in: a message in the other framing is dropped (False), never read, for
        0.1's REPLY and HEARTBEAT are 0.2's PARTIAL and FINAL (docs/protocol.md section
        12.1).  An unknown worker's follows its latest message, so that the DISCONNECT or
        the refusal that answers it is one it can read."""
        workers = self._v01_workers
        if v01 == (ident in workers):
            return True
        if self.sched.has_worker(ident):
            self.malformed += 1
            self._bad.warning("worker %s registered in MDP/%s and sent an MDP/%s message; dropped it",
                              _Peer(frames[1], ident), "0.2" if v01 else "0.1", "0.1" if v01 else "0.2")
            self.sched.worker_seen(ident, now)
            return False
        if v01:
            workers.add(ident)  # bounded: a subset of `_delimited` (`_delimit` prunes both)
        else:
            workers.discard(ident)
        return True

    def _delimit(self, ident: bytes) -> None:
        """``ident`` leads its messages with an empty frame: so do ours to it.  RFC 18 took
        that frame out of MDP/0.2 ("removal of empty frames at start of commands"), but a
        worker that kept it (majortomo 0.2.0, whose worker.py sends and expects it on every
        command) reads nothing without it: it registered, and dropped each REQUEST and
        HEARTBEAT as malformed, a black hole for its service's requests."""
        delimited = self._delimited
        if ident not in delimited:
            if len(delimited) >= _MAX_CLIENT_PIDS:
                self._delimited = delimited = {w for w in delimited if self.sched.has_worker(w)}
                self._v01_workers &= delimited
            delimited.add(ident)

    def _tell_unknown(self, ident: bytes, now: float) -> None:
        """DISCONNECT to a worker the broker does not know (MDP: reconnect and send READY),
        at most once a heartbeat interval per identity: a worker presumed dead after a
        stall sends the replies it held all at once, and one DISCONNECT says it all."""
        if self._once_an_interval(self._told_unknown, ident, now):
            self.send_to_worker([ident, *P.worker_disconnect()])

    def _refuse_ready(self, ident: bytes, frame: Any, why: str, now: float) -> None:
        """A READY the broker cannot take: told why (DISCONNECT with the reason), so that a
        worker of ours stops (exit 2) instead of registering again, refused each time.

        At most once a heartbeat interval per peer (its process on ipc, its address over
        tcp): a worker that takes the DISCONNECT for a plain one (a plain MDP worker, or
        ours from before the reason was sent) reconnects at once, and answering each READY
        made a loop of thousands a second that took half a core of the broker (found by the
        version-skew hunt).  A READY inside the interval is dropped unanswered, as brokers
        before did: the worker's next heartbeat is refused as an unknown worker's, at its
        own pace."""
        self._bad.warning("refused a READY from worker %r: %s", ident[:16], why)
        if self._once_an_interval(self._refused_at, _peer_key(frame, ident), now):
            self.send_to_worker([ident, *P.worker_disconnect(
                P.error_body(0, P.ErrorCode.PROTOCOL_ERROR, f"READY refused: {why}"))])

    def _once_an_interval(self, last_at: dict, key: object, now: float) -> bool:
        """Whether ``key`` may be answered now: not within a heartbeat interval of the last
        time (``last_at``, bounded: cleared when full), which becomes now."""
        last = last_at.get(key)
        if last is not None and now - last < self.cfg.scheduler.heartbeat_interval:
            return False
        if len(last_at) >= _MAX_CLIENT_PIDS:
            last_at.clear()
        last_at[key] = now
        return True

    def _note_worker(self, ident: bytes, service: str, ready, frame: Any = None) -> None:
        """What the HTTP endpoint and the metrics say about a worker: its service (now a
        known name: 503, not 404, once it has no worker), pid, declared inputs and outputs.
        The pid is the kernel's word for the connection ``frame`` came on where it has one
        (ipc), else the READY's claim."""
        now = time.monotonic()
        self._seen_services.add(service, now)
        if self.metrics is not None:
            self.metrics.register(service, now)
        if service not in self._seen_services or (self.metrics is not None and service not in self.metrics.known):
            self._unlabelled.add(service)  # no room for its name now: taken once there is (`_prune_workers`)
        if len(self._worker_info) >= _MAX_CLIENT_PIDS:
            live = {w: v for w, v in self._worker_info.items() if self.sched.has_worker(w)}
            self._worker_info = live
        attested = None if frame is None else _peer_pid(frame)
        pid = attested if attested is not None else None if ready is None else ready.pid
        if ready is not None and (ready.inputs or ready.outputs):
            self._check_signature(ident, service, pid, ready)
        self._worker_info[ident] = (service, pid, None if ready is None else ready.inputs,
                                    None if ready is None else ready.host,
                                    None if ready is None else ready.outputs, attested is not None)

    def _check_signature(self, ident: bytes, service: str, pid, ready) -> None:
        """Warn (once per pair of signatures in a service) when a worker registers for a
        service whose live workers declared other inputs or outputs: its clients get one
        model or the other, whichever worker takes each request (two pools of one service
        with different models; expected for the length of a rolling upgrade that changes
        the model's signature).  O(the service's workers) per READY: it looked at every
        worker's, and a restart's storm of READYs was quadratic (the scale hunt: 8000
        workers of as many services took 1.6 s of the loop, 0.2 ms the last READYs)."""
        mine = (_signature(ready.inputs), _signature(ready.outputs))
        info = self._worker_info
        for w in self.sched.workers_of(service):
            v = info.get(w)
            if w == ident or v is None or v[0] != service or not (v[2] or v[4]):
                continue
            theirs = (_signature(v[2]), _signature(v[4]))
            if theirs == mine:
                return  # like a live worker's: any mismatch was said when it came
            key = (service, mine, theirs)
            if key not in self._sig_warned and len(self._sig_warned) < _MAX_SERVICES:
                self._sig_warned.add(key)
                log.warning("a worker (pid %s) registered for '%s' declaring inputs %s and outputs %s, unlike "
                            "a live worker of it (pid %s: inputs %s, outputs %s): each request of '%s' goes to "
                            "one or the other (expected only while a rolling upgrade changes the model)",
                            pid, service, _show_sig(ready.inputs), _show_sig(ready.outputs), v[1],
                            _show_sig(v[2]), _show_sig(v[4]), service)
            return

    def _on_our_clock(self, who: tuple) -> bool:
        """Whether the client process ``who`` ((pid, start time), `_client_pid`'s) reads our
        CLOCK_MONOTONIC (learned once per process)."""
        return self._clock_peers.same(*who)

    def _client_pid(self, ident: bytes, frame: Any) -> tuple | None:
        """(pid, start time) of the process that made this client's ipc connection (learned
        once per client; start None where it cannot be read), or None when the kernel cannot
        say (tcp, another pid namespace) or that process has exited (`_fd_peer`)."""
        who = self._client_pids.get(ident, -1)
        learned = self._client_conn.get(ident, -1)
        fd = None
        if who == -1 or learned is not None:  # None: learned from a frame without a descriptor
            try:
                fd = frame.get(zmq.SRCFD)  # 0.1 us: the connection this message came on
            except (zmq.ZMQError, AttributeError):
                fd = None
            if who != -1 and learned != fd:
                who = -1  # the identity arrives on another connection now: learn it afresh
        if who == -1:
            if fd is not None and sock_events(self._frontend_events) & _POLLIN:
                # The events queued are applied before the identity is filed under `fd`:
                # its EVENT_ACCEPTED (when it was accepted), and the close of an earlier
                # connection on the same number.  libzmq queues that close before it closes
                # the descriptor, so before any later connection on it can send: unread, it
                # would be taken for this connection's and end this client's requests (a
                # fresh client's request, read before the close of the connection whose
                # number it got, was never answered).
                self._on_frontend_events()
            if not ident[0] and ident in self._closed_clients:
                # Its connection's close was among those events: what it sent is left behind,
                # whoever has the number now (its own process again, after a drop, included).
                self._left_behind(ident)
                raise _LeftBehind
            # (On a tcp frontend no client connection is a unix socket: one found under the
            # number is another connection's, a worker's, by reuse.)
            who = None if fd is None or self._tcp_frontend else _fd_peer(fd, self._accept_ticks.get(fd))
            if who is not None:
                said = _said_pid(frame)
                if said is not None and said != who[0]:
                    # The number is another process's connection now: this message came on
                    # one that closed (`_said_pid`).  Nothing is learned from it.
                    self._left_behind(ident)
                    raise _LeftBehind
                self._on_our_clock(who)  # while the process is there to ask (a request may outlive it)
                if who[1] is not None:
                    self._pid_starts[who[0]] = who[1]
            if len(self._client_pids) >= _MAX_CLIENT_PIDS:
                # Bounded: the clients still here are learned again.
                self._client_pids.clear()
                self._pid_starts.clear()
                self._client_tcp.clear()
                self._client_keys.clear()
                self._client_conn.clear()
                self._conn_clients.clear()
                self._kept_conns.clear()
            self._client_pids[ident] = who
            self._client_tcp.pop(ident, None)
            self._client_conn[ident] = fd
            if fd is not None:
                self._conn_clients.setdefault(fd, []).append(ident)
                state = self._fd_state.get(fd, 0)
                if state < 0:
                    # The connection it came on has closed already (its close read before
                    # this, its first message read): what it sent is for nobody.
                    self._conn_closed(ident, fd, state)
        return who

    def _on_frontend_events(self) -> None:
        """Forget what was learned about clients whose connection closed."""
        while sock_events(self._frontend_events) & _POLLIN:
            event = recv_monitor_event(self._frontend_events)
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._mismatch("client", event)
                continue
            if event["event"] == zmq.EVENT_ACCEPTED:
                if len(self._accept_ticks) >= 4 * _MAX_CLIENT_PIDS:
                    self._accept_ticks.clear()
                self._fd_events += 1
                self._fd_state[event["value"]] = self._fd_events
                self._accept_ticks[event["value"]] = _boot_ticks()
                self._accepted()
                continue
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self._closed_conns += 1
            fd = event["value"]
            self._fd_events += 1
            state = self._fd_state[fd] = -self._fd_events
            self._accept_ticks.pop(fd, None)
            for ident in self._conn_clients.pop(fd, ()):
                if self._client_conn.get(ident) == fd:
                    del self._client_conn[ident]
                    self._client_pids.pop(ident, None)
                    self._client_tcp.pop(ident, None)
                    self._client_keys.pop(ident, None)
                    self._kept_conns.pop(ident, None)
                    self._req_clients.discard(ident)
                    self._req_sockets.discard(ident)
                    self._v01_clients.discard(ident)
                    self._drop_unread(ident)
                    self._conn_closed(ident, fd, state)
                if not ident[0]:
                    # libzmq's own routing id, never given to another connection: what it
                    # sent that is read from now on was left behind by this connection
                    # (one dropped for not reading, or forgotten at its DISCONNECT, included:
                    # learned again, its number may be another process's connection by then).
                    self._file_closed(ident, fd, state)

    def _conn_closed(self, ident: bytes, fd: int, state: int) -> None:
        """The connection of client ``ident`` (descriptor ``fd``, closed as ``state``) has
        closed.  A client without heartbeats (a plain MDP one) is dropped as at a DISCONNECT,
        its queued requests dropped (`client_gone`) and its running ones cancelled at their
        worker: nothing else would end them, and a plain client that queued 50,000 and left
        kept them (40 MB) and had the workers run them for nobody (the scale hunt).  Through
        `_doomed`, so after the actions being sent.  A client that heartbeats is left to its
        liveness window (`Scheduler.ends_with_connection`).

        Filed only once the events queued before its message were read (`_client_pid`), so
        a close is never taken for the connection that reused its number."""
        if not self.sched.ends_with_connection(ident):
            return
        self._file_closed(ident, fd, state)
        self._doomed[ident] = None

    def _file_closed(self, ident: bytes, fd: int, state: int) -> None:
        """Drop ``ident``'s messages that came on its closed connection (`_from_closed`)."""
        closed = self._closed_clients
        closed.pop(ident, None)
        if len(closed) >= _MAX_CLIENT_PIDS:
            closed.popitem(last=False)  # (O(1): a dict's first key after many deletions is a scan)
        closed[ident] = (fd, state)

    def _left_behind(self, ident: bytes) -> None:
        """``ident``'s message came on a connection that has closed, its descriptor reused
        (`_client_pid`).  A routing id of libzmq's own (a zero byte first) never comes on
        another connection: its messages from now on are dropped unread (`_from_closed`).
        A chosen one may connect again; its next message is looked at afresh."""
        self._forget_client(ident)
        if not ident[0]:
            self._file_closed(ident, -1, 0)

    def _count_left_behind(self, frames: list) -> None:
        """A message dropped as left behind (`_LeftBehind`): a REQUEST is counted as one
        whose client went, as a message of a closed connection is (`on_client`)."""
        if self.metrics is None:
            return
        try:
            msg = P.parse_client(frames[1:])
        except P.ProtocolError:
            return
        if msg.command == P.C_REQUEST and not msg.service.startswith(b"mmi."):
            self.metrics.final(msg.service.decode(errors="replace"), CLIENT_GONE, None, None, time.monotonic())

    def _from_closed(self, ident: bytes, frame: Any) -> bool:
        """Whether a message of ``ident``, a client whose connection's close ended its
        requests (`_conn_closed`), came on that closed connection: libzmq holds up to
        client_hwm of a connection's messages, read after its close.  libzmq's own routing
        ids (a zero byte first) are never given to another connection of the socket: yes.
        A chosen id may connect again: yes only if the message came on the closed descriptor
        and nothing was accepted on that number since (events read: `on_client`); else it is
        the id's new connection, served afresh."""
        if not ident[0]:
            return True
        fd, state = self._closed_clients[ident]
        try:
            src = frame.get(zmq.SRCFD)
        except (zmq.ZMQError, AttributeError):
            src = None
        if src == fd and self._fd_state.get(fd) == state:
            return True
        del self._closed_clients[ident]
        return False

    def _accepted(self) -> None:
        """A connection was accepted: near the descriptor limit, stop new clients and workers
        from reaching the broker (see Headroom).  On an ipc path, the socket file is moved
        aside: new peers find no broker there and keep trying (libzmq reconnects), while
        the connections made are served as before (an unbind would close them all).  A tcp
        or abstract endpoint cannot be hidden that way: the warning is all.  The backend's
        too: a flood of connections to it took the last descriptors, and libzmq aborted the
        broker (the resource audit)."""
        hr = self._headroom
        if not hr.accepted():
            return
        self._hidden = self._hide(self.frontend_ep)
        self._hidden_backend = self._hide(self.backend_ep)
        if self._hidden is not None:
            what = ("new clients cannot connect until some close" +
                    (", nor new workers" if self._hidden_backend is not None else "") +
                    " (connected ones are served as before)")
        else:  # (a tcp frontend cannot be hidden)
            what = ("new workers cannot connect until some close; " if self._hidden_backend is not None else "") + \
                   "new clients would take the last of them"
        log.warning("%d of this process's %d descriptors are in use: %s; at the limit libzmq would abort the "
                    "broker.  Raise its descriptor limit (ulimit -n; LimitNOFILE= in a systemd unit; --ulimit "
                    "nofile= for a container)", hr.used, hr.limit, what)

    def _hide(self, ep: str) -> str | None:
        """Move ``ep``'s socket file aside (`_accepted`); where it went, or None."""
        path = self._ipc_path(ep)
        if path is None:
            return None
        try:
            hidden = move_aside(path)
        except OSError as e:
            log.error("cannot move %s aside: %s", path, e)
            return None
        self._own_ipc("ipc://" + hidden, was=path)
        return hidden

    def _show(self, hidden: str, ep: str) -> bool:
        """Put ``ep``'s socket file back from ``hidden`` (`_headroom_tick`); False if it
        could not be (tried again at the next tick)."""
        path = self._ipc_path(ep)
        try:
            put_back(hidden, path)
        except OSError as e:
            self._gc_oops.warning("cannot put %s back (%s): new peers cannot reach this broker", path, e)
            return False
        self._own_ipc(ep, was=hidden)
        return True

    def _own_ipc(self, ep: str, was: str | None = None) -> None:
        """The socket file at ``ep``'s path is this broker's now (bound, or moved there from
        ``was``, which is no longer)."""
        path = self._ipc_path(ep)
        if was is not None:
            self._ipc_files.pop(was, None)
        got = _ipc_file(path)
        if got is not None:
            self._ipc_files[path] = got

    @staticmethod
    def _ipc_path(ep: str) -> str | None:
        return ep[len("ipc://"):] if ep.startswith("ipc://") and not ep.startswith("ipc://@") else None

    def _headroom_tick(self) -> None:
        """Once a second while paused: let new clients reach the frontend again once
        descriptors closed."""
        hr = self._headroom
        if not hr.paused or not hr.tick():
            return
        # Each file on its own: one that cannot be put back now keeps the pause (tried again
        # at the next tick; the file stays ours to unlink), not the other out.
        for attr, ep, who in (("_hidden", self.frontend_ep, "clients"), ("_hidden_backend", self.backend_ep, "workers")):
            hidden = getattr(self, attr)
            if hidden is None:
                continue  # a tcp or abstract endpoint: nothing was hidden
            if not self._show(hidden, ep):
                hr.paused = True
                continue
            setattr(self, attr, None)
            log.warning("%d of %d descriptors in use: new %s can connect to %s again", hr.used, hr.limit, who, ep)

    def _bind_connection(self, ident: bytes, frame: Any, now: float) -> None:
        if self._gone.pop(ident, None) is not None and self.sched.has_worker(ident):
            # A READY under the identity of a worker whose connection closed (a peer that
            # names itself): the old registration's verdict comes first, as the event's did.
            self._presume_dead(ident, "closed its connection", now)
        try:
            fd = frame.get(zmq.SRCFD)  # the connection libzmq read this READY from
        except (zmq.ZMQError, AttributeError):  # not a received frame, or no SRCFD here
            return
        gone = self._worker_conns.bind(fd, ident)
        if gone is not None:
            self._presume_dead(gone, "lost its connection (its number was reused)", now)

    def _mismatch(self, peer: str, event: dict) -> None:
        """A peer's tcp handshake failed for its protocol: most often CurveZMQ on one side
        only (a plain client against a frontend with keys: a broker restarted with security
        on while its clients stayed up, or the reverse), or a peer given another server key.
        libzmq drops the connection and tells the peer nothing it could act on (a libzmq 4.3
        peer gives the endpoint up for good once it sees the failure itself; this SDK's
        clients dial again each second), so this line is the operator's one clue (a key
        refused by the allow-lists is logged by the ZAP handler).  Best effort: a peer whose
        libzmq saw the mismatch first closes before sending its mechanism, and the broker's
        libzmq reports a bare close then (a loaded broker, often)."""
        where = event.get("endpoint", b"")
        where = where.decode(errors="replace") if isinstance(where, bytes) else str(where)
        code = event.get("value", 0) or 0
        why = _HANDSHAKE_ERRORS.get(code) or f"ZMTP protocol error 0x{code:x}"
        throttle = self._handshakes[peer, code if code in _HANDSHAKE_ERRORS else None]
        throttle.warning("a %s's handshake on %s failed: %s; the peer is told nothing", peer, where, why)

    def _on_backend_events(self) -> None:
        """Apply the backend's connection events: the descriptor bookkeeping now, and for a
        worker whose connection closed, the verdict (presumed dead) once what it sent before
        closing has been read (`_settle_gone`): a worker that said DISCONNECT and exited
        finished its work, it did not fail holding it (its leases' clients would resend
        what it had answered).  libzmq delivers a connection's messages before its ROUTER
        sees the pipe close, so they are in the backend by the time the event is here."""
        now = time.monotonic()
        while sock_events(self._backend_events) & _POLLIN:
            event = recv_monitor_event(self._backend_events)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted()
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._mismatch("worker", event)
                continue
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self._closed_conns += 1
            gone = self._worker_conns.closed(event["value"])
            if gone is not None:
                self._gone.setdefault(gone, now)
                self.sched.worker_closed(gone)  # nothing new for it meanwhile

    def _settle_gone(self, now: float) -> None:
        """The verdict on workers whose connection closed (`_on_backend_events`), once the
        backend holds nothing more (their last messages, a DISCONNECT among them, were
        read), or after GONE_WAIT_S whatever it holds (a flood from other workers must not
        keep a dead one alive)."""
        if sock_events(self.backend) & _POLLIN:
            # Something is still to read: only those that waited long enough (the others'
            # DISCONNECT may be in it).
            gone = [ident for ident, t in self._gone.items() if now - t >= GONE_WAIT_S]
            for ident in gone:
                del self._gone[ident]
        else:
            gone, self._gone = list(self._gone), {}
        for ident in gone:
            if self.sched.has_worker(ident):  # not if it said DISCONNECT meanwhile
                self._presume_dead(ident, "closed its connection without a DISCONNECT", now)

    def _presume_dead(self, ident: bytes, how: str, now: float) -> None:
        """A registered worker is gone without saying DISCONNECT: a WARNING (operators must
        hear of a death, and of a service left without workers, at the default level;
        throttled: a host's workers dying together are one line and a count), then the
        scheduler's verdict."""
        self._warn_death(ident, f"{how}; presumed dead{self.sched.death_note(ident)}")
        self._act(self.sched.worker_disconnect(ident, now, closed=True), now)

    def _warn_death(self, ident: bytes, what: str) -> None:
        info = self._worker_info.get(ident)
        who = f"pid {info[1]}" if info is not None and info[1] is not None else repr(ident[:16])
        # The last worker of a service has a throttle of its own: other deaths cannot hide it.
        (self._lost if LAST_WORKER in what else self._deaths).warning("worker %s %s", who, what)

    # ------------------------------------------------------------------ actions

    def _act(self, actions, now: float) -> None:
        if not actions:
            return
        # One action that raises (a peer's message no check foresaw) must not cost the
        # others theirs: the scheduler has already moved on, so a Dispatch skipped after it
        # left a request counted at its worker that never left the broker (the review of
        # the buggy-worker hunt).  The rest are carried out; the failed one is logged.
        it = iter(actions)
        while True:
            try:
                for a in it:
                    t = type(a)
                    if t is Dispatch:
                        self._dispatch(a, now)
                    elif t is ToClient:
                        payload, code = a.payload, a.code
                        if a.request_id >= 0:  # a tensor request (an opaque one's id is negative)
                            got = P.header_id(payload[0]) if payload else None
                            if got != a.request_id:
                                payload = (self._misaddressed(a, got) if got is not None
                                           else self._opaque_answer(a))
                                if payload is None:
                                    continue  # a PARTIAL that names no slot: dropped
                                code = P.ErrorCode.PROTOCOL_ERROR
                        sent = self._send_client(
                            a.client, P.client_reply(a.final, a.service.encode(), payload)
                        )
                        if a.final and self.metrics is not None:
                            # A result that could not go (its client's connection closed: a client
                            # killed while its request ran, before its liveness window dropped it)
                            # reached nobody: `client_gone`, as one relayed after the client left
                            # (counted `ok` before: the counts hunt); an error is the service's own.
                            self.metrics.final(a.service, CLIENT_GONE if not sent and not code else code,
                                               a.enqueued_at, a.dispatched_at, now)
                    elif t is LateToClient:
                        if a.client not in self._req_clients and _names_slots(a.payload):
                            payload = a.payload
                            got = P.header_id(payload[0])
                            if got != a.request_id:  # its slots still go back, under this request's id
                                payload = self._misaddressed(a, got)
                            if payload is not None:
                                self._send_late(a.client, P.client_reply(a.final, a.service.encode(), payload))
                    elif t is ClientError:
                        if self.metrics is not None and a.counted:
                            # (left_queue: its deadline took it out of the queue, and that wait counts)
                            self.metrics.final(a.service, a.code, a.enqueued_at, a.left_queue, now)
                        if a.code == P.ErrorCode.WORKER_FAILED:
                            # The service failed a request (its workers died under it: a request
                            # that kills every worker it meets, a stream cut): a WARNING at the
                            # default level, naming it, as a model that raised is an ERROR naming its
                            # batch; the deaths' own WARNINGs do not say which request it was.
                            self._worker_failed.warning("request failed: " + a.message, extra={
                                **self._request_head(a.payload, a.request_id), "service": a.service, "code": int(a.code)})
                        elif self._log_info:
                            self._log_request("request failed: " + a.message, a.payload, a.request_id,
                                              service=a.service, code=int(a.code))
                        rid = a.request_id if a.request_id >= 0 else 0
                        self._send_client(
                            a.client,
                            P.client_reply(True, a.service.encode(), P.error_body(rid, a.code, a.message)),
                        )
                    elif t is HeartbeatWorker:
                        self.send_to_worker([a.worker, *P.worker_heartbeat()])
                    elif t is CancelAtWorker:
                        self.send_to_worker(P.to_worker_cancel(a.worker, P.token_envelope(a.token), a.why))
                        if a.why == P.CANCEL_CLIENT_GONE and self._log_info:
                            known = self._worker_info.get(a.worker)
                            # Its rid, as the worker's line has it (the counts hunt: this line had
                            # none, and an operator could not match the two).
                            self._log_request("a client left while a worker held one of its requests: cancelled there (a "
                                              "result it sent straight to the client may have crossed this)", a.payload,
                                              a.request_id, worker_pid=known[1] if known is not None else None)
                    elif t is RecallAtWorker:
                        if self.metrics is not None:
                            known = self._worker_info.get(a.worker)
                            if known is not None:
                                self.metrics.recalled(known[0], len(a.tokens))
                        envs = [P.token_envelope(t) for t in a.tokens]
                        for i in range(0, len(envs), P.MAX_DONE):
                            self.send_to_worker(P.to_worker_recall(a.worker, envs[i:i + P.MAX_DONE]))
                    elif t in _LEASE_ACTIONS:
                        self._lease_action(a)
                    elif t is DisconnectWorker:
                        if a.dead:
                            self._warn_death(a.worker, a.reason)
                        else:
                            log.info("disconnecting worker %r: %s", a.worker[:16], a.reason)
                        self.send_to_worker([a.worker, *P.worker_disconnect()])
                        # A worker presumed dead may have died for real: sweep what it left soon
                        # (the loop: at most every _SWEEP_SOON_S; a flood of unknown workers' messages
                        # each disconnected swept every client's file every time: the scale hunt).
                        self._sweep_soon = True
                break
            except Exception:
                self.malformed += 1
                self._oops.exception("unexpected error while carrying out %s; went on with the rest",
                                     type(a).__name__)
        if self._doomed:
            self._drop_doomed()

    def _may_reply_direct(self, ident: bytes, payload: Any) -> bool:
        """Whether worker ``ident`` can have sent the FINAL of the request it holds with
        ``payload`` straight to its client, as a DONE says: the request named a reply socket
        (`reply_to`) on the worker's host.  True for a request it does not hold (the DONE is
        late: the scheduler drops it)."""
        if payload is None:
            return True
        head = payload.header
        if head is None or head.reply_to is None:
            return False
        known = self._worker_info.get(ident)
        return known is None or known[3] == head.host

    def _undelivered(self, ident: bytes, tokens: list, now: float) -> None:
        """A DONE for requests whose client has no reply socket the worker could reach (a
        worker's bug): settled as it was, they left their clients waiting for a FINAL that
        never came (our SDK until its deadline; a plain client without one, for good).  Each
        is answered 400 instead."""
        self.malformed += 1
        self._bad.warning("worker %r sent DONE for %d request(s) that named no reply socket on its host; "
                          "their clients get a 400", ident[:16], len(tokens))
        for token in tokens:
            payload = self.sched.held_payload(ident, token)
            rid = payload.header.id if payload is not None and payload.header is not None else 0
            self._act(self.sched.worker_final(ident, token, now, P.error_body(
                rid, P.ErrorCode.PROTOCOL_ERROR,
                "the worker said it sent this request's answer straight to the client (DONE), but the request "
                "named no reply socket on its host: a bug in the worker; nothing reached the client"),
                P.ErrorCode.PROTOCOL_ERROR), now)

    def _misaddressed(self, a: ToClient | LateToClient, got: int) -> list | None:
        """A worker's reply to request ``a.request_id`` whose header names request ``got``
        (a worker's bug): relayed, the client took it for the answer to its call ``got``
        (another request's result, perhaps of another service, delivered as right) and left
        this one waiting for its deadline.  A FINAL becomes a 400 for the request it answers,
        naming the output slots the reply named (the client gives them back; inline frames
        are dropped); a PARTIAL is dropped (None), unless it names output slots: they are
        lent to the client, which alone gives them back, so it gets them named in an error
        PARTIAL of its own request (which it ignores, once it gave them back)."""
        self.malformed += 1
        lent = []
        try:
            lent = [t for t in P.decode_reply(a.payload[0]).tensors if type(t.loc) is not P.InlineLoc]
        except P.ProtocolError:
            pass
        self._bad.warning("a worker of %r answered request %d with a %s for request id %d; %s", a.service,
                          a.request_id, "FINAL" if a.final else "PARTIAL", got,
                          "its client gets a 400 instead" if a.final else
                          "dropped it" + (", giving its client the output slots it named" if lent else ""))
        if not a.final and not lent:
            return None
        return [P.encode_header(P.Reply(id=a.request_id, tensors=lent, error=P.ErrorInfo(
            code=P.ErrorCode.PROTOCOL_ERROR,
            message=f"the worker answered this request with a reply for request id {got} (a bug in a worker of "
                    f"service {a.service!r}: it must echo the request's id); its reply was dropped")))]

    def _opaque_answer(self, a: ToClient) -> list | None:
        """A worker's reply to tensor request ``a.request_id`` whose body is no header (a
        plain MDP worker that does not speak our tensors, or one that answers with nothing):
        relayed, it carried no id, and the client could only fail the oldest call it had
        waiting on that service.  A FINAL becomes a 400 for the request it answers; a
        PARTIAL is dropped (None)."""
        self.malformed += 1
        self._bad.warning("a worker of %r answered tensor request %d with a %s that is not a header (a plain MDP "
                          "worker?); %s", a.service, a.request_id, "FINAL" if a.final else "PARTIAL",
                          "its client gets a 400 instead" if a.final else "dropped it")
        if not a.final:
            return None
        return [P.encode_header(P.Reply(id=a.request_id, error=P.ErrorInfo(
            code=P.ErrorCode.PROTOCOL_ERROR,
            message=f"service {a.service!r} answered a tensor request with an opaque body (a plain MDP worker?); "
                    f"use client.request() for opaque services")))]

    def _lease_action(self, a) -> None:
        t = type(a)
        if t is LeaseToWorker:
            grant = P.LeaseGrant(lease=P.lease_id(a.lease), secret=a.secret, service=a.service, slots=a.slots,
                                 client_host=a.client_host, client_pid=a.client_pid, client_start=a.client_start,
                                 principal=_principal_text(a.principal))
            self.send_to_worker(P.to_worker_lease(a.worker, P.encode_header(grant)))
        elif t is LeaseToClient:
            info = P.LeaseInfo(id=a.ask_id, lease=P.lease_id(a.lease), secret=a.secret, endpoint=a.endpoint,
                               slots=a.slots, instance=self.instance, host=a.worker_host, link=a.link,
                               server_key=a.server_key)
            self._send_client(a.client, P.client_leased(a.service, [P.encode_header(info)]))
        elif t is LeaseRefused:
            self._send_client(a.client, P.client_leased(a.service, P.error_body(a.ask_id, a.code, a.message)))
        elif t is LeaseEndToClient:
            end = P.LeaseEnd(lease=P.lease_id(a.lease), reason=a.reason, resend=a.resend)
            self._send_client(a.client, P.client_lease_end(a.service, P.encode_header(end)))
        elif t is LeaseEndToWorker:
            end = P.LeaseEnd(lease=P.lease_id(a.lease), reason=a.reason)
            self.send_to_worker(P.to_worker_lease_end(a.worker, P.lease_id(a.lease), P.encode_header(end)))

    def _dispatch(self, a: Dispatch, now: float) -> None:
        p: _Payload = a.payload
        req = p.header
        if req is None:
            body = p.body
        else:
            # The worker sees what is left of the budget and how long the request queued.
            if a.deadline is not None:
                req.timeout_ms = max(0.0, (a.deadline - now) * 1000.0)
            req.queue_ms = (now - a.enqueued_at) * 1000.0
            req.returned = a.returned or None
            req.backlog = a.backlog  # 0 tells a latency-first batcher that nothing is on its way
            if a.priority is not None:
                req.priority = a.priority  # a class it outscored by aging (broker/state.py, "Dispatch")
            # with the keys it did not know, as they came, and a retry's attempt (the worker
            # then keeps its principal in order, as this broker did: a retry goes first)
            body = (P.encode_routed(req, a.attempt or None), *p.body)
        try:
            self.send_to_worker(P.to_worker_request(a.worker, P.token_envelope(a.token), body))
        except zmq.ZMQError as e:
            self._bad.warning("could not send to worker %r: %s", a.worker[:16], e)
            return
        if self._log_info:
            known = self._worker_info.get(a.worker)
            self._log_request("request dispatched", p, a.request_id, service=a.service,
                              worker_pid=known[1] if known is not None else None,
                              queue_ms=round((now - a.enqueued_at) * 1000.0, 3), attempt=a.attempt,
                              returned=a.returned or None)

    # ------------------------------------------------------------------ request log lines

    def _log_levels(self) -> None:
        """Read the log levels once (at start, then every _GC_INTERVAL), so that a request
        line that is off costs the request path one attribute test."""
        self._log_info = log.isEnabledFor(logging.INFO)
        self._log_debug = log.isEnabledFor(logging.DEBUG)

    def _log_request(self, msg: str, payload: Any, request_id: int, **fields: Any) -> None:
        """One INFO line about a request, naming it (rid, trace_id) as the worker does."""
        log.info(msg, extra={**self._request_head(payload, request_id), **fields})

    @staticmethod
    def _request_head(payload: Any, request_id: int) -> dict:
        """The fields that name a request in a log line (rid, trace_id), as the worker's do."""
        req = getattr(payload, "header", None)
        if req is not None:
            return logs.request_fields(req)
        return {"rid": f"mdp:{-request_id}"}  # a plain MDP request: ids of its own (negative), unknown to workers

