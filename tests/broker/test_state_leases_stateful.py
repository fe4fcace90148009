"""Leases under random interleavings (hypothesis stateful testing): the request machine of
test_state_stateful.py, with two of its four workers taking leases and clients asking for,
ending and losing them among everything else.  Checked on every action and after every step:

- a lease goes only to a live worker of its service with a direct socket, and never leaves a
  worker less than half its credit for brokered requests;
- brokered dispatch never uses leased credit (a worker holds fewer tokens than its credit
  minus its leased slots);
- the client hears of a lease only after its worker confirmed it, every ask gets exactly one
  answer (LEASED or an error), and an end is told only to the side that did not end it;
- a lease never outlives its worker or its client: a dead worker's leases end at once with
  ``resend`` for the client, a departed client's with a word to the worker;
- a lease ended while its worker lives (by the worker, the client or a drain; not a departed
  client's) is told to its client once more, ``worker_failed`` with ``resend``, if that
  worker then dies without saying DISCONNECT (it still owed the lease's requests their
  replies), and never after a DISCONNECT;
- the scheduler's leased credit agrees with the model's, and the request rules of the parent
  machine (one final per request, caps, queues) still hold.
"""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from broker.leases import (
    LeaseEndToClient,
    LeaseEndToWorker,
    LeaseRefused,
    LeaseToClient,
    LeaseToWorker,
    WORKER_FAILED,
)
from broker.protocol import ErrorCode
from broker.state import CancelAtWorker, ClientError, Dispatch, DisconnectWorker, RecallAtWorker
from tests.broker.test_state_stateful import CLIENTS, SERVICES, SchedulerMachine

DIRECT = {b"w0", b"w1"}  # the workers with a direct socket
EP = "ipc:///run/direct.ipc"



def _flush_output(a) -> bool:
    """What any scheduling pass may emit: a dispatch, a recall (requests parked behind a
    busy worker asked back for an idle one, once their time came: `advance_without_tick`
    lets it come before a tick), or a deadline's expiry (its error FINAL, and the CANCEL of
    a running request)."""
    return (isinstance(a, (Dispatch, CancelAtWorker, RecallAtWorker))
            or (isinstance(a, ClientError) and a.code == ErrorCode.DEADLINE_EXCEEDED))

