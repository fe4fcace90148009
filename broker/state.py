"""Scheduling core of the broker: a pure state machine.

Theory of operation
===================

Rule 1: every scheduling decision lives in this file (and, for leases, in its mixin
``broker/leases.py``).  ``broker.server`` decodes frames,
calls one event method of :class:`Scheduler` with the current monotonic time, and turns the
returned actions into frames.  It never chooses a worker, never orders requests and never
decides that something timed out; if it ever needs to, the decision belongs here.

Rule 2: no I/O, no clock.  Every event takes ``now`` (seconds, monotonic, never decreasing);
nothing here reads a clock, touches a socket or starts a thread.  That is what lets the tests
replay any interleaving of events with an injected clock, and what lets the server sleep
exactly until :meth:`Scheduler.next_wakeup`.

Rule 3: exactly one final per client request, ever.  A request is ``QUEUED`` (waiting in
its service's queue), ``RUNNING`` (a worker holds its token), ``CANCELLING`` (the client
asked to cancel; the worker was told and its final is awaited), ``ABANDONED`` (the client
already got its final, or went away, but a worker still holds the token and so still holds a
credit) or ``DONE``.  A final (``ToClient(final=True)`` or ``ClientError``) is only ever
emitted while leaving QUEUED/RUNNING/CANCELLING, and leaving them is one-way.

Requests and payloads
---------------------
Payloads are opaque: carried in, handed back in actions.  A request is named by
``(client, request_id)`` towards the client and by a broker-unique ``token`` towards a
worker; every dispatch attempt (a retry after a worker death included) gets a fresh token,
so a late reply from a worker presumed dead can never be mistaken for the current attempt.

Connections and principals
--------------------------
``client`` is the ZeroMQ routing identity of one *connection*: replies and errors go to it,
request ids are unique per connection, and cancellation, liveness and disconnect are per
connection.  Fairness, eviction and the per-client caps are about who is *behind* the
connection, its *principal*: the server passes the attested process of an ipc client, its
(pid, start time) (a new process that reuses a pid is another principal: it inherits no
remembered turn, no caps), the CurveZMQ user id of a tcp client, or None when it knows neither, and None means the
connection is its own principal (its identity is the key).  So a process that opens N
connections still gets one share: one turn in each ring, one set of caps, one count when the
heaviest is looked for.  A request's principal is recorded on it at admission and never
recomputed (a later request on the same identity may carry another one); a connection that
goes away takes exactly its own requests out of its principal's FIFOs and counts.  Below,
"client" in fairness, eviction and caps means the principal.

Dispatch
--------
Each service has three priority classes.  A class holds one FIFO per principal (holding the
requests of all its connections) and keeps those principals in a ring, least recently
served first: a principal joins the ring at its back when it queues something in the class
while having nothing there, a principal that is served moves to the back, and one whose FIFO
empties leaves.  A principal that rejoins after it was served in the class (its FIFO
emptied since, its last request dispatched, or cancelled, expired or evicted: its last
dispatch is still its last) goes instead ahead of the first principal in the ring served
after it (among the first 16, none of them never served; ``_Service.left`` remembers when,
for the last 1024 per class; two light clients rejoining keep their order): a client
sending one request at a time beside a flood waited, at the back, for one more of the
flood's dispatches than it had to, every time (the flood had been served since; the
overload hunt).
A principal never served in the class (or forgotten) joins at the back: a new name gets no
earlier turn.  A request sent straight to a free worker from an empty queue is its
principal's turn too, remembered as its last, and a FIFO made in an empty ring starts with
its principal's remembered turn: before, either left a FIFO "never served", which no
rejoining principal passes, so a light client queued behind a flood served after it each
time the service's queue had emptied (a congested worker setting its oldest aside frees
credit in bunches, and the queue empties often: 12 light calls of 60 waited one flood
dispatch more, tests/broker/test_state_light_client.py).  A
principal's FIFO is in arrival order (across its connections), except that retries go back
to its front (see Failure handling).

When a worker has spare credit, each non-empty class proposes one *candidate*: walking the
ring from its front, the first request (in FIFO order) whose pool has a worker with spare
credit.  The walk looks at no more than ``_SCAN`` requests of one principal and
``_CLASS_SCAN`` requests of the class in all, so a pile of requests that cannot go anywhere
now costs a constant per pass instead of the queue length; requests found expired on the way
are failed, never dispatched.  Among the candidates the one with the highest effective
priority ``weight[pri] * (1 + waited / aging_s)`` is dispatched: urgent work wins while
fresh, and anything that waits long enough overtakes it, so no class starves.  ``waited``
counts from the candidate's arrival or from its principal's previous dispatch in its class,
whichever is later: a request behind its own principal's backlog is waiting for that
backlog, not for the other classes.  (Counted from arrival, the head of one client's deep
urgent backlog was always as old as the backlog took to drain, and outscored every normal
request for as long as it was refilled.)  So while one principal floods the urgent class,
each principal with normal requests queued gets one of them dispatched about every (3 - 1)
x aging_s = 1 s (default weights): urgent work still comes first, and nothing starves.  A
request dispatched ahead of a more urgent class's candidate (aging won it its turn) is
dispatched as of that class (``Dispatch.priority``, the header's ``priority`` the worker
sees): the worker's batcher scores what it holds the same way from each request's arrival
there, and it made such a request wait behind the urgent ones parked there until it had aged
once more (end to end, at a worker of credit 8: 2 s for a normal request behind an urgent
flood, 5 s for a background one; now 1 and 2.5 s, plus what the worker held).  Within a class
this is round robin between principals: a principal with 50,000 queued requests (on one
connection or on 50,000) gets one dispatch, then every other principal waiting in the class
(with something placeable) gets one, before its next; a principal with one request at a time
waits for at most one dispatch from each other principal queued in its class, however long
their queues are and however many connections they use.  With a single principal the order
is plain FIFO, as before, while the queue drains (see Congestion for when it does not).

A request carrying shared-memory references (``local_host`` set) may only go to a worker of
its service on that host that speaks ``shm``; the workers able to take a given request form a
*pool* (``None``: every worker of the service; a host name: the shm workers on that host).  A
request whose pool has no spare credit is skipped by the walk above, so it blocks neither the
requests behind it in its principal's FIFO nor the other principals; its principal stays at
the front of the ring (it was not served) and is served as soon as its pool frees up.

When nothing is queued in the service, a new request goes straight to the least-loaded
worker of its pool (no order to decide; this is the common case under light load).

Congestion
----------
First in, first out is the right order while the queue drains, and the wrong one when it
does not: under sustained overload every request waits behind all the others, reaches a
worker with its budget nearly spent, and finishes late or barely in time (each caller
waits nearly its whole timeout for a success), while the newest requests, the ones whose
callers will wait longest, wait most.  So once a service's queue has not been empty for
``lifo_after`` seconds (0.1; ``_Service.since``: when it last went from empty to not), and
one of its requests missed its deadline within the last ``lifo_miss_window`` seconds (0.1;
``_Service.missed``: one expired here in the queue; or one that had waited a quarter of its
budget or more in the queue expired while running, or its worker answered it 504, as one it
would not run: `_queue_took_it`; None: not asked), it is *congested*, and the walk takes each principal's FIFO from its newest end (adaptive
LIFO, as Facebook's "Fail at scale" describes it): what is dispatched then has most of its
time left, and the oldest, whose callers are about to give up, wait on and are failed by
their deadlines here, never dispatched.  Everything else stays as above: round robin
between principals, the classes and their aging (a principal's wait is counted from its
oldest queued request of the class, or its previous dispatch there, as before: the young
candidate does not make an urgent flood starve the other classes).  Requests put back at
the front of their FIFO (retries, requests given back) are still served first: a FIFO that
starts with one is walked in order.  So is a FIFO whose oldest request has no deadline:
newest first is safe only for requests that leave by their deadline, and one without (a
batch job's call with no timeout) waited, behind a client that kept its pipeline full, for
as long as that client sent more; walked in order from it, every request is served or
leaves by its deadline, as before.  And so is a FIFO whose oldest is a stream's frame
(``stream``: the request carries ``dropped``): a stream runs in its order, its client
already giving up its stale frames.  Admission is unchanged (a full queue refuses the
newcomer if its principal is the heaviest, with nothing less urgent queued: immediate
backpressure; what stays too long leaves by its deadline), but an eviction takes what the
heaviest's walk would serve last in its least urgent class queued: from a FIFO walked
newest first, its oldest, not the newest it would serve next (see Admission).  The queue is FIFO again the moment it empties,
and while its requests keep their deadlines.
Why the missed deadline: a queue that stands is not by itself one past what it serves.
Closed-loop callers (each sends its next call as the previous returns) more than the
workers take at once keep one standing with every call in time, and when they are one
principal (the threads of one process, the coroutines sharing a client) newest first
served the ones that had just been answered and left the one whose request was oldest to
wait: one of four threads of one process waited 6.6 s, the others 1.2 s at most (the
operations audit).  A deadline missed is what says first in first out is costing calls
(the workers ask the same before they go newest first: gpu_worker/batching.py).
``newest_first`` counts the dispatches made while congested.  Cost: two comparisons per
pass.

Taking work back
----------------
Credit lets a worker hold more than it runs (its next batch waits at the worker, so batches
follow each other without a broker round trip), but a request held that way waits for the
worker's running batch however long that is, while another worker of its pool may sit idle:
the broker cannot know how long a batch will take.  So it corrects placement after the fact.
A worker that answers RECALL (``recall`` at READY) and holds two or more requests is *deep*
(``_Service.deep``); one holding nothing is *idle* (``_Service.idle``).  At the end of every
event that touched a service with both, and nothing queued that an idle worker could take
(``_pump`` runs first), each idle worker not already waiting for work taken back picks the
deep worker of its service whose oldest request has run longest, if that is at least
``recall_after`` seconds (younger: a timer looks again when it is not; waiting behind a
short batch is cheaper than a round trip), and that worker gets a ``RecallAtWorker`` for its
newest requests that the idle worker's pools can take, at most half of those it holds that
are still running and not yet asked for, and at most the idle worker's credit.  The worker
drops the ones it has not started and says so (``worker_returned``); each goes straight to
the idle worker it was taken back for if that one can still take it (it already had its
turn), else to the front of its principal's FIFO, without counting as an attempt
(``returned`` is counted on the request and shown to the worker, so the reply's timing
says so; ``queue_ms`` is measured from the broker's receipt, so it includes the time spent
parked).  The ones already started finish as usual.  A request is asked for at most once per
dispatch; a worker that returns one unasked is refusing work, and that counts as a failed
attempt.  The worker answers every RECALL, also for the requests it keeps (started), so
an idle worker waits for at most one round trip before it may look elsewhere.  The check is
O(1) when no worker is idle or none is deep.  With both, the full look (O(deep x credit +
idle)) is made only at an event that may have given an idle worker something to take: a
worker newly deep or newly idle, an idle worker's RECALL answered, a lease, the timer of a
batch grown old enough; an event that only changed what some deep workers hold (a request
dispatched to one, one answered) looks at those workers alone (``_recall_touched``).  An
event that gives an idle worker nothing new costs no look, however many workers are deep.

Urgent work.  The same parking delays an urgent request: a background flood fills every
worker's credit (a batch runs, the next waits at the worker), so an urgent request queued
at the broker got the first credit freed, and then waited at the worker behind the batch
already formed from the parked background requests: one whole batch more than the running
one (measured end to end: 5 background requests ran before it at a worker of batch 4 and
credit 8).  So an urgent request that is queued on arrival (every worker of its pool full)
asks one deep worker of its pool that answers RECALL (a busy one only when no other will
do) for its newest request of a lower class not asked for yet (``_make_room``: at most ``_SCAN`` requests looked at; nothing when
``recall_after`` is negative; from a worker holding more than its brokered credit, after a
lease took some of it, as many as bring it one under, or none).  Given back unstarted, that request goes to the front of its
principal's FIFO (``returned`` counted, not an attempt) and the credit it frees goes to the
urgent request, which outscores it; at the worker the urgent request then joins the batch
after the running one (the batcher orders by class).  A request already started is kept
and nothing moves.  One urgent request asks for one.

A newcomer's turn.  The same parking delays a light client beside a flood of its own class:
the flood's requests fill the worker's credit, the light client's request waits at the
broker for the running batch to end, and by the time it reaches the worker the worker has
begun its next batch from the flood's parked requests: a whole batch more (measured: a 20
ms model at credit 8, a flood at 125/s and a client at 5/s, the light client's p50 49.5
ms, two batches and a half).  The ring already puts a principal that was served before the
flood ahead of it (Dispatch); so a request queued on arrival that is its principal's only
one queued in the service (``count`` 1), for which one deep worker of its pool (a busy one only
when no other will do: its credit puts what takes it behind a long batch; as for urgent
work) holds nothing of its principal's and two or more
running of another principal's (not asked back already, not cancelling), asks that worker
for its newest of the principal holding most there (``_make_turn``), of a class no more
urgent than its own, from a principal the freed credit would not go to first: not ahead of
it in its class's ring, and, with nothing queued, not remembered as served before it (its
FIFO, made again by the give-back, would go ahead), and not one that aging sent ahead of
a more urgent class (given back to its own, its wait may win).  The credit freed goes to the ring's
first: a principal never served here, which joins at the back, takes nothing from a flood
queued ahead of it.  Given back
unstarted, it goes back into its principal's FIFO by age (``_enqueue(by_age=True)``: ahead
of the requests that came after it, not at the front: congested, a FIFO headed by a request
put back at the front is walked oldest first, and the flood's newest waited for the one
given back, late by then: at credit 2 the flood's p95 was 66-68 ms, 49.5-49.9 by age), and its principal's place in
the ring stays where it was (a retry or an urgent request's give-back moves its principal
to the front: here the credit would go straight back), and the freed credit goes to the newcomer, which
the worker's batcher then takes ahead of the flood's parked requests (its turns:
gpu_worker/batching.py).  One who holds something there already, or has another request
queued, asks nothing: with every principal holding one, nothing moves.  At most ``_SCAN``
principals of the ring and ``_CLASS_SCAN`` held requests looked at; nothing when
``recall_after`` is negative or the worker does not answer RECALL; counted in
``recalled`` and ``turns``.

Leased work (pinned streams, broker/leases.py) runs at a worker without the broker seeing
it, so a worker that takes leases and whose running batch runs long says BUSY
(``worker_busy``), and says so again when it ends.  A busy worker is never idle (nothing
is taken back for it), comes last in its pools' heaps (dispatch hands it work only when
every other worker of the pool is full or busy too), and is deep from one request held:
everything it holds is parked behind the long batch, so all of it (not half) may be taken
back for an idle worker.

Each pool keeps a lazy min-heap of its workers with spare credit, keyed by
``(busy, (in_flight + leased) / credit, in_flight, last used)``.  A load change bumps the worker's version
and pushes one new entry; stale entries are discarded when they surface, and the heap is
rebuilt when stale entries outnumber live workers.  Choosing a worker is therefore
O(log workers) and independent of the queue length; nothing scans all workers per request.
Queueing, unqueueing (dispatch, cancel, deadline, eviction) and moving a principal in its
ring are O(1) OrderedDict operations.

Admission
---------
After the checks that make a request invalid (priority, duplicate id on its connection,
deadline already passed, NOT_LOCAL), a request is refused at once with QUEUE_FULL, and
nothing else changes, when its principal (all its connections, across all services) already
has ``max_client_requests`` requests outstanding (queued, running or cancelling), or when its
``size`` (the inline payload bytes the server passes) would take the ``size`` sum of the
principal's outstanding requests over ``max_client_bytes``.  Bytes are counted from admission
until the request's final, whatever the path (result, direct reply, error, cancel, deadline,
worker failure, eviction), or until its connection goes away; a retry after a worker death
keeps them counted.  Both are O(1) dict entries per principal (no zero entries), adjusted
request by request, so they stay exact as the principal's connections come and go.

``max_queue`` bounds the requests queued in one service.  When the queue is over it after
dispatching and the newcomer is still queued, the deadlines already due that no tick() has
fired yet (between two ticks a queue may hold requests past their deadline) fire first, as
the tick would fire them (``Scheduler._expire_due``: from the timer heap, those due only, at
most ``TICK_MAX`` entries; each fired leaves the heap for good, and a queue with room looks
at nothing): requests past their deadline are answered DEADLINE_EXCEEDED and cost no live
request its place.  If the queue is still over, one request of the principal holding the most
queued requests in that service is refused.  If that is another principal than the
newcomer's, one of its queued requests, whichever of its connections sent it, gets its
QUEUE_FULL final now (on that connection) and the newcomer stays.  That one is of the least
urgent class the principal has queued (background, then normal, then urgent), and in that
class what its walk would serve last: its newest, or, where its FIFO is walked newest first
(Congestion), its oldest, which waits on for its deadline anyway; never a request put back
at the front of its FIFO (a retry, or given back to an idle worker's take-back or urgent
work; not one given back for a newcomer's turn, which goes back by age) while the principal has another queued
(such a FIFO is passed over for the next class).  If the heaviest is the newcomer's own
principal (ties included), the newcomer is refused, unless that principal has queued a
request of a less urgent class than the newcomer's, not put back at the front: then that one
goes, chosen as above among those classes, and the newcomer stays (``Scheduler._victim``: at
most three FIFOs looked at).  Why the class first: it is the one word a client gives on
which of its requests it can best do without; chosen by arrival alone, a principal feeding a
background backlog lost its urgent request, the newest, to another client's newcomer, and its
own urgent newcomer was refused, while the backlog kept its place.  A victim found past its
deadline (more timers due than ``_expire_due`` looked at) is answered DEADLINE_EXCEEDED
instead, never QUEUE_FULL.
So a principal can only ever push itself into QUEUE_FULL, and a principal's burst, on any
number of connections, fills the queue at no one else's expense.  (Retries after a worker
death may take a queue over ``max_queue``; they refuse nothing.)  A principal's queued count
in a service is the length of its (at most three) FIFOs there: O(1) to read and nothing to
maintain.  Once a queue overflows, its principals are also bucketed by count
(``_Service.tiers``, ``_Service.top``) until it is down to half of ``max_queue``, so finding
the heaviest principal is O(1) amortised and costs nothing while queues stay short (see
``Scheduler._heaviest``).

Time
----
Everything time-driven (deadlines, service grace, heartbeats to workers, worker and client
liveness) is one min-heap of timers, also lazy: an entry is checked when it surfaces
(is its request still waiting? has the worker been heard from since?) and is dropped or
pushed back to its real due time.  Refreshing liveness on every message is therefore an
O(1) store, and :meth:`Scheduler.next_wakeup` is exact after it settles the heap top.

Failure handling
----------------
A worker that dies (DISCONNECT, a second READY, or silence for ``heartbeat_liveness``
intervals) loses its requests: RUNNING ones go back to the front of their principal's FIFO,
and that principal to the front of its class's ring (they have already waited their turn), with
``attempt + 1`` until ``max_retries`` is spent (then WORKER_FAILED), CANCELLING ones finish
as CANCELLED, ABANDONED ones simply vanish.

A request's last attempt (``attempt == max_retries``, after at least one failed attempt)
runs alone (``_Request.alone``).  A request that kills the process running it (a crash in
the model's native code, an abort, an out-of-memory kill on one input) takes every request
its worker holds with it; retried together, they were batched together again, died with it
again, and failed with it.  So a last attempt waits in its service's ``lone`` list as well
as in its FIFO (where the walk above passes over it) and goes only to a worker of its pool
that holds nothing; where no worker is empty, the least loaded one not set aside already is
set aside for it (``_Worker.iso``): that worker gets no other brokered dispatch, is never
idle (nothing is taken back for it) and none of its requests on a last attempt is taken
back, until it is empty, has run that request and answered it.  So a request that dies on
its last attempt died alone, and the others that died beside it before run without it: the
killer takes one worker per attempt, as before, and nobody else fails.  Only the last
attempt runs alone, so that workers that die together (a host, a deploy) are not made to
retry everything one request at a time.  Leased requests reach a worker without the broker
(broker/leases.py), so one may still share a batch with a last attempt; a leaseholder
resends its lost requests through the broker when its worker dies.  A set-aside worker
is freed when its request leaves the queue another way (cancel, deadline, its client gone)
or goes elsewhere (the worker's connection closed, or another worker of its pool went idle
while the one set aside still runs other work).  The cost (see _place_lone) is paid only
after worker deaths.  With ``max_retries`` 1 the first retry is the last: workers that die
together then have their requests retried one per worker at a time.

A request whose pool has had no live worker
for ``service_grace`` seconds fails with SERVICE_UNAVAILABLE (or NOT_LOCAL when the service
lives on, but not on the request's host).  A client connection that disconnects or falls
silent loses its queued requests silently and its running ones are cancelled at the worker;
the other connections of its principal keep theirs.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from broker.leases import T_LEASE, LeaseAction, LeaseEvents
from broker.protocol import CANCEL_CLIENT_GONE, CANCEL_EXPIRED, MIN_LIVENESS_WINDOW, ErrorCode, Priority  # noqa: F401  (re-exported)

__all__ = [
    "Priority",
    "ErrorCode",
    "Config",
    "Dispatch",
    "ToClient",
    "LateToClient",
    "ClientError",
    "CancelAtWorker",
    "RecallAtWorker",
    "HeartbeatWorker",
    "DisconnectWorker",
    "Action",
    "Scheduler",
]


# The codes and classes are wire values: they live in broker.protocol, the single source
# of truth, and are re-exported here for the scheduler's users.


def cuda_key(host: str) -> str:
    """The ``local_host`` of a request with CUDA IPC references: only workers on ``host`` that
    advertise the ``cuda`` transport can take it."""
    return host + "#cuda"


@dataclass(slots=True)
class Config:
    heartbeat_interval: float = 1.0  # seconds between heartbeats to workers
    heartbeat_liveness: int = 3  # missed intervals before a peer is presumed dead
    max_queue: int = 1024  # queued requests per service (the heaviest principal yields first)
    priority_weights: tuple = (3.0, 1.0, 0.5)  # urgent, normal, background
    aging_s: float = 0.5  # waiting this long adds one unit of the weight (no starvation)
    max_retries: int = 2  # re-dispatches after worker deaths before WORKER_FAILED
    service_grace: float = 1.0  # wait for a live worker before SERVICE_UNAVAILABLE
    client_liveness: float | None = None  # default heartbeat_interval * heartbeat_liveness
    # A client the server knows to be alive though silent (its ipc connection is open:
    # client_kept) stays so this long after it was last heard; then its silence counts, so
    # that a stopped or wedged process does not hold leases and queued work for ever.
    quiet_client_max: float = 60.0
    # Per principal (a client process or user, all its connections together; see the module
    # docstring), across services: outstanding (queued, running or cancelling) requests, and
    # the sum of their ``size`` (inline payload bytes).  Over either: QUEUE_FULL.
    max_client_requests: int = 4096
    max_client_bytes: int = 512 << 20  # 512 MiB: two of the broker's largest messages
    # All principals together: the ``size`` sum of every outstanding request.  Over it:
    # QUEUE_FULL.  (Many processes within their caps held more than the broker's memory:
    # the resource audit's broker was killed by its cgroup.)  The broker sets it from its
    # memory limit when it is not given (`broker.server`, half its cgroup's or the machine's).
    max_total_bytes: int | None = None  # None: no cap here (`broker.server` gives it one)
    # Head-of-line: a worker of the pool that is idle takes back requests parked behind a
    # busy worker's running batch once that worker's oldest request has run this long
    # (seconds; None: never).  See "Taking work back" in the module docstring.
    recall_after: float | None = 0.005
    # Overload: once a service's queue has not been empty for this long (seconds; None or
    # negative: never), each principal's queued requests are served newest first.  See
    # "Congestion" in the module docstring.
    lifo_after: float | None = 0.1
    # ... and one of its requests missed its deadline at most this long ago (seconds; None or
    # negative: a queue that has not emptied is congested whatever its deadlines).
    lifo_miss_window: float | None = 0.1


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send a REQUEST to ``worker``; the worker echoes ``token`` in every reply.

    ``attempt`` is 0 for the first dispatch and n for the n-th retry after worker deaths."""

    worker: bytes
    token: int
    client: bytes
    request_id: int
    service: str
    payload: object
    enqueued_at: float
    deadline: float | None
    attempt: int
    returned: int = 0  # times a busy worker gave this request back unstarted (RecallAtWorker)
    backlog: int = 0   # requests of the service still queued here after this dispatch
    #: the class the worker is told (the header's ``priority``): the request's own, or the
    #: more urgent class it outscored by aging ("Dispatch" in the module docstring); None:
    #: the header's is left as it is
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class ToClient:
    """Forward a worker's PARTIAL (``final=False``) or FINAL to the client."""

    client: bytes
    request_id: int
    service: str
    final: bool
    payload: object
    enqueued_at: float
    dispatched_at: float
    code: int = 0  # a FINAL's outcome as the server read it (0: a result), for the metrics


