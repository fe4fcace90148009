"""Leases (pinned streams): the broker's side, as events and actions of the pure scheduler.

docs/protocol.md section 10 is the protocol; this module is the part of it that decides:
which worker a lease goes to, what it reserves, and who is told when it ends.  It is a mixin
of :class:`broker.state.Scheduler` (it reads the scheduler's workers, services and clients,
and keeps the same rules: no I/O, no clock, every event returns actions).

A lease reserves ``slots`` of one worker's credit: brokered dispatch treats that worker as
having ``credit - leased`` (state.py's ``_reload``), so a slot is never handed out twice, and
every worker keeps half its credit (rounded up) for brokered requests.  A lease is PENDING from the
client's ask until the worker confirms it (only then is the client told where to connect:
the worker always knows a lease before the client can use it), then ACTIVE until it ends:

- the client ends it, or goes away (disconnect, silence): the worker is told (``client_done``,
  ``client_gone``);
- the worker ends it (SIGTERM, scale-down: ``worker_stopping``) or dies (``worker_failed``):
  the client is told, with ``resend`` when requests in flight on the lease will get no reply
  (a dead worker), so it sends them again through the broker.  A lease ended while its
  worker lives (the worker stopping, a drain, the client done) still has that worker owe
  its requests in flight their replies: should it die before it says DISCONNECT (it would
  have finished them first), the client is told again, ``worker_failed`` with ``resend``
  (the worker keeps a note of such leases, ``stopped``: the latest ``MAX_STOPPED_NOTES``, of
  them the latest ``MAX_CLIENT_NOTES`` of a principal, forgotten with their client);
- the broker drains (``end_leases``): both are told.

Lease ids are the scheduler's own counter (unique for the broker's life; the server makes
them 8 bytes); the ``secret`` that binds a direct connection to a lease is made by the server
(randomness is I/O) and carried through untouched.
"""
from __future__ import annotations

from dataclasses import dataclass

from broker.protocol import ErrorCode

# Lease states.
PENDING, ACTIVE = "pending", "active"

# Why a lease ended (LeaseEnd.reason on the wire).
WORKER_FAILED = "worker_failed"
WORKER_STOPPING = "worker_stopping"
DRAIN = "drain"
SCALE_DOWN = "scale_down"
CLIENT_DONE = "client_done"
CLIENT_GONE = "client_gone"
REVOKED = "revoked"  # the client's CurveZMQ key left the broker's allow-list (to the client only)
UNCONFIRMED = "worker_failed"  # the worker did not confirm in its liveness window: as if it had failed
T_LEASE = 6  # the scheduler's timer kind for a lease not yet confirmed (state.py's own are 0..5)
#: notes of leases a live worker ended (``stopped``) kept per worker, the oldest forgotten
#: first: a worker that lives for months sees a lease end for every stream a client closed,
#: and a note is needed only until the requests in flight on it are answered (the oldest
#: long since); at its death every note left is a LEASE_END to send, a burst this bounds.
#: The trade-off: a request still running on a lease that ended 1024 lease ends before its
#: worker died without DISCONNECT gets no resend from here (its call waits for its deadline)
MAX_STOPPED_NOTES = 1024
#: of those notes, one principal's kept at most, all workers together, its oldest forgotten
#: first: a client that asked for a lease and gave it back in a loop pushed every other
#: client's notes out of a worker's MAX_STOPPED_NOTES (a client that gave a lease back with a
#: call on it then waited for the call's deadline when the worker died; the churn hunt)
MAX_CLIENT_NOTES = 256
# What a worker may give as its reason to end a lease; anything else is taken as stopping.
WORKER_REASONS = frozenset({WORKER_STOPPING, SCALE_DOWN, DRAIN})