class LeaseMachine(SchedulerMachine):
    def __init__(self):
        super().__init__()
        self.leases: dict[int, dict] = {}  # lease id -> {client, worker, service, slots, active}
        self.asks: dict[tuple[bytes, int], int] = {}  # (client, ask id) -> answers so far
        self.ask_ids = iter(range(10**9, 2 * 10**9))
        self.current_ask = None  # the ask whose LeaseToWorker may come in the actions being applied
        self.ended: dict[int, dict] = {}  # leases the worker was told of in the actions being applied
        self.departed: set[bytes] = set()  # clients gone (disconnect, silence) and not back since
        self.noted: dict[int, dict] = {}  # active leases ended while their worker lived (resend if it dies)

    def leased(self, worker: bytes) -> int:
        return sum(le["slots"] for le in self.leases.values() if le["worker"] == worker)

    # ---- workers: some have direct sockets

    def ready(self, worker, service, credit, host, shm, recall):
        transports = frozenset({"inline", "shm"} if shm else {"inline"})
        fresh = worker not in self.workers
        if fresh:
            self.workers[worker] = {"service": service, "credit": credit, "host": host,
                                    "shm": shm and host is not None, "tokens": {},
                                    "recall": recall, "recalled": set(), "unanswered": set()}
        out = self.s.worker_ready(worker, service, self.now, credit=credit, host=host,
                                  transports=transports, recall=recall,
                                  direct=EP if worker in DIRECT else None)
        if not fresh:
            assert isinstance(out[0], DisconnectWorker) and out[0].worker == worker
        self.apply(out)

    # ---- checking every action

    def apply(self, actions):
        for a in actions:  # one at a time, in order, the parent's actions too
            if isinstance(a, Dispatch):
                w = self.workers.get(a.worker)
                assert w is not None
                assert len(w["tokens"]) < w["credit"] - self.leased(a.worker), "leased credit dispatched"
                super().apply([a])
            elif isinstance(a, LeaseToWorker):
                w = self.workers.get(a.worker)
                assert w is not None and a.worker in DIRECT, f"lease to {a.worker!r}"
                assert w["service"] == a.service and a.slots >= 1
                assert self.leased(a.worker) + a.slots <= w["credit"] // 2, "less than half left for the broker"
                assert a.lease not in self.leases
                assert self.current_ask is not None and self.current_ask[0] == a.client, "unasked lease"
                self.leases[a.lease] = {"client": a.client, "worker": a.worker, "service": a.service,
                                        "slots": a.slots, "active": False, "ask": self.current_ask[1]}
                self.current_ask = None
            elif isinstance(a, LeaseToClient):
                le = self.leases.get(a.lease)
                assert le is not None and not le["active"] and le["client"] == a.client
                assert le["ask"] == a.ask_id and le["slots"] == a.slots and a.endpoint == EP
                le["active"] = True
                self.answer(a.client, a.ask_id)
            elif isinstance(a, LeaseRefused):
                for lid, le in list(self.leases.items()):
                    if le["client"] == a.client and le["ask"] == a.ask_id:
                        assert not le["active"], "refused after it was granted"
                        del self.leases[lid]
                self.answer(a.client, a.ask_id)
            elif isinstance(a, LeaseEndToClient):
                # A drain tells the worker first, then the client, of one lease.
                le = self.leases.pop(a.lease, None) or self.ended.pop(a.lease, None)
                if le is None:  # an ended lease's worker died before saying DISCONNECT
                    le = self.noted.pop(a.lease, None)
                    assert le is not None and a.reason == WORKER_FAILED and a.resend, a
                assert le is not None and le["active"] and le["client"] == a.client, a
                assert a.resend == (a.reason == WORKER_FAILED)
            elif isinstance(a, LeaseEndToWorker):
                le = self.leases.pop(a.lease, None)
                assert le is not None and le["worker"] == a.worker and a.worker in self.workers, a
                self.ended[a.lease] = le
            else:
                super().apply([a])
        self.ended = {}

    def client_gone(self, client):
        super().client_gone(client)
        self.departed.add(client)
        # The notes of the leases it ended go with it: nobody is left to tell.
        self.noted = {lid: le for lid, le in self.noted.items() if le["client"] != client}
        for key in self.asks:  # a client that went away is owed no answer
            if key[0] == client:
                self.asks[key] = 1

    def answer(self, client, ask_id):
        key = (client, ask_id)
        assert key in self.asks and self.asks[key] == 0, f"second answer to {key}"
        assert client not in self.departed, f"an answer to a client that went away: {key}"
        self.asks[key] = 1

    # ---- lease events

    @rule(client=st.sampled_from(CLIENTS), service=st.sampled_from(SERVICES), slots=st.integers(1, 3))
    def client_lease(self, client, service, slots):
        ask = next(self.ask_ids)
        self.asks[(client, ask)] = 0
        self.departed.discard(client)  # it is back
        out = self.s.client_lease(client, None, ask, service, self.now, slots=slots, secret=b"x")
        if any(isinstance(a, LeaseToWorker) for a in out):
            self.tracked[client] = self.heard[client] = self.now  # a leaseholder is tracked from the lease's placement
        self.current_ask = (client, ask)
        self.apply(out)
        self.current_ask = None

    @precondition(lambda self: any(not le["active"] for le in self.leases.values()))
    @rule(data=st.data(), ok=st.booleans())
    def worker_confirms(self, data, ok):
        lid = data.draw(st.sampled_from(sorted(k for k, le in self.leases.items() if not le["active"])))
        worker = self.leases[lid]["worker"]
        self.s.worker_seen(worker, self.now)
        self.apply(self.s.worker_leased(worker, lid, self.now, ok=ok))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def client_ends_a_lease(self, data):
        lid = data.draw(st.sampled_from(sorted(self.leases)))
        le = self.leases[lid]
        out = self.s.client_lease_end(le["client"], lid, self.now)
        # Besides the worker's LEASE_END, only what the scheduling pass after it does: the
        # freed slots dispatched, and requests whose deadline passed before a tick expired
        # (`advance_without_tick`: the broker may handle this before its timer fires).
        assert [type(a) for a in out if not _flush_output(a)] == [LeaseEndToWorker], out
        self.apply(out)
        self.note(lid, le)
        if not le["active"]:  # withdrawn before its answer: it needs none now
            self.answer(le["client"], le["ask"])

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def worker_ends_a_lease(self, data):
        lid = data.draw(st.sampled_from(sorted(self.leases)))
        le = self.leases[lid]
        self.s.worker_seen(le["worker"], self.now)
        out = self.s.worker_lease_end(le["worker"], lid, self.now)
        self.apply(out)
        assert lid not in self.leases
        self.note(lid, le)

    @rule()
    def broker_ends_every_lease(self):
        ending = dict(self.leases)
        self.apply(self.s.end_leases("drain", self.now))
        assert self.leases == {}
        for lid, le in ending.items():
            self.note(lid, le)

    def note(self, lid, le):
        if le["active"] and le["worker"] in self.workers:
            self.noted[lid] = le

    @precondition(lambda self: any(le["active"] for le in self.leases.values()))
    @rule(data=st.data(), goodbye=st.booleans())
    def worker_stops_then_goes(self, data, goodbye):
        """A worker ends an active lease by stopping, then leaves: with a DISCONNECT (it
        finished what it held) or dying (its client must resend)."""
        lid = data.draw(st.sampled_from(sorted(k for k, le in self.leases.items() if le["active"])))
        self.worker_stops_then_goes_lease(lid, goodbye)

    @rule(worker=st.sampled_from(sorted(DIRECT)), client=st.sampled_from(CLIENTS), goodbye=st.booleans())
    def lease_stop_and_go(self, worker, client, goodbye):
        """The whole sequence in one step (random rules reach it too rarely): a direct
        worker with room for a lease, a lease placed on it and confirmed, the worker ending
        it by stopping, then leaving with or without a DISCONNECT."""
        if worker not in self.workers:
            self.ready(worker, SERVICES[0], 3, None, False, False)
        if worker not in self.workers or self.workers[worker]["credit"] - self.leased(worker) < 2:
            return  # no room for a lease on it (its credit is the parent machine's draw)
        service = self.workers[worker]["service"]
        before = set(self.leases)
        self.client_lease(client, service, 1)
        mine = [lid for lid in set(self.leases) - before if self.leases[lid]["worker"] == worker]
        if not mine:
            return  # placed on another worker of the service, or refused: nothing to stop here
        [lid] = mine
        self.s.worker_seen(worker, self.now)
        self.apply(self.s.worker_leased(worker, lid, self.now, ok=True))
        if not self.leases.get(lid, {}).get("active"):
            return
        self.worker_stops_then_goes_lease(lid, goodbye)

    def worker_stops_then_goes_lease(self, lid, goodbye):
        le = self.leases[lid]
        worker = le["worker"]
        self.s.worker_seen(worker, self.now)
        self.apply(self.s.worker_lease_end(worker, lid, self.now))
        self.note(lid, le)
        assert lid in self.noted
        out = self.s.worker_disconnect(worker, self.now, failed=not goodbye)
        self.workers.pop(worker, None)
        if goodbye:
            assert not any(isinstance(a, LeaseEndToClient) and a.lease in self.noted for a in out)
            self.noted = {k: v for k, v in self.noted.items() if v["worker"] != worker}
        self.apply(out)
        assert lid not in self.noted

    @precondition(lambda self: self.noted)
    @rule(data=st.data())
    def worker_says_goodbye(self, data):
        """A clean DISCONNECT (after its drain): nothing more to tell anyone of its notes."""
        worker = data.draw(st.sampled_from(sorted({le["worker"] for le in self.noted.values()})))
        out = self.s.worker_disconnect(worker, self.now, failed=False)
        self.workers.pop(worker, None)
        self.apply(out)
        assert not any(isinstance(a, LeaseEndToClient) and a.lease in self.noted for a in out)
        self.noted = {lid: le for lid, le in self.noted.items() if le["worker"] != worker}

    # ---- invariants

    @invariant()
    def leases_live_with_their_worker_and_client(self):
        for le in self.leases.values():
            assert le["worker"] in self.workers, "a dead worker's lease did not end"
            assert le["client"] in self.tracked, "a departed client's lease did not end"
        for ident, w in self.s._workers.items():
            assert w.leased == self.leased(ident) and len(w.leases) == sum(
                1 for le in self.leases.values() if le["worker"] == ident)
            assert w.leased <= w.credit // 2
        assert sum(v["leases"] for v in self.s.stats()["services"].values()) == len(self.leases)

    @invariant()
    def a_dead_workers_notes_were_told(self):
        for lid, le in self.noted.items():
            assert le["worker"] in self.workers, f"lease {lid}'s worker died and its client was not told"

    @invariant()
    def every_ask_is_answered_or_pending(self):
        pending = {(le["client"], le["ask"]) for le in self.leases.values() if not le["active"]}
        for key, n in self.asks.items():
            assert n == 1 or key in pending, f"ask {key} left without an answer"


LeaseMachine.TestCase.settings = SchedulerMachine.TestCase.settings
TestSchedulerLeases = LeaseMachine.TestCase
