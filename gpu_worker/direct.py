"""The worker's side of direct reply (docs/protocol.md section 8): which FINALs go straight to
a same-host client's ``reply_to`` socket, and the DONEs that tell the broker about them.

Three pure cores (no socket, no clock: time is passed in) and one socket cache:

* `direct_endpoint` - whether a reply may skip the broker: a FINAL (not a PARTIAL), of a
  tensor request (not opaque), of a model that does not stream, to a client on this host
  that named a ``reply_to``, with direct reply enabled.  Anything else is relayed.
* `DoneGather` - envelopes of FINALs sent direct, waiting to go to the broker as DONE.  A
  DONE waits for company for at most ``delay`` seconds or until ``max_pending`` envelopes
  are held, whichever comes first, and never past half the time the earliest-due request had
  left (so the broker hears of it before it would time the request out).  A DONE carries at
  most ``P.MAX_DONE`` envelopes; more go as several DONEs.
* `BatchFinals` - the header-only FINALs of one batch, per client, sent as one message each
  (FINALS).  Only a batch of several is gathered (`gathers_finals`): a lone request's FINAL
  is never held back for company.
* `DirectSockets` - one PUSH socket per ``reply_to`` endpoint, least recently used closed
  first.  An endpoint whose ipc path is not visible from here (another mount namespace, or
  the client is gone) gets no socket: a connect would queue replies forever.  A send never
  blocks: a full socket (the client stopped reading) or a failed one means the caller relays
  this reply through the broker, which knows whether the client is still there.  `sweep`
  (the worker's housekeeping) closes the sockets of clients that exited: each would
  otherwise try to reconnect to a dead endpoint ten times a second until 64 newer
  clients pushed it out.  Near the process's descriptor limit a new socket sends only once
  its connection is made (the others are relayed): a connection that cannot be made for
  want of descriptors would hold a reply until its client times out.  Whether it is near
  is an estimate that counts what a new client costs this worker (`NEW_CLIENT_FDS`),
  listed again when a socket is made within the reserve of the mark; a socket made to queue
  before its connection is closed at the next `sweep` that finds the process near its
  limit (its connection may never come), and the next one made for its client waits.

Invariant the worker must keep: an envelope enters `DoneGather` only after its FINAL was
queued on a direct socket, and every envelope that entered is told to the broker (or dropped
with the connection it belonged to: `clear()` after a reconnect).  A closed socket lingers
`DIRECT_LINGER_MS` so that FINALs already told to the broker as DONE still reach their client.
"""
from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict

import zmq

from broker import protocol as P
from broker.protocol.limits import Headroom, nofile_limit
from broker.protocol.wire import NOBLOCK, send_frames
from shm.book import PidfdHolders

__all__ = ["DIRECT_LINGER_MS", "direct_endpoint", "DoneGather", "gathers_finals", "BatchFinals", "DirectSockets"]

log = logging.getLogger("gpu_worker")

# Milliseconds a closed reply_to socket keeps delivering what it has queued: a FINAL already
# told to the broker as DONE must still reach its client (close() itself does not wait).
DIRECT_LINGER_MS = 2000

#: descriptors a new client costs this worker: its reply socket and that socket's connection,
#: a pidfd, and the two of its segment's mapping (only the socket's are this cache's own: the
#: others are counted here so that the estimate does not lag behind them)
NEW_CLIENT_FDS = 5


def direct_endpoint(final: bool, req: P.Request | None, *, host: str, enabled: bool, streaming: bool) -> str | None:
    """The ``reply_to`` a reply may be sent to directly, or None: relay it through the broker.

    PARTIALs and a streaming model's FINAL stay with the broker (their order and relay-time
    checks live there), as do opaque replies (``req`` None) and replies to a client on
    another host or without ``reply_to``.  Whether the endpoint is reachable and its socket
    takes the message is `DirectSockets`' answer.

    The socket must be the requester's own: its file name states its owner's pid
    (`broker.protocol.naming`), which must be the pid the broker attested for the request
    (``req.pid``).  A ``reply_to`` naming another process's socket is ignored and the reply
    goes back through the broker, to the client that sent the request."""
    if (final and req is not None and req.reply_to is not None and req.host == host
            and enabled and not streaming and req.pid is not None):
        rt = req.reply_to
        owner = _owners.get(rt, _UNSEEN)
        if owner is _UNSEEN:  # a regex per request otherwise; a client keeps one socket
            if len(_owners) >= 4096:
                _owners.clear()
            owner = _owners[rt] = P.parse_reply_socket_name(rt.rpartition("/")[2])
        if owner is not None and owner[0] == req.pid and (req.pid_start is None or owner[1] == req.pid_start):
            return rt
    return None


_owners: dict[str, tuple | None] = {}  # reply_to -> its parsed name (owner pid, ...), or None
_UNSEEN = object()


