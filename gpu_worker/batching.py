"""A pure dynamic batcher: which pending requests form the next batch, and how long to wait.

No sockets, no clock reads, no torch: every method that depends on time takes ``now``
(seconds, any monotonic origin, the same one as ``Pending.arrived`` and ``deadline``).

Policy
------
* Compatibility.  Only requests with equal ``key`` share a batch.  The key must capture
  everything that stacking needs (input names, dtypes, per-item shapes); ``batch_key()``
  builds one from an input dict.
* Size.  A batch holds at most ``max_batch`` requests and at most ``max_cost`` total cost;
  a single request whose cost alone exceeds ``max_cost`` still runs, alone.  Requests of a
  group are taken in order (add order, but for turns, priorities and congestion, below) and
  a batch stops at the first one that does not fit (no overtaking inside a group).
* Turns.  Requests of several principals (``Pending.principal``: the client the broker
  attested) in one group take turns: a batch takes one request of each principal, then a
  second of each that has one, and so on, each principal's own in add order.  The
  principals go least recently served first: one joins the turns at their back with its
  first pending request of the group (so, until one is served, in the order their oldest
  pending requests arrived), and one served in a batch goes to the back (the one served
  last at the very back), so turns go on across batches, even batches of one.  One that
  rejoins, its requests of the group having run out (served, or the last ones cancelled
  or expired: a turn it had is still its last), goes instead ahead of the first
  principal in the turns served since its last turn, behind those served before it (the
  broker's rule, broker/state.py "Dispatch": among the first ``_SCAN``, none of them
  never served here; the last ``_LEFT_MEMO`` that left are remembered).  A principal
  left alone in a group (its queue the plain one below) keeps the last turn it had: once
  its queue's head is served it was served after every turn remembered there (also when
  it had none in the turns), and a principal with a turn on record whose plain queue runs
  out as it is served is remembered as served then, as is one whose request the worker's
  lone-request lane runs (`goes_alone`).  Where a turn went unseen (a
  principal with no turn on record served alone, its queue gone and back) it counts as
  never served, and a rejoiner goes behind it (at the back, as before): a client sending
  one request at a time beside a flood otherwise waited, at the back, for one more of the
  flood's requests every time (with a batch of one; with more it goes in the next batch
  anyway).  So a flood of one
  principal parked at a worker (up to its credit, or a lease's slots) makes another
  principal's lone request of its class wait for at most one request of each principal
  ahead of it in the turns (and the batch running), not for the flood: with a batch of
  two or more it goes in the next batch.  With one principal nothing changes (and costs
  nothing: the group is the plain queue it always was, and becomes one again once a
  single principal is left in it; whether that one was served since is read off its
  queue's head when another joins, so the plain queue's path does no extra work but a
  look at ``_solo`` when it runs out, and a principal with a turn on record, a record
  renewed as it is served alone).  A
  request without a principal (None) is one principal like any other.  The wait bounds
  below stay the group's oldest request's, whichever turn it is.
* Priorities (``priority``: 0 urgent, 1 normal, 2 background, as in the request header).
  While requests of one class only are pending, nothing changes.  With several, each
  request scores as the broker scores its queues, ``priority_weights[priority] x (1 +
  waited / aging_s)`` (3 / 1 / 0.5 and 0.5 s, the broker's defaults): inside a group the
  higher scores go first (ties by add order), and the group whose best request scores
  highest goes first.  With several principals in a group, the slots of a batch go to the
  classes as they would with one (by score), and a class's slots to its principals in
  turn.  Urgent work wins while the rest waits only so long (no starvation); on a pinned
  stream (docs/protocol.md section 10) the worker's batcher is the only queue a
  request meets, so this is where its priority holds.
* Fairness between groups.  Among requests of one class, the group holding the oldest
  pending request (by ``arrived``, ties by add order) goes first, even while a younger
  group's batch is fuller (whichever principal's turn that batch begins with).
* Congestion.  The broker serves a congested service's queue newest first (broker/state.py,
  "Congestion"), but what it dispatched to a worker with credit to spare (up to the
  credit, or a lease's slots) waited here in add order: under overload the oldest
  parked requests went first, each with its budget nearly spent, while the newest waited
  behind them until they too were nearly out of time.  So a group is *congested* while it
  holds more requests than one batch takes (``max_batch``: a group of one batch or less
  goes whole into the next batch, whatever its order) and one of its requests was set
  aside for its deadline (below: passed, or too near to run) within ``lifo_after`` (0.1 s,
  the broker's; the worker's ``--lifo-after-ms``; None: never): first in first out is
  losing requests to their deadlines.  Then each principal's
  requests in it go newest first: what runs has most of its time left, and the oldest wait
  on until "Deadlines" below sets them aside (answered at once, never run late).  As at the
  broker, a principal whose oldest pending request of the group (of the class, while
  several are pending) has no deadline, or must go first (``in_order``: given back unstarted
  once by a busy worker, or dispatched again after its worker died, either of which the
  broker served first; or a stream's frame, pinned or brokered, whose results their client
  takes in send order, so a newer frame run first would only wait, done, for the older
  ones), keeps add order.  Why not a time alone (the
  broker's "not empty for ``lifo_after``", or the oldest request's wait): a model slower
  than ``lifo_after`` keeps a parked request waiting that long in normal operation, and
  newest first then only reordered a client's calls (a stream's frames through the broker
  came back later: each waits for the one before it), with nothing gained; and under a
  flood with short deadlines the oldest is set aside before it has waited ``lifo_after``.
  A request lost to its deadline is what says the queue costs calls.  The signal is read
  where a batch is planned, only while some group holds two requests or more (``_deep``;
  the lone request's path does no extra work), and ends once the backlog is worked off or
  no request was lost for ``lifo_after`` (under overload the oldest, served last, keep
  being set aside, which keeps the group congested).  Everything
  else holds: turns between principals (a congested group whose order this changes is its
  principals' `_Turns`, ``lifo``, even with one principal: the plain queue's path knows
  nothing of it),
  priorities and aging (a batch's slots go to the classes by score as before; only which
  request of a principal's class fills one changes), the wait bounds (the group's oldest
  request's ``max_delay``) and the deadline rules.
* Deadlines.  A request whose ``deadline`` has passed (``deadline <= now``) is never put
  in a batch: ``take()`` sets it aside and ``expire(now)`` hands it to the caller (which
  owes its client an error).  ``expire`` also collects any that passed since.  Nor is one
  that can no longer finish in time because it waited, with less than ``deadline_margin``
  left (``deadline - deadline_margin <= now``; the worker sets the margin to the shortest
  time its recent batches took) of a budget that had room for it (``deadline - since >=
  deadline_margin``): run, it would only finish after its caller gave up, taking a batch's
  place from requests that can still make theirs (under overload every request reached
  the model with its budget nearly spent, and almost none of them got a result).  It is
  set aside the same way, except when nothing competes for the worker: it is the only
  request pending and the broker had no other request of the service queued when it
  dispatched it (``backlog`` 0, or not said).  Then it runs (nothing is taken from anyone,
  and the margin, a prediction, gets a new measurement).  A request whose whole budget is
  under the margin is this worker's too slow for it, not late: it runs as before (set
  aside at once, it freed the worker's credit for the next such one, and a worker slower
  than the others of its service answered the broker's queue with errors that a quicker
  worker would have served).
* Waiting, when the worker is idle.  The batcher keeps, per key, an EWMA of the
  inter-arrival time.  If the expected gap is larger than ``max_delay`` (light traffic, or
  no estimate yet) nothing is gained by waiting and the batch - a lone request included -
  goes at once.  Otherwise it waits until the earlier of
    - the oldest request's ``arrived + max_delay`` (the hard bound on added latency),
    - the expected time the batch fills up (last arrival + missing items x expected gap),
  and not at all when a pending request's ``deadline - deadline_margin`` comes first (a
  wait that ended there ended as that request could no longer finish in time: "Deadlines"
  set it aside then, a 504 for what would have made its deadline had it gone at once); a
  full batch (``max_batch`` items, or the next item would exceed ``max_cost``) goes at once.
* Waiting must pay off.  A short inter-arrival time does not prove that company is coming:
  a closed-loop client that sends its next request only after the reply arrives has short
  gaps and never sends anything while we wait.  So the batcher keeps, per key, an EWMA of
  how many requests each wait gathered; when that falls below ``min_gain`` it stops waiting
  (lone requests go at once) and only probes again every ``probe_every`` batches.  The times depend only on state that changes with an arrival, so ``wake_at``
  stays true until the next ``add``; when the expected arrivals do not come (a burst
  ended), the batch goes at the expected fill time rather than waiting out ``max_delay``.
* Latency first (``latency_first``, the default).  Our broker writes in each request how
  many requests of its service it still had queued when it dispatched it (``backlog``).
  When that is 0 for every request of the next batch, every other outstanding request is
  already at some worker: this one's are in the batcher, and another worker's will not come
  here.  Company could then only be a request its client has not sent yet, which a closed
  loop client never sends while it waits, so the batch goes at once: no wait, and no
  probing wait either (a lone sequential client pays nothing for batching).  Under load
  batches still form: requests that arrive while a batch runs go together when it ends, and
  a broker backlog (``backlog`` > 0) brings back the waiting rules above.  Without the
  field (a plain MDP broker), or with ``latency_first=False`` (``--batching throughput``:
  wait for company on the arrival-rate evidence alone), the rules above apply as they are.
* Busy worker.  ``take(now, idle=False)`` means a batch is still running: only a full batch
  is returned (waiting is free while the worker cannot start anything anyway).  A batch
  handed out by ``take`` also marks the worker busy.  The first ``take(now, idle=True)``
  after that returns whatever accumulated, without any extra wait: those requests have
  already waited for the worker.  Once a take finds nothing pending, the worker counts as
  idle again and the waiting rules above apply to new arrivals.

Every request added is returned exactly once: by ``take`` (in a batch), ``expire`` or
``drop``.  ``len()`` counts the ones still owed.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice

__all__ = ["Batcher", "Pending", "batch_key"]

#: `Batcher.goes_alone`'s principal when the caller says none (None is a principal)
_UNSAID = object()

#: principals whose last turn is remembered after their requests of a group ran out
#: (`Batcher._left`, all groups together): beyond it the oldest are forgotten (they rejoin
#: at the back), as the broker's ``_LEFT_MEMO``
_LEFT_MEMO = 1024
#: principals of the turns a rejoining one is compared with, from the front (as the
#: broker's ``_SCAN``): past them it joins at the back
_SCAN = 16


@dataclass(slots=True)
class Pending:
    """One request waiting to be batched.  ``item`` is opaque to the batcher."""

    key: Hashable
    cost: float
    item: object
    arrived: float
    deadline: float | None = None
    #: requests of the service the broker still had queued when it dispatched this one
    #: (None: not said, e.g. a plain MDP broker); see "Latency first" in the module docstring
    backlog: int | None = None
    #: 0 urgent, 1 normal, 2 background (the request header's): lower goes first
    priority: int = 1
    #: whose request it is (the worker passes the client the broker attested: its pid, or a
    #: lease's principal); requests of several principals in one group take turns (see
    #: "Turns" in the module docstring).  None, like any other value, is one principal.
    principal: Hashable = None
    #: when its time began (the broker's receipt, on this clock: ``arrived`` less the time
    #: it queued there); None: ``arrived``.  See "Deadlines" in the module docstring.
    since: float | None = None
    #: its principal's requests of the group are taken in arrival order while it is the
    #: oldest of them, even while the group is congested ("Congestion" in the module
    #: docstring): the worker sets it for a request a busy worker gave back unstarted once
    #: (the broker served it first: the header's ``returned``), for a retry after its
    #: worker died (put back at the front: ``attempt``) and for a stream's frame (the
    #: header's ``dropped``, 0 included: its results their client takes in send order)
    in_order: bool = False


def batch_key(inputs: Mapping[str, object]) -> Hashable:
    """A key under which requests can be stacked: input names, dtypes and per-item shapes.

    Works for anything with ``.dtype`` and ``.shape`` (numpy arrays, tensors) without
    importing either library.
    """
    return tuple(sorted((name, str(a.dtype), tuple(a.shape)) for name, a in inputs.items()))


@dataclass(slots=True)
class _Entry:
    seq: int
    p: Pending


def _rounds(queues: Iterable[Iterable[_Entry]]) -> Iterator[_Entry]:
    """Round robin: the first entry of each queue (in the order given), then the second of
    each that has one, and so on.  Lazy: the first ``n`` cost O(n) whatever the queues hold."""
    its = []
    for q in queues:
        it = iter(q)
        e = next(it, None)
        if e is not None:
            yield e
            its.append(it)
    while its:
        more = []
        for it in its:
            e = next(it, None)
            if e is not None:
                yield e
                more.append(it)
        its = more


def _newest_first(oldest: _Entry) -> bool:
    """Whether a congested group takes one principal's requests (of a class), whose oldest
    is ``oldest``, newest first ("Congestion"): not while that oldest must go first
    (``in_order``) or has no deadline (nothing else would ever take it out; newest first,
    it waited for as long as its principal sent more).  The broker's rule (broker/state.py,
    `_newest_first`)."""
    return oldest.p.deadline is not None and not oldest.p.in_order


def _remember(left: OrderedDict, k: tuple, turn: int) -> None:
    """``k`` = (key, principal) left its group's turns with its last turn ``turn``
    (`Batcher._left`: the newest last, the oldest forgotten past ``_LEFT_MEMO``)."""
    left[k] = turn
    left.move_to_end(k)
    if len(left) > _LEFT_MEMO:
        left.popitem(last=False)


class _Solo:
    """What a group's turns knew of its last principal when it became a plain queue again
    (`Batcher._settle_turns`): whether that principal was served since, and when before.
    Kept without any work on the plain queue's path: served since is its head gone."""

    __slots__ = ("group", "seq", "served")

    def __init__(self, group: deque, served: int | None):
        self.group = group  # the plain queue (a rebuild that serves nothing carries this on)
        self.seq = group[0].seq  # its head then; 0: served since (a popleft took the head)
        self.served = served  # the principal's last turn then (`Batcher._tick`); None: it had none