@dataclass(frozen=True, slots=True)
class LateToClient:
    """A worker's reply to a request its client was already answered for (its deadline
    passed while the worker ran it), forwarded only so that the client gives back the
    output slots the reply names: a slot lent to a live client is freed by it alone, and
    one whose reply was dropped here stayed held for the client's life.  Our SDK releases
    what a reply for nobody names; the server forwards only a reply with our header (a
    plain MDP client would take an opaque one for an answer)."""

    client: bytes
    request_id: int
    service: str
    final: bool
    payload: object


@dataclass(frozen=True, slots=True)
class ClientError:
    """A typed error FINAL; ``payload`` is the original request payload."""

    client: bytes
    request_id: int
    service: str
    code: ErrorCode
    message: str
    payload: object
    enqueued_at: float | None = None  # None: refused at admission (it never queued)
    #: a request its deadline took out of the queue, never dispatched: when (its wait there
    #: counts in the queue-wait histogram as a dispatched one's does; newest first, under
    #: overload, that is where the queue's wait is: "Congestion")
    left_queue: float | None = None
    #: False: its outcome is counted later, through ``on_direct`` (a deadline that passed while
    #: a worker ran it: "Deadlines", `Scheduler._expire_deadline`)
    counted: bool = field(default=True, compare=False)


@dataclass(frozen=True, slots=True)
class CancelAtWorker:
    worker: bytes
    token: int
    why: int = 0  # 0: the client asked; CANCEL_EXPIRED: its deadline passed; CANCEL_CLIENT_GONE
    # The request, for a log line that names it as the worker's does (rid): not compared.
    request_id: int = field(default=0, compare=False)
    payload: object = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class RecallAtWorker:
    """Ask ``worker`` to give back these requests if it has not started them (RECALL); it
    answers with the ones it dropped (`Scheduler.worker_returned`) and runs the others."""

    worker: bytes
    tokens: tuple


@dataclass(frozen=True, slots=True)
class HeartbeatWorker:
    worker: bytes


#: words of `Scheduler.death_note` when the worker was its service's last live one
LAST_WORKER = "the service's last live worker"


@dataclass(frozen=True, slots=True)
class DisconnectWorker:
    worker: bytes
    reason: str
    dead: bool = False  # presumed dead for its silence (the server warns: operators must hear of it)


Action = (Dispatch | ToClient | ClientError | CancelAtWorker | RecallAtWorker | HeartbeatWorker
          | DisconnectWorker | LeaseAction)

# ------------------------------------------------------------------------ internal state

#: The outcome `on_direct` reports for a request whose client went away before any final
#: (queued, or held by a worker that then died or gave it back): never a wire code.
CLIENT_GONE = -1

# Request states (see Rule 3 in the module docstring).
_QUEUED, _RUNNING, _CANCELLING, _ABANDONED, _DONE = range(5)
#: `_Request.recalled` of a request asked back to give another principal its turn
#: (`Scheduler._make_turn`): truthy like True, told apart when it comes back
_TURN = 2
_LIVE_FOR_CLIENT = (_QUEUED, _RUNNING, _CANCELLING)

# Timer kinds.
_T_DEADLINE, _T_GRACE, _T_HEARTBEAT, _T_WORKER, _T_CLIENT, _T_RECALL = range(6)
#: timers one `Scheduler.tick` handles at most (about 50 ms of the broker's work at the most)
TICK_MAX = 4096
_T_LEASE = T_LEASE  # 6: a lease its worker has not confirmed yet (broker/leases.py)
_T_COUNT = 7  # a running request's deadline passed: its outcome is counted now, if no answer came
#: about how long a FINAL sent straight to its client takes to be read there (one ipc hop and a
#: wake-up; `_settle`): one sent later than this before its deadline came too late for the
#: client's own timer (0.1-0.3 ms gave callers' and broker's `ok` within 10 of 2,000 near-deadline
#: calls on the test VM: BENCHMARKS.md, "Deadlines counted as their callers saw them")
_DELIVERY_S = 0.0002

# How many queued requests a dispatch pass looks at to get past ones that cannot go anywhere
# now (locality): at most _SCAN of one principal's FIFO and _CLASS_SCAN of one priority class.
# Bounded so a pile of unplaceable requests costs a constant per pass, not the queue length.
_SCAN = 16
_CLASS_SCAN = 4 * _SCAN
#: principals per service and class whose last dispatch is remembered after their FIFO
#: emptied (_Service.left): beyond it the oldest are forgotten (they rejoin at the back)
_LEFT_MEMO = 1024

#: services whose record went (no worker, nothing queued) remembered by when their last live
#: worker went, so that a request for one later is told so, not "start one" (`_expire_grace`)
_GONE_SERVICES = 1024

_COUNTERS = (
    "dispatched",
    "completed",
    "direct",           # of the completed: FINAL sent by the worker straight to the client
    "expired",
    "rejected_full",
    "retried",
    "dropped_late",
    "cancelled",
    "worker_failed",
    "unavailable",
    "not_local",
    "protocol_errors",
    "client_dropped",
    "worker_deaths",
    "evicted",                   # queued requests of the heaviest principal refused for a newcomer
    "rejected_client_requests",  # over max_client_requests
    "rejected_client_bytes",     # over max_client_bytes
    "rejected_total_bytes",      # over max_total_bytes
    "recalled",                  # requests asked back from a busy worker for an idle one, an urgent one or a turn
    "returned",                  # ... and given back unstarted (then run by another worker)
    "leases_granted",            # leases a worker confirmed (broker/leases.py)
    "leases_refused",            # lease asks answered with an error
    "leases_ended",
    "alone",                     # requests on their last attempt dispatched to run alone
    "workers_left",              # workers that said DISCONNECT (a drain, a rolling restart): not deaths
    "paused",                    # the broker itself did not run for a while (stopped, frozen): `resumed`
    "newest_first",              # dispatches made while the service's queue was congested (newest first)
    "turns",                     # of the recalled: asked back for a newcomer's turn (`_make_turn`)
)


class _Request:
    __slots__ = (
        "client",
        "principal",
        "request_id",
        "svc",
        "payload",
        "priority",
        "deadline",
        "local_host",
        "enqueued_at",
        "attempt",
        "state",
        "worker",
        "token",
        "dispatched_at",
        "size",
        "recalled",
        "returned",
        "thief",
        "orphan",
        "late",
        "streamed",
        "alone",
        "iso",
        "shown",
        "front",
        "stream",
        "count_by",
    )

    def __init__(self, client, principal, request_id, svc, payload, priority, deadline,
                 local_host, now, size, stream=False):
        self.client = client  # the connection: where its replies go
        # Who it counts against (fairness, eviction, caps): fixed at admission, never
        # recomputed (the connection's next request may carry another principal).
        self.principal = principal
        self.request_id = request_id
        self.svc = svc
        self.payload = payload
        self.priority = priority
        self.shown = priority  # the class its current dispatch told the worker (Dispatch.priority)
        self.front = False  # queued at the front of its FIFO (a retry, or given back, not for a turn): served in order
        self.stream = stream  # a stream's frame: its FIFO is walked in order even when congested (`_newest_first`)
        self.deadline = deadline
        self.local_host = local_host
        self.enqueued_at = now
        self.attempt = 0
        self.state = _QUEUED
        self.worker = None
        self.token = 0
        self.dispatched_at = 0.0
        self.size = size  # counted in Scheduler._bytes, its principal's, while live
        self.recalled = False  # a RECALL was sent for the current token
        self.returned = 0      # times a busy worker gave it back unstarted
        self.thief = None      # the idle worker it was recalled for
        self.orphan = False    # its connection went away while a worker held it (no final sent):
        #                        True, or "cancelling" when its client had cancelled it first
        self.streamed = False  # a PARTIAL of it was relayed: it is never run again (its caller would see them twice)
        # Its last attempt: it runs alone on a worker that holds nothing else (see Failure
        # handling), ``iso`` the worker set aside for it while it waits.
        self.alone = False
        self.iso = None
        # Its deadline answered it while a worker ran it: the client's record then (None for
        # one that never heartbeats), to which the worker's late replies go while it is the
        # client's record still (LateToClient)
        self.late = None
        # Its deadline passed while a worker ran it, and its outcome waits for the worker's
        # answer until then (`_expire_deadline`); None otherwise
        self.count_by = None


# How a service's last worker went, in its requests' SERVICE_UNAVAILABLE ("its last one went
# 2.0 s ago (...)"): the broker tells these apart.  A crash (SIGSEGV, os._exit, SIGKILL)
# closes the worker's connection without a DISCONNECT, which the server sees at once; only a
# worker that stalled, or whose host or network went, is presumed dead after its silence.
# All of them were "presumed dead after silence, or stopped" (the models audit).
_WENT_SILENT = "presumed dead after its silence past the liveness window"
_WENT_CLOSED = "its connection closed without a goodbye: it crashed or was killed"
_WENT_AWAY = "it said goodbye: stopped, or drained"
_WENT_STOPPING = "it was stopped (draining)"
_WENT_DROPPED = "disconnected by the broker"


