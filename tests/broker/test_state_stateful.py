"""broker.state under random interleavings of events (hypothesis stateful testing).

A small model of the outside world (which workers are alive, which tokens each holds,
which requests are still owed a final) checks every action the scheduler returns:

- a client never gets two finals for one request, nor one after it went away;
- a worker never holds more tokens than its credit;
- an expired request is never dispatched, and a shm request only goes to a same-host shm
  worker of its service;
- tick() before next_wakeup() has nothing to do;
- once workers stop dying and time moves on, every request gets exactly one final;
- with several client connections, mapped onto fewer principals (several connections per
  principal, one connection its own principal, and a connection's principal may change
  between its requests): the per-principal caps refuse exactly the requests over them, and
  nothing else; an eviction only ever takes a queued request of another principal (or of the
  newcomer's own, of a less urgent class than the newcomer), and its error goes to that
  request's own connection; it takes, from the least urgent class that principal has queued,
  what that class's walk would serve last (congested, its oldest if walked newest first),
  never a request put back at the front while the principal has another queued
  (`check_victim`); no live request is evicted or refused for a full queue while a request
  past its deadline (not ticked yet) is queued there, and none of those is answered
  QUEUE_FULL (`check_full`); the queue bookkeeping (per-principal FIFOs in rings, per-principal queued counts and their buckets) agrees with the queued requests and
  never holds an empty FIFO or a zero or negative count; each principal's outstanding
  requests and bytes agree with what the model owes it (whatever its connections did), and
  are back to 0 at the end.
"""
from __future__ import annotations

import itertools

from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from broker.state import (
    CLIENT_GONE,
    CancelAtWorker,
    ClientError,
    Config,
    DisconnectWorker,
    Dispatch,
    ErrorCode,
    HeartbeatWorker,
    Priority,
    RecallAtWorker,
    Scheduler,
    LateToClient,
    ToClient,
)

WORKERS = [b"w0", b"w1", b"w2", b"w3"]
# Workers with a direct socket (they take leases, so only their BUSY counts).
DIRECT_WORKERS = {b"w0", b"w1"}
CLIENTS = [b"c0", b"c1", b"c2", b"c3", b"c4"]  # connections (routing identities)
# What the server passes as ``principal`` (None: the connection is its own principal).
PRINCIPALS = [None, 7, "u"]
FIRST_PRINCIPAL = {b"c0": None, b"c1": 7, b"c2": 7, b"c3": "u", b"c4": "u"}
PRINCIPAL_KEYS = CLIENTS + [7, "u"]  # every key the scheduler may count against
SERVICES = ["a", "b"]
HOSTS = ["h0", "h1"]
# Multiples of 1/4 keep every sum of times exact in binary floating point, so the model's
# liveness arithmetic agrees with the scheduler's to the last bit.
STEPS = st.sampled_from([0.25, 0.5, 1.0, 2.0])
SIZES = st.sampled_from([0, 0, 10, 60])
MAX_CLIENT_REQUESTS = 5
MAX_CLIENT_BYTES = 100


class _Req:
    def __init__(self, principal, service, deadline, local_host, size=0, priority=Priority.NORMAL):
        self.principal = principal  # the key it counts against, fixed when it was sent
        self.priority = priority
        self.size = size
        self.service = service
        self.deadline = deadline
        self.local_host = local_host
        self.finals = 0
        self.gone = False  # its client went away: no final is owed any more
        self.left = False  # its client went away, before or after its final
        self.code = None  # its final's code (a ClientError's), once it had one
        self.counted = False  # (gone) its worker's answer was counted
        # its deadline passed while a worker ran it: the broker's error FINAL went, and its
        # count waits for the worker's answer, a timer or the worker's end (through on_direct)
        self.deferred = False