class _Turns:
    """The requests of one group that several principals hold: each principal's in its own
    queue (add order), and the principals in the order of their turns (``ring``: least
    recently served first; one joins at the back with its first pending request, or, back
    after its requests ran out, ahead of the first principal served since)."""

    __slots__ = ("queues", "ring", "served", "mixed", "lifo", "_oldest", "_key", "_left")

    def __init__(self, key: Hashable, left: OrderedDict, group: deque, served: int | None, e: _Entry | None):
        first = group[0].p.principal
        self._key = key
        #: the batcher's: (key, principal) -> its last turn, for principals whose requests of
        #: a group ran out as they were served (oldest first)
        self._left = left
        self.queues: dict[Hashable, deque[_Entry]] = {first: group}
        self.ring: deque[Hashable] = deque((first,))
        #: principal -> its last turn (`Batcher._tick`), for those of the ring that had one
        #: (here, or before they rejoined); one without is "never served" and not passed
        self.served: dict[Hashable, int] = {}
        if served is not None:
            self.served[first] = served
        # (``first`` has no entry in ``left``: `Batcher.add` dropped it with its queue's start.)
        #: the batch order while several classes are pending (`Batcher._best_scored_key`)
        self.mixed: list[_Entry] | None = None
        #: the group is congested ("Congestion"): each principal's queue newest first
        #: (`_newest_first`); `Batcher._congestion` says so before each batch is planned
        self.lifo = False
        self._oldest: _Entry | None = None
        if e is not None:  # None: one principal's queue, congested (`Batcher._congestion`)
            self.add(e)

    def add(self, e: _Entry) -> None:
        pr = e.p.principal
        q = self.queues.get(pr)
        if q is None:
            self.queues[pr] = deque((e,))
            ring = self.ring
            last = self._left.pop((self._key, pr), None) if self._left else None
            if last is None:
                ring.append(pr)  # new here (or forgotten): no earlier turn for a new name
            else:
                # Rejoining: least recently served first, so ahead of the first principal in
                # the turns served since its last turn, behind those served before (another
                # rejoiner keeps its place); behind one never served, and past _SCAN of them,
                # at the back.
                served = self.served
                served[pr] = last
                for i, r in enumerate(ring):
                    s = served.get(r)
                    if s is None or i == _SCAN:
                        ring.append(pr)
                        break
                    if s > last:
                        ring.insert(i, pr)
                        break
                else:
                    ring.append(pr)
        else:
            q.append(e)
        o = self._oldest
        if o is not None and (e.p.arrived, e.seq) < (o.p.arrived, o.seq):
            self._oldest = e

    def oldest(self) -> _Entry:
        """The pending request that arrived first (ties: added first)."""
        o = self._oldest
        if o is None:
            o = self._oldest = min((q[0] for q in self.queues.values()), key=lambda e: (e.p.arrived, e.seq))
        return o

    def order(self) -> Iterator[_Entry]:
        """The batch order while one class is pending: one request of each principal in
        turn, round after round."""
        queues = self.queues
        if self.lifo:
            return _rounds((reversed(q) if _newest_first(q[0]) else q) for q in (queues[pr] for pr in self.ring))
        return _rounds(queues[pr] for pr in self.ring)

    def order_mixed(self, score: Callable[[_Entry], float]) -> _Entry:
        """Set ``mixed``, the batch order while several classes are pending, and return the
        best-scored request.  The slots go to the classes as they would with one principal
        (by score, highest first, ties by add order); a class's slots go to its principals in
        turn (in ``ring`` order), each principal's requests of the class by score."""
        ranked = sorted((e for q in self.queues.values() for e in q), key=lambda e: (-score(e), e.seq))
        per_class: dict[int, dict[Hashable, list[_Entry]]] = {}
        for e in ranked:
            per_class.setdefault(e.p.priority, {}).setdefault(e.p.principal, []).append(e)
        if self.lifo:  # congested: a principal's requests of a class newest first (`_newest_first`)
            for held in per_class.values():
                for es in held.values():
                    if len(es) > 1 and _newest_first(min(es, key=lambda e: e.seq)):
                        es.sort(key=lambda e: e.seq, reverse=True)
        place = {pr: i for i, pr in enumerate(self.ring)}
        turns = {c: _rounds(sorted(held.values(), key=lambda es: place[es[0].p.principal]))
                 for c, held in per_class.items()}
        self.mixed = [next(turns[e.p.priority]) for e in ranked]
        return ranked[0]

    def settle(self, taken: list[_Entry], tick: int) -> None:
        """``taken`` (in batch order) went: out of their queues, and the principals served
        to the back of the ring, the one served last at the very back.  Their turns are
        ``tick`` on (the i-th of the batch ``tick + i``); one whose queue ran out leaves,
        remembered in ``_left``."""
        last: dict[Hashable, int] = {}
        queues = self.queues
        for i, e in enumerate(taken):
            pr = e.p.principal
            q = queues[pr]
            if q[0] is e:
                q.popleft()
            elif q[-1] is e:  # congested: newest first
                q.pop()
            else:  # several classes: a principal's more urgent request went first
                q.remove(e)
            last[pr] = i
        ring = self.ring
        k = len(last)
        if all(pr in last for pr in islice(ring, k)):  # round robin serves a prefix of the ring
            for _ in range(k):
                ring.popleft()
        else:
            self.ring = ring = deque(pr for pr in ring if pr not in last)
        served = self.served
        for pr in sorted(last, key=last.__getitem__):
            turn = tick + last[pr]
            if queues[pr]:
                ring.append(pr)
                served[pr] = turn
            else:
                del queues[pr]
                served.pop(pr, None)
                _remember(self._left, (self._key, pr), turn)
        self.mixed = self._oldest = None

    def remove(self, seqs: set[int]) -> None:
        """``seqs`` went unserved (dropped, expired): a principal whose queue ran out leaves,
        its last turn (if it had one) remembered in ``_left``, as if it had been served."""
        queues = self.queues
        for pr in [pr for pr, q in queues.items() if any(e.seq in seqs for e in q)]:
            q = deque(e for e in queues[pr] if e.seq not in seqs)
            if q:
                queues[pr] = q
            else:
                del queues[pr]
                turn = self.served.get(pr)
                if turn is not None:
                    _remember(self._left, (self._key, pr), turn)
        if len(self.ring) != len(queues):
            self.ring = deque(pr for pr in self.ring if pr in queues)
            served = self.served
            for pr in [pr for pr in served if pr not in queues]:
                del served[pr]
        self.mixed = self._oldest = None