class DoneGather:
    """Envelopes whose FINAL went straight to the client, gathered into DONEs.

    One DONE for several FINALs costs the broker one wake-up instead of several, and on a
    small machine that wake-up competes with the client the FINAL just woke.  The broker's
    credit count lags by at most ``max_pending`` requests or ``delay`` seconds."""

    def __init__(self, *, delay: float, max_pending: int):
        self.delay = float(delay)
        self.max_pending = int(max_pending)
        #: envelopes not yet told to the broker, in the order their FINALs went
        self.envelopes: list[bytes] = []
        #: per pending envelope: its FINAL's outcome (0, or the error code) and when it went
        self.codes: list[int] = []
        self.sent: list[float] = []
        #: when the pending envelopes must go (meaningful while there are some)
        self.due = 0.0
        #: whether a DONE carries the outcomes and ages (the broker counts: its WELCOME said so)
        self.info = True

    def __len__(self) -> int:
        return len(self.envelopes)

    def add(self, envelope: bytes, deadline: float | None, now: float, code: int = 0) -> None:
        """A FINAL for ``envelope`` (whose request is due at ``deadline``) went direct at
        ``now``; ``code``: 0 for a result, else its error code."""
        due = now + self.delay
        if deadline is not None:
            due = min(due, now + max(0.0, deadline - now) / 2)
        if not self.envelopes or due < self.due:
            self.due = due
        self.envelopes.append(envelope)
        self.codes.append(code)
        self.sent.append(now)

    def ready(self, now: float) -> bool:
        """Whether the pending envelopes should go now."""
        return bool(self.envelopes) and (now >= self.due or len(self.envelopes) >= self.max_pending)

    def wait_ms(self, now: float) -> int | None:
        """Milliseconds until the DONE is due (a poll timeout), None when nothing is pending.
        Whole milliseconds, rounded up: zmq_poll truncates, and a DONE can afford to be late
        where spinning until it is due cannot."""
        if not self.envelopes:
            return None
        return math.ceil(max(0.0, self.due - now) * 1000.0)

    def take(self, now: float) -> list[list[bytes]]:
        """The DONE messages (frames) for everything pending, which is then forgotten; each
        carries the outcomes and ages of its FINALs (`P.DoneInfo`: the broker counts them)."""
        done, self.envelopes = self.envelopes, []
        codes, self.codes = self.codes, []
        sent, self.sent = self.sent, []
        out = []
        for i in range(0, len(done), P.MAX_DONE):
            j = i + P.MAX_DONE
            info = None
            if self.info:
                info = P.DoneInfo(codes=codes[i:j], ages_ms=[max(0.0, (now - t) * 1000.0) for t in sent[i:j]])
            out.append(P.worker_done(done[i:j], info))
        return out

    def clear(self) -> None:
        """Forget the pending envelopes (their tokens died with the broker connection)."""
        self.envelopes.clear()
        self.codes.clear()
        self.sent.clear()


def gathers_finals(batch_size: int) -> bool:
    """Whether a batch's header-only FINALs are gathered per client (`BatchFinals`): only
    for a batch of several; a lone request's FINAL goes at once."""
    return batch_size > 1


class BatchFinals:
    """The header-only FINALs of one batch, per ``reply_to``, while its replies are written."""

    def __init__(self):
        self._by_endpoint: dict[str, list] = {}

    def __len__(self) -> int:
        return sum(len(items) for items in self._by_endpoint.values())

    def add(self, endpoint: str, header, item) -> None:
        """Gather one FINAL (its only frame, ``header``); ``item`` comes back with it."""
        self._by_endpoint.setdefault(endpoint, []).append((header, item))

    def messages(self, service: bytes) -> list[tuple[str, list, list]]:
        """(endpoint, frames, [(header, item)...]) per client: a FINALS message for several
        headers, a plain FINAL for one."""
        out = []
        for endpoint, items in self._by_endpoint.items():
            heads = [head for head, _ in items]
            frames = P.client_reply(True, service, heads) if len(heads) == 1 else P.direct_finals(service, heads)
            out.append((endpoint, frames, items))
        return out