def _brokered_share(credit: int) -> int:
    """Of a worker's credit, what leases never hold: half of it (at least one slot), so
    brokered requests still form batches on a worker that holds leases (its default credit
    is twice its largest batch), however little the leaseholders send.  A lease held idle
    took all but one slot, and every brokered batch on that worker was a batch of one."""
    return max(1, (credit + 1) // 2)


@dataclass(frozen=True, slots=True)
class LeaseToWorker:
    """Send the worker a LEASE (LeaseGrant); it answers with `Scheduler.worker_leased`."""

    worker: bytes
    lease: int
    service: str
    slots: int
    client: bytes
    principal: object
    secret: bytes
    client_pid: int | None = None   # as the server attested it (the grant carries it)
    client_host: str | None = None  # the client's shared-memory host, when the lease is near it
    client_start: int | None = None  # the attested process's start time, with client_pid


@dataclass(frozen=True, slots=True)
class LeaseToClient:
    """Answer the client's LEASE: where to connect (LeaseInfo)."""

    client: bytes
    ask_id: int
    service: str
    lease: int
    endpoint: str
    slots: int
    secret: bytes
    worker_host: str | None  # set only when the client may send shared-memory references
    link: str | None = None  # the worker's local link, on a near lease only
    server_key: str | None = None  # the CurveZMQ public key of the worker's tcp direct socket


@dataclass(frozen=True, slots=True)
class LeaseRefused:
    """Answer the client's LEASE with a typed error: it stays on the brokered path."""

    client: bytes
    ask_id: int
    service: str
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class LeaseEndToClient:
    client: bytes
    service: str
    lease: int
    reason: str
    resend: bool  # requests in flight on the lease get no reply: send them through the broker


@dataclass(frozen=True, slots=True)
class LeaseEndToWorker:
    worker: bytes
    lease: int
    reason: str


LeaseAction = LeaseToWorker | LeaseToClient | LeaseRefused | LeaseEndToClient | LeaseEndToWorker


class _Lease:
    __slots__ = ("id", "client", "principal", "svc", "worker", "slots", "ask_id", "secret", "state", "near",
                 "confirm_by")

    def __init__(self, lid, client, principal, svc, worker, slots, ask_id, secret, near=False):
        self.id = lid
        self.client = client
        self.principal = principal
        self.svc = svc
        self.worker = worker
        self.slots = slots
        self.ask_id = ask_id
        self.secret = secret
        self.state = PENDING
        self.near = near  # same host, shared memory on both sides: the client may send references
        self.confirm_by = 0.0  # when an unconfirmed lease is refused (the T_LEASE timer's due time)


class LeaseEvents:
    """The lease events of the scheduler (mixed into `broker.state.Scheduler`, whose
    ``__init__`` calls ``_init_leases``)."""

    def _init_leases(self) -> None:
        self._leases: dict[int, _Lease] = {}
        self._client_leases: dict[bytes, dict[int, _Lease]] = {}
        self._principal_leased: dict[object, int] = {}  # slots leased, per principal (capped)
        # The notes of ended leases (``_Worker.stopped``, `_note`) by principal, oldest first
        # (lease id -> its worker), and each noted client's principal: a principal keeps
        # MAX_CLIENT_NOTES, and a client's go with it (`_end_client_leases`).
        self._notes: dict[object, dict[int, object]] = {}
        self._note_key: dict[bytes, object] = {}
        self._lease_seq = 0

    # ------------------------------------------------------------------ events

    def client_lease(self, client: bytes, principal: object, ask_id: int, service: str, now: float, *,
                     slots: int = 1, host: str | None = None, transports=frozenset({"inline"}),
                     secret: bytes = b"", pid: int | None = None, start: int | None = None,
                     remote: bool = False) -> list:
        """The client asks to be pinned to a worker of ``service`` for ``slots`` requests in
        flight.  ``remote``: it came over tcp (only a worker with a tcp direct socket will
        do, and never through shared memory).  A leaseholder is a tracked client (as after a
        heartbeat) from the moment a lease is placed: silent for its liveness window, it
        loses its leases.  All of a principal's leases hold at most ``max_client_requests``
        slots together."""
        out: list = []
        if self._draining is not None or self._holding:
            self._counters["leases_refused"] += 1
            out.append(LeaseRefused(client, ask_id, service, ErrorCode.SERVICE_UNAVAILABLE,
                                    self._draining or "the broker is shutting down (told to stop): requests go "
                                                      "through the broker, to its successor"))
            return out
        slots = max(1, int(slots))
        svc = self._services.get(service)
        workers = [w for w in svc.workers.values() if w.alive and not w.closing] if svc is not None else []

        def refuse(why):
            self._counters["leases_refused"] += 1
            out.append(LeaseRefused(client, ask_id, service, ErrorCode.SERVICE_UNAVAILABLE, why))
            return out

        if not workers:
            return refuse(f"no live worker for service '{service}'")
        key = client if principal is None else principal
        room = self._max_client_requests - self._principal_leased.get(key, 0)
        if room < 1:
            return refuse(f"this client's leases hold {self._max_client_requests} slots already "
                          f"(max_client_requests); requests go through the broker")
        # A local client connects to ipc direct sockets (or their links); a remote one to tcp
        # ones, CurveZMQ for a client that came with a key (its principal) and plain for one
        # that came in clear (--insecure): what its SDK can connect to (client_sdk/sockets.py).
        scheme = "tcp://" if remote else "ipc://"
        curve = isinstance(principal, str) and principal.startswith("curve:")

        def usable(w) -> bool:
            # Not a worker set aside for a request's last attempt (state.py: it runs alone).
            return (bool(w.direct) and w.direct.startswith(scheme) and w.iso is None
                    and (not remote or (w.direct_key is not None) == curve))

        cands = [w for w in workers if usable(w) and w.credit - w.leased > _brokered_share(w.credit)]
        near = False
        if not remote and host is not None and "shm" in transports:
            close = [w for w in cands if w.host == host and "shm" in w.transports]
            near = bool(close)
            cands = close or cands  # a remote worker takes the lease inline
        if not cands:
            if not any(w.direct for w in workers):
                why = "no worker of it takes leases (none set a direct socket)"
            elif remote and not any(w.direct and w.direct.startswith("tcp://") for w in workers):
                why = "no worker of it has a tcp direct socket for a remote client"
            elif remote and not any(usable(w) for w in workers):
                why = ("no worker of it has a tcp direct socket with CurveZMQ for a client with a key" if curve else
                       "no worker of it has a plain tcp direct socket for a client without a key")
            elif not remote and not any(usable(w) for w in workers):
                why = "no worker of it has an ipc direct socket for a client of this host"
            else:
                why = "every worker's credit is leased already"
            return refuse(f"service '{service}': {why}; requests go through the broker")
        w = min(cands, key=lambda w: (w.busy, (len(w.in_flight) + w.leased) / w.credit, w.used))
        grant = min(slots, w.credit - w.leased - _brokered_share(w.credit), room)
        self._lease_seq += 1
        lease = _Lease(self._lease_seq, client, principal, w.svc, w, grant, ask_id, secret, near)
        self._leases[lease.id] = lease
        self._client_leases.setdefault(client, {})[lease.id] = lease
        self._principal_leased[key] = self._principal_leased.get(key, 0) + grant
        w.leases[lease.id] = lease
        self._reserve(w, grant)
        self.client_heartbeat(client, now)
        # Unconfirmed within the worker's liveness window: the ask is refused, the slots return.
        lease.confirm_by = now + self._worker_ttl
        self._push_timer(lease.confirm_by, T_LEASE, lease)
        out.append(LeaseToWorker(w.ident, lease.id, service, grant, client, principal, secret,
                                 pid, host if near else None, start if pid is not None else None))
        # What the reservation changed (the worker's spare credit: a recall now due, say) is
        # acted on now, as at the end of every event, not at whatever event comes next (a
        # stale reply's answer carried a RecallAtWorker: the stateful test's find).
        self._flush(now, out)
        return out

    def worker_leased(self, worker: bytes, lease_id: int, now: float, *, ok: bool = True,
                      message: str = "") -> list:
        """The worker took the lease (or refused it): now the client is told."""
        out: list = []
        lease = self._leases.get(lease_id)
        if lease is None or lease.worker.ident != worker or lease.state != PENDING:
            self._counters["protocol_errors"] += 1  # late, duplicate or not its lease
            return out
        if ok:
            lease.state = ACTIVE
            self._counters["leases_granted"] += 1
            w = lease.worker
            out.append(LeaseToClient(lease.client, lease.ask_id, lease.svc.name, lease.id, w.direct,
                                     lease.slots, lease.secret, w.host if lease.near else None,
                                     w.link if lease.near else None, w.direct_key))
            return out
        self._counters["leases_refused"] += 1
        self._forget(lease)
        out.append(LeaseRefused(lease.client, lease.ask_id, lease.svc.name, ErrorCode.SERVICE_UNAVAILABLE,
                                f"the worker refused the lease{': ' + message if message else ''}"))
        self._flush(now, out)
        return out

    def client_lease_end(self, client: bytes, lease_id: int, now: float) -> list:
        """The client is done with a lease (unknown or not its own: ignored)."""
        out: list = []
        lease = self._client_leases.get(client, {}).get(lease_id)
        if lease is not None:
            self._end(lease, CLIENT_DONE, out, tell_client=False)
            self._flush(now, out)
        return out

    def worker_lease_end(self, worker: bytes, lease_id: int, now: float,
                         reason: str = WORKER_STOPPING) -> list:
        """The worker ends a lease (it is stopping): it finishes what it holds, so the
        client resends nothing."""
        out: list = []
        lease = self._leases.get(lease_id)
        if lease is not None and lease.worker.ident == worker:
            # A worker ends its own leases only by stopping: it cannot speak for the client
            # (client_done), nor say it failed while it talks (resend stays the broker's call).
            self._end(lease, reason if reason in WORKER_REASONS else WORKER_STOPPING, out, tell_worker=False)
            self._flush(now, out)
        return out

    def end_leases(self, reason: str, now: float) -> list:
        """End every lease, telling both sides (a drain: the workers finish what they hold,
        the clients go back to the brokered path)."""
        out: list = []
        for lease in list(self._leases.values()):
            self._end(lease, reason, out)
        self._flush(now, out)
        return out

    def principal_revoked(self, principal: object, now: float, why: str) -> list:
        """``principal`` (a tcp client's CurveZMQ key) was removed from the broker's allow-list:
        its leases end, as when a client ends one (``client_done`` to the worker: what it
        holds of them it answers, as the broker answers the brokered requests that came
        before the removal; a later REQUEST on them is sent back through the broker, which
        refuses it 403).  The client is told ``revoked``, without ``resend``: a client that
        does not know the reason drops the message, and its next pinned call comes back
        through the broker all the same.  An ask not yet confirmed is refused 403."""
        out: list = []
        for lease in [lease for lease in self._leases.values() if lease.principal == principal]:
            pending = lease.state == PENDING
            self._end(lease, CLIENT_DONE, out, tell_client=False)
            if pending:  # (counted refused by `_end`)
                out.append(LeaseRefused(lease.client, lease.ask_id, lease.svc.name, ErrorCode.FORBIDDEN, why))
            else:
                out.append(LeaseEndToClient(lease.client, lease.svc.name, lease.id, REVOKED, False))
        if out:
            self._flush(now, out)
        return out

    # ------------------------------------------------------------------ queries

    def leases_of(self, service: str) -> int:
        return sum(1 for lease in self._leases.values() if lease.svc.name == service)

    @property
    def has_leases(self) -> bool:
        return bool(self._leases)

    # ------------------------------------------------------------------ internals

    def _reserve(self, w, slots: int) -> None:
        w.leased += slots
        w.svc.recall_stale = True  # what it may take back as an idle worker changed
        self._reload(w)  # its spare credit for brokered dispatch changed
        self._dirty[w.svc] = None

    def _forget(self, lease) -> None:
        """Take the lease out of every index and give its slots back."""
        del self._leases[lease.id]
        key = lease.client if lease.principal is None else lease.principal
        left = self._principal_leased.get(key, 0) - lease.slots
        if left > 0:
            self._principal_leased[key] = left
        else:
            self._principal_leased.pop(key, None)
        mine = self._client_leases.get(lease.client)
        if mine is not None:
            mine.pop(lease.id, None)
            if not mine:
                del self._client_leases[lease.client]
        w = lease.worker
        w.leases.pop(lease.id, None)
        if w.alive:
            self._reserve(w, -lease.slots)
        else:
            w.leased -= lease.slots

    def _end(self, lease, reason: str, out: list, *, tell_worker: bool = True, tell_client: bool = True,
             resend: bool = False, why: str = "") -> None:
        pending = lease.state == PENDING
        self._forget(lease)
        if not pending and lease.worker.alive and reason != CLIENT_GONE:
            # Ended while its worker lives (stopping, drain, scale-down, the client done):
            # the worker still owes its requests in flight their replies, so should it die
            # before it says DISCONNECT, the client resends them (`_end_worker_leases`).
            self._note(lease)
        # An ask never confirmed is a refusal, whatever ended it; only a granted lease ends
        # (ended counted both: 67 ended of 59 granted after a churn; the leases audit).
        self._counters["leases_refused" if pending else "leases_ended"] += 1
        if tell_worker and lease.worker.alive:
            out.append(LeaseEndToWorker(lease.worker.ident, lease.id, reason))
        if tell_client:
            if pending:  # the client was never told of it: its ask gets an answer
                out.append(LeaseRefused(lease.client, lease.ask_id, lease.svc.name,
                                        ErrorCode.SERVICE_UNAVAILABLE,
                                        why or f"the lease ended before the worker confirmed it ({reason})"))
            else:
                out.append(LeaseEndToClient(lease.client, lease.svc.name, lease.id, reason, resend))

    def _end_worker_leases(self, w, out: list, *, failed: bool = True) -> None:
        """``w`` is dead (already marked so): its clients resend what they had in flight,
        on its leases and (``failed``: it did not say DISCONNECT) on those it had ended by
        stopping, whose requests it was still to answer."""
        for lease in list(w.leases.values()):
            self._end(lease, WORKER_FAILED, out, tell_worker=False, resend=True)
        stopped, w.stopped = w.stopped, {}
        for lid, (client, service, key) in stopped.items():
            self._unnote(key, lid)
            if failed:
                out.append(LeaseEndToClient(client, service, lid, WORKER_FAILED, True))

    def _leases_resumed(self, lost: float, now: float) -> None:
        """The broker did not run for ``lost`` seconds (`Scheduler.resumed`): a lease its
        worker has not confirmed yet waits that much longer for the confirmation."""
        for lease in self._leases.values():
            if lease.state == PENDING:
                lease.confirm_by = min(now + self._worker_ttl, lease.confirm_by + lost)

    def _lease_unconfirmed(self, lease, out: list) -> None:
        """The worker never confirmed (a worker that set a direct socket but does not speak
        leases, or a lost message): the ask is refused and the worker told to forget it."""
        # (counted refused by `_end`.)  Said as it is: a worker whose heartbeats still arrive
        # is alive (its loop busy in a long batch, say), and the client, told
        # "worker_failed", looked for a fault.
        self._end(lease, UNCONFIRMED, out,
                  why=f"the worker did not confirm the lease within its liveness window ({self._worker_ttl:g} s; "
                      f"alive but busy, or it does not speak leases); requests go through the broker")
        self._dirty[lease.svc] = None

    def _end_client_leases(self, client: bytes, out: list) -> None:
        """``client`` went away: its workers drop its leases, and the notes of those it
        ended (nobody is left to tell)."""
        for lease in list(self._client_leases.get(client, {}).values()):
            self._end(lease, CLIENT_GONE, out, tell_client=False)
        key = self._note_key.pop(client, None)
        mine = self._notes.get(key) if key is not None else None
        if mine:
            for lid, w in list(mine.items()):
                note = w.stopped.get(lid)
                if note is not None and note[0] == client:
                    del w.stopped[lid]
                    del mine[lid]
            if not mine:
                del self._notes[key]

    def _noted(self, client: bytes) -> bool:
        """Whether a note of a lease ``client`` ended is kept (`_note`)."""
        key = self._note_key.get(client)
        mine = self._notes.get(key) if key is not None else None
        return bool(mine) and any(w.stopped.get(lid, (None,))[0] == client for lid, w in mine.items())

    def _note(self, lease) -> None:
        """Note a lease ended while its worker lives (``_Worker.stopped``): the latest
        MAX_STOPPED_NOTES of the worker, and the latest MAX_CLIENT_NOTES of the principal."""
        w = lease.worker
        key = lease.client if lease.principal is None else lease.principal
        notes = w.stopped
        notes[lease.id] = (lease.client, lease.svc.name, key)
        mine = self._notes.setdefault(key, {})
        mine[lease.id] = w
        self._note_key[lease.client] = key
        if len(mine) > MAX_CLIENT_NOTES:
            lid = next(iter(mine))  # its oldest (dicts keep insertion order)
            mine.pop(lid).stopped.pop(lid, None)
        if len(notes) > MAX_STOPPED_NOTES:
            lid = next(iter(notes))  # the worker's oldest
            self._unnote(notes.pop(lid)[2], lid)

    def _unnote(self, key, lid: int) -> None:
        mine = self._notes.get(key)
        if mine is not None:
            mine.pop(lid, None)
            if not mine:
                del self._notes[key]