@dataclass(slots=True)
class _Rate:
    last: float  # latest arrival seen for the key
    gap: float | None = None  # EWMA of inter-arrival time; None until two arrivals
    gain: float = 1.0  # EWMA of the requests a wait gathered (did waiting pay off?)
    waited_from: int | None = None  # batch size when the current wait began
    skips: int = 0  # waits skipped since the last probe because they did not pay off


class Batcher:
    """Dynamic batcher; see the module docstring for the policy."""

    #: weight of a new inter-arrival sample in the EWMA
    alpha = 0.2
    #: a wait that gathers fewer requests than this on average is not worth its delay
    min_gain = 0.5
    #: batches between two probing waits once waiting stopped paying off
    probe_every = 32
    #: keys whose arrival rate is remembered (LRU), so that many one-off shapes cannot grow
    #: the state without bound
    max_tracked_keys = 1024

    def __init__(self, *, max_batch: int = 8, max_cost: float = math.inf, max_delay: float = 0.002,
                 deadline_margin: float = 0.0, latency_first: bool = True,
                 priority_weights: tuple = (3.0, 1.0, 0.5), aging_s: float = 0.5,
                 lifo_after: float | None = 0.1):
        if int(max_batch) != max_batch or max_batch < 1:
            raise ValueError("max_batch must be an integer >= 1")
        if not max_cost > 0:
            raise ValueError("max_cost must be > 0")
        if not (0 <= max_delay < math.inf):
            raise ValueError("max_delay must be finite and >= 0")
        if not (0 <= deadline_margin < math.inf):
            raise ValueError("deadline_margin must be finite and >= 0")
        self.max_batch = int(max_batch)
        self.max_cost = float(max_cost)
        self.max_delay = float(max_delay)
        self.latency_first = bool(latency_first)
        #: time a batch needs to run: a request is dispatched no later than its deadline
        #: minus this, and one with less left is not run while others compete ("Deadlines").
        #: The worker sets it from measured batch times (`ComputeTimes.floor`).
        self.deadline_margin = float(deadline_margin)
        # Samples are capped so that one long silence does not make the estimate "light
        # traffic" for the next hundred arrivals; anything above max_delay reads as light.
        self._gap_cap = 16.0 * self.max_delay
        # per key: its requests in batch order (one principal), or its principals' turns
        self._groups: dict[Hashable, deque[_Entry] | _Turns] = {}
        self._live: dict[int, _Entry] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped lazily
        self._expired: list[Pending] = []
        self._rates: OrderedDict[Hashable, _Rate] = OrderedDict()
        self._seq = 0
        # Turns ("Turns" in the module docstring): a clock of turns (it moves on only while
        # several principals share a group), the principals whose requests ran out (see
        # `_Turns._left`), and per plain queue that had turns, what they knew of its
        # principal (`_Solo`; gone with the queue, so at most one per group).
        self._tick = 0
        self._left: OrderedDict[tuple, int] = OrderedDict()
        self._solo: dict[Hashable, _Solo] = {}
        self._busy = False
        if len(priority_weights) != 3 or not all(w > 0 for w in priority_weights):
            raise ValueError("priority_weights must be three positive numbers")
        if not aging_s > 0:
            raise ValueError("aging_s must be > 0")
        self.priority_weights = tuple(float(w) for w in priority_weights)
        self.aging_s = float(aging_s)
        if lifo_after is not None and not (0 <= lifo_after < math.inf):
            raise ValueError("lifo_after must be None (never) or a finite number of seconds >= 0")
        #: a group holding more requests than one batch takes, one of which was set aside
        #: for its deadline within this long, is congested, and each principal's requests in
        #: it go newest first ("Congestion"); None: never
        self.lifo_after = None if lifo_after is None else float(lifo_after)
        # Some group holds two requests or more, or several classes are pending: the next
        # batch's order is looked at (`_congestion`, then `_best_scored_key` if mixed).  Set
        # by `add` off its lone path; cleared by `_congestion` once no group needs it.
        self._deep = False
        #: key -> when a request of its group was last set aside for its deadline (passed,
        #: or too near to run it: "Deadlines"), for `_congestion`: only those within
        #: ``lifo_after`` count, and older ones are let go (`_shed`)
        self._shed_at: dict[Hashable, float] = {}
        self._priority = 1     # the class of what is pending, while it is one class
        self._mixed = False    # several classes are pending: groups are ordered by score

    def __len__(self) -> int:
        return len(self._live) + len(self._expired)

    # ------------------------------------------------------------------------------ input

    def add(self, p: Pending, now: float, *, observed: bool = False) -> None:
        """Queue a request.  Its ``arrived`` feeds the arrival-rate estimate (unless
        ``observed``: `goes_alone` counted it); ``now`` is only used to set aside a request
        that is already past its deadline."""
        if not observed:
            self._observe_arrival(p.key, p.arrived)
        if p.deadline is not None and p.deadline <= now:
            self._expired.append(p)
            return
        self._seq += 1
        e = _Entry(self._seq, p)
        if not self._live:
            self._priority = p.priority
        elif p.priority != self._priority:
            self._mixed = self._deep = True
        self._live[e.seq] = e
        group = self._groups.get(p.key)
        if group is None:
            self._groups[p.key] = group = deque((e,))
            if self._left:
                # Served alone from here on, unseen by the turns: its last turn beside the
                # others, if remembered, goes on with its queue (`_Solo`: it is its last
                # until its queue's head is served; then it was served after them all).
                last = self._left.pop((p.key, p.principal), None)
                if last is not None:
                    self._solo[p.key] = _Solo(group, last)
        elif type(group) is deque:
            self._deep = True
            if group[0].p.principal == p.principal:  # one principal: the common case
                group.append(e)
            else:
                self._groups[p.key] = _Turns(p.key, self._left, group, self._solo_served(p.key, group), e)
        else:
            group.add(e)
        if p.deadline is not None:
            heapq.heappush(self._deadlines, (p.deadline, e.seq))

    def _observe_arrival(self, key: Hashable, arrived: float) -> None:
        r = self._rates.get(key)
        if r is None:
            self._rates[key] = _Rate(arrived)
            while len(self._rates) > self.max_tracked_keys:
                self._rates.popitem(last=False)
            return
        self._rates.move_to_end(key)
        # Out-of-order stamps (several receiving threads) count as simultaneous arrivals.
        sample = min(max(arrived - r.last, 0.0), self._gap_cap)
        r.gap = sample if r.gap is None else r.gap + self.alpha * (sample - r.gap)
        r.last = max(r.last, arrived)

    # ------------------------------------------------------------------------------ output

    def take(self, now: float, *, idle: bool, force: bool = False) -> list[Pending]:
        """The next batch to run, or [] to keep waiting (see ``wake_at``).

        ``force=True`` skips the wait (not the size, key and deadline rules): for draining
        at shutdown.  Pass the real ``now``; a time in the future would expire requests."""
        self._set_aside_expired(now)
        key = self._oldest_key(now)
        if key is None:
            # Idle with nothing pending: new arrivals follow the waiting rules again.  Busy
            # with nothing pending: whatever arrives meanwhile goes when the worker is free.
            self._busy = not idle
            return []
        n, full = self._plan(key)
        if not idle:
            self._busy = True
            if full:
                self._settle_wait(key, n)
                return self._pop(key, n)
            return []
        if full or force or self._busy:
            self._settle_wait(key, n)
            return self._pop(key, n)
        t, gated = self._wait_until(key, n, now)
        r = self._rates.get(key)
        if t <= now:
            if gated and r is not None:
                r.skips += 1
            self._settle_wait(key, n)
            return self._pop(key, n)
        if r is not None and r.waited_from is None:
            r.waited_from = n
        return []

    def goes_alone(self, key: Hashable, arrived: float, backlog: int | None,
                   deadline: float | None = None, since: float | None = None, principal=_UNSAID) -> bool:
        """Whether a request of ``key`` arriving at ``arrived`` (the current time) with
        ``backlog`` (the broker's word) and ``deadline`` would be a batch of one at once:
        nothing is pending, and `take(arrived, idle=True)` after `add` would return it now
        (a batch size of one; the batcher still busy from the last batch; latency-first
        with no backlog; or the arrival-rate rules say go: light traffic, or waits that
        stopped paying off).  Its arrival is counted
        as `add` counts it, either way.  True: the batcher is busy, as after `take`
        returned it, and the caller runs it now (the worker's lone-request lane) and
        calls `idle` once it ran.  False: the caller must `add` it with ``observed=True``
        (its arrival is counted already) and `take` decides, as always; so too for a
        finite ``max_cost`` (the cost rules need it queued), unless one of the first three
        reasons holds.  Not for a request already past its deadline (`add` sets it aside),
        nor for one that can no longer finish in time while the broker has others queued
        (``backlog`` > 0; ``since``, as `Pending.since`: `expire` sets it aside,
        "Deadlines").  ``principal``, as `Pending.principal`: a turn it goes alone is
        its last (remembered if one of its group's was: "Turns")."""
        self._observe_arrival(key, arrived)
        if self._live or self._expired:
            return False
        if (deadline is not None and deadline - self.deadline_margin <= arrived
                and self._late(Pending(key, 0.0, None, arrived, deadline, backlog, since=since), True)):
            return False  # it cannot finish in time and others wait: `add`, then `expire`
        if not (self.max_batch == 1 or self._busy
                or (self.latency_first and backlog is not None and backlog <= 0)):  # as `_no_backlog`
            if self.max_cost != math.inf:
                return False  # the cost rules (`_plan`, `_ready_at`) need it queued
            # `_wait_until` for a batch of this one request, without queueing it.
            r = self._rates.get(key)
            if r is None or r.gap is None or r.gap > self.max_delay:
                pass  # light traffic: `_ready_at` says now
            else:
                # The wait would end at the earliest of max_delay, the expected fill, and
                # the deadline's margin; one that ends now is no wait (gap 0, or the deadline).
                t = min(arrived + self.max_delay, r.last + (self.max_batch - 1) * r.gap)
                if deadline is not None and deadline - self.deadline_margin <= t:
                    t = arrived  # it could not wait and still finish in time (`_ready_at`)
                if t > arrived:
                    if not (r.waited_from is None and r.gain < self.min_gain and r.skips < self.probe_every):
                        return False  # it would wait for company
                    r.skips += 1  # waiting stopped paying off: it goes, and the probe comes closer
        self._settle_wait(key, 1)
        self._busy = True
        if self._left and principal is not _UNSAID:
            k = (key, principal)
            if k in self._left:
                # A turn, served alone: after every one remembered (left as it was, it
                # would let it pass a principal served before this one).
                self._tick += 1
                _remember(self._left, k, self._tick)
        return True

    def idle(self) -> None:
        """The worker is free and nothing is pending: what ``take(idle=True)`` does with an
        empty queue, without the rest of it (new arrivals follow the waiting rules again)."""
        if not self._live and not self._expired:
            self._busy = False

    def _settle_wait(self, key: Hashable, n: int) -> None:
        """A batch of ``key`` goes now: if we had been waiting for it, learn what that gained."""
        r = self._rates.get(key)
        if r is None or r.waited_from is None:
            return
        r.gain += self.alpha * ((n - r.waited_from) - r.gain)
        r.waited_from = None
        r.skips = 0

    def wake_at(self, now: float) -> float | None:
        """When ``take(idle=True)`` may return a batch, or ``expire`` a request, without a
        new arrival: ``now`` if already, None if nothing is pending.

        Meant for an idle worker's poll timeout.  While a batch runs the answer is ``now``
        whenever something is pending (it goes as soon as the worker is free), so a busy
        worker should wait for its batch, not for this time."""
        if self._expired:
            return now
        key = self._oldest_key(now)
        if key is None:
            return None
        n, full = self._plan(key)
        t = now if (full or self._busy) else self._wait_until(key, n, now)[0]
        first_deadline = self._first_deadline()
        if first_deadline is not None:
            t = min(t, first_deadline)
        return max(t, now)

    def expire(self, now: float) -> list[Pending]:
        """Remove and return every request whose deadline has passed (``deadline <= now``),
        or that can no longer finish in time while others compete (``deadline -
        deadline_margin <= now``, "Deadlines"), including those ``take`` set aside."""
        self._set_aside_expired(now)
        out, self._expired = self._expired, []
        return out

    def lost(self, key: Hashable, now: float) -> None:
        """A request of ``key`` pending here was lost to its deadline all the same, though
        not set aside here (its broker's cancel for the deadline came first, and the
        caller dropped it): it counts for "Congestion" as one set aside."""
        self._shed((key,), now)

    def drop(self, predicate: Callable[[Pending], bool]) -> list[Pending]:
        """Remove and return the requests (pending or expired) for which ``predicate`` is
        true, e.g. cancelled ones."""
        dropped = [e for e in self._live.values() if predicate(e.p)]
        if dropped:
            self._remove({e.seq for e in dropped})
        out = [e.p for e in dropped]
        kept = []
        for p in self._expired:
            if predicate(p):
                out.append(p)
            else:
                kept.append(p)
        self._expired = kept
        return out

    # ------------------------------------------------------------------------------ internals

    def _oldest_key(self, now: float) -> Hashable | None:
        if self._deep:
            self._congestion(now)
            if self._mixed:
                return self._best_scored_key(now)
        best = None
        best_key = None
        for key, group in self._groups.items():
            head = group[0] if type(group) is deque else group.oldest()
            rank = (head.p.arrived, head.seq)
            if best is None or rank < best:
                best, best_key = rank, key
        return best_key

    def _congestion(self, now: float) -> None:
        """Say which groups are congested now ("Congestion": the group holds more requests
        than one batch takes, and one of its requests was set aside for its deadline within
        ``lifo_after``): a plain queue that is becomes its principal's turns (`_Turns`,
        ``lifo``: the turns take each queue newest first, and keep the principal's turns if
        another joins), and turns that no longer are lose ``lifo`` (one principal's: its
        plain queue again, as `_settle_turns` makes it).  Clears ``_deep`` when nothing is
        left for it to look at."""
        shed = self._shed_at
        cut = None if self.lifo_after is None or not shed else now - self.lifo_after
        cap = self.max_batch
        deep = self._mixed
        groups = self._groups
        for key, group in list(groups.items()):
            if type(group) is deque:
                n = len(group)
                if n < 2:
                    continue
                deep = True
                if cut is None or n <= cap or shed.get(key, -math.inf) < cut:
                    continue
                if self._reversible(group):
                    served = self._solo_served(key, group)
                    if self._mixed:  # scored: back in add order, as the turns keep a queue
                        group = deque(sorted(group, key=lambda e: e.seq))
                    turns = groups[key] = _Turns(key, self._left, group, served, None)
                    turns.lifo = True
            else:
                deep = True
                lifo = (cut is not None and shed.get(key, -math.inf) >= cut
                        and sum(map(len, group.queues.values())) > cap)
                if lifo is not group.lifo:
                    group.lifo = lifo
                    group.mixed = None
                if len(group.queues) == 1:
                    self._settle_turns(key, group)  # its plain queue again, unless newest first
        self._deep = deep

    def _shed(self, keys: Iterable[Hashable], now: float) -> None:
        """Requests of ``keys`` were set aside for their deadlines now (`_congestion`)."""
        if self.lifo_after is None:
            return
        shed = self._shed_at
        for key in keys:
            shed[key] = now
        if len(shed) > 64:  # (a key's entry matters for lifo_after only)
            cut = now - self.lifo_after
            self._shed_at = {k: t for k, t in shed.items() if t >= cut}

    def _reversible(self, q: deque) -> bool:
        """Whether congestion changes the order of one principal's queue ``q`` (two requests
        or more, in add order unless scored): newest first (`_newest_first`), of one class,
        or of some class, while several are pending."""
        if len(q) < 2:
            return False
        if not self._mixed:
            return _newest_first(q[0])
        heads: dict[int, _Entry] = {}
        for e in q:
            h = heads.get(e.p.priority)
            if h is None or e.seq < h.seq:
                heads[e.p.priority] = e
        return any(map(_newest_first, heads.values()))

    def _best_scored_key(self, now: float) -> Hashable | None:
        """Several classes pending: each group put in the order its requests go (score,
        highest first, then add order), and the key of the group whose head scores highest
        (ties: the oldest head)."""
        weights, aging = self.priority_weights, self.aging_s

        def score(e: _Entry) -> float:
            return weights[e.p.priority] * (1.0 + max(0.0, now - e.p.arrived) / aging)

        best = None
        best_key = None
        for key, group in self._groups.items():
            if type(group) is deque:
                ranked = sorted(group, key=lambda e: (-score(e), e.seq))
                if ranked != list(group):
                    new = deque(ranked)
                    if self._solo:
                        self._rebuilt(key, group, new)
                    self._groups[key] = group = new
                head = group[0]
            else:
                head = group.order_mixed(score)
            rank = (-score(head), head.p.arrived, head.seq)
            if best is None or rank < best:
                best, best_key = rank, key
        return best_key

    def _plan(self, key: Hashable) -> tuple[int, bool]:
        """(items in the next batch of ``key``, whether that batch is full)."""
        total = 0.0
        n = 0
        for e in self._order(key):
            if n == self.max_batch:
                return n, True
            c = e.p.cost
            if n and total + c > self.max_cost:
                return n, True
            total += c
            n += 1
            if total >= self.max_cost:  # at the cap, or a lone request over it
                return n, True
        return n, n == self.max_batch

    def _wait_until(self, key: Hashable, n: int, now: float) -> tuple[float, bool]:
        """(when a not-yet-full batch should go, whether "now" is only because waiting has
        not been paying off)."""
        if self.latency_first and self._no_backlog(key, n):
            return now, False  # nothing is on its way: waiting could only cost latency
        r = self._rates.get(key)
        if r is not None and r.waited_from is None and r.gain < self.min_gain and r.skips < self.probe_every:
            t = self._ready_at(key, n, now)
            return now, t > now
        return self._ready_at(key, n, now), False

    def _ready_at(self, key: Hashable, n: int, now: float) -> float:
        """When a not-yet-full batch of ``key`` with ``n`` items should go."""
        r = self._rates.get(key)
        if r is None or r.gap is None or r.gap > self.max_delay:
            return now
        gap = r.gap
        group = self._groups[key]
        if self._mixed:
            # Priorities reorder: the bound is the oldest pending request's, whatever its
            # group (once it is reached, the best-scored group goes, and the rest follow).
            t = min(e.p.arrived for e in self._live.values()) + self.max_delay
        else:
            t = (group[0] if type(group) is deque else group.oldest()).p.arrived + self.max_delay
        missing = self.max_batch - n
        if math.isfinite(self.max_cost):
            used = sum(e.p.cost for e in islice(self._order(key), n))
            if used > 0:
                room = (self.max_cost - used) / (used / n)  # items of average cost that still fit
                if room < missing:  # (also keeps a huge room from tiny costs out of int())
                    missing = max(1, int(room))
        t = min(t, r.last + missing * gap)
        first_deadline = self._first_deadline()
        if first_deadline is not None and first_deadline - self.deadline_margin <= t:
            # A wait that ends when a request has only the margin left ends when it can no
            # longer finish in time ("Deadlines": set aside then): no wait at all.
            return now
        return t

    def _no_backlog(self, key: Hashable, n: int) -> bool:
        """Whether the broker said, for each of the next ``n`` requests of ``key``, that it
        had nothing of the service queued when it dispatched them (so any company would
        have to be a request not sent yet)."""
        for e in islice(self._order(key), n):
            if e.p.backlog is None or e.p.backlog > 0:
                return False
        return True

    def _order(self, key: Hashable) -> Iterable[_Entry]:
        """The requests of ``key`` in the order they go into batches."""
        group = self._groups[key]
        if type(group) is deque:
            return group
        return group.mixed if self._mixed else group.order()

    def _first_deadline(self) -> float | None:
        heap = self._deadlines
        while heap and heap[0][1] not in self._live:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _set_aside_expired(self, now: float) -> None:
        heap = self._deadlines
        gone = set()
        # A request with less than ``deadline_margin`` left cannot finish in time (see
        # "Deadlines"): set aside as its deadline had passed, unless nothing competes for
        # the worker (it is the only request here, and the broker had nothing else queued).
        margin = self.deadline_margin
        cut = now + margin
        kept = []
        while heap and (heap[0][1] not in self._live or heap[0][0] <= cut):
            entry = heapq.heappop(heap)
            seq = entry[1]
            if seq in self._live and seq not in gone:
                p = self._live[seq].p
                if entry[0] > now and not self._late(p, len(self._live) == 1):
                    kept.append(entry)  # it may still finish, or nothing else would use the worker
                    continue
                gone.add(seq)
                self._expired.append(p)
        for entry in kept:
            heapq.heappush(heap, entry)
        if gone:
            if self.lifo_after is not None:  # (what `_shed` keeps matters only then)
                self._shed({self._live[s].p.key for s in gone}, now)
            self._remove(gone)
        if len(heap) > 64 and len(heap) > 4 * len(self._live):
            # Taken and dropped requests leave stale entries behind; compact once they
            # dominate so a long deadline horizon cannot grow the heap without bound.
            self._deadlines = [(d, s) for d, s in heap if s in self._live]
            heapq.heapify(self._deadlines)

    def _late(self, p: Pending, alone: bool) -> bool:
        """Whether ``p``, with less than the margin left, is set aside ("Deadlines"): its
        budget had room for a batch (it is late for its wait, not for this worker's speed),
        and something competes for the worker (``alone``: it is the only one pending)."""
        since = p.arrived if p.since is None else p.since
        if p.deadline - since < self.deadline_margin:
            return False
        return not alone or (p.backlog is not None and p.backlog > 0)

    def _remove(self, seqs: set[int]) -> None:
        for key in {self._live[s].p.key for s in seqs}:
            group = self._groups[key]
            if type(group) is deque:
                old, group = group, deque(e for e in group if e.seq not in seqs)
                if self._solo:
                    self._rebuilt(key, old, group)
                if group:
                    self._groups[key] = group
                else:
                    del self._groups[key]
            else:
                group.remove(seqs)
                self._settle_turns(key, group)
        for s in seqs:
            del self._live[s]
        if not self._live:
            self._mixed = False

    def _pop(self, key: Hashable, n: int) -> list[Pending]:
        group = self._groups[key]
        batch = []
        if type(group) is deque:
            for _ in range(n):
                e = group.popleft()
                del self._live[e.seq]
                batch.append(e.p)
            if not group:
                del self._groups[key]
                if self._solo:
                    s = self._solo.pop(key, None)
                    if s is not None and s.group is group:
                        # Its principal has a turn on record here, and was just served: that
                        # is its last turn now, after every other one remembered here (a
                        # rejoiner served before it goes ahead of it; lost, it counted as
                        # never served, which nobody passes).
                        self._tick += 1
                        _remember(self._left, (key, batch[-1].principal), self._tick)
        else:
            taken = list(islice(self._order(key), n))
            group.settle(taken, self._tick + 1)
            self._tick += len(taken)
            for e in taken:
                del self._live[e.seq]
                batch.append(e.p)
            self._settle_turns(key, group)
        if not self._live:
            self._mixed = False
        self._busy = True
        return batch

    def _settle_turns(self, key: Hashable, group: _Turns) -> None:
        """After some of a shared group's requests went: with one principal left, its queue
        is the group again (the fast path; `_Solo` keeps its last turn); with none, the
        group is gone."""
        if len(group.queues) > 1:
            return
        if group.queues:
            pr, q = next(iter(group.queues.items()))
            if group.lifo and self._reversible(q):
                return  # one principal's queue, congested, newest first: turns until `_congestion` says
            self._groups[key] = q
            # (also one never served in the turns: served alone from now on, it is served
            # after every turn remembered, which a rejoiner must not pass for "never")
            self._solo[key] = _Solo(q, group.served.get(pr))
        else:
            del self._groups[key]

    def _solo_served(self, key: Hashable, group: deque) -> int | None:
        """The last turn of the principal of ``group``, a plain queue another principal now
        joins: as its turns left it (`_Solo`), or now if it was served since (a newer turn
        than any remembered, whether or not it had one in the turns); None if unknown (never
        in turns, its queue ran out since, or it had no turn there and none since: it is
        "never served", and nobody passes it)."""
        s = self._solo.pop(key, None) if self._solo else None
        if s is None or s.group is not group:
            return None
        if s.seq == group[0].seq:
            return s.served
        self._tick += 1
        return self._tick

    def _rebuilt(self, key: Hashable, old: deque, new: deque) -> None:
        """A plain queue was rebuilt without serving anything (a removal, a reorder): its
        `_Solo` goes on with the new one (served since or not, as before).  Emptied, its
        principal leaves with its last turn if it was not served since (`_Turns.remove`)."""
        s = self._solo.get(key)
        if s is None or s.group is not old:
            return
        if not new:
            del self._solo[key]
            if not (s.seq and s.seq == old[0].seq):
                # served since: after every turn remembered here
                self._tick += 1
                _remember(self._left, (key, old[0].p.principal), self._tick)
            elif s.served is not None:
                # not served since: its last turn (if it had one) is still known
                _remember(self._left, (key, old[0].p.principal), s.served)
            return
        s.group = new
        if s.seq and s.seq == old[0].seq:  # not served since: the new head is the mark
            s.seq = new[0].seq
        else:
            s.seq = 0