class SchedulerMachine(RuleBasedStateMachine):
    # A multiple of 1/4, like STEPS: waiting for it exercises the recall timer.
    RECALL_AFTER = 0.5

    def __init__(self):
        super().__init__()
        self.cfg = Config(
            heartbeat_interval=1.0,
            heartbeat_liveness=3,
            max_queue=4,
            max_retries=1,
            service_grace=1.0,
            client_liveness=2.0,
            quiet_client_max=3.0,
            max_client_requests=MAX_CLIENT_REQUESTS,
            max_client_bytes=MAX_CLIENT_BYTES,
            recall_after=self.RECALL_AFTER,
        )
        self.directs: list = []  # on_direct calls: direct replies the metrics count
        self.sent_n = 0          # client_request calls
        self.final_n = 0         # finals the broker sent (ToClient final, ClientError)
        self.counted: dict = {}  # (client, rid) -> times counted (admitted requests only)
        self.s = Scheduler(self.cfg, on_direct=lambda *a: self.directs.append(a))
        victim = self.s._victim

        def checked_victim(svc, principal, now, than=None):
            got = victim(svc, principal, now, than)
            self.check_victim(svc, principal, now, than, *got)
            return got

        self.s._victim = checked_victim
        self.now = 0.0
        self.rids = itertools.count()
        self.workers: dict[bytes, dict] = {}  # live, as the outside world sees it
        self.reqs: dict[tuple[bytes, int], _Req] = {}
        self.tokens_seen: set[int] = set()
        self.alone_tokens: set[int] = set()  # dispatches of last attempts (run alone)
        self.tracked: dict[bytes, float] = {}  # clients that heartbeat: what liveness counts from
        self.heard: dict[bytes, float] = {}  # ... and when each was last heard
        self.principal_of = dict(FIRST_PRINCIPAL)  # what the server would pass now

    # ---- checking every action

    def apply(self, actions):
        for a in actions:
            if isinstance(a, Dispatch):
                w = self.workers.get(a.worker)
                assert w is not None, f"dispatch to a dead or unknown worker: {a}"
                assert not w.get("closing"), f"dispatch to a worker whose connection closed: {a}"
                assert w["service"] == a.service
                assert len(w["tokens"]) < w["credit"], "credit exceeded"
                assert a.deadline is None or a.deadline > self.now, "expired request dispatched"
                assert a.token not in self.tokens_seen, "token reused"
                assert 0 <= a.attempt <= self.cfg.max_retries
                # A last attempt runs alone: its worker holds nothing else, and gets nothing
                # else while it holds it.
                assert not self.alone_tokens.intersection(w["tokens"]), f"work sent next to a last attempt: {a}"
                if a.attempt and a.attempt == self.cfg.max_retries:
                    assert not w["tokens"], f"a last attempt sent next to other work: {a}"
                    self.alone_tokens.add(a.token)
                r = self.reqs[(a.client, a.request_id)]
                assert r.finals == 0 and not r.gone
                assert r.service == a.service and r.deadline == a.deadline
                if r.local_host is not None:
                    assert w["host"] == r.local_host and w["shm"], "shm request sent off-host"
                self.tokens_seen.add(a.token)
                w["tokens"][a.token] = (a.client, a.request_id)
            elif isinstance(a, (ToClient, ClientError)):
                # Keyed by connection: a reply routed to another connection of the same
                # principal is not found.
                assert (a.client, a.request_id) in self.reqs, f"misrouted: {a}"
                r = self.reqs[(a.client, a.request_id)]
                assert not r.gone, f"reply to a client that went away: {a}"
                assert r.finals == 0, f"second final: {a}"
                if isinstance(a, ClientError) or a.final:
                    r.finals = 1
                    r.code = a.code if isinstance(a, ClientError) else None
                    if isinstance(a, ClientError) and not a.counted:
                        assert a.code == ErrorCode.DEADLINE_EXCEEDED, a
                        r.deferred = True
                    else:
                        self.final_n += 1
                        self.counted[(a.client, a.request_id)] = self.counted.get((a.client, a.request_id), 0) + 1
            elif isinstance(a, LateToClient):
                # Only for a request its deadline answered (one its client had cancelled, its
                # worker not confirming by then, ends `cancelled`: _expire_deadline), to its
                # client while it is here.
                r = self.reqs[(a.client, a.request_id)]
                assert r.finals == 1 and r.code in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CANCELLED) \
                    and not r.left, f"late reply forwarded wrongly: {a}"
            elif isinstance(a, CancelAtWorker):
                assert a.token in self.workers[a.worker]["tokens"]
            elif isinstance(a, RecallAtWorker):
                w = self.workers[a.worker]
                assert w["recall"], "RECALL to a worker that did not ask for it"
                assert a.tokens and all(t in w["tokens"] for t in a.tokens)
                assert not (set(a.tokens) & w["recalled"]), "asked twice for one dispatch"
                w["recalled"].update(a.tokens)
                w["unanswered"].update(a.tokens)
            elif isinstance(a, HeartbeatWorker):
                assert a.worker in self.workers
            elif isinstance(a, DisconnectWorker):
                self.workers.pop(a.worker, None)
            else:  # pragma: no cover
                raise AssertionError(f"unknown action {a!r}")

    def check_victim(self, svc, principal, now, than, req, oldest):
        """An eviction (Admission) takes one of the heaviest's queued requests: of its least
        urgent class queued, the one that class's walk would serve last (from a FIFO walked
        newest first, congested: its oldest; else its newest); never one put back at the
        front (a retry, given back) while it has another queued.  For its own newcomer
        (``than``: the newcomer's class), only one of a less urgent class, never one put
        back at the front; none: the newcomer is refused."""
        lifo = self.s._congested(svc, now)
        fifos = [(pri, list(f)) for pri, f in ((pri, svc.classes[pri].get(principal)) for pri in (2, 1, 0))
                 if f and (than is None or pri > than)]

        def newest_first(f):
            return lifo and not f[0].front and f[0].deadline is not None

        last = [f[0] if newest_first(f) else f[-1] for _, f in fifos]
        free = [r for r in last if not r.front]
        if req is None:
            assert than is not None and not free, "refused the newcomer though a less urgent request could go"
            return
        assert req in [r for _, f in fifos for r in f], "evicted a request its principal has not queued there"
        want = free[0] if free else (last[0] if than is None else None)
        assert req is want, (f"evicted {req.request_id} (class {req.priority}), not {want and want.request_id}: "
                             f"what the least urgent class's walk would serve last")
        assert oldest == newest_first(next(f for _, f in fifos if req in f))
        self.evictions = getattr(self, "evictions", 0) + 1

    def touch(self, client):
        if client in self.tracked:
            self.tracked[client] = self.heard[client] = self.now

    def client_gone(self, client):
        self.tracked.pop(client, None)
        for (c, _), r in self.reqs.items():
            if c == client:
                r.left = True
                if r.finals == 0:
                    r.gone = True

    def owed(self):
        return [k for k, r in self.reqs.items() if r.finals == 0 and not r.gone]

    def usage(self, principal):
        """What the scheduler must count against ``principal``: the requests still owed, of
        all its connections."""
        live = [r for r in self.reqs.values() if r.principal == principal and r.finals == 0
                and not r.gone]
        return {"outstanding": len(live), "bytes": sum(r.size for r in live)}

    def key(self, client):
        p = self.principal_of[client]
        return client if p is None else p

    # ---- workers

    @rule(
        worker=st.sampled_from(WORKERS),
        service=st.sampled_from(SERVICES),
        credit=st.integers(1, 3),
        host=st.sampled_from(HOSTS + [None]),
        shm=st.booleans(),
        recall=st.booleans(),
    )
    def worker_ready(self, worker, service, credit, host, shm, recall):
        self.ready(worker, service, credit, host, shm, recall)

    def ready(self, worker, service, credit, host, shm, recall):
        transports = frozenset({"inline", "shm"} if shm else {"inline"})
        if worker not in self.workers:
            self.workers[worker] = {"service": service, "credit": credit, "host": host,
                                    "shm": shm and host is not None, "tokens": {},
                                    "recall": recall, "recalled": set(), "unanswered": set()}
            fresh = True
        else:
            fresh = False
        out = self.s.worker_ready(worker, service, self.now, credit=credit, host=host,
                                  transports=transports, recall=recall,
                                  direct="ipc:///run/direct.ipc" if worker in DIRECT_WORKERS else None)
        if not fresh:
            assert isinstance(out[0], DisconnectWorker) and out[0].worker == worker
        self.apply(out)

    @rule(worker=st.sampled_from(WORKERS))
    def worker_disconnect(self, worker):
        out = self.s.worker_disconnect(worker, self.now)
        self.workers.pop(worker, None)
        self.apply(out)

    @rule(worker=st.sampled_from(WORKERS))
    def worker_closed(self, worker):
        # The server saw its connection close; the verdict (worker_disconnect) follows.
        assert self.s.worker_closed(worker) == []
        if worker in self.workers:
            self.workers[worker]["closing"] = True

    @rule(worker=st.sampled_from(WORKERS))
    def worker_heartbeat(self, worker):
        out = self.s.worker_seen(worker, self.now)
        if worker in self.workers:
            assert out == []
        else:
            assert [type(a) for a in out] == [DisconnectWorker]

    @rule(worker=st.sampled_from(WORKERS), busy=st.booleans())
    def worker_busy(self, worker, busy):
        """BUSY (a long leased batch runs there) on or off: dispatch puts it last, and what
        it holds may all be taken back for an idle worker.  From a worker without a direct
        socket (it takes no leases) it is ignored."""
        out = self.s.worker_busy(worker, busy, self.now)
        if worker not in self.workers:
            assert [type(a) for a in out] == [DisconnectWorker]
            return
        if worker not in DIRECT_WORKERS:
            assert out == [] and not self.s._workers[worker].busy
        self.apply(out)

    @precondition(lambda self: any(w["tokens"] for w in self.workers.values()))
    @rule(data=st.data(), final=st.booleans())
    def worker_reply(self, data, final):
        worker = data.draw(st.sampled_from(sorted(k for k, w in self.workers.items()
                                                  if w["tokens"])))
        token = data.draw(st.sampled_from(sorted(self.workers[worker]["tokens"])))
        self.s.worker_seen(worker, self.now)
        if final:
            out = self.s.worker_final(worker, token, self.now, "result")
            del self.workers[worker]["tokens"][token]
        else:
            out = self.s.worker_partial(worker, token, self.now, "chunk")
        self.apply(out)

    @precondition(lambda self: any(w["tokens"] for w in self.workers.values()))
    @rule(data=st.data())
    def worker_done(self, data):
        """Direct reply: the worker delivered FINALs to their clients itself, then DONE."""
        worker = data.draw(st.sampled_from(sorted(k for k, w in self.workers.items()
                                                  if w["tokens"])))
        held = self.workers[worker]["tokens"]
        tokens = data.draw(st.lists(st.sampled_from(sorted(held)), min_size=1, unique=True))
        self.s.worker_seen(worker, self.now)
        owed = 0
        deferred = set()
        counted = {d[-1] for d in self.directs}
        for token in tokens:
            key = held.pop(token)
            r = self.reqs[key]
            if r.deferred and key not in counted:
                deferred.add(key)  # its deadline's count waited for this answer
                owed += 1
            elif r.finals == 0 and not r.gone:
                r.finals = 1  # the client has it; the broker must not send another
                owed += 1
            elif r.finals == 0 and r.gone and not r.counted:
                r.counted = True  # its client left first: the worker's answer is its one count
                owed += 1
        before = len(self.directs)
        codes = [0 if i % 2 else 499 for i in range(len(tokens))]
        self.apply(self.s.worker_done(worker, tokens, self.now, codes, [0.0] * len(tokens)))
        # Counted once for each request whose client was still waiting, and only those.
        assert len(self.directs) - before == owed
        for service, code, enq, disp, fin, key in self.directs[before:]:
            if key in deferred:  # sent at `now` (age 0): as the client saw it, at its deadline or after
                assert code in (0, 499, ErrorCode.DEADLINE_EXCEEDED) and enq <= disp <= fin <= self.now
                continue
            # (499 to a request whose client left first: the broker's own cancellation, CLIENT_GONE)
            assert code in (0, 499, CLIENT_GONE) and enq <= disp <= fin == self.now

    @precondition(lambda self: any(w["tokens"] for w in self.workers.values()))
    @rule(data=st.data())
    def worker_finishes_all(self, data):
        """A worker answers everything it holds at once: it is idle, maybe next to a busy one."""
        worker = data.draw(st.sampled_from(sorted(k for k, w in self.workers.items()
                                                  if w["tokens"])))
        self.s.worker_seen(worker, self.now)
        for token in sorted(self.workers[worker]["tokens"]):
            del self.workers[worker]["tokens"][token]
            self.apply(self.s.worker_final(worker, token, self.now, "result"))

    @precondition(lambda self: any(w["tokens"] for w in self.workers.values()))
    @rule(data=st.data(), asked=st.booleans())
    def worker_returns(self, data, asked):
        self.worker_returned(data, asked)

    def worker_returned(self, data, asked):
        """A worker gives requests back unstarted: recalled ones (asked) or any (unasked)."""
        def held(w):
            return w["recalled"] & set(w["tokens"]) if asked else set(w["tokens"])
        candidates = sorted(k for k, w in self.workers.items() if held(w))
        if not candidates:
            return
        worker = data.draw(st.sampled_from(candidates))
        w = self.workers[worker]
        pool = sorted(held(w))
        if not pool:
            return
        tokens = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
        self.s.worker_seen(worker, self.now)
        for token in tokens:
            del w["tokens"][token]
        self.apply(self.s.worker_returned(worker, tokens, self.now))

    @precondition(lambda self: self.tokens_seen)
    @rule(data=st.data(), worker=st.sampled_from(WORKERS))
    def stale_reply(self, data, worker):
        token = data.draw(st.sampled_from(sorted(self.tokens_seen)))
        held = self.workers.get(worker, {}).get("tokens", {})
        if token in held:
            return
        assert self.s.worker_final(worker, token, self.now, "stale") == []
        assert self.s.worker_partial(worker, token, self.now, "stale") == []
        assert self.s.worker_done(worker, [token], self.now) == []
        assert self.s.worker_returned(worker, [token], self.now) == []

    # ---- clients

    @rule(
        client=st.sampled_from(CLIENTS),
        service=st.sampled_from(SERVICES),
        priority=st.sampled_from(list(Priority)),
        deadline=st.sampled_from([None, None, 0.0, 0.25, 1.0, 3.0]),
        local_host=st.sampled_from([None, None] + HOSTS),
        size=SIZES,
    )
    def client_request(self, client, service, priority, deadline, local_host, size):
        self.send(client, service, priority, deadline, local_host, size)

    @rule(
        client=st.sampled_from(CLIENTS),
        service=st.sampled_from(SERVICES),
        priority=st.sampled_from(list(Priority)),
        n=st.integers(2, 6),
        size=SIZES,
        deadline=st.sampled_from([None, None, 3.0, 0.25]),
    )
    def client_burst(self, client, service, priority, n, size, deadline):
        """Several requests at once: fills queues, reaches the caps, provokes evictions
        (with a deadline, congested: from FIFOs walked newest first; a short one, past by the
        next step: full queues holding requests past their deadline, `check_full`)."""
        for _ in range(n):
            self.send(client, service, priority, deadline, None, size)

    def send(self, client, service, priority, deadline, local_host, size):
        rid = next(self.rids)
        dl = None if deadline is None else self.now + deadline
        key = self.key(client)
        held = self.usage(key)
        over = (held["outstanding"] >= MAX_CLIENT_REQUESTS
                or (size and held["bytes"] + size > MAX_CLIENT_BYTES))
        self.reqs[(client, rid)] = _Req(key, service, dl, local_host, size, priority)
        self.sent_n += 1
        out = self.s.client_request(client, rid, service, self.now, payload=rid,
                                    priority=priority, deadline=dl, local_host=local_host,
                                    size=size, principal=self.principal_of[client])
        self.touch(client)
        if deadline == 0.0:
            assert [(type(a), a.code) for a in out] == [(ClientError,
                                                         ErrorCode.DEADLINE_EXCEEDED)]
        elif over:
            # Refused at once (NOT_LOCAL is checked first), and nothing else happens.
            assert [(type(a), a.request_id) for a in out] == [(ClientError, rid)], out
            assert out[0].code in (ErrorCode.QUEUE_FULL, ErrorCode.NOT_LOCAL)
        for a in out:
            if isinstance(a, ClientError) and "max_client_" in a.message:
                assert over and a.request_id == rid and a.code == ErrorCode.QUEUE_FULL
            if isinstance(a, ClientError) and a.request_id != rid and \
                    a.code == ErrorCode.QUEUE_FULL:
                # An eviction: the newcomer's own principal's (whichever connection) only
                # if less urgent than the newcomer; always a queued request.
                r = self.reqs[(a.client, a.request_id)]
                assert r.principal != key or (r.priority > priority and "of its own" in a.message), a
                assert "largest share" in a.message
                assert not any(rid_ == a.request_id for w in self.workers.values()
                               for (_, rid_) in w["tokens"].values())
        self.check_full(service, out)
        self.apply(out)

    def check_full(self, service, out):
        """A full queue turns away a live request (an eviction, or the newcomer refused) only
        once no request past its deadline is queued there: those leave first, answered
        DEADLINE_EXCEEDED as the tick would, even if no tick ran since their deadline; and a
        request past its deadline is never answered QUEUE_FULL."""
        full = [a for a in out if isinstance(a, ClientError) and a.code == ErrorCode.QUEUE_FULL
                and "largest share" in a.message]
        if not full:
            return
        for a in full:
            dl = self.reqs[(a.client, a.request_id)].deadline
            assert dl is None or dl > self.now, f"a request past its deadline answered QUEUE_FULL: {a}"
        svc = self.s._services.get(service)
        dead = [(r.client, r.request_id) for ring in svc.classes for fifo in ring.values() for r in fifo
                if r.deadline is not None and r.deadline <= self.now]
        assert not dead, f"{full[0]} while requests past their deadline were queued: {dead}"

    @rule(client=st.sampled_from(CLIENTS), principal=st.sampled_from(PRINCIPALS))
    def change_principal(self, client, principal):
        """The server would now pass another principal for this identity (a reconnect that
        reuses it, say): requests already admitted stay counted where they were."""
        self.principal_of[client] = principal

    @precondition(lambda self: self.owed())
    @rule(data=st.data(), principal=st.sampled_from(PRINCIPALS))
    def duplicate_request(self, data, principal):
        # Duplicate ids are per connection, whatever the principal.
        client, rid = data.draw(st.sampled_from(sorted(self.owed())))
        self.sent_n += 1
        out = self.s.client_request(client, rid, "a", self.now, payload=None,
                                    principal=principal)
        self.touch(client)
        assert [(type(a), a.code) for a in out] == [(ClientError, ErrorCode.PROTOCOL_ERROR)]
        self.final_n += 1  # the refusal is that request's one count

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def client_cancel(self, data):
        client, rid = data.draw(st.sampled_from(sorted(self.reqs)))
        out = self.s.client_cancel(client, rid, self.now)
        self.touch(client)
        self.apply(out)

    @rule(client=st.sampled_from(CLIENTS))
    def client_heartbeat(self, client):
        self.s.client_heartbeat(client, self.now)
        self.tracked[client] = self.heard[client] = self.now

    @rule(client=st.sampled_from(CLIENTS))
    def client_kept(self, client):
        # The server's look: the client's ipc connection is open.
        assert self.s.client_kept(client, self.now) == []
        if client in self.tracked and self.now - self.heard[client] <= self.cfg.quiet_client_max:
            self.tracked[client] = self.now

    @rule(client=st.sampled_from(CLIENTS))
    def client_seen(self, client):
        assert self.s.client_seen(client, self.now) == []
        self.touch(client)

    @rule(client=st.sampled_from(CLIENTS))
    def client_disconnect(self, client):
        out = self.s.client_disconnect(client, self.now)
        self.client_gone(client)
        self.apply(out)

    # ---- time

    @rule(dt=STEPS)
    def advance(self, dt):
        wake = self.s.next_wakeup(self.now)
        self.now += dt
        out = self.s.tick(self.now)
        if wake is None or wake > self.now:
            assert out == [], f"tick before next_wakeup ({wake}) did something: {out}"
        self.apply(out)
        ttl = self.cfg.client_liveness
        for client, seen in list(self.tracked.items()):
            if seen + ttl <= self.now:
                self.client_gone(client)

    @rule(dt=STEPS)
    def advance_without_tick(self, dt):
        # The server may handle a message before its timer fires: nothing may rely on
        # tick() having run first (an expired request must still never be dispatched).
        self.now += dt

    # ---- invariants

    @invariant()
    def credit_and_liveness_agree(self):
        for ident, w in self.s._workers.items():
            assert len(w.in_flight) <= w.credit
            assert ident in self.workers
        assert set(self.workers) == set(self.s._workers)
        for service in SERVICES:
            assert self.s.has_service(service) == any(
                w["service"] == service for w in self.workers.values())

    @invariant()
    def recall_bookkeeping_agrees(self):
        for svc in self.s._services.values():
            for w in svc.workers.values():
                if w.closing:  # takes nothing, gives nothing back: in neither
                    assert w not in svc.idle and w not in svc.deep
                    continue
                assert (w in svc.idle) == (not w.in_flight and not w.busy and w.iso is None)
                if w.iso is not None:  # set aside for a last attempt, or running it alone
                    r = w.iso
                    assert r.iso is w and r.alone
                    if r.worker is w:
                        assert list(w.in_flight.values()) == [r] and w not in svc.aside
                    else:
                        assert r.state == 0 and w in svc.aside and r not in svc.lone  # QUEUED, waiting for it
                assert (w in svc.deep) == (w.recall and (len(w.in_flight) >= 2 or bool(w.in_flight) and w.busy))
                assert w.awaiting == sum(1 for o in self.s._workers.values()
                                         for r in o.in_flight.values() if r.thief is w)
            queued_alone = {r for ring in svc.classes for fifo in ring.values() for r in fifo if r.alone}
            assert set(svc.lone) == {r for r in queued_alone if r.iso is None}
            assert {w.iso for w in svc.aside} == {r for r in queued_alone if r.iso is not None}
            assert svc.isos == sum(1 for w in svc.workers.values() if w.iso is not None)
            assert set(svc.idle) <= set(svc.workers.values())
            assert set(svc.deep) <= set(svc.workers.values())

    @invariant()
    def queue_bookkeeping_agrees(self):
        for svc in self.s._services.values():
            counts: dict[object, int] = {}
            for pri, ring in enumerate(svc.classes):
                for principal, fifo in ring.items():
                    assert fifo, "empty FIFO left in a ring"
                    for r in fifo:
                        assert r.principal == principal and r.priority == pri and r.svc is svc
                        assert self.reqs[(r.client, r.request_id)].principal == principal
                        assert r.state == 0  # QUEUED
                        counts[principal] = counts.get(principal, 0) + 1
            assert all(svc.count(p) == n > 0 for p, n in counts.items())
            assert svc.queued == sum(counts.values()) >= 0
            if svc.tiers is not None:  # kept only while the queue is long
                assert svc.queued > self.cfg.max_queue // 2
                tiers: dict[int, set] = {}
                for p, n in counts.items():
                    tiers.setdefault(n, set()).add(p)
                assert {n: set(t) for n, t in svc.tiers.items()} == tiers
                assert svc.top == max(counts.values(), default=0)

    @invariant()
    def client_usage_agrees(self):
        for p in PRINCIPAL_KEYS:
            assert self.s.client_usage(p) == self.usage(p)
        assert all(b > 0 for b in self.s._bytes.values())
        assert all(n > 0 for n in self.s._outstanding.values())
        assert self.s.stats()["principals"] == sum(
            1 for p in PRINCIPAL_KEYS if self.usage(p)["outstanding"])

    def teardown(self):
        # The verdict on those whose connection closed; then workers stop dying: everyone
        # stays audible and answers everything it holds.
        for ident, w in list(self.workers.items()):
            if w.get("closing"):
                out = self.s.worker_disconnect(ident, self.now)
                self.workers.pop(ident, None)
                self.apply(out)
        for _ in range(200):
            if not self.owed() and not any(w["tokens"] for w in self.workers.values()):
                break
            self.now += 0.5
            for ident, w in list(self.workers.items()):
                self.apply(self.s.worker_seen(ident, self.now))
                for token in list(w["tokens"]):
                    out = self.s.worker_final(ident, token, self.now, "result")
                    del w["tokens"][token]
                    self.apply(out)
            for client in self.tracked:
                self.s.client_seen(client, self.now)
                self.tracked[client] = self.heard[client] = self.now
            self.apply(self.s.tick(self.now))
        assert self.owed() == [], "requests left without a final"
        # The metrics' view: every request counted exactly once, by the final the broker
        # sent, or through on_direct (direct replies, and requests whose client left).
        assert self.final_n + len(self.directs) == self.sent_n, (self.final_n, len(self.directs), self.sent_n)
        for *_, key in self.directs:
            self.counted[key] = self.counted.get(key, 0) + 1
        # ... and per request: each admitted request exactly once (a duplicate id's refusal
        # is the refused copy's count, made while the original was live).
        twice = {k: n for k, n in self.counted.items() if n != 1}
        assert not twice, twice
        st_ = self.s.stats()
        assert st_["requests"] == 0
        assert st_["client_requests"] == 0 and st_["client_bytes"] == 0
        assert self.s._bytes == {} and self.s._requests == {} and self.s._outstanding == {}
        assert all(sum(v["queued"].values()) == 0 and v["in_flight"] == 0
                   for v in st_["services"].values())


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # No explain phase: on Python < 3.12 it traces every line while it shrinks a failure,
    # and a long machine then runs past pytest-timeout, which reports a Timeout instead of
    # the failing steps (as a fresh-clone run did once).
    phases=[p for p in Phase if p is not Phase.explain],
)
TestScheduler = SchedulerMachine.TestCase