class DirectSockets:
    """PUSH sockets to clients' ``reply_to`` endpoints, least recently used closed first."""

    #: replies a client that stops reading may have queued before the worker relays instead
    sndhwm = 1000

    def __init__(self, ctx: zmq.Context, *, capacity: int = 64, holders: PidfdHolders | None = None,
                 guard: Headroom | None = None):
        self._bad = P.RateLimitedLog(log)  # a warning a second at most (out of descriptors: one per reply)
        self.ctx = ctx
        self.capacity = max(1, int(capacity))
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._owner: dict[str, tuple[int, int]] = {}  # endpoint -> its client's (pid, starttime)
        # Their liveness, one poll for all (sweep): the worker's (`HostPlane.holders`, one
        # pidfd per live client for everything it keeps of it), or our own.
        self._own_holders = holders is None
        self._holders = holders if holders is not None else PidfdHolders()
        # This process's descriptors: near its limit, a new socket sends only once connected.
        self._guard = guard if guard is not None else Headroom(nofile_limit())
        # Sockets made to queue before their connection (far from the limit), since the last
        # sweep that found the process far from it: `sweep` closes them if it is near now.
        self._eager: set[str] = set()

    def __len__(self) -> int:
        return len(self._socks)

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._socks

    def open(self, endpoint: str) -> zmq.Socket | None:
        """The socket for ``endpoint`` (connected now if need be), or None when the endpoint
        cannot be reached from here."""
        sock = self._socks.get(endpoint)
        if sock is not None:
            self._socks.move_to_end(endpoint)
            return sock
        if not os.path.exists(endpoint[len("ipc://"):]):
            # Not visible from here (another mount namespace, or the client is gone): a
            # connect would queue replies forever, so relay instead.
            return None
        near_limit = self._near_limit()
        sock = None
        try:
            sock = self.ctx.socket(zmq.PUSH)
            sock.linger = 0
            # A client that stops reading costs at most this many queued replies before
            # the worker falls back to relaying (and reconnects afresh).
            sock.sndhwm = self.sndhwm
            if near_limit:
                # Queue only on a connection that was made.  Otherwise a send queues on the
                # pipe the connect creates at once, and a connection the I/O thread cannot
                # make (this process out of descriptors) holds the reply until its client
                # times out.  A send before the connection is up is refused (zmq.Again) and
                # relayed.  Only near the limit: elsewhere a client's first replies would be
                # relayed while its connection is made (about 3 here, +80 us each).
                sock.immediate = True
            P.ipv6_for(sock, endpoint)
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            if sock is not None:
                sock.close(linger=0)
            self._bad.warning("cannot connect to reply_to %s (%s); relaying through the broker", endpoint, e)
            return None
        self._socks[endpoint] = sock
        if not near_limit:
            self._eager.add(endpoint)
        owner = P.parse_reply_socket_name(endpoint.rpartition("/")[2])
        if owner is not None:
            self._owner[endpoint] = owner
            self._holders.starttime(owner[0])  # a pidfd for sweep to poll, once per client
        while len(self._socks) > self.capacity:
            name, old = self._socks.popitem(last=False)
            self._owner.pop(name, None)
            self._eager.discard(name)
            old.close(linger=DIRECT_LINGER_MS)
        return sock

    def _near_limit(self) -> bool:
        """Whether a new socket must wait for its connection before it queues a reply.

        The estimate between listings adds what a new client costs the worker
        (`NEW_CLIENT_FDS`); within the reserve of the pause mark (and at the mark:
        `Headroom.accepted`) the descriptors are listed again, since others (a client's
        second segment, libzmq's) are not in it.  Far from the limit, nothing is listed."""
        guard = self._guard
        if guard.accepted(NEW_CLIENT_FDS) or guard.paused:
            return True
        if guard.used >= guard.limit - 2 * guard.reserve:
            guard.watch()
        return guard.paused

    def sweep(self) -> list[str]:
        """Close the sockets of clients that exited (the name states the owner's pid and
        start time) or closed theirs (its file is gone); a reply still queued there has
        nobody to read it."""
        guard = self._guard
        guard.watch()  # the descriptors counted again: near the limit or not
        eager, self._eager = self._eager, set()
        if guard.paused:
            # Made to queue before their connection, while far from the limit: a connection
            # that failed for want of descriptors may never come, and its socket would hold
            # its client's replies for good.  Closed (what a connection made in the linger
            # delivers still goes); its client's next reply opens one that waits.
            for ep in eager:
                self._owner.pop(ep, None)
                sock = self._socks.pop(ep, None)
                if sock is not None:
                    sock.close(linger=DIRECT_LINGER_MS)
        self._holders.prune()
        gone = [ep for ep in self._owner if self._gone(ep)]
        for ep in gone:
            self.drop(ep)
        return gone

    def _gone(self, endpoint: str) -> bool:
        """Whether nobody can read what goes to ``endpoint``: its client closed its socket (the
        file is gone) or exited (the pid and start time its name states)."""
        owner = self._owner.get(endpoint)
        return not os.path.exists(endpoint[len("ipc://"):]) or (owner is not None and not self._holders.alive(*owner))

    def send(self, endpoint: str, frames, *, keep_failed: bool = False) -> bool:
        """Queue one message on ``endpoint``'s open socket without blocking; False when the
        caller must relay it instead: no socket is open for it (closed since), the socket is
        full (it stays: the replies already queued stay queued), or the send failed (the
        socket is closed, with a warning, unless ``keep_failed``)."""
        sock = self._socks.get(endpoint)
        if sock is None:
            return False
        try:
            send_frames(sock, frames, NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if not keep_failed:
                log.warning("direct reply to %s failed (%s); relaying through the broker", endpoint, e)
                self.drop(endpoint)
            return False
        return True

    def drop(self, endpoint: str) -> None:
        self._owner.pop(endpoint, None)
        self._eager.discard(endpoint)
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        """Close every socket: those of live clients linger (`DIRECT_LINGER_MS`: FINALs told
        to the broker as DONE still reach them); one whose client closed its socket (its file
        is gone) or exited has nobody to deliver to, and closes at once (a reply queued to a
        client that had closed held the worker's exit for the whole linger, 2 s)."""
        for ep, sock in self._socks.items():
            sock.close(linger=0 if self._gone(ep) else DIRECT_LINGER_MS)
        self._socks.clear()
        self._owner.clear()
        self._eager.clear()
        if self._own_holders:
            self._holders.close()