class _Pool:
    """The workers of one service able to take one class of request (see docstring)."""

    __slots__ = ("key", "live", "ready", "gap_since", "gap_epoch", "lost_at", "lost_how")

    def __init__(self, key, now, epoch):
        self.key = key
        self.live = 0
        # Lazy min-heap of (load, in_flight, used, seq, version, worker).
        self.ready = []
        # While the pool has no live worker: since when, and an epoch that grace timers
        # carry so a timer from an earlier gap cannot fire in a later one.
        self.gap_since = now
        self.gap_epoch = epoch
        self.lost_at = None  # when its last live worker went (presumed dead, or left); None: never had one
        self.lost_how = _WENT_SILENT  # how it went (`Scheduler._leave_pools`), for the error that says so


def _remember_turn(left, principal, when) -> None:
    """``principal``'s last turn in a class was at ``when`` (`_Service.left`: the newest
    last, the oldest forgotten past ``_LEFT_MEMO``)."""
    left[principal] = when
    left.move_to_end(principal)
    if len(left) > _LEFT_MEMO:
        left.popitem(last=False)


def _busy_last(workers):
    """``workers``, those that said BUSY last: a credit one of them frees puts what takes it
    behind a long batch, so it is asked only when no other worker would do (every worker
    of the pool busy, as with one worker whose batches all run long)."""
    busy = None
    for w in workers:
        if w.busy:
            if busy is None:
                busy = []
            busy.append(w)
        else:
            yield w
    if busy:
        yield from busy


def _queue_took_it(req) -> bool:
    """Whether a dispatched request that missed its deadline had spent a quarter of its budget
    or more queued here: a miss the queue's order may have caused (Congestion).  One sent on
    at once that its worker could not finish in time (a timeout shorter than the model's
    run) says nothing of the queue: counted, one such client beside a standing queue kept
    it newest first, and its closed-loop callers starved again (the review)."""
    d = req.deadline
    return d is None or (req.dispatched_at - req.enqueued_at) * 4 >= d - req.enqueued_at


def _newest_first(fifo) -> bool:
    """Whether a congested queue walks this (non-empty) FIFO newest first (Congestion): not
    while its head must go first, a request put back at the front, or one without a deadline
    (nothing else ever takes it out; newest first, it waited for as long as its principal
    sent more), or a stream's frame (a stream is run in its order: its client already gives
    up stale frames, latest wins, and a newer frame run first would be delivered ahead of
    an older one; 46 of 153 were, the streams audit)."""
    head = next(iter(fifo))
    return not head.front and not head.stream and head.deadline is not None


class _Service:
    __slots__ = ("name", "classes", "left", "queued", "since", "missed", "tiers", "top", "workers", "pools", "any",
                 "in_flight", "idle", "deep", "recall_at", "lone", "aside", "isos",
                 "recall_stale", "recall_hot", "recall_takers", "recall_touched")

    def __init__(self, name, now, epoch):
        self.name = name
        # One ring per priority class: principal -> that principal's FIFO (the requests of
        # all its connections), least recently served principal first (see Dispatch in the
        # module docstring).  OrderedDicts throughout: O(1) append, removal from the middle
        # (cancel, deadline, eviction, a connection gone), move to either end (a served
        # principal to the back, a retry to the front).  FIFO keys are the requests
        # themselves; no FIFO in a ring is ever empty.
        self.classes = (OrderedDict(), OrderedDict(), OrderedDict())
        # Per class, the principals whose FIFO emptied after one of its requests was
        # dispatched, or whose request went straight to a worker from an empty queue:
        # principal -> when it was last served, oldest first, at most _LEFT_MEMO.  One that
        # queues again goes ahead of the first principal in the ring served after it (least
        # recently served first), not behind a flood served since (_enqueue).
        self.left = (OrderedDict(), OrderedDict(), OrderedDict())
        self.queued = 0
        self.since = 0.0  # when the queue last went from empty to not (meaningful while queued)
        # When a request of the service last missed its deadline: in the queue, while a
        # worker ran it, or answered 504 by the worker ("not run"): Congestion's second test.
        self.missed = -math.inf
        # How many requests a principal has queued here is the length of its FIFOs (at
        # most three: _Service.count).  While the queue is long (see Scheduler._heaviest),
        # the principals are also bucketed by that count (count -> {principal: None}; no
        # empty buckets), the largest count in ``top``, so that who holds most is an O(1)
        # question; None while the queue is short.
        self.tiers = None
        self.top = 0
        self.workers = {}
        self.any = _Pool(None, now, epoch)
        self.pools = {None: self.any}
        self.in_flight = 0  # tokens held by this service's workers, abandoned ones included
        # Taking work back (module docstring): workers holding nothing, and workers that
        # answer RECALL holding two or more (one may run while others wait behind it).
        # Kept by Scheduler._reload, so "is there anything to take back?" is O(1).
        self.idle = {}
        self.deep = {}
        self.recall_at = None  # when a _T_RECALL timer of this service is due, if one is
        # What the last look for work to take back left behind (Scheduler._recall), so that
        # an event that changed nothing an idle worker could take from costs no look
        # (Scheduler._flush): whether the next one must look at everything; the pools of
        # the requests that deep workers whose batch ran long enough could give back, and
        # the pools of the idle workers that could take them (both supersets); and the
        # deep workers whose requests changed since (their batch's age, what they hold).
        self.recall_stale = True
        self.recall_hot = set()
        self.recall_takers = set()
        self.recall_touched = {}
        # Queued requests on their last attempt (``_Request.alone``) that no worker is set
        # aside for yet, oldest retry first; the workers set aside for queued ones (until
        # they are empty: then each runs its request alone); and how many workers of the
        # service are set aside or run one (``_Worker.iso``).  See _place_lone.
        self.lone = OrderedDict()
        self.aside = {}
        self.isos = 0

    def count(self, principal):
        """How many requests ``principal`` has queued in this service (all classes): O(1)."""
        n = 0
        for ring in self.classes:
            fifo = ring.get(principal)
            if fifo is not None:
                n += len(fifo)
        return n


class _Worker:
    __slots__ = (
        "ident",
        "svc",
        "credit",
        "host",
        "transports",
        "pools",
        "in_flight",
        "last_seen",
        "last_heartbeat",
        "used",
        "version",
        "alive",
        "recall",
        "awaiting",
        "is_idle",
        "is_deep",
        "busy",     # it said BUSY: a long batch runs there (worker_busy)
        "direct",   # the worker's direct socket (Ready.direct): it takes leases
        "link",     # its local link (Ready.link): near leaseholders connect there
        "direct_key",  # a tcp direct socket's CurveZMQ public key (Ready.direct_key)
        "leased",   # credit reserved by its leases (not for brokered dispatch)
        "leases",   # lease id -> broker.leases._Lease
        "stopped",  # lease id -> (client, service) of leases it ended by stopping (broker.leases)
        "closing",  # its connection closed (worker_closed), or it drains: no new work while its verdict waits
        "stopping",  # it said STOPPING (worker_stopping): draining, no longer counted live in its pools
        "iso",      # the request on its last attempt it is set aside for, or runs alone (else None)
        "quiet_busy",  # a plain MDP worker (bare READY): silent while it runs a request (worker_ready)
    )


class _Client:
    __slots__ = ("ident", "last_seen", "heard", "epoch")

    def __init__(self, ident, now, epoch=0):
        self.ident = ident
        self.last_seen = now  # what its liveness counts from
        self.heard = now  # its last message (client_kept moves last_seen only)
        self.epoch = epoch  # which record of the client this is (client_epoch)


#: clients remembered as dropped while they held something (Scheduler.client_epoch)
_MAX_RENAMED = 1 << 16


# ----------------------------------------------------------------------------- scheduler