def _progress_ok(s: Scheduler) -> None:
    """With recall_after 0: after every event, no worker that holds nothing (and waits for no
    RECALL answer) sits next to a worker it could take something back from."""
    for svc in s._services.values():
        for thief in svc.idle:
            if thief.in_flight or thief.awaiting:
                continue
            for victim in svc.deep:
                # RUNNING, not asked for yet, not on its last attempt (that one runs alone)
                mine = [r for r in victim.in_flight.values() if r.state == 1 and not r.recalled and not r.alone]
                if (len(mine) if victim.busy else len(mine) // 2) < 1:
                    continue
                able = [r for r in mine if svc.pools.get(r.local_host) in thief.pools]
                assert not able, f"idle {thief.ident} could take {len(able)} back from {victim.ident}"


class RecallMachine(SchedulerMachine):
    """The same model, with workers that make taking work back likely: one service, deep
    credit, most of them answering RECALL, asked at once."""

    RECALL_AFTER = 0.0

    @rule(
        worker=st.sampled_from(WORKERS),
        credit=st.integers(2, 3),
        host=st.sampled_from(HOSTS + [None]),
        shm=st.booleans(),
        recall=st.sampled_from([True, True, False]),
    )
    def worker_ready(self, worker, credit, host, shm, recall):
        self.ready(worker, SERVICES[0], credit, host, shm, recall)


    @precondition(lambda self: any(w["unanswered"] & set(w["tokens"]) for w in self.workers.values()))
    @rule(data=st.data())
    def worker_answers_recall(self, data):
        """A worker answers a RECALL: some given back (not started), the rest kept."""
        worker = data.draw(st.sampled_from(sorted(k for k, w in self.workers.items()
                                                  if w["unanswered"] & set(w["tokens"]))))
        w = self.workers[worker]
        asked = sorted(w["unanswered"] & set(w["tokens"]))
        back = data.draw(st.lists(st.sampled_from(asked), unique=True))
        kept = [t for t in asked if t not in back]
        w["unanswered"] -= set(asked)
        self.s.worker_seen(worker, self.now)
        for token in back:
            del w["tokens"][token]
        self.apply(self.s.worker_returned(worker, back, self.now, kept))

    @invariant()
    def nobody_idles_next_to_work_it_could_take(self):
        _progress_ok(self.s)


RecallMachine.TestCase.settings = SchedulerMachine.TestCase.settings
TestSchedulerRecall = RecallMachine.TestCase