class Scheduler(LeaseEvents):
    """The broker's scheduling state.  Every event method returns a list of actions."""

    @staticmethod
    def check(cfg: Config) -> None:
        """ValueError naming the first setting of ``cfg`` out of its range.  Every number is
        looked at for NaN and infinity too: a NaN service_grace passed `< 0` and crashed the
        running broker at its first grace timer (the command-line hunt); the heartbeat bounds
        are what a WELCOME may carry (workers refuse others)."""
        for name in ("heartbeat_interval", "aging_s", "service_grace", "quiet_client_max", "client_liveness",
                     "recall_after", "lifo_after", "lifo_miss_window"):
            v = getattr(cfg, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, not {v}")
        if not 0.001 <= cfg.heartbeat_interval <= 3600:
            raise ValueError(f"heartbeat_interval must be from 0.001 to 3600 seconds, not {cfg.heartbeat_interval}")
        if not 2 <= cfg.heartbeat_liveness <= 1000:
            # (1: a peer heartbeating every interval is presumed dead whenever one heartbeat
            # comes a moment late: an idle worker was, about once a second)
            raise ValueError(f"heartbeat_liveness must be from 2 to 1000, not {cfg.heartbeat_liveness}")
        if cfg.heartbeat_interval * cfg.heartbeat_liveness < MIN_LIVENESS_WINDOW:
            raise ValueError(f"heartbeat_interval x heartbeat_liveness (the liveness window) must be at least "
                             f"{MIN_LIVENESS_WINDOW} s, not {cfg.heartbeat_interval} x {cfg.heartbeat_liveness}: "
                             f"shorter, ordinary pauses of a live process read as deaths")
        if cfg.client_liveness is not None and not MIN_LIVENESS_WINDOW <= cfg.client_liveness <= 86400:
            raise ValueError(f"client_liveness must be from {MIN_LIVENESS_WINDOW} to 86400 seconds, "
                             f"not {cfg.client_liveness}")
        if not 0 <= cfg.max_queue <= 1 << 31:
            raise ValueError(f"max_queue must be from 0 to {1 << 31}, not {cfg.max_queue}")
        if len(cfg.priority_weights) != 3 or any(not (0 < w < math.inf) for w in cfg.priority_weights):
            raise ValueError("priority_weights must be three positive numbers")
        if cfg.aging_s <= 0:
            raise ValueError("aging_s must be > 0 (it divides the waiting time)")
        if not 0 <= cfg.max_retries <= 100:
            raise ValueError(f"max_retries must be from 0 to 100, not {cfg.max_retries}")
        if not 0 <= cfg.service_grace <= 86400:
            raise ValueError(f"service_grace must be from 0 to 86400 seconds, not {cfg.service_grace}")
        if not 0 <= cfg.quiet_client_max <= 86400 * 30:
            raise ValueError(f"quiet_client_max must be from 0 to 2592000 seconds, not {cfg.quiet_client_max}")
        if not 1 <= cfg.max_client_requests <= 1 << 31:
            raise ValueError(f"max_client_requests must be from 1 to {1 << 31}, not {cfg.max_client_requests}")
        # 0 is not "no limit": it refused every request with an inline tensor, the small ones
        # a shared-memory client sends inline too, with "wait for results" (the
        # configuration hunt)
        if not 1 <= cfg.max_client_bytes <= 1 << 50:
            raise ValueError(f"max_client_bytes must be from 1 to {1 << 50} (0 is not 'no limit': it would refuse "
                             f"every request with an inline tensor), not {cfg.max_client_bytes}")
        if cfg.max_total_bytes is not None and not 1 <= cfg.max_total_bytes <= 1 << 50:
            raise ValueError(f"max_total_bytes must be from 1 to {1 << 50}, not {cfg.max_total_bytes}")

    def __init__(self, config: Config | None = None, *, on_direct=None):
        """``on_direct(service, code, enqueued_at, dispatched_at, finished_at, key)`` (``key``:
        the request's ``(client, request_id)``), if given, is
        called for every request settled by a worker's DONE whose client was still waiting
        (the broker relays nothing for it, so the caller counts it there: its metrics), and
        for every request whose connection went away while a worker held it, when the
        worker's answer comes: the one count of each request the broker sends no final for."""
        cfg = config if config is not None else Config()
        self.check(cfg)
        self.config = cfg
        self._max_client_requests = int(cfg.max_client_requests)
        self._max_client_bytes = int(cfg.max_client_bytes)
        self._max_total_bytes = 1 << 62 if cfg.max_total_bytes is None else int(cfg.max_total_bytes)
        self._total_bytes = 0  # the sum of `_bytes`
        # Negative: never (a TOML file has no null to say so).
        self._recall_after = (None if cfg.recall_after is None or cfg.recall_after < 0
                              else float(cfg.recall_after))
        self._lifo_after = (None if cfg.lifo_after is None or cfg.lifo_after < 0
                            else float(cfg.lifo_after))
        self._lifo_miss = (None if cfg.lifo_miss_window is None or cfg.lifo_miss_window < 0
                           else float(cfg.lifo_miss_window))
        self._tiers_off = int(cfg.max_queue) // 2  # see _heaviest
        self._weights = tuple(float(w) for w in cfg.priority_weights)
        self._worker_ttl = cfg.heartbeat_interval * cfg.heartbeat_liveness
        self._client_ttl = (
            cfg.client_liveness if cfg.client_liveness is not None else self._worker_ttl
        )
        self._services: dict[str, _Service] = {}
        # name -> when its last live worker went, for services whose record was dropped
        # (`_flush`), oldest first, at most _GONE_SERVICES
        self._lost_services: dict[str, tuple[float, str]] = {}  # (lost_at, lost_how) of _Pool
        self._workers: dict[bytes, _Worker] = {}
        self._clients: dict[bytes, _Client] = {}  # only clients that sent a heartbeat
        # Requests live for their client, per connection (routing, duplicate ids, cancel,
        # disconnect), and what they count against the caps, per principal (see the module
        # docstring): how many, and the sum of their sizes.  No empty or zero entries.
        self._requests: dict[bytes, dict[int, _Request]] = {}
        self._outstanding: dict[object, int] = {}
        self._bytes: dict[object, int] = {}
        self._live = 0  # requests not DONE; bounds the number of valid timers
        self._timers: list = []
        self._seq = itertools.count()
        self._tokens = itertools.count(1)
        self._uses = itertools.count()
        self._epochs = itertools.count(1)
        # Clients dropped while they held something -> the number their next record gets
        # (client_epoch); oldest first out past _MAX_RENAMED.
        self._renamed: dict[bytes, int] = {}
        # Services whose queues or workers changed during the current event; a dict, not a
        # set, so the order of the resulting actions does not depend on object addresses.
        self._dirty: dict[_Service, None] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._draining: str | None = None  # see drain()
        self._holding = False  # see hold()
        self._on_direct = on_direct
        self._init_leases()

    # ------------------------------------------------------------------ worker events

    def worker_ready(
        self,
        worker: bytes,
        service: str,
        now: float,
        *,
        credit: int = 1,
        host: str | None = None,
        transports: frozenset = frozenset({"inline"}),
        recall: bool = False,
        direct: str | None = None,
        link: str | None = None,
        direct_key: str | None = None,
        quiet_busy: bool = False,
    ) -> list[Action]:
        """A worker announced itself for ``service`` with ``credit`` concurrent requests.

        ``transports`` must contain ``"shm"`` (and ``host`` be set) for it to take requests
        that carry shared-memory references.  ``recall``: it answers RECALL (requests it
        holds unstarted can be taken back for an idle worker).  ``direct``: the endpoint of
        its direct socket, for leases (broker/leases.py), and ``link`` its local link (near
        leaseholders connect there instead).  ``quiet_busy``: a plain MDP worker, which may
        be silent while it runs a request (the zguide's worker API and majortomo's heartbeat
        only while they wait for work, and the brokers they come with never expire a busy
        worker): its silence counts only while it runs nothing a client still waits for.
        A second READY from a registered worker disconnects it; its in-flight work is
        retried elsewhere."""
        out: list[Action] = []
        known = self._workers.get(worker)
        if known is not None:
            # MDP: a second READY means the peer lost its state (restart with the same
            # identity) or is confused; either way its in-flight work cannot be trusted.
            self._kill_worker(known, now, out, how=_WENT_DROPPED)
            out.insert(0, DisconnectWorker(worker, "READY from a worker already registered; "
                                                   "reconnect and send READY once"))
            self._flush(now, out)
            return out
        svc = self._service(service, now)
        w = _Worker()
        w.ident = worker
        w.svc = svc
        w.credit = max(1, int(credit))  # a worker with no credit would only hold a slot
        w.host = host
        w.transports = frozenset(transports)
        w.in_flight = {}
        w.last_seen = now
        w.last_heartbeat = now  # READY is the handshake; the first heartbeat is due later
        w.used = next(self._uses)
        w.version = 0
        w.alive = True
        w.recall = bool(recall)
        w.awaiting = 0  # requests recalled for it from busy workers, not yet answered
        w.is_idle = w.is_deep = False  # in svc.idle / svc.deep (kept by _reload)
        w.busy = False
        w.direct = direct or None
        w.link = link if w.direct else None
        w.direct_key = direct_key if w.direct else None
        w.leased = 0
        w.leases = {}
        w.stopped = {}
        w.closing = False
        w.stopping = False
        w.iso = None
        w.quiet_busy = bool(quiet_busy)
        pools = [svc.any]
        if host is not None:
            # One pool per same-host transport: shared-memory requests are keyed by the host,
            # CUDA IPC requests by cuda_key(host), so neither reaches a worker that can't map it.
            if "shm" in w.transports:
                pools.append(self._pool(svc, host, now))
            if "cuda" in w.transports:
                pools.append(self._pool(svc, cuda_key(host), now))
        w.pools = tuple(pools)
        for pool in pools:
            pool.live += 1
            pool.gap_since = None
            pool.gap_epoch = None
        self._workers[worker] = w
        svc.workers[worker] = w
        self._reload(w)
        self._push_timer(now + self.config.heartbeat_interval, _T_HEARTBEAT, w)
        self._push_timer(now + self._worker_ttl, _T_WORKER, w)
        self._dirty[svc] = None
        self._flush(now, out)
        return out

    def worker_seen(self, worker: bytes, now: float) -> list[Action]:
        """Any message other than READY from ``worker`` (call it before the specific event)."""
        w = self._workers.get(worker)
        if w is None:
            # MDP: tell an unknown peer to reconnect, so it comes back with a READY.
            return [DisconnectWorker(worker, "unknown worker (expired or never sent READY); "
                                             "reconnect and send READY")]
        w.last_seen = now
        return []

    def worker_busy(self, worker: bytes, busy: bool, now: float) -> list[Action]:
        """BUSY from ``worker`` (docs/protocol.md section 10.3): a long batch runs there
        (``busy``: leased work the broker cannot see, or a brokered batch it cannot time),
        or it ended.  While
        busy the worker is never idle (nothing is taken back for it), is the last choice for
        dispatch, and counts as deep from one request it holds: every request it holds
        unasked may be taken back for an idle worker ("Taking work back").  Ignored from a
        worker without a direct socket: our workers send it only when they take leases (older
        ones only for leased work), and a plain one must not keep itself out of dispatch
        and recall with it."""
        out = self.worker_seen(worker, now)
        w = self._workers.get(worker)
        if w is None or w.direct is None or w.busy == bool(busy):
            return out
        w.busy = bool(busy)
        self._reload(w)
        self._dirty[w.svc] = None
        self._flush(now, out)
        return out

    def worker_partial(self, worker: bytes, token: int, now: float, payload: object = None
                       ) -> list[Action]:
        """Relay a PARTIAL if ``worker`` holds ``token``; otherwise drop it (counted)."""
        req = self._held(worker, token, now)
        if req is None:
            return []
        if req.state == _ABANDONED:
            self._counters["dropped_late"] += 1
            if self._late_to_client(req):
                return [LateToClient(req.client, req.request_id, req.svc.name, False, payload)]
            return []
        req.streamed = True
        return [ToClient(req.client, req.request_id, req.svc.name, False, payload,
                         req.enqueued_at, req.dispatched_at)]

    def worker_final(self, worker: bytes, token: int, now: float, payload: object = None,
                     code: int = 0) -> list[Action]:
        """Relay a FINAL if ``worker`` holds ``token`` and return its credit; a reply
        for a token the worker does not hold (late, duplicate) is dropped and counted.
        ``code``: the FINAL's outcome, passed through to the ToClient."""
        out: list[Action] = []
        self._settle(worker, token, now, payload, out, relay=True, code=code)
        self._flush(now, out)
        return out

    def worker_done(self, worker: bytes, tokens, now: float, codes=None, ages=None) -> list[Action]:
        """``worker`` sent these requests' FINALs straight to their clients (direct reply,
        docs/protocol.md section 8): settle each as `worker_final` would and return its
        credit, relaying nothing.  Tokens it does not hold (late, duplicate) are dropped
        and counted.  The client itself drops a second FINAL for one request, so a retry
        raced by a direct reply still ends in exactly one result.  ``codes`` and ``ages``
        (seconds since each FINAL went), when the worker sent them, reach ``on_direct``."""
        out: list[Action] = []
        for i, token in enumerate(tokens):
            self._settle(worker, token, now, None, out, relay=False,
                         code=codes[i] if codes is not None else 0,
                         age=ages[i] if ages is not None else 0.0)
        self._flush(now, out)
        return out

    def worker_returned(self, worker: bytes, tokens, now: float, kept=()) -> list[Action]:
        """``worker``'s answer to a RECALL: ``tokens`` it gave back unstarted, ``kept`` the
        ones it had started (they finish there).  Each one given back goes to the idle worker
        it was recalled for if that one can still take it, or to the front of its queue (one
        given back for a newcomer's turn: into it by age), without counting as an attempt; one the broker did not recall counts as a failed
        attempt (a worker refusing work); cancelled or abandoned ones end here.  A kept one
        frees its idle worker to look elsewhere.  Tokens it does not hold are dropped and
        counted."""
        out: list[Action] = []
        retry = []
        if kept:
            w = self._workers.get(worker)
            if w is not None:
                for token in kept:
                    req = w.in_flight.get(token)
                    if req is not None and req.thief is not None:
                        self._unthief(req)
                        self._dirty[req.svc] = None
        for token in tokens:
            req = self._held(worker, token, now)
            if req is None:
                continue
            w = req.worker
            del w.in_flight[token]
            req.svc.in_flight -= 1
            thief = req.thief
            if thief is not None:
                self._unthief(req)
            if req.iso is not None:
                self._unlone(req, reload=False)
            self._reload(w)
            self._dirty[req.svc] = None
            if req.state == _RUNNING:
                retry.append((req, thief))
            elif req.state == _CANCELLING:
                self._error(req, ErrorCode.CANCELLED, "cancelled by the client", out)
                self._retire(req)
            else:
                self._gone(req, now)  # abandoned: counted now if its client left without a final
                self._retire(req)
        for req, thief in reversed(retry):
            req.state = _QUEUED
            req.worker = None
            if req.deadline is not None and req.deadline <= now:
                # Never dispatched expired, even if tick() has not run yet.
                self._enqueue(req, now)
                self._expire_deadline(req, now, out)
                continue
            if req.recalled:
                self._counters["returned"] += 1
                req.returned += 1
                pool = req.svc.pools.get(req.local_host)
                if (thief is not None and thief.alive and not thief.busy and not thief.closing
                        and not self._holding and thief.iso is None and len(thief.in_flight) < thief.credit - thief.leased
                        and pool is not None and pool in thief.pools):
                    # It already had its turn: straight to the worker it was taken back for.
                    self._start(req, thief, now, out)
                    continue
            elif req.attempt >= self.config.max_retries:
                self._worker_failed(req, f"a worker gave this request back unasked {req.attempt + 1} time(s) "
                                         f"(max_retries={self.config.max_retries})", out)
                continue
            else:
                self._retry([req], now)
                continue
            if req.recalled is _TURN:
                # Given back for a newcomer's turn: its principal keeps its place in the ring
                # (at the front, it would take back the credit it freed), and it goes back
                # among its principal's queued requests by age, as if never dispatched
                # (congested, the newer go first: at the front, it made the walk oldest first).
                self._enqueue(req, now, by_age=True)
            else:
                self._enqueue(req, now, front=True)
        self._flush(now, out)
        return out

    def _settle(self, worker, token, now, payload, out, *, relay, code=0, age=0.0):
        req = self._held(worker, token, now)
        if req is None:
            return
        if code == ErrorCode.DEADLINE_EXCEEDED and _queue_took_it(req):
            req.svc.missed = now  # (a worker's "not run": Congestion)
        w = req.worker
        del w.in_flight[token]
        req.svc.in_flight -= 1
        if req.thief is not None:
            self._unthief(req)  # it had started before the RECALL arrived
        if req.iso is not None:
            self._unlone(req, reload=False)
        self._reload(w)
        self._dirty[req.svc] = None
        if req.state == _ABANDONED:
            if req.count_by is not None:
                # Its deadline passed while it ran: a result sent straight to the client
                # before then (less the time it takes to be read) was taken
                # (`_expire_deadline`); anything later, or relayed (the broker's error went
                # first), the client saw as its deadline.
                sent = now - age
                if not relay and sent <= req.deadline - _DELIVERY_S:
                    self._count_expired(req, max(req.dispatched_at, sent), code)
                else:
                    self._count_expired(req, req.deadline)
            if relay or not req.orphan:
                # (A DONE of a request whose client left went to that client itself, read or
                # not: nothing is dropped here, and `_on_direct` below is its one count; a
                # `with Client()` script that exits after its last result made 40 of 50.)
                self._counters["dropped_late"] += 1
            if relay and self._late_to_client(req):
                out.append(LateToClient(req.client, req.request_id, req.svc.name, True, payload))
            if req.orphan and self._on_direct is not None:
                # Its client left before any final: the worker's answer is its only count.
                # The cancellation the broker asked for when the client left, and a result
                # relayed after it (it reached nobody) are `client_gone`; a result sent
                # straight to the client may have been read before the client left (the
                # DONE's age cannot tell, a close races it), and an error is the service's
                # own (a model's 500 must not hide behind a client that left).
                finished = max(req.dispatched_at, now - age)
                gone = req.orphan is True and (code == ErrorCode.CANCELLED or (relay and code == 0))
                if req.orphan == "cancelling" and code == 0:
                    code = ErrorCode.CANCELLED  # its client cancelled it, then left: see below
                self._on_direct(req.svc.name, CLIENT_GONE if gone else code,
                                req.enqueued_at, req.dispatched_at, finished, (req.client, req.request_id))
        else:
            self._unlink(req)
            self._counters["completed"] += 1
            if req.state == _CANCELLING and code == 0:
                # A result that crossed its CANCEL (the batch ran to its end, or the FINAL
                # went straight to the client before the CANCEL reached the worker): the
                # client's call ended `Cancelled` when it sent it, and what comes for it now is
                # thrown away (its slots released).  It counts as the client saw it (it was
                # `ok`, an answer nobody read: the counts hunt).  A result that reached the
                # broker before the CANCEL was the client's: `ok`.
                code = ErrorCode.CANCELLED
            if relay:
                out.append(ToClient(req.client, req.request_id, req.svc.name, True, payload,
                                    req.enqueued_at, req.dispatched_at, code))
            else:
                self._counters["direct"] += 1
                if self._on_direct is not None:
                    self._on_direct(req.svc.name, code, req.enqueued_at, req.dispatched_at,
                                    max(req.dispatched_at, now - age), (req.client, req.request_id))
        self._retire(req)

    def worker_closed(self, worker: bytes) -> list[Action]:
        """The worker's connection closed (the server saw it): nothing new goes to it, while
        the verdict (`worker_disconnect`) waits for the messages it sent before closing.
        Without this, the requests of a worker that died were dispatched again at once to
        a worker whose connection had closed too (workers that die together, a host, an OOM
        kill) and were charged a second death, and a third: WORKER_FAILED for requests that
        killed nobody.  Its replies still count; nothing else changes."""
        w = self._workers.get(worker)
        if w is not None and not w.closing:
            w.closing = True
            self._reload(w)  # out of the ready heaps and the idle and deep sets
        return []

    def worker_stopping(self, worker: bytes, now: float) -> list[Action]:
        """STOPPING from ``worker``: it drains (SIGTERM: it finishes what it holds, then says
        DISCONNECT).  Nothing new goes to it, and it no longer counts as a live worker of
        its service: readiness says so at once, and requests queued for a service left with
        no other worker start their grace now (before, they waited for the drain to end,
        then the grace: the observability hunt).  What it holds is settled at its
        DISCONNECT, as before."""
        w = self._workers.get(worker)
        if w is None or w.stopping:
            return []
        w.last_seen = now
        w.stopping = True
        if not w.closing:
            w.closing = True
            self._reload(w)  # out of the ready heaps and the idle and deep sets
        out: list[Action] = []
        self._leave_pools(w, now, _WENT_STOPPING)
        self._flush(now, out)
        return out

    def worker_disconnect(self, worker: bytes, now: float, *, failed: bool = True,
                          closed: bool = False) -> list[Action]:
        """The worker is gone: retry its work.  ``failed=False``: it said DISCONNECT, so it
        finished what it held (its leases' requests included); otherwise (the server saw
        its connection close, or its number reused) it may have died holding some.
        ``closed``: the server saw its connection close without a DISCONNECT (it crashed
        or was killed), which the service's later SERVICE_UNAVAILABLE says."""
        w = self._workers.get(worker)
        if w is None:
            return []
        out: list[Action] = []
        how = _WENT_AWAY if not failed else _WENT_CLOSED if closed else _WENT_DROPPED
        self._kill_worker(w, now, out, failed=failed, how=how)
        self._flush(now, out)
        return out

    # ------------------------------------------------------------------ client events

    def client_request(
        self,
        client: bytes,
        request_id: int,
        service: str,
        now: float,
        *,
        payload: object,
        priority: Priority | int = Priority.NORMAL,
        deadline: float | None = None,
        local_host: str | None = None,
        size: int = 0,
        principal: object = None,
        stream: bool = False,
    ) -> list[Action]:
        """Admit, dispatch, or refuse a request.  ``deadline`` is absolute on the clock of
        ``now``; ``local_host`` marks a request whose tensors sit in shared memory on that
        host; ``size`` is what the request counts against ``max_client_bytes`` while it is
        live (the server passes its inline payload bytes).  ``principal`` (hashable; the
        server passes an attested pid or a CurveZMQ user id, never bytes) is who the request
        counts against for fairness, eviction and the caps; None: the connection ``client``
        is its own principal.  Refusals (expired, duplicate id, NOT_LOCAL, QUEUE_FULL) are
        immediate; admitting a request into a full queue may instead evict a queued request
        of a heavier principal (see Admission)."""
        if principal is None:
            principal = client
        self._touch_client(client, now)
        cnt = self._counters

        def reject(code, message):
            return [ClientError(client, request_id, service, code, message, payload)]

        if self._draining is not None:
            cnt["unavailable"] += 1
            return reject(ErrorCode.SERVICE_UNAVAILABLE, self._draining)
        try:
            priority = Priority(priority)
        except ValueError:
            cnt["protocol_errors"] += 1
            return reject(ErrorCode.PROTOCOL_ERROR,
                          f"unknown priority {priority!r}; use 0 (urgent), 1 (normal) or "
                          f"2 (background)")
        mine = self._requests.get(client)
        if mine is not None and request_id in mine:
            cnt["protocol_errors"] += 1
            return reject(ErrorCode.PROTOCOL_ERROR,
                          f"request id {request_id} is already in flight from this client; "
                          f"use a fresh id for every request")
        if deadline is not None and deadline <= now:
            cnt["expired"] += 1
            return reject(ErrorCode.DEADLINE_EXCEEDED,
                          f"deadline had already passed ({now - deadline:.3f} s ago) when the "
                          f"broker received the request; allow more time")
        svc = self._services.get(service)
        if local_host is not None and svc is not None and svc.any.live > 0:
            pool = svc.pools.get(local_host)
            if pool is None or pool.live == 0:
                cnt["not_local"] += 1
                return reject(ErrorCode.NOT_LOCAL, self._not_local_message(service, local_host))
        outstanding = self._outstanding.get(principal, 0)
        if outstanding >= self._max_client_requests:
            cnt["rejected_client_requests"] += 1
            return reject(ErrorCode.QUEUE_FULL,
                          f"this client process/principal already has {outstanding} requests "
                          f"outstanding over all its connections, the limit per client "
                          f"(max_client_requests={self._max_client_requests}); wait for "
                          f"results before sending more")
        if size:
            held = self._bytes.get(principal, 0)
            if size > self._max_client_bytes:
                # Alone over the cap: waiting for results, as the message below says, would
                # never let it in (the configuration hunt).
                cnt["rejected_client_bytes"] += 1
                return reject(ErrorCode.QUEUE_FULL,
                              f"this request's {size} payload bytes are over the limit per client "
                              f"(max_client_bytes={self._max_client_bytes}) by themselves: it can never be "
                              f"admitted; pass its large tensors in shared memory, split it, or raise the "
                              f"broker's --max-client-mb")
            if size > self._max_total_bytes:  # (a broker in a small cgroup: under its client cap)
                cnt["rejected_total_bytes"] += 1
                return reject(ErrorCode.QUEUE_FULL,
                              f"this request's {size} payload bytes are over what the broker holds for all its "
                              f"clients' outstanding requests (max_total_bytes={self._max_total_bytes}, the "
                              f"broker's --max-total-mb: by default half its memory) by themselves: it can never be "
                              f"admitted; pass its large tensors in shared memory, split it, or raise the broker's "
                              f"--max-total-mb or its memory")
            if held + size > self._max_client_bytes:
                cnt["rejected_client_bytes"] += 1
                return reject(ErrorCode.QUEUE_FULL,
                              f"this request's {size} payload bytes would take the "
                              f"outstanding requests of this client process/principal (over "
                              f"all its connections) to {held + size} bytes, over the limit "
                              f"per client (max_client_bytes={self._max_client_bytes}); wait "
                              f"for results before sending more, or pass large tensors in "
                              f"shared memory")
            total = self._total_bytes
            if total + size > self._max_total_bytes:
                cnt["rejected_total_bytes"] += 1
                return reject(ErrorCode.QUEUE_FULL,
                              f"this request's {size} payload bytes would take what the broker holds for all "
                              f"its clients' outstanding requests to {total + size} bytes, over its limit "
                              f"(max_total_bytes={self._max_total_bytes}, the broker's --max-total-mb); retry "
                              f"later, or pass large tensors in shared memory")
            self._bytes[principal] = held + size
            self._total_bytes = total + size
        self._outstanding[principal] = outstanding + 1
        if svc is None:
            svc = self._service(service, now)

        req = _Request(client, principal, request_id, svc, payload, priority, deadline,
                       local_host, now, size, stream)
        self._live += 1
        if mine is None:
            mine = self._requests[client] = {}
        mine[request_id] = req
        if deadline is not None:
            self._push_timer(deadline, _T_DEADLINE, req)
        pool = self._pool(svc, local_host, now)
        if pool.live == 0:
            self._push_grace(req, pool)

        out: list[Action] = []
        if not svc.queued:
            # Nothing else waits, so there is no order to decide: the least-loaded worker of
            # its pool takes it now (the common case under light load, kept short).
            w = self._ready_worker(pool)
            if w is not None and not self._holding:
                # Served outside the ring, but served: its last turn is now (a memo kept from
                # an older turn would let it pass those served before this one, and none at
                # all would make its next FIFO "never served", which nobody passes).
                _remember_turn(svc.left[priority], principal, now)
                self._start(req, w, now, out)
                self._flush(now, out)
                return out
            self._enqueue(req, now)
        else:
            self._enqueue(req, now)
            self._pump(svc, now, out)
        # Full is judged after dispatching, so a free worker is never left idle by a queue
        # clogged with requests it cannot take.
        if req.state == _QUEUED and svc.queued > self.config.max_queue:
            # Requests past their deadline that no tick() has answered yet leave first, as
            # the tick would have them leave: they cost no live request its place.
            self._expire_due(now, out)
        if req.state == _QUEUED and svc.queued > self.config.max_queue:
            top, heavy = self._heaviest(svc)
            n = svc.count(principal)
            if n >= top:
                # This principal holds the most (ties included): one of its own goes, its
                # newcomer unless it has a request of a less urgent class queued.
                own = True
                victim, oldest = self._victim(svc, principal, now, priority)
            else:
                own = False
                victim, oldest = self._victim(svc, heavy, now)
            if victim is None and svc.any.live == 0:
                # No worker to wait for, and no room to wait in (max_queue 0 always): the
                # service is unavailable, not busy ("queue full" for a misspelt name, and
                # counted as load shedding: the operations-docs audit).
                self._unqueue(req)
                self._unlink(req)
                self._retire(req)
                cnt["unavailable"] += 1
                lost = svc.any.lost_at
                out.append(ClientError(
                    client, request_id, service, ErrorCode.SERVICE_UNAVAILABLE,
                    (f"no worker serves '{service}'" if lost is None else
                     f"no live worker for '{service}': its last one went {now - lost:.1f} s ago "
                     f"({svc.any.lost_how})")
                    + f", and the queue is full ({self.config.max_queue} waiting): nothing can wait for one; "
                      f"start a worker for the service, or check its name", payload))
            elif victim is None:
                self._unqueue(req)
                self._unlink(req)
                self._retire(req)
                cnt["rejected_full"] += 1
                out.append(ClientError(
                    client, request_id, service, ErrorCode.QUEUE_FULL,
                    f"the queue for '{service}' is full ({self.config.max_queue} waiting) and "
                    f"this client process/principal holds the largest share of it, or as much as "
                    f"any other ({n - 1} waiting before this one, "
                    f"over all its connections, none less urgent than this one); retry with "
                    f"backoff, lower the request rate or start more workers", payload))
            elif victim.deadline is not None and victim.deadline <= now:
                # Past its deadline (more timers were due than _expire_due looks at): it is
                # answered by its deadline, not told to back off.
                self._expire_deadline(victim, now, out)
            else:
                cnt["evicted"] += 1
                self._unqueue(victim)
                which = ("its oldest request (served last: the queue is congested, newest "
                         "first)" if oldest else "its newest request")
                self._error(victim, ErrorCode.QUEUE_FULL,
                            f"the queue for '{service}' is full ({self.config.max_queue} "
                            f"waiting) and this client process/principal holds the "
                            f"largest share of it ({n if own else top} waiting, over all its "
                            f"connections): {which} made room for "
                            + ("a more urgent one of its own" if own else "another client's")
                            + f" ({victim.priority.name.lower()}: the least urgent class it had queued); "
                            f"retry with backoff or send fewer requests at a time", out)
                self._retire(victim)
        if (req.state == _QUEUED and svc.deep and self._recall_after is not None and not req.alone
                and not self._holding):
            if not priority:
                self._make_room(req, out)
            elif svc.count(principal) == 1:
                self._make_turn(req, out)
        self._flush(now, out)
        return out

    def client_cancel(self, client: bytes, request_id: int, now: float, queued_only: bool = False,
                      expired: bool = False) -> list[Action]:
        """Queued: CANCELLED now.  Running: CancelAtWorker, and the worker's own final is
        forwarded when it comes, unless ``queued_only`` (a client resending a call it may
        have sent twice: a copy that started is left to answer, whichever run answers
        first is the call's).  ``expired``: the client gave up at the request's deadline,
        a hair before the broker's own timer would have: the request expires as at that
        timer (DEADLINE_EXCEEDED, counted `expired`; it was counted `cancelled`, most
        timeouts, since the client's timer usually fires first).  Unknown or already final:
        ignored."""
        self._touch_client(client, now)
        req = self._requests.get(client, {}).get(request_id)
        if req is None or (queued_only and req.state != _QUEUED):
            return []
        out: list[Action] = []
        if expired and req.state in (_QUEUED, _RUNNING):
            self._expire_deadline(req, now, out)
        elif req.state == _QUEUED:
            self._counters["cancelled"] += 1
            self._unqueue(req)
            self._error(req, ErrorCode.CANCELLED, "cancelled by the client", out)
            self._retire(req)
        elif req.state == _RUNNING:
            # The worker's own final (result or its cancellation error) is the one final.
            self._counters["cancelled"] += 1
            req.state = _CANCELLING
            out.append(CancelAtWorker(req.worker.ident, req.token))
        self._flush(now, out)
        return out

    def client_heartbeat(self, client: bytes, now: float) -> list[Action]:
        """From the first heartbeat on, the client is expected to stay audible."""
        c = self._clients.get(client)
        if c is None:
            c = self._clients[client] = _Client(client, now, self._renamed.get(client, 0))
            self._push_timer(now + self._client_ttl, _T_CLIENT, c)
        else:
            c.last_seen = c.heard = now
        return []

    def client_seen(self, client: bytes, now: float) -> list[Action]:
        """Any message from ``client``; refreshes liveness if the client is tracked."""
        self._touch_client(client, now)
        return []

    def ends_with_connection(self, client: bytes) -> bool:
        """Whether the close of ``client``'s connection ends its requests (the server then
        drops it as at a DISCONNECT: `client_disconnect`).  A client that heartbeats is left
        to its liveness window, as before; one that never did (a plain MDP client, or ours
        with heartbeats off) is never presumed dead, so its connection's close is the only
        sign that nobody waits for its requests any more."""
        return client not in self._clients

    def client_epoch(self, client: bytes) -> int | None:
        """Which record of a tracked client this is: a new number once the broker dropped
        the client for its silence while it held something (queued or running requests,
        leases) and heard it again; the same after a drop that lost nothing (an idle
        client's silence), and a fresh start after its DISCONNECT (the server's drop of a
        client that does not read its replies is one: it finds its calls unanswered).  The
        server names it in the client's heartbeat answers, so that the client sends again
        what it still waits for (docs/protocol.md section 2)."""
        c = self._clients.get(client)
        return None if c is None else c.epoch

    def client_kept(self, client: bytes, now: float) -> list[Action]:
        """The server knows ``client`` is alive though it is silent (its process lives: an
        ipc connection still open): its silence does not count, for at most
        ``quiet_client_max`` seconds since its last message."""
        c = self._clients.get(client)
        if c is not None and now - c.heard <= self.config.quiet_client_max:
            c.last_seen = now
        return []

    def client_disconnect(self, client: bytes, now: float) -> list[Action]:
        """Drop the connection's queued requests silently and cancel its running ones (its
        principal's other connections keep theirs)."""
        out: list[Action] = []
        self._drop_client(client, out, now)
        self._renamed.pop(client, None)  # it said goodbye: a record of it later starts afresh
        self._flush(now, out)
        return out

    # ------------------------------------------------------------------ time

    def resumed(self, lost: float, now: float) -> list[Action]:
        """The broker itself did not run for ``lost`` seconds, up to ``now``: its process was
        stopped (SIGSTOP, a job-control stop of the launcher's process group, a frozen
        container) or starved of CPU.  What its peers sent meanwhile is read before any timer
        judges them (the server drains its backend first), but peers stopped with it (one
        ``docker pause`` for the stack, one Ctrl-Z in a terminal) sent nothing, and would all
        be presumed dead at once on the thaw: their requests retried, their leases ended,
        for a silence that was the broker's own.  So every liveness window (workers',
        clients', unconfirmed leases') is moved on by ``lost``, never past ``now``: a peer
        that is really gone is found ``lost`` later.  Deadlines are not moved: a request's
        caller lived through the same time."""
        self._counters["paused"] += 1
        for w in self._workers.values():
            w.last_seen = min(now, w.last_seen + lost)
        for c in self._clients.values():
            c.last_seen = min(now, c.last_seen + lost)
        self._leases_resumed(lost, now)
        return []


    def tick(self, now: float) -> list[Action]:
        """Fire what is due by ``now``: deadlines, service grace, heartbeats to workers,
        worker and client liveness; at most `TICK_MAX` timers a call.  More may be due (a
        big queue whose workers died: a grace timer each), and then `next_wakeup` is still
        ``now``: the server reads its sockets between the calls.  All in one call, 300,000
        queued requests held the broker's loop 4 s, and healthy workers, silent to it that
        long, reconnected (a scale hunt)."""
        out: list[Action] = []
        timers = self._timers
        budget = TICK_MAX
        while timers and timers[0][0] <= now and budget:
            budget -= 1
            _, _, kind, obj, epoch = heapq.heappop(timers)
            due = self._timer_due(kind, obj, epoch)
            if due is None:
                continue
            if due > now:
                self._push_timer(due, kind, obj, epoch)
                continue
            if kind == _T_DEADLINE:
                self._expire_deadline(obj, now, out)
            elif kind == _T_GRACE:
                self._expire_grace(obj, out, now)
            elif kind == _T_HEARTBEAT:
                out.append(HeartbeatWorker(obj.ident))
                obj.last_heartbeat = now
                self._push_timer(now + self.config.heartbeat_interval, _T_HEARTBEAT, obj)
            elif kind == _T_RECALL:
                obj.recall_at = None
                obj.recall_stale = True  # a batch ran long enough since the last look
                self._dirty[obj] = None  # _flush looks for work to take back
            elif kind == _T_LEASE:
                self._lease_unconfirmed(obj, out)
            elif kind == _T_COUNT:
                self._count_expired(obj, obj.deadline)
            elif kind == _T_WORKER:
                if obj.quiet_busy and any(r.state == _RUNNING for r in obj.in_flight.values()):
                    # A plain worker busy for a client: its silence is its work (worker_ready).
                    # Its death still shows as its connection's close; looked at again a
                    # window later, and counted once nothing it runs has a client waiting.
                    self._push_timer(now + self._worker_ttl, _T_WORKER, obj)
                    continue
                out.append(DisconnectWorker(
                    obj.ident, f"no message for {now - obj.last_seen:.3f} s "
                               f"(liveness {self._worker_ttl} s); presumed dead{self.death_note(obj.ident)}",
                    dead=True))
                self._kill_worker(obj, now, out, how=_WENT_SILENT)
            else:
                self._rename_if_it_loses(obj.ident)
                self._drop_client(obj.ident, out, now)
        self._flush(now, out)
        return out

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time at which :meth:`tick` has something to do (possibly <= now),
        or None if nothing is scheduled.  ``now`` is accepted for symmetry; the answer does
        not depend on it."""
        timers = self._timers
        while timers:
            when, _, kind, obj, epoch = timers[0]
            due = self._timer_due(kind, obj, epoch)
            if due is None:
                heapq.heappop(timers)
            elif due > when:
                heapq.heapreplace(timers, (due, next(self._seq), kind, obj, epoch))
            else:
                return when
        return None

    # ------------------------------------------------------------------ queries

    @property
    def client_window(self) -> float:
        """Seconds a tracked client may stay silent before it is presumed dead (clients are
        told, so that they heartbeat often enough)."""
        return self._client_ttl

    def drain(self, reason: str) -> None:
        """Refuse every new request from now on (SERVICE_UNAVAILABLE, with ``reason`` as its
        message) while the requests already admitted run to their finals: the first step of
        a graceful shutdown (broker.launcher waits for :attr:`live` to reach 0).  One
        attribute store: the launcher's thread may call it while the loop runs."""
        self._draining = reason

    def hold(self) -> None:
        """Dispatch nothing from now on: queued requests, and those that arrive, stay queued,
        while what the workers hold runs to its end (its replies and DONEs still come
        through): a standalone broker's SIGTERM (python -m broker), which exits once
        :meth:`at_workers` is 0.  What stays queued goes with the broker, for its clients to
        send again to the next one (a restart), as they would at a crash; nothing is taken
        back from a worker (a RECALL would only queue it again)."""
        self._holding = True

    @property
    def holding(self) -> bool:
        """Whether `hold()` was called."""
        return self._holding

    def at_workers(self) -> int:
        """Requests the workers hold (running, cancelling, or answered directly and not
        DONE yet).  O(services): for a drain's look, not per request."""
        return sum(svc.in_flight for svc in self._services.values())

    @property
    def live(self) -> int:
        """Requests not DONE: queued, running, cancelling, or still held by a worker."""
        return self._live

    @property
    def draining(self) -> bool:
        """Whether `drain()` was called: new requests are refused."""
        return self._draining is not None

    def live_services(self) -> int:
        """How many services have a live worker (O(services): for probes, not per request)."""
        return sum(1 for svc in self._services.values() if svc.any.live > 0)

    def quiet(self, now: float, longer_than: float) -> tuple[list[bytes], list[bytes]]:
        """The tracked clients and the live workers not heard from for more than
        ``longer_than`` seconds: those whose connection the server looks at (bytes of a
        message still crossing a slow link keep a peer alive: it then calls
        :meth:`client_seen` or :meth:`worker_seen`)."""
        since = now - longer_than
        return ([c.ident for c in self._clients.values() if c.last_seen < since],
                [w.ident for w in self._workers.values() if w.last_seen < since])

    def has_worker(self, worker: bytes) -> bool:
        """Whether ``worker`` is registered and alive."""
        return worker in self._workers

    def death_note(self, worker: bytes) -> str:
        """What the death of ``worker`` (registered) costs, for the log line that reports it:
        the requests it holds (retried elsewhere, or failed past their retries), and whether
        it is its service's last live worker; "" for a worker not registered."""
        w = self._workers.get(worker)
        if w is None:
            return ""
        svc = w.svc
        note = f"; service '{svc.name}', {len(w.in_flight)} request(s) held (retried on another worker, or failed)"
        if svc.any.live - (0 if w.stopping else 1) <= 0:  # (a stopping worker is counted out already)
            note += (f"; it was {LAST_WORKER}: its requests wait {self.config.service_grace:g} s "
                     f"(--service-grace) for another, then fail SERVICE_UNAVAILABLE")
        return note

    def has_service(self, service: str) -> bool:
        svc = self._services.get(service)
        return svc is not None and svc.any.live > 0

    def workers_of(self, service: str) -> list[bytes]:
        """The registered workers of ``service``, in the order they registered (O(its
        workers), not O(all workers))."""
        svc = self._services.get(service)
        return [] if svc is None else list(svc.workers)

    def holds_service(self, service: str) -> bool:
        """Whether ``service`` has a worker, or a request waiting for one (what its name
        must be kept for: broker.names)."""
        return service in self._services

    def stats(self) -> dict:
        services = {}
        for name, svc in self._services.items():
            u, n, b = (sum(map(len, ring.values())) for ring in svc.classes)
            live = [w for w in svc.workers.values() if not w.stopping]  # (draining ones are not)
            services[name] = {
                "queued": {"urgent": u, "normal": n, "background": b},
                "in_flight": svc.in_flight,
                "workers": len(live),
                "credit": sum(w.credit for w in live),
                "hosts": self._hosts(svc),
                "leases": sum(len(w.leases) for w in live),
                "leased_credit": sum(w.leased for w in live),
            }
        return {
            "services": services,
            "workers": len(self._workers),
            "clients": len(self._clients),
            "requests": self._live,
            "client_requests": sum(self._outstanding.values()),
            "client_bytes": sum(self._bytes.values()),
            "principals": len(self._outstanding),  # with something outstanding
            "counters": dict(self._counters),
        }

    @staticmethod
    def _hosts(svc) -> dict:
        hosts: dict = {}
        for w in svc.workers.values():
            if w.stopping:
                continue  # draining: not a live worker of the service any more
            key = w.host or ""
            hosts[key] = hosts.get(key, 0) + 1
        return hosts

    def service_info(self, service: str) -> dict | None:
        """What the broker knows of ``service`` right now (None: nothing): its queue, and
        each live worker's host, transports, credit and requests held."""
        svc = self._services.get(service)
        if svc is None:
            return None
        u, n, b = (sum(map(len, ring.values())) for ring in svc.classes)
        return {
            "queued": {"urgent": u, "normal": n, "background": b},
            "in_flight": svc.in_flight,
            "workers": [{"worker": w.ident, "host": w.host, "transports": sorted(w.transports),
                         "credit": w.credit, "in_flight": len(w.in_flight), "stopping": w.stopping}
                        for w in svc.workers.values()],
        }

    def client_usage(self, principal: object) -> dict:
        """What ``principal`` holds against its caps, over all its connections: requests
        outstanding (queued, running or cancelling, all services) and the sum of their
        sizes in bytes.  ``principal`` is what the requests were sent with (an ipc client's
        (pid, start time), a user id), or the connection identity for requests sent with
        ``principal=None``."""
        return {"outstanding": self._outstanding.get(principal, 0),
                "bytes": self._bytes.get(principal, 0)}

    # ------------------------------------------------------------------ internals

    def _service(self, name, now):
        svc = self._services.get(name)
        if svc is None:
            svc = self._services[name] = _Service(name, now, next(self._epochs))
            lost = self._lost_services.pop(name, None)
            if lost is not None:  # it had workers before its record went: its grace's error says so
                svc.any.lost_at, svc.any.lost_how = lost
        return svc

    def _pool(self, svc, key, now):
        pool = svc.pools.get(key)
        if pool is None:
            if len(svc.pools) > 2 * len(svc.workers) + 64:
                self._prune_pools(svc)
            pool = svc.pools[key] = _Pool(key, now, next(self._epochs))
        return pool

    def _prune_pools(self, svc):
        """Forget the host pools of ``svc`` with no worker that no queued request waits for
        (requests for hosts that never had a worker make them too; a pool goes with its last
        worker otherwise: `worker_disconnect`).  O(pools + queued), once the count passes
        twice the workers plus 64: amortised over the pools made."""
        wanted = {req.local_host for ring in svc.classes for fifo in ring.values() for req in fifo}
        for key in [k for k, p in svc.pools.items() if k is not None and p.live == 0 and k not in wanted]:
            del svc.pools[key]

    def _touch_client(self, client, now):
        c = self._clients.get(client)
        if c is not None:
            c.last_seen = c.heard = now

    def held_payload(self, worker: bytes, token: int) -> object:
        """The payload of the request ``worker`` holds as ``token``; None when it holds none."""
        w = self._workers.get(worker)
        req = w.in_flight.get(token) if w is not None else None
        return None if req is None else req.payload

    def _held(self, worker, token, now):
        """The request ``worker`` holds as ``token``, or None (a late or duplicate reply)."""
        w = self._workers.get(worker)
        if w is None:
            self._counters["dropped_late"] += 1
            return None
        w.last_seen = now
        req = w.in_flight.get(token)
        if req is None:
            self._counters["dropped_late"] += 1
        return req

    def _not_local_message(self, service, host):
        if host.endswith("#cuda"):
            return (f"no worker for '{service}' on host '{host[:-5]}' accepts CUDA IPC tensors; "
                    f"start one with python -m gpu_worker --device cuda:N, or send host tensors")
        return (f"no worker for '{service}' on host '{host}' accepts shared memory (the "
                f"service runs on other hosts); send the tensors inline instead")

    # ---- bookkeeping of one request

    def _late_to_client(self, req) -> bool:
        """Whether a late reply of ``req`` goes to its client: answered by its deadline, the
        same client record still here (not dropped, not a new one under the id: one that
        never heartbeats has none, and gets none), and the id not reused by a request of
        its own since."""
        late = req.late
        return (late is not None and self._clients.get(req.client) is late
                and req.request_id not in self._requests.get(req.client, ()))

    def _unlink(self, req):
        """The client has its final: forget the request under its connection's name and
        stop counting it against its principal."""
        # Stale timer entries may keep this object a while (lazy deletion); the payload can
        # be a 64 MB inline tensor, so it must not stay reachable through them.
        req.payload = None
        client = req.client
        mine = self._requests.get(client)
        if mine is not None and mine.get(req.request_id) is req:
            del mine[req.request_id]
            if not mine:
                del self._requests[client]
            self._release(req)

    def _release(self, req):
        """Take a request that was live for its client off its principal's counts (once:
        the caller has just removed it from ``_requests``)."""
        p = req.principal
        left = self._outstanding[p] - 1
        if left:
            self._outstanding[p] = left
        else:
            del self._outstanding[p]
        if req.size:
            self._total_bytes -= req.size
            left = self._bytes[p] - req.size
            if left:
                self._bytes[p] = left
            else:
                del self._bytes[p]

    def _retire(self, req):
        if req.count_by is not None:  # no answer came (its worker died): its deadline's outcome
            self._count_expired(req, req.deadline)
        req.state = _DONE
        req.worker = None
        self._live -= 1

    @staticmethod
    def _enqueue(req, now, front=False, by_age=False):
        """Queue ``req`` at the back of its principal's FIFO in its class (a retry: at the
        front of the FIFO, its principal at the front of the ring; ``by_age``: back in the
        FIFO where its age puts it, its principal where it was)."""
        svc = req.svc
        if not svc.queued:
            svc.since = now
        c = req.principal
        ring = svc.classes[req.priority]
        fifo = ring.get(c)
        if fifo is None:
            # (also into an empty ring: a FIFO counted as never served keeps everyone who
            # rejoins later behind it)
            last = svc.left[req.priority].pop(c, None)
            fifo = ring[c] = OrderedDict()
            # When this FIFO last had a request dispatched (_pump's aging: a rejoining
            # principal's last dispatch is older than its request, so it ages as before).
            fifo.served = 0.0 if last is None else last
            if last is not None:
                # Least recently served first: a principal served before one in the ring was
                # (its last request dispatched, its FIFO emptied) goes ahead of the first
                # such, among the first _SCAN; behind those served before it (another light
                # client rejoined just now: its served is restored above).  One never served
                # here, or forgotten, joins at the back (new names do not jump the queue), and
                # so does one that would pass a principal never served (it waits its turn).
                before = []
                for p, f in ring.items():
                    if f is fifo or not f.served or len(before) == _SCAN:
                        break
                    if f.served > last:
                        ring.move_to_end(c, last=False)
                        for q in reversed(before):
                            ring.move_to_end(q, last=False)
                        break
                    before.append(p)
        fifo[req] = None
        req.front = front
        if front:
            fifo.move_to_end(req, last=False)
            ring.move_to_end(c, last=False)
        elif by_age and len(fifo) > 1:
            # Ahead of the requests that came after it (or with it): with nothing older
            # queued (the rule but for congestion) at the front; congested, among the newest
            # few (it was dispatched newest first), found from the back, at most _CLASS_SCAN
            # looked at.
            # Never ahead of a request put back at the front (a retry): those stay a prefix
            # served first (`_newest_first`, `_victim`).
            t = req.enqueued_at
            head = next(iter(fifo))
            if head.enqueued_at >= t and not head.front:
                fifo.move_to_end(req, last=False)
            else:
                newer = []
                it = reversed(fifo)
                next(it)  # req itself
                for r in it:
                    if r.enqueued_at < t or r.front or len(newer) == _CLASS_SCAN:
                        break
                    newer.append(r)
                for r in reversed(newer):
                    fifo.move_to_end(r)
        svc.queued += 1
        tiers = svc.tiers
        if tiers is not None:
            k = svc.count(c)
            if k > 1:
                t = tiers[k - 1]
                del t[c]
                if not t:
                    del tiers[k - 1]
            t = tiers.get(k)
            if t is None:
                tiers[k] = {c: None}
            else:
                t[c] = None
            if k > svc.top:
                svc.top = k

    def _take(self, req, served):
        """Remove ``req`` from its queue; ``served``: it is being dispatched, so its principal
        moves to the back of the ring."""
        svc = req.svc
        c = req.principal
        ring = svc.classes[req.priority]
        fifo = ring[c]
        del fifo[req]
        if req.alone:
            svc.lone.pop(req, None)
            if not served:
                self._unlone(req)
        if not fifo:
            del ring[c]
            if fifo.served:
                # Its last dispatch, also when its last request leaves undispatched
                # (cancelled, expired, evicted, refused): that turn is still its last.
                _remember_turn(svc.left[req.priority], c, fifo.served)
        elif served:
            ring.move_to_end(c)
        svc.queued -= 1
        tiers = svc.tiers
        if tiers is not None:
            if svc.queued <= self._tiers_off:
                svc.tiers = None  # short again: see _heaviest
                return
            k = svc.count(c)
            t = tiers[k + 1]
            del t[c]
            if not t:
                del tiers[k + 1]
                if k + 1 == svc.top:
                    svc.top = k
            if k:
                t = tiers.get(k)
                if t is None:
                    tiers[k] = {c: None}
                else:
                    t[c] = None

    @staticmethod
    def _heaviest(svc):
        """(count, principal): a principal holding the most queued requests in ``svc``.

        Only asked when the queue is over ``max_queue``.  The buckets that answer it in O(1)
        are built then (O(principals queued), at most O(queue length)) and kept up to date until
        the queue is down to half of ``max_queue``; refilling it takes at least half as many
        enqueues as the next build can cost, so the cost is O(1) amortised, and nothing at
        all while queues stay short (the hot path)."""
        tiers = svc.tiers
        if tiers is None:
            counts = {}
            for ring in svc.classes:
                for c, fifo in ring.items():
                    counts[c] = counts.get(c, 0) + len(fifo)
            tiers = svc.tiers = {}
            top = 0
            for c, k in counts.items():
                t = tiers.get(k)
                if t is None:
                    tiers[k] = {c: None}
                else:
                    t[c] = None
                if k > top:
                    top = k
            svc.top = top
        top = svc.top
        return top, next(iter(tiers[top]))

    def _unqueue(self, req):
        """Remove a queued request that is not being dispatched (cancel, deadline, grace,
        eviction, its connection gone)."""
        self._take(req, False)
        self._dirty[req.svc] = None

    @property
    def reads_misses(self) -> bool:
        """Whether the congestion rule reads missed deadlines (Congestion): then a worker's
        504 counts, and the server reads the codes of its FINALs and DONEs."""
        return self._lifo_after is not None and self._lifo_miss is not None

    def _congested(self, svc, now):
        """Whether ``svc``'s queue has not been empty for ``lifo_after``, and one of its
        requests missed its deadline within the last ``lifo_miss_window`` (Congestion)."""
        after = self._lifo_after
        return (bool(svc.queued) and after is not None and now - svc.since >= after
                and (self._lifo_miss is None or now - svc.missed <= self._lifo_miss))

    def _victim(self, svc, principal, now, than=None):
        """The queued request of ``principal`` in ``svc`` that an eviction takes, from
        whichever of its connections, and whether it is its oldest (see Admission): one of
        its least urgent class queued (background, then normal, then urgent: the class is the
        one word a client gives on which of its requests it can best do without), the one
        that class's FIFO walk would serve last: its oldest when it is walked newest first
        (congested, its head neither put back at the front nor without a deadline: then no
        request in it is at the front; its caller is about to give up), else its newest.  A
        FIFO whose newest was put back at the front (a retry, or given back: then all of it
        was) is passed over for the next class; if all are, the least urgent one's newest.
        ``than``: for the principal's own newcomer of that class, only a less urgent class
        and never one put back at the front (the newcomer is another request), else None
        (the newcomer is refused).  O(1): at most three FIFOs looked at."""
        lifo = self._congested(svc, now)
        back = None
        for pri in (2, 1, 0):
            if than is not None and pri <= than:
                break
            fifo = svc.classes[pri].get(principal)
            if not fifo:
                continue
            if lifo and _newest_first(fifo):
                return next(iter(fifo)), True
            req = next(reversed(fifo))  # at the front only if all of its FIFO is
            if not req.front:
                return req, False
            if back is None:
                back = req
        return (back if than is None else None), False

    def _worker_failed(self, req: _Request, why: str, out: list[Action]) -> None:
        """``req`` ends with WORKER_FAILED: ``why``, and where to look."""
        self._counters["worker_failed"] += 1
        self._error(req, ErrorCode.WORKER_FAILED, f"{why}; check the logs of the '{req.svc.name}' workers", out)
        self._retire(req)

    def _error(self, req, code, message, out, left_queue=None, counted=True):
        out.append(ClientError(req.client, req.request_id, req.svc.name, code, message,
                               req.payload, req.enqueued_at, left_queue, counted))
        self._unlink(req)

    # ---- workers and dispatch

    def _reload(self, w):
        """Re-file ``w`` in its pools' ready heaps after its load changed."""
        w.version += 1
        if w.closing:  # in no heap (the version made its entries stale), set or list
            if w.is_idle:
                del w.svc.idle[w]
                w.is_idle = False
            if w.is_deep:
                del w.svc.deep[w]
                w.is_deep = False
            return
        n = len(w.in_flight)
        iso = w.iso
        # Membership changes only when the count crosses 0 or 2 (or BUSY changes): flags
        # keep the common case (one request in, one out) to two attribute reads.
        if n == 0 and not w.busy and iso is None:
            if not w.is_idle:
                svc = w.svc
                svc.idle[w] = None
                w.is_idle = True
                if svc.deep and not svc.recall_stale:
                    if len(svc.idle) == 1:
                        svc.recall_stale = True  # (none was idle: nothing was looked at meanwhile)
                    elif not w.awaiting:
                        self._thief_free(w)
        elif w.is_idle:
            del w.svc.idle[w]
            w.is_idle = False
        if (n >= 2 or n and w.busy) and w.recall:
            if not w.is_deep:
                w.svc.deep[w] = None
                w.is_deep = True
                w.svc.recall_stale = True
                self._dirty[w.svc] = None  # an idle worker may take from it (see _flush)
            elif w.svc.idle and not w.svc.recall_stale:
                w.svc.recall_touched[w] = None  # what it holds changed (see _flush)
        elif w.is_deep:
            del w.svc.deep[w]
            w.is_deep = False
        if iso is not None:
            # Set aside for a request's last attempt, or running it: no other brokered work
            # (and, above, never idle: nothing is taken back for it).  Empty, it can take
            # the one waiting for it: the service's next pass places it (_place_lone).
            if n == 0 and iso.state == _QUEUED:
                self._dirty[w.svc] = None
            return
        if n >= w.credit - w.leased:  # leased credit is the leaseholders' (broker/leases.py)
            return
        # A busy worker (BUSY) last: what it is handed waits behind leased work.
        entry = (w.busy, (n + w.leased) / w.credit, n, w.used, next(self._seq), w.version, w)
        for pool in w.pools:
            heap = pool.ready
            heapq.heappush(heap, entry)
            if len(heap) > 4 * pool.live + 16:
                heap[:] = [e for e in heap if e[6].alive and e[6].version == e[5]]
                heapq.heapify(heap)

    @staticmethod
    def _ready_worker(pool):
        heap = pool.ready
        while heap:
            e = heap[0]
            w = e[6]
            if w.alive and w.version == e[5]:
                return w
            heapq.heappop(heap)
        return None

    def _pump(self, svc, now, out):
        """Dispatch while some queued request has a worker with spare credit in its pool."""
        if not svc.queued or self._holding:
            return
        if svc.lone or svc.aside:
            self._place_lone(svc, now, out)
        weights = self._weights
        aging = self.config.aging_s
        pools = svc.pools
        ready = self._ready_worker
        classes = svc.classes
        scan = _SCAN
        # Congested (the queue has not been empty for lifo_after): newest first within each
        # principal's FIFO (see Congestion in the module docstring).
        lifo = self._congested(svc, now)
        while ready(svc.any) is not None:
            best = None
            best_score = 0.0
            top = None  # the most urgent class with a candidate
            for pri in (0, 1, 2):
                ring = classes[pri]
                if not ring:
                    continue
                expired = None
                cand = cand_fifo = None
                left = _CLASS_SCAN
                # Least recently served principal first; in its FIFO, the first request that
                # can go somewhere now (see Dispatch in the module docstring).
                for fifo in ring.values():
                    n = scan if scan < left else left
                    for req in (reversed(fifo) if lifo and _newest_first(fifo) else fifo):
                        if not n:
                            break
                        n -= 1
                        left -= 1
                        if req.deadline is not None and req.deadline <= now:
                            # Never dispatch an expired request, even if tick() has not run.
                            if expired is None:
                                expired = []
                            expired.append(req)
                            continue
                        if req.alone:
                            continue  # it waits for a worker of its own (_place_lone)
                        pool = pools.get(req.local_host)
                        if pool is not None and ready(pool) is not None:
                            cand, cand_fifo = req, fifo
                            break
                    if cand is not None or not left:
                        break
                if expired:
                    for req in expired:
                        self._expire_deadline(req, now, out)
                if cand is not None:
                    # Its wait: since it was queued, or since its principal's previous request
                    # in this class was dispatched, whichever is later: a request behind its
                    # own principal's backlog waits for that backlog, not for the other
                    # classes (the head of a deep urgent backlog is always old, and scored by
                    # its age it kept normal requests out for good: the resource hunt).
                    # (Newest first, the candidate is young: its principal has waited since
                    # its oldest request came, and that is what ages.)
                    first = next(iter(cand_fifo)) if lifo else cand
                    start = first.enqueued_at if first.enqueued_at > cand_fifo.served else cand_fifo.served
                    score = weights[pri] * (1.0 + (now - start) / aging)
                    if top is None:
                        top = pri
                    if best is None or score > best_score:
                        best, best_score, best_fifo = cand, score, cand_fifo
            if best is None:
                return
            best_fifo.served = now
            if lifo:
                self._counters["newest_first"] += 1
            self._take(best, True)
            # Aging won it its turn over a more urgent class: the worker is told that class,
            # so its batcher does not make it wait for its turn a second time.
            self._start(best, ready(pools[best.local_host]), now, out, top)

    def _place_lone(self, svc, now, out):
        """Requests on their last attempt: each runs alone on a worker of its pool that
        holds nothing (see Failure handling).

        First the workers set aside: an empty one runs its request now; one still busy gives
        it up to a worker of its pool gone idle meanwhile (it would otherwise wait behind
        whatever the busy one runs, however long); a closing one gives it up.  Then the
        requests still waiting: each gets the least loaded worker of its pool not set aside
        (run now if empty, else set aside).  O(workers set aside) per pass, plus O(workers +
        requests waiting) while some worker is not set aside; nothing when no worker died."""
        if svc.aside:
            for w in list(svc.aside):
                req = w.iso
                if req.deadline is not None and req.deadline <= now:
                    self._expire_deadline(req, now, out)  # (_take, _unlone: w is free again)
                    continue
                if w.closing:
                    self._unlone(req, reload=False)  # its connection closed: it gets nothing new
                    svc.lone[req] = None
                    svc.lone.move_to_end(req, last=False)
                    continue
                if w.in_flight and svc.idle:
                    pool = svc.pools.get(req.local_host)
                    for t in svc.idle:
                        if pool in t.pools and not t.awaiting:
                            self._unlone(req)
                            self._set_aside(t, req)
                            w = t
                            break
                if not w.in_flight:
                    self._served_alone(req, now)
                    self._counters["alone"] += 1
                    self._start(req, w, now, out)
        if svc.lone and svc.isos < len(svc.workers):
            free = [w for w in svc.workers.values() if w.iso is None and not w.closing]
            for req in list(svc.lone):
                if not free:
                    break
                if req.deadline is not None and req.deadline <= now:
                    self._expire_deadline(req, now, out)
                    continue
                pool = svc.pools.get(req.local_host)
                if pool is None:
                    continue  # its grace timer runs
                best = None
                for i, w in enumerate(free):
                    if pool in w.pools:
                        key = (len(w.in_flight) + w.leased, w.busy)
                        if best is None or key < best[0]:
                            best = (key, i)
                            if not key[0]:
                                break
                if best is None:
                    continue  # no worker of its pool is free: it waits its turn
                w = free.pop(best[1])
                self._set_aside(w, req)
                if not w.in_flight:
                    self._served_alone(req, now)
                    self._counters["alone"] += 1
                    self._start(req, w, now, out)

    def _served_alone(self, req, now):
        """``req`` leaves its queue to run alone: its principal's turn, as a dispatch from
        `_pump` is (its FIFO's ``served``: the rejoin memo and the aging read it)."""
        req.svc.classes[req.priority][req.principal].served = now
        self._take(req, True)

    def _set_aside(self, w, req):
        """``w`` is ``req``'s until it has run it alone (``req`` is queued now)."""
        w.iso = req
        req.iso = w
        w.svc.isos += 1
        w.svc.lone.pop(req, None)
        w.svc.aside[w] = None
        self._reload(w)  # out of the heaps, not idle

    def _unlone(self, req, reload=True):
        """``req`` no longer holds the worker set aside for it (it ended there, or left the
        queue another way): that worker takes brokered work again (``reload``: re-filed
        now; else the caller does it)."""
        w = req.iso
        req.iso = None
        if w is not None and w.iso is req:
            w.iso = None
            svc = w.svc
            svc.aside.pop(w, None)
            if w.alive:
                svc.isos -= 1
                if reload:
                    self._reload(w)
                    self._dirty[svc] = None

    def _retry(self, reqs, now):
        """Queue ``reqs`` (oldest first) again after a failed attempt (their worker died, or
        gave them back unasked), at the front of their principals' FIFOs in that order.  A
        last attempt runs alone: it waits in its service's ``lone`` too, behind those that
        were there already."""
        for req in reversed(reqs):
            self._counters["retried"] += 1
            req.attempt += 1
            req.state = _QUEUED
            req.worker = None
            self._enqueue(req, now, front=True)
        last = self.config.max_retries
        for req in reqs:
            if req.attempt >= last:
                req.alone = True
                req.svc.lone[req] = None

    @classmethod
    def _unthief(cls, req):
        """``req`` is no longer on its way to the idle worker it was recalled for."""
        thief = req.thief
        thief.awaiting -= 1
        req.thief = None
        if not thief.awaiting and thief.is_idle:
            cls._thief_free(thief)

    @staticmethod
    def _thief_free(w):
        """``w`` is idle and waits for no RECALL's answer: it may take work back.  The next
        look is made in full if it could take from what the last one saw (`_flush`)."""
        svc = w.svc
        if svc.recall_stale or w.credit - w.leased <= 0:
            return
        hot = svc.recall_hot
        takers = svc.recall_takers
        for pool in w.pools:
            takers.add(pool)
            if pool in hot:
                svc.recall_stale = True

    def _start(self, req, w, now, out, shown=None):
        """Hand a request that is in no queue to ``w``; ``shown``: the class to tell the worker
        (a more urgent one it outscored by aging), else its own."""
        svc = req.svc
        token = next(self._tokens)
        req.state = _RUNNING
        req.worker = w
        req.token = token
        req.dispatched_at = now
        req.recalled = False
        req.shown = shown = req.priority if shown is None else shown
        if req.iso is not None:
            w.svc.aside.pop(w, None)  # set aside for it, and now running it
        w.in_flight[token] = req
        svc.in_flight += 1
        w.used = next(self._uses)
        self._reload(w)
        self._counters["dispatched"] += 1
        out.append(Dispatch(w.ident, token, req.client, req.request_id, svc.name, req.payload,
                            req.enqueued_at, req.deadline, req.attempt, req.returned, svc.queued, shown))

    def _kill_worker(self, w, now, out, failed: bool = True, how: str = _WENT_DROPPED):
        """Forget a dead worker and settle everything it held (``failed``: it did not say
        DISCONNECT, so what it held on leases it had ended may be lost too; ``how``: the
        words for how it went, `_leave_pools`)."""
        w.alive = False
        self._end_worker_leases(w, out, failed=failed)
        svc = w.svc
        del self._workers[w.ident]
        del svc.workers[w.ident]
        svc.idle.pop(w, None)
        svc.deep.pop(w, None)
        self._counters["worker_deaths" if failed else "workers_left"] += 1
        kept_for = w.iso
        if kept_for is not None:
            svc.isos -= 1
            svc.aside.pop(w, None)
            if kept_for.iso is w:
                kept_for.iso = None
                if kept_for.state == _QUEUED:  # it was set aside for this one: it looks again
                    svc.lone[kept_for] = None
                    svc.lone.move_to_end(kept_for, last=False)
        retry = []
        for req in w.in_flight.values():
            svc.in_flight -= 1
            if req.thief is not None:
                self._unthief(req)
            req.iso = None
            if req.state == _RUNNING:
                if req.streamed:
                    # Its caller has partial results already: run again, it would see them
                    # twice (docs/client.md).  It fails, as a stream cut by a broker restart does.
                    self._worker_failed(req, "the worker streaming this request died, or fell silent past its "
                                             "liveness window (presumed dead: a stall does it too), after some of "
                                             "its partial results were sent; a stream is not run again (its caller "
                                             "would see them twice)", out)
                elif req.attempt >= self.config.max_retries:
                    if not failed:
                        why = (f"the workers running this request died or left before answering it "
                               f"{req.attempt + 1} times, the last one saying goodbye (DISCONNECT: a worker "
                               f"stopped, or drained) (max_retries={self.config.max_retries})")
                    elif req.alone:
                        why = (f"the workers running this request died {req.attempt + 1} times, the last one "
                               f"while running it alone (max_retries={self.config.max_retries}): this input "
                               f"may be what kills them (a crash in the model's native code, an abort, an "
                               f"out-of-memory kill)")
                    else:
                        why = (f"the worker running this request died {req.attempt + 1} time(s) "
                               f"(max_retries={self.config.max_retries})")
                    self._worker_failed(req, why, out)
                else:
                    retry.append(req)
            elif req.state == _CANCELLING:
                self._error(req, ErrorCode.CANCELLED,
                            "cancelled by the client (the worker died before confirming)", out)
                self._retire(req)
            else:
                self._gone(req, now)
                self._retire(req)
        w.in_flight = {}
        # Front of their FIFOs, and their principals to the front of the rings, oldest first:
        # these requests have already waited their turn.
        self._retry(retry, now)
        if not w.stopping:
            self._leave_pools(w, now, how)
        else:
            # It left its pools when it said STOPPING; what it held and did not answer (it
            # died draining) waits for another worker, a whole grace from now if there is
            # none (counted from the STOPPING, a drain longer than the grace failed them at
            # once, a replacement on its way or not: found by review).
            empty = {}
            for req in retry:
                pool = self._pool(svc, req.local_host, now)
                if pool.live == 0:
                    empty[id(pool)] = pool
            for pool in empty.values():
                self._open_gap(svc, pool, now)
        self._dirty[svc] = None

    def _leave_pools(self, w, now, how: str):
        """``w`` no longer counts as live in its pools: a pool left with none starts the grace
        of the requests waiting for it (and a host's pool nobody waits for is forgotten);
        ``how`` it went is what their SERVICE_UNAVAILABLE says."""
        svc = w.svc
        for pool in w.pools:
            pool.live -= 1
            if pool.live == 0:
                pool.lost_how = how
                waiting = self._open_gap(svc, pool, now)
                if not waiting and pool is not svc.any:
                    # A host's pool with no worker and nothing waiting for one: forgotten (a
                    # service whose pods roll for months would keep one per pod's host, and
                    # the dead workers its heap still names).  A request for that host later
                    # makes it again, its gap counted from then: as its grace would be.
                    del svc.pools[pool.key]

    def _open_gap(self, svc, pool, now) -> bool:
        """``pool`` has no live worker from ``now``: the requests waiting for it get their
        grace (from now, or their arrival if later); whether any waits."""
        pool.gap_since = pool.lost_at = now
        pool.gap_epoch = next(self._epochs)
        waiting = False
        for ring in svc.classes:
            for fifo in ring.values():
                for req in fifo:
                    if req.local_host == pool.key:
                        self._push_grace(req, pool)
                        waiting = True
        return waiting

    # ---- timers

    def _push_timer(self, when, kind, obj, epoch=None):
        timers = self._timers
        heapq.heappush(timers, (when, next(self._seq), kind, obj, epoch))
        # Lazy deletion leaves stale entries behind (e.g. deadlines of requests that finished
        # long before them).  Valid timers are bounded by this census, so rebuilding once the
        # heap is twice that size keeps it O(live state) at O(1) amortised cost.
        bound = 2 * len(self._workers) + len(self._clients) + 2 * self._live + 256
        if len(timers) > 2 * bound:
            timers[:] = [t for t in timers if self._timer_due(t[2], t[3], t[4]) is not None]
            heapq.heapify(timers)

    def _push_grace(self, req, pool):
        self._push_timer(max(req.enqueued_at, pool.gap_since) + self.config.service_grace,
                         _T_GRACE, req, pool.gap_epoch)

    def _timer_due(self, kind, obj, epoch):
        """When the timer really fires, or None if it no longer applies."""
        if kind == _T_DEADLINE:
            return obj.deadline if obj.state in _LIVE_FOR_CLIENT else None
        if kind == _T_GRACE:
            if obj.state != _QUEUED:
                return None
            pool = obj.svc.pools.get(obj.local_host)
            if pool is None or pool.gap_epoch != epoch:
                return None
            return max(obj.enqueued_at, pool.gap_since) + self.config.service_grace
        if kind == _T_HEARTBEAT:
            return obj.last_heartbeat + self.config.heartbeat_interval if obj.alive else None
        if kind == _T_WORKER:
            return obj.last_seen + self._worker_ttl if obj.alive else None
        if kind == _T_COUNT:
            return obj.count_by
        if kind == _T_LEASE:  # a lease the worker has not confirmed (broker/leases.py)
            return obj.confirm_by if self._leases.get(obj.id) is obj and obj.state == "pending" else None
        if kind == _T_RECALL:
            # One live timer per service: the one whose time it keeps in ``recall_at``.
            if self._services.get(obj.name) is not obj or obj.recall_at != epoch:
                return None
            return epoch
        if self._clients.get(obj.ident) is not obj:
            return None
        return obj.last_seen + self._client_ttl

    def _expire_due(self, now, out):
        """Fire the deadlines due by ``now`` that no tick() has fired yet, as the tick would:
        asked by a full queue before it turns a live request away (Admission).  Other timers
        due are left to the tick (a peer's silence is judged there, after the server read what
        it sent).  At most TICK_MAX entries looked at, as a tick; a deadline fired or found
        stale leaves the heap for good, so each costs O(log n) once, whoever fires it, and the
        others due (a few between two ticks) go back as they were."""
        timers = self._timers
        kept = []
        budget = TICK_MAX
        while timers and timers[0][0] <= now and budget:
            budget -= 1
            entry = heapq.heappop(timers)
            kind, obj = entry[2], entry[3]
            if kind != _T_DEADLINE:
                kept.append(entry)
                continue
            due = self._timer_due(kind, obj, entry[4])
            if due is None:
                continue
            if due > now:
                kept.append(entry)  # (a deadline never moves; as the tick, to be safe)
                continue
            self._expire_deadline(obj, now, out)
        for entry in kept:
            heapq.heappush(timers, entry)

    def _expire_deadline(self, req, now, out):
        if req.state == _CANCELLING:
            # Its client cancelled it (its call ended `Cancelled` then) and its worker has not
            # confirmed: the deadline ends it, as it would a running one, but as what its
            # client saw: `cancelled` (it counted `deadline_exceeded`, and `expired`: the
            # counts hunt).  The worker was told already; its late answer goes to the client
            # (LateToClient), as a running request's does when its deadline answers it, so
            # that the client frees what it names.
            req.state = _ABANDONED
            req.late = self._clients.get(req.client)
            self._error(req, ErrorCode.CANCELLED,
                        f"cancelled by the client; its worker had not confirmed by the request's deadline "
                        f"({now - req.dispatched_at:.3f} s in flight)", out)
            return
        self._counters["expired"] += 1
        if req.state == _QUEUED or _queue_took_it(req):
            req.svc.missed = now  # (Congestion)
        if req.state == _QUEUED:
            self._unqueue(req)
            self._error(req, ErrorCode.DEADLINE_EXCEEDED,
                        f"deadline passed after {now - req.enqueued_at:.3f} s waiting for a "
                        f"free '{req.svc.name}' worker; allow more time, lower the load or "
                        f"start more workers", out, now)
            self._retire(req)
            return
        counted = True
        if req.state == _RUNNING:
            out.append(CancelAtWorker(req.worker.ident, req.token, CANCEL_EXPIRED))
            if self._on_direct is not None:
                # Its FINAL may have gone straight to the client a hair before the deadline,
                # and the client took that result: its DONE, on its way, says when it went.
                # Counted `deadline_exceeded` here, the broker's counts and its callers'
                # differed by 1-2 % of calls with deadlines near their compute time (the
                # ninth session's deadline hunt).  So its outcome waits for the worker's
                # answer (`_settle`), a heartbeat interval at most (`_T_COUNT`), or the
                # worker's end (`_retire`).
                counted = False
                req.count_by = now + self.config.heartbeat_interval
                self._push_timer(req.count_by, _T_COUNT, req)
        # The worker keeps the credit until its late final arrives or it dies.
        req.state = _ABANDONED
        req.late = self._clients.get(req.client)  # what the worker still sends goes to it (LateToClient)
        self._error(req, ErrorCode.DEADLINE_EXCEEDED,
                    f"deadline passed while a worker was running the request "
                    f"({now - req.dispatched_at:.3f} s in flight); allow more time or use a "
                    f"faster worker", out, counted=counted)

    def _count_expired(self, req, finished, code=ErrorCode.DEADLINE_EXCEEDED):
        """The outcome of a request whose deadline passed while a worker ran it, once known
        (`_expire_deadline`): ``code`` as its client saw it (a result sent straight to it
        before the deadline: 0), at ``finished``."""
        if req.count_by is None:
            return
        req.count_by = None
        self._on_direct(req.svc.name, code, req.enqueued_at, req.dispatched_at, finished,
                        (req.client, req.request_id))

    def _expire_grace(self, req, out, now):
        svc = req.svc
        grace = float(self.config.service_grace)
        self._unqueue(req)
        if svc.any.live == 0:
            self._counters["unavailable"] += 1
            lost = svc.any.lost_at
            if self._draining is not None and lost is not None:
                # The workers were stopped before this admitted request ran (a second signal to
                # the launcher, or a stop of the whole service, which signals the workers
                # too): say so, not "look at the workers" (they were told to go).
                why = (f"'{svc.name}' has no live worker left to run it: {self._draining.split(';')[0]}, "
                       f"and its last worker went {now - lost:.1f} s ago (its workers were stopped before the "
                       f"admitted requests had run: a second signal to the launcher, or a stop of the whole "
                       f"service, which signals them too)")
            elif lost is None:
                why = (f"no worker for '{svc.name}' registered within {grace} s; start one "
                       f"with python -m gpu_worker --model {svc.name}")
            else:  # it had workers: "start one" would point the wrong way
                why = (f"no live worker for '{svc.name}' within {grace} s: its last one went {now - lost:.1f} s "
                       f"ago ({svc.any.lost_how}) and none has registered since")  # errors.py
            self._error(req, ErrorCode.SERVICE_UNAVAILABLE, why, out)
        else:
            self._counters["not_local"] += 1
            self._error(req, ErrorCode.NOT_LOCAL,
                        self._not_local_message(svc.name, req.local_host), out)
        self._retire(req)

    # ---- clients

    def _gone(self, req, now):
        """An abandoned request ends without a worker's answer: if its client left before any
        final (an orphan), this is its one count (outcome CLIENT_GONE)."""
        if req.orphan and self._on_direct is not None:
            self._on_direct(req.svc.name, CLIENT_GONE, req.enqueued_at, req.dispatched_at, now,
                            (req.client, req.request_id))

    def _rename_if_it_loses(self, client):
        """``client`` is dropped for its silence: if it holds something (queued or running
        requests, leases), its next record gets a new number (client_epoch)."""
        mine = self._requests.get(client)
        if (self._client_leases.get(client) or self._noted(client)
                or (mine and any(r.state in (_QUEUED, _RUNNING) for r in mine.values()))):
            renamed = self._renamed
            renamed.pop(client, None)
            renamed[client] = next(self._epochs)
            if len(renamed) > _MAX_RENAMED:
                del renamed[next(iter(renamed))]

    def _drop_client(self, client, out, now):
        """The connection ``client`` went away (or fell silent): exactly its requests go;
        its principal's other connections keep theirs, and their counts."""
        self._end_client_leases(client, out)
        self._clients.pop(client, None)
        mine = self._requests.pop(client, None)
        if not mine:
            return
        for req in mine.values():
            # Nothing of the connection's is live for it any more: off its principal's
            # counts (request by request: they need not share one principal).
            self._release(req)
            if req.state == _QUEUED:
                self._counters["client_dropped"] += 1
                self._unqueue(req)
                if self._on_direct is not None:
                    self._on_direct(req.svc.name, CLIENT_GONE, req.enqueued_at, None, now,
                                    (req.client, req.request_id))
                self._retire(req)
            else:
                if req.state == _RUNNING:
                    out.append(CancelAtWorker(req.worker.ident, req.token, CANCEL_CLIENT_GONE,
                                              req.request_id, req.payload))
                if req.state != _ABANDONED:
                    # (truthy either way; a client that had cancelled it gets its 499 counted
                    # `cancelled`, as it asked, not `client_gone`: `_settle`)
                    req.orphan = True if req.state == _RUNNING else "cancelling"
                req.state = _ABANDONED
            # Never needed again (an abandoned request is not retried), and it may be large.
            req.payload = None

    # ---- end of every event

    def _flush(self, now, out):
        dirty = self._dirty
        while dirty:
            svc = next(iter(dirty))
            del dirty[svc]
            if self._services.get(svc.name) is not svc:
                continue
            self._pump(svc, now, out)
            if svc.idle and svc.deep and self._recall_after is not None and not self._holding:
                # The full look only when something an idle worker could take may have
                # appeared since the last one (see _recall_touched); a timer it set may be
                # due and not fired yet (no tick() since).
                if svc.recall_stale or (svc.recall_at is not None and svc.recall_at <= now):
                    self._recall(svc, now, out)
                elif svc.recall_touched:
                    self._recall_touched(svc, now, out)
            if not svc.workers and not svc.queued:
                del self._services[svc.name]
                if svc.any.lost_at is not None:
                    gone = self._lost_services
                    gone.pop(svc.name, None)
                    if len(gone) >= _GONE_SERVICES:
                        del gone[next(iter(gone))]
                    gone[svc.name] = (svc.any.lost_at, svc.any.lost_how)

    def _recall(self, svc, now, out):
        """Take back requests parked behind busy workers' running batches for the workers
        of ``svc`` that hold nothing (see "Taking work back" in the module docstring).

        A look at everything: O(deep workers x credit + idle workers).  It also notes what
        lets `_recall_touched` tell, at the events that follow, whether a look would find
        anything (``recall_hot``, ``recall_takers``), and the time the next look is due
        (the timer)."""
        svc.recall_stale = False
        svc.recall_touched = {}
        after = self._recall_after
        wake = None
        ripe = []
        for w in svc.deep:
            oldest = next(iter(w.in_flight.values()))
            ready_at = oldest.dispatched_at + after
            if ready_at > now:
                # Its current batch is young: waiting behind it is cheap.  Look again when
                # it is not.
                if wake is None or ready_at < wake:
                    wake = ready_at
            else:
                ripe.append((oldest.dispatched_at, w))
        # Only workers with something left to ask back: one whose held requests were all
        # asked already (kept: they had started) gives nothing, and looking at it again for
        # every idle worker at every event made this quadratic in the pool (a scale hunt:
        # 750 µs a request at 80 workers, 4.5 ms at 200).
        ripe = [e for e in ripe if self._askable(e[1])]
        svc.recall_hot = hot = set()
        by_key = svc.pools
        for _, v in ripe:
            for r in v.in_flight.values():
                if r.state == _RUNNING and not r.recalled and not r.alone:
                    hot.add(by_key.get(r.local_host))
        if ripe:
            ripe.sort(key=lambda e: e[0])  # the longest-running batch first
            victims = [v for _, v in ripe]
            # Per set of pools (the workers of one host share theirs), the victims holding
            # something such a thief could take.  Idle workers of another host than the
            # deep ones' shared-memory requests were each paired with every victim at every
            # event, for nothing: O(idle x deep x credit) an event (a scale hunt: 5.6 ms a
            # request with 100 deep workers on one host and 10 idle on another, 20 ms with 100).
            takers: dict = {}
            for thief in list(svc.idle):
                if thief.in_flight or thief.awaiting:
                    continue  # busy, or waiting for the answer to a RECALL made for it
                cands = takers.get(thief.pools)
                if cands is None:
                    cands = takers[thief.pools] = [v for v in victims if self._takes_from(thief.pools, v)]
                i = 0
                while i < len(cands):
                    victim = cands[i]
                    tokens = self._recall_for(thief, victim)
                    if tokens:
                        self._counters["recalled"] += len(tokens)
                        out.append(RecallAtWorker(victim.ident, tokens))
                        break
                    if thief.credit - thief.leased > 0:
                        del cands[i]  # nothing left there for these pools: not asked again now
                    else:
                        i += 1
        svc.recall_takers = {pool for t in svc.idle if not t.awaiting and t.credit - t.leased > 0
                             for pool in t.pools}
        if wake is not None and (svc.recall_at is None or wake < svc.recall_at):
            svc.recall_at = wake
            self._push_timer(wake, _T_RECALL, svc, wake)

    def _recall_touched(self, svc, now, out):
        """An event changed only what some deep workers of ``svc`` hold (a request dispatched
        to one, one answered or given back) since the last look found nothing more to take
        back: whether a look would find something now is a question about those workers
        alone.  Nothing changed that could give an idle worker something elsewhere: a
        worker newly deep or idle (`_reload`), an idle worker's RECALL answered
        (`_thief_free`), a BUSY, a lease, a batch grown old enough (the timer, whose time
        `recall_at` keeps the earliest of) each make the next look a full one
        (``recall_stale``).  So one of these workers whose batch ran long enough (the
        timer's business otherwise) and that has requests to give back (`_askable`) sends
        for the full look when one of them is in the pools of an idle worker that could
        take it; else what it holds is noted (``recall_hot``), and the timer comes to the
        earliest time one of them ripens, as the full look would set it (the other deep
        workers' times are not earlier than the timer's).  O(those workers x credit)."""
        touched = svc.recall_touched
        svc.recall_touched = {}
        after = self._recall_after
        hot = svc.recall_hot
        takers = svc.recall_takers
        by_key = svc.pools
        wake = None
        for w in touched:
            if not w.is_deep:
                continue
            ready_at = next(iter(w.in_flight.values())).dispatched_at + after
            if ready_at > now:
                if wake is None or ready_at < wake:
                    wake = ready_at
                continue
            mine = [by_key.get(r.local_host) for r in w.in_flight.values()
                    if r.state == _RUNNING and not r.recalled and not r.alone]
            if len(mine) >= 2 or (mine and w.busy):
                for pool in mine:
                    if pool in takers:
                        self._recall(svc, now, out)
                        return
                    hot.add(pool)
        if wake is not None and (svc.recall_at is None or wake < svc.recall_at):
            svc.recall_at = wake
            self._push_timer(wake, _T_RECALL, svc, wake)

    def _make_room(self, req, out):
        """An urgent ``req`` was queued because every worker of its pool is full: ask one of
        them back for its newest request of a lower class that may still be parked there
        (see "Urgent work" in the module docstring).  It comes back to the front of its
        principal's FIFO, and the credit it frees goes to ``req``, which outscores it."""
        pool = req.svc.pools.get(req.local_host)
        if pool is None:
            return
        left = _SCAN
        for w in _busy_last(req.svc.deep):
            if w.iso is not None or pool not in w.pools:
                continue
            # As many as take it under its brokered credit: one, but more just after a
            # lease took some of that credit (brokered work it held then stays).
            k = len(w.in_flight) - (w.credit - w.leased) + 1
            if k < 1:  # (room there already: nothing to ask for, and never an empty RECALL)
                continue
            found = []
            for r in reversed(w.in_flight.values()):
                if r.state == _RUNNING and not r.recalled and not r.alone and r.shown > req.priority:
                    found.append(r)
                    if len(found) == k:
                        break
                left -= 1
                if not left:
                    return
            if len(found) == k:
                for r in found:
                    r.recalled = True
                self._counters["recalled"] += k
                # Oldest first: given back, they go to the front of their FIFO in that order.
                out.append(RecallAtWorker(w.ident, tuple(r.token for r in reversed(found))))
                return

    def _make_turn(self, req, out):
        """``req``, its principal's only request queued in the service, was queued because every
        worker of its pool is full: if one of them (a busy one last) holds nothing of its
        principal's and two or more running of another principal that a credit freed would
        not go to first (one ahead of it in its class's ring, or one whose FIFO, made again
        by the give-back, would go ahead of it), ask that worker back for the newest of
        those of the one holding most, of a class no more urgent than ``req``'s (see "A
        newcomer's turn" in the module docstring).  It comes back into its principal's FIFO
        by age, the FIFO keeping its place in the ring, so the credit it frees goes to
        ``req`` (or to a principal ahead of it, whose turn it was).  At most ``_SCAN``
        principals and ``_CLASS_SCAN`` requests looked at."""
        svc = req.svc
        pool = svc.pools.get(req.local_host)
        if pool is None:
            return
        me = req.principal
        pri = req.priority
        ring = svc.classes[pri]
        # The principals ahead of it in its class (a principal never served here joins at
        # the back: new names do not jump the queue, and one behind a flood's queued
        # requests asks nothing of the flood), and ``bar``, the newest last turn among the
        # FIFOs up to its own, from the front, as far as the first never served: a FIFO
        # made again from a remembered turn older than that goes ahead of the first FIFO
        # served after it (`_enqueue`), so ahead of it.
        ahead = set()
        bar = 0.0
        walk = True
        for p, f in ring.items():
            if walk:
                if not f.served:
                    walk = False
                elif f.served > bar:
                    bar = f.served
            if p == me:
                break
            ahead.add(p)
            if len(ahead) == _SCAN:
                return
        memo = svc.left[pri]
        goes_first = {}  # principal -> whether a credit freed would go to it before req
        left = _CLASS_SCAN
        for w in _busy_last(svc.deep):
            if w.iso is not None or pool not in w.pools or len(w.in_flight) != w.credit - w.leased:
                continue  # (over its brokered credit after a lease: one given back would not do)
            held = {}
            newest = {}
            for r in w.in_flight.values():
                q = r.principal
                if q == me:
                    break  # it holds one of ours: its share is not nothing
                left -= 1
                if not left:
                    return
                # Not counted: one asked back already (it is leaving), one cancelling or
                # abandoned (it gives nothing back), one of a more urgent class, and one
                # aging sent ahead of a more urgent class (given back to its own, its wait
                # may win the credit back).
                if r.recalled or r.state != _RUNNING or r.alone or r.shown < pri or r.shown != r.priority:
                    continue
                if r.shown == pri:
                    first = goes_first.get(q)
                    if first is None:
                        if q in ahead:
                            first = True
                        elif q in ring:
                            first = False
                        else:
                            # Given back, its FIFO is made again from its remembered turn.
                            last = memo.get(q)
                            first = last is not None and last < bar
                        goes_first[q] = first
                    if first:
                        continue
                held[q] = held.get(q, 0) + 1
                newest[q] = r
            else:
                if not held:
                    continue
                q = max(held, key=held.__getitem__)
                if held[q] < 2:
                    continue
                r = newest[q]
                r.recalled = _TURN
                self._counters["recalled"] += 1
                self._counters["turns"] += 1
                out.append(RecallAtWorker(w.ident, (r.token,)))
                return

    @staticmethod
    def _askable(victim) -> bool:
        """Whether `_recall_for` could take anything from ``victim`` (for some thief)."""
        n = 0
        for r in victim.in_flight.values():
            if r.state == _RUNNING and not r.recalled and not r.alone:
                n += 1
                if n >= 2 or victim.busy:
                    return True
        return False

    @staticmethod
    def _takes_from(pools, victim) -> bool:
        """Whether a thief in ``pools`` could be handed one of ``victim``'s requests (the
        pool test of `_recall_for`)."""
        by_key = victim.svc.pools
        for r in victim.in_flight.values():
            if r.state == _RUNNING and not r.recalled and not r.alone and by_key.get(r.local_host) in pools:
                return True
        return False

    @staticmethod
    def _recall_for(thief, victim) -> tuple:
        """The tokens to ask ``victim`` back for ``thief``: its newest (most likely not
        started) that the thief's pools can take, at most half of those it still runs
        unasked and at most the thief's credit; each marked asked (once per dispatch).  From
        a busy victim (BUSY: leased work runs there, not these) all of them may be."""
        mine = [r for r in victim.in_flight.values() if r.state == _RUNNING and not r.recalled and not r.alone]
        k = min(len(mine) if victim.busy else len(mine) // 2, thief.credit - thief.leased)
        if not k:
            return ()
        pools = victim.svc.pools
        tokens = []
        for req in reversed(mine):
            pool = pools.get(req.local_host)
            if pool is None or pool not in thief.pools:
                continue
            req.recalled = True
            req.thief = thief
            thief.awaiting += 1
            tokens.append(req.token)
            if len(tokens) == k:
                break
        return tuple(tokens)
