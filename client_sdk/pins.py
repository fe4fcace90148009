"""Pinned streams, the client's side of leases (docs/protocol.md section 10): socket-free.

`PinEvents` is a mixin of `ClientCore` (core.py), like the broker's lease mixin of its
scheduler: it decides, the twins (client.py, aio.py) move frames.  A client made with
`pin=True` (or a number of slots) asks the broker for a lease on a service the first time it
sends that service a request, and sends its requests straight to the leased worker once the
broker said where (LEASED), up to the lease's `slots` in flight; everything else (no lease
yet, the lease's slots all in flight, tensors the lease cannot take) goes through the broker
as before.  Replies on the direct connection take the same path as the broker's.

A client made without `pin` pins on demand: a stream (`client.stream(..., pin=None)`, with
heartbeats on) adds its service to `pin_services` (`pin_on_demand`), and from then on that
service's requests are handled exactly as a pinning client's (asked for
the largest max_in_flight of its streams' slots) until its last stream closes (`pin_release`:
LEASE_END); every other service's stay byte for
byte what they were before leases (no LEASE, the same frames).  A call with `no_pin` set (a
`pin=False` stream's frame) never goes on a lease, on any client.

What the core asks of its twin goes into `core.ops`, in order, which the twin runs after
each call into the core (`ClientCore.on_message`, `request_frames`, `give_up`, ...):

- a plain frame list: send it to the broker (LEASE, LEASE_END);
- `PinOpen(pin, hello)`: connect a DEALER to `pin.endpoint` and send `hello` on it;
- `PinSend(pin, frames)`: send `frames` on that DEALER (a CANCEL of a pinned call);
- `PinClose(pin)`: close it (DISCONNECT first).

A call the core puts on a lease has `call.pin` set when `request_frames` returns: the twin
sends it on that lease's DEALER (or, when it cannot, calls `reroute` and sends the same
frames to the broker).  Messages read from a lease's DEALER are handed to `on_message` with
`pin=` that lease.

Ends, all of which put the service back on the brokered path (a new lease is asked for on
a later request, no sooner than `PIN_RETRY_MIN_S` after the end; refusals back off from
there, doubling up to `PIN_RETRY_MAX_S`):

- LEASED with an error (no worker with a direct socket, unknown service, ...): backoff;
- LEASE_END with `resend` (the worker is presumed dead): the DEALER closes at once and every
  call in flight on the lease is sent again through the broker, under the same id (the
  broker never saw it); nothing more can arrive for it on the closed connection, and a
  direct reply to a call that is no longer on that lease is dropped as a stray, so each
  call completes exactly once;
- LEASE_END without `resend` (drain, scale-down, the worker stopping): new calls go through
  the broker, those in flight finish on the DEALER (which closes after the last one);
- a direct FINAL that says the request did not run and asks to be sent through the broker
  (503 after the lease ended, 429 beyond the lease's slots, 400 "not bound"): it is sent
  through the broker instead of being delivered (a 429 at once; a 503 or 400 after the
  broker's next heartbeat answer, `_park`), and a 503 or 400 ends the lease here too;
- a broker restart, or our connection to it replaced (a new instance, or a new route, in a
  heartbeat answer): every lease ends as by a drain (`_pin_reset`): new calls go through the
  broker, those in flight stay on the connection, where their worker, alive, finishes them
  (one it refuses or loses goes through the broker as above and below, once); core.py's
  restart logic resends none of them;
- the lease's connection lost (`pin_link_lost`: the local link closed, or a tcp connection
  dropped, or its peer stopped acknowledging): its calls go through the broker after its
  next heartbeat answer (`_park`) and the lease goes back (LEASE_END ``client_done``);
- a tcp lease whose handshake has not succeeded within `PIN_CONNECT_S` (an address this
  client cannot reach, a firewall), or was refused for good: the lease goes back
  (`pin_broken`); until the twin saw that handshake succeed (`pin_connected`) the lease
  took no call;
- `close()`: LEASE_END `client_done` for each lease held (`pin_goodbye`).

Invariant: a call is on at most one lease (`call.pin`), listed in that lease's `calls`
until its FINAL (`ClientCore._forget`) or until it is moved to the broker (or parked for
it: `_parked`, a call on no lease that the broker has not been sent yet).
"""
from __future__ import annotations

import heapq
import logging
import operator
from collections import deque
from typing import Any, NamedTuple

from broker import protocol as P
from broker.protocol import ErrorCode

from .errors import InvalidInput, error_from

__all__ = ["Pin", "PinOpen", "PinSend", "PinClose", "PinEvents", "pin_slots", "PIN_SLOTS",
           "PIN_RETRY_MIN_S", "PIN_RETRY_MAX_S", "ASK_TIMEOUT_S", "PIN_MAX_SLOTS", "PIN_CONNECT_S"]

log = logging.getLogger("client_sdk")

#: slots a `pin=True` client asks for per lease (the broker may grant fewer); a stream's
#: service pinned on demand asks for the stream's max_in_flight
PIN_SLOTS = 8
#: the most slots one lease may ask for
PIN_MAX_SLOTS = 1 << 16
#: seconds before a service whose lease ended (or was refused) is asked for again, doubling
#: with each refusal up to PIN_RETRY_MAX_S
PIN_RETRY_MIN_S = 1.0
PIN_RETRY_MAX_S = 30.0
#: services a backoff is remembered for before the stale ones go (`forget_stale`)
BACKOFF_MEMO = 256


def forget_stale(retry: dict, backoff: dict, now: float, idle_s: float, most: int = BACKOFF_MEMO) -> None:
    """Bound the per-service backoff memos ``retry`` (service -> no try before) and ``backoff``
    (service -> its last backoff): past ``most`` entries, those whose time came ``idle_s``
    ago are forgotten (their next refusal starts the backoff over), then those whose time
    comes soonest (not the oldest entry: often the busiest service at its longest backoff).
    A long-lived client calling services that come and go (a name per model version) kept
    one entry per name for good (the soak hunt).  Costs nothing until the memo is full."""
    if len(retry) <= most and len(backoff) <= most:
        return
    services = set(retry) | set(backoff)
    stale = {k for k in services if retry.get(k, -1.0) + idle_s < now}
    services -= stale
    if len(services) > most:
        stale.update(heapq.nsmallest(len(services) - most, services, key=lambda k: retry.get(k, -1.0)))
    for svc in stale:
        retry.pop(svc, None)
        backoff.pop(svc, None)


#: an ask unanswered this long is taken as lost (a broker that does not know LEASE, or a
#: restart): refused, and asked again after the backoff
ASK_TIMEOUT_S = 5.0
#: a lease's tcp connection (--direct-tcp) whose handshake has not succeeded this long after
#: the LEASED is given up: the lease goes back (`pin_broken`) and the service stays brokered
#: for the backoff.  Until its handshake succeeds a tcp lease takes no call: they go through
#: the broker, so an unreachable worker costs a remote client nothing but this lease.
PIN_CONNECT_S = 3.0

#: the direct FINALs that mean "this request did not run: send it through the broker"
_BOUNCE_CODES = (int(ErrorCode.SERVICE_UNAVAILABLE), int(ErrorCode.QUEUE_FULL), int(ErrorCode.PROTOCOL_ERROR))
_NOT_BOUND = "not bound to a lease"


def pin_slots(pin: Any) -> int:
    """The slots a `pin=` option asks for: 0 (off) for False/None, PIN_SLOTS for True, or
    the number given (an int, numpy's included, 1..PIN_MAX_SLOTS)."""
    if pin is None or pin is False:
        return 0
    if pin is True:
        return PIN_SLOTS
    try:
        n = operator.index(pin)  # an int, numpy's too (as pool_capacity and max_in_flight take)
    except TypeError:
        n = 0
    if 1 <= n <= PIN_MAX_SLOTS and type(pin).__name__ != "bool_":
        return n
    raise InvalidInput(f"pin must be True, False or a number of slots (1..65536), got {pin!r}")


class Pin:
    """One lease held: where its worker listens, how many calls it takes, which are on it."""

    __slots__ = ("service", "lease", "secret", "endpoint", "link", "server_key", "slots", "near", "calls", "ending",
                 "closed", "ready", "opened", "trouble", "given_up")

    def __init__(self, service: str, info: P.LeaseInfo, near: bool, now: float = 0.0):
        self.service = service
        self.lease: bytes = info.lease
        self.secret: bytes = info.secret
        self.endpoint: str = info.endpoint
        # the worker's local link (docs/protocol.md section 10.6): a near lease's faster way in
        self.link: str | None = info.link if near else None
        self.server_key: str | None = info.server_key  # a tcp direct socket's CurveZMQ key
        self.slots: int = info.slots
        self.near = near            # shared-memory references may go on it
        self.calls: dict[int, Any] = {}  # id -> Call in flight on it
        self.ending = False         # ended: takes no new call, closes after its last one
        self.closed = False         # PinClose queued
        # Takes calls: at once over ipc and the link; over tcp once its twin saw the handshake
        # succeed (`pin_connected`), which must happen within PIN_CONNECT_S of `opened`.
        self.ready = not info.endpoint.startswith("tcp://")
        self.opened = now
        self.trouble = ""           # what the tcp connection last reported while not ready
        self.given_up: dict[int, float | None] = {}  # id -> when its caller gave it up (CANCEL sent): `free_given_up`

    def __repr__(self) -> str:
        return (f"<Pin {self.service!r} lease={self.lease.hex()} slots={self.slots} in_flight={len(self.calls)}"
                f"{'' if self.ready else ' connecting'}{' ending' if self.ending else ''}"
                f"{' closed' if self.closed else ''}>")


class PinOpen(NamedTuple):
    pin: Pin
    hello: list


class PinSend(NamedTuple):
    pin: Pin
    frames: list


class PinClose(NamedTuple):
    pin: Pin


def _inline_only(packed: Any) -> bool:
    return packed is not None and all(type(t.loc) is P.InlineLoc for t in packed.tensors)


class PinEvents:
    """The lease decisions of `ClientCore` (its ``__init__`` calls ``_init_pins``)."""

    def _init_pins(self, pin: Any) -> None:
        self.pin_slots = pin_slots(pin)          # every service pinned (pin=True); 0: none but ...
        self.pin_services: dict[str, int] = {}   # ... these, pinned on demand (a stream's): service -> slots
        self._pin_streams: dict[str, int] = {}   # service -> its open streams that pinned it
        self.ops: deque[Any] = deque()           # for the twin (see the module docstring)
        self.pins: dict[str, Pin] = {}           # service -> its lease in use
        self.pin_all: dict[bytes, Pin] = {}      # lease id -> every lease with an open connection
        self._asking: dict[str, tuple[int, float]] = {}  # service -> (ask id, when asked)
        self._ask_ids: dict[int, str] = {}       # ask id -> service
        self._pin_retry: dict[str, float] = {}   # service -> no ask before this time
        self._pin_backoff: dict[str, float] = {}  # service -> the last refusal's backoff
        self._parked: dict[int, Any] = {}        # id -> a call off its lease, for the broker's next answer (`_park`)
        self._park_asked = False                 # a heartbeat went out for them (`_park`)
        self.pinned_replies = 0                  # replies that came on a lease's connection
        self.pins_granted = 0
        self.pins_refused = 0
        self.pins_ended = 0

    # ------------------------------------------------------------------ queries

    def pinned(self, service: str) -> bool:
        """Whether `service` is leased now and its connection is up (its next requests may go
        straight to its worker)."""
        pin = self.pins.get(service)
        return pin is not None and pin.ready

    # ------------------------------------------------------------------ streams

    def stream_pins(self, pin: Any) -> bool:
        """Whether a stream opened with `pin` (None, True or False) may put its frames on a
        lease: None when the client can (heartbeats on), False never, True always
        (InvalidInput when heartbeats are off)."""
        if pin is not None and not isinstance(pin, bool):
            raise InvalidInput(f"a stream's pin must be None (pin when the client can), True or False, got {pin!r}")
        if pin is False:
            return False
        if self.heartbeat_interval is None:
            if pin:
                raise InvalidInput("stream(pin=True) needs heartbeats (heartbeat_interval > 0): a leaseholder the "
                                   "broker does not hear from loses its lease")
            return False
        if pin is None and self.endpoint.startswith("tcp://"):
            # A remote client pins only when asked to (pin=True on the stream or the client):
            # only workers with a tcp direct socket take its leases (--direct-tcp).
            return False
        return True

    def pin_on_demand(self, service: str, max_in_flight: int) -> bool:
        """A stream that may pin opened on `service`: a client that does not pin every
        service pins this one until its last such stream closes, asking for max_in_flight slots
        (the largest of its streams')."""
        if self.pin_slots or self.closed:
            return False  # a pinning client pins every service already, with its own slots
        want = min(max(1, int(max_in_flight)), PIN_MAX_SLOTS)
        self.pin_services[service] = max(self.pin_services.get(service, 0), want)
        self._pin_streams[service] = self._pin_streams.get(service, 0) + 1
        return True  # counted: pin_release when the stream closes

    def pin_release(self, service: str, now: float) -> None:
        """A stream of `service` that `pin_on_demand` counted closed: after the last one the
        service is not pinned any more and its lease ends (LEASE_END; calls in flight on it
        finish there), so the worker's slots go back to everyone else."""
        n = self._pin_streams.get(service, 0) - 1
        if n > 0:
            self._pin_streams[service] = n
            return
        self._pin_streams.pop(service, None)
        if self.pin_slots or self.pin_services.pop(service, None) is None:
            return
        self._forget_ask(service)
        pin = self.pins.get(service)
        if pin is not None:
            self.ops.append(self._lease_end_frames(service, pin.lease))
            self._end_pin(pin, now, resend=False)

    # ------------------------------------------------------------------ sending

    def pin_inline(self, service: str) -> bool:
        """Whether a new call to `service` must pack its inputs inline: its lease is not near
        (the worker cannot map our memory), so only inline tensors can go on it."""
        pin = self.pins.get(service)
        return pin is not None and not pin.near

    def _pin_route(self, call: Any, now: float) -> None:
        """A call registered and about to be sent: put it on its service's lease when there
        is room, or ask for a lease when there is none (the call itself goes through the
        broker meanwhile)."""
        svc = call.service
        pin = self.pins.get(svc)
        if pin is not None:
            if not pin.ready:  # a tcp connection still in its handshake: brokered meanwhile
                self._pin_overdue(pin, now)
                return
            if len(pin.calls) < pin.slots and (pin.near or _inline_only(call.packed)):
                call.pin = pin
                pin.calls[call.id] = call
            return
        asked = self._asking.get(svc)
        if asked is not None:
            if now - asked[1] < ASK_TIMEOUT_S:
                return
            log.info("no answer to the lease ask for %r within %.0f s; staying brokered", svc, ASK_TIMEOUT_S)
            self._forget_ask(svc)
            self._pin_refused(svc, now)
        if now < self._pin_retry.get(svc, -1.0):
            return
        ask_id = next(self._ids)
        self._asking[svc] = (ask_id, now)
        self._ask_ids[ask_id] = svc
        transports = ["shm", "inline"] if self.use_shm else ["inline"]
        slots = self.pin_slots or self.pin_services.get(svc, PIN_SLOTS)
        ask = P.LeaseAsk(id=ask_id, slots=slots, host=P.local_host_id(), transports=transports)
        self.ops.append(P.client_lease(svc, P.encode_header(ask)))

    def reroute(self, call: Any) -> None:
        """The twin could not send `call` on its lease's connection: it goes to the broker
        instead (the same frames, the same id)."""
        if call.pin is not None:
            self._unpin(call)

    def _unpin(self, call: Any) -> None:
        """`call` leaves its lease (answered, unsent, or moved to the broker)."""
        pin, call.pin = call.pin, None
        pin.calls.pop(call.id, None)
        if pin.ending and not pin.calls:
            self._close_pin(pin)

    def _pin_cancel(self, call: Any, expired: bool = False, now: float | None = None) -> None:
        """CANCEL a pinned call where it runs: on its lease's connection; ``expired``: its
        deadline passed (the worker answers and counts it as the deadline's, not a cancel)."""
        pin = call.pin
        self.ops.append(PinSend(pin, P.client_cancel(call.service, call.id, expired=expired)))
        pin.given_up[call.id] = now  # None (no clock given): timed from the next sweep

    def free_given_up(self, now: float, window: float) -> None:
        """Lease slots of calls given up ``window`` seconds ago that no FINAL answered are free
        again.  A worker answers a CANCEL of what it still holds; one whose reply was lost (a
        Ctrl-C in the receive) knows nothing of it, and its slot stayed taken for the lease's
        life: after as many as it had, every call went through the broker (the interruption
        hunt: 8 of 8 after 300 Ctrl-Cs).  The call itself stays, its inputs with it, until a
        FINAL comes or the client closes; one still running takes one slot more than the
        lease has, which the worker answers 429 and the client sends through the broker."""
        # Every open lease, ending ones too: one ended without resend (a drain) stays open
        # for the calls still on it, and a given-up one whose answer was lost kept it, and its
        # connection, for the client's life (found by the leases audit).
        for pin in list(self.pin_all.values()):
            given = pin.given_up
            if not given:
                continue
            for cid, at in list(given.items()):
                call = pin.calls.get(cid)
                if call is None or call.done:
                    del given[cid]
                elif at is None:
                    given[cid] = now
                elif now - at > window:
                    del given[cid]
                    del pin.calls[cid]
                    if pin.ending:
                        # Its lease is over: once its connection closes nothing can answer
                        # it, so it is forgotten now, its inputs with it (found by review:
                        # it stayed in the client's calls until the client closed).
                        call.pin = None
                        self._forget(call)
                        self._finish_inputs(call)
                        call.done = True
            if pin.ending and not pin.calls:
                self._close_pin(pin)

    # ------------------------------------------------------------------ the broker's answers

    def _on_lease_message(self, frames: list[Any], now: float) -> list[list[Any]] | None:
        """LEASED or LEASE_END from the broker (which `parse_broker_to_client` does not know);
        None when `frames` is neither.  Returns frames to send to the broker."""
        if len(frames) < 2 or bytes(frames[0]) != P.MDPC:
            return None
        cmd = bytes(frames[1])
        if cmd not in (P.C_LEASED, P.C_LEASE_END):
            return None
        if len(frames) != 4:
            log.warning("dropping a malformed lease message from the broker (%d frames)", len(frames))
            return []
        if cmd == P.C_LEASED:
            return self._on_leased(bytes(frames[2]), frames[3], now)
        try:
            end = P.decode_lease_end(frames[3])
        except P.ProtocolError as e:
            log.warning("dropping a malformed LEASE_END from the broker: %s", e)
            return []
        pin = self.pin_all.get(end.lease)
        if pin is None or pin.ending and not end.resend:
            return []
        if not pin.ending:  # a second end (resend after a stop) is not a second lease ended
            self.pins_ended += 1
        log.info("lease %s on %r ended (%s)%s", end.lease.hex(), pin.service, end.reason,
                 "; resending its requests through the broker" if end.resend and pin.calls else "")
        return self._end_pin(pin, now, resend=end.resend)

    def _on_leased(self, service: bytes, head: Any, now: float) -> list[list[Any]]:
        try:
            info = P.decode_lease_info(head)
        except P.ProtocolError:
            info = None
        if info is None:
            try:
                err = P.decode_reply(head).error
                rid = P.lenient_request_id(head)
            except P.ProtocolError as e:
                log.warning("dropping a malformed LEASED from the broker: %s", e)
                return []
            svc = self._ask_ids.get(rid)
            if svc is None:
                self.discarded += 1
                return []
            self._forget_ask(svc)
            log.info("no lease for %r (%s); its requests go through the broker",
                     svc, err.message if err is not None else "no reason given")
            self._pin_refused(svc, now)
            return []
        svc = self._ask_ids.get(info.id)
        # ipc endpoints for a client of a local broker, tcp ones for a remote client (whose
        # twin connects with its CurveZMQ keys and the lease's server_key)
        usable = info.endpoint.startswith("tcp://" if self.endpoint.startswith("tcp://") else "ipc://")
        stale = (svc is None or self.closed or not usable
                 or (self.broker_instance is not None and info.instance != self.broker_instance))
        if stale:
            # Not ours any more (a late answer to an ask given up on, a previous broker's, or
            # an endpoint we cannot use yet): the broker gets its slots back.
            if svc is not None:
                self._forget_ask(svc)
                self._pin_refused(svc, now)
            return [self._lease_end_frames(service, info.lease)]
        self._forget_ask(svc)
        old = self.pins.get(svc)
        if old is not None:  # cannot happen (one ask per service at a time); keep the one in use
            return [self._lease_end_frames(service, info.lease)]
        near = self.use_shm and info.host is not None and info.host == P.local_host_id()
        pin = Pin(svc, info, near, now)
        self.pins[svc] = pin
        self.pin_all[pin.lease] = pin
        self._pin_backoff.pop(svc, None)
        self._pin_retry.pop(svc, None)
        self.pins_granted += 1
        log.info("pinned %r to %s (%d slots%s)", svc, info.endpoint, info.slots, ", shared memory" if near else "")
        hello = [P.MDPC, P.C_HELLO, P.encode_header(P.LeaseHello(lease=pin.lease, secret=pin.secret))]
        self.ops.append(PinOpen(pin, hello))
        return []

    def _forget_ask(self, svc: str) -> None:
        asked = self._asking.pop(svc, None)
        if asked is not None:
            self._ask_ids.pop(asked[0], None)

    def _pin_refused(self, svc: str, now: float) -> None:
        self.pins_refused += 1
        backoff = min(2.0 * self._pin_backoff.get(svc, PIN_RETRY_MIN_S / 2), PIN_RETRY_MAX_S)
        self._pin_backoff[svc] = backoff
        self._pin_retry[svc] = now + backoff
        forget_stale(self._pin_retry, self._pin_backoff, now, PIN_RETRY_MAX_S)

    @staticmethod
    def _lease_end_frames(service: Any, lease: bytes) -> list[Any]:
        return P.client_lease_end(service, P.encode_header(P.LeaseEnd(lease=lease, reason="client_done")))

    # ------------------------------------------------------------------ ends

    def _end_pin(self, pin: Pin, now: float, *, resend: bool, park: bool = False) -> list[list[Any]]:
        """The lease is over: new calls go through the broker (a new lease is asked for
        after the backoff).  With `resend` its calls in flight go through the broker (now,
        or ``park``: after the broker's next answer, `_park`) and its connection closes;
        without, they finish on it."""
        if self.pins.get(pin.service) is pin:
            del self.pins[pin.service]
            self._pin_retry[pin.service] = max(self._pin_retry.get(pin.service, -1.0), now + PIN_RETRY_MIN_S)
            forget_stale(self._pin_retry, self._pin_backoff, now, PIN_RETRY_MAX_S)
        pin.ending = True
        out: list[list[Any]] = []
        if resend:
            for call in list(pin.calls.values()):
                out += self._to_broker(call, now, lost=True, park=park)
        if not pin.calls:
            self._close_pin(pin)
        return out

    def _close_pin(self, pin: Pin) -> None:
        if pin.closed:
            return
        pin.closed = True
        pin.ending = True
        self.pin_all.pop(pin.lease, None)
        if self.pins.get(pin.service) is pin:
            del self.pins[pin.service]
        self.ops.append(PinClose(pin))

    def _to_broker(self, call: Any, now: float, *, lost: bool, park: bool = False) -> list[list[Any]]:
        """Move a pinned call to the broker: its REQUEST again, same id (now, or ``park``:
        after the broker's next heartbeat answer, `_park`).  `lost`: its worker will not
        answer (presumed dead); an abandoned call is then forgotten (nobody waits, nothing
        will reply) and a call that streamed PARTIALs fails (its caller would see them
        twice)."""
        self._unpin(call)
        if call.done:
            return []
        if lost and call.abandoned:
            self._forget(call)
            self._finish_inputs(call)
            call.done = True
            return []
        if lost and call.partials:
            self._forget(call)
            self._finish_inputs(call)
            # (said as the worker's failure alone, where the worker had closed the connection
            # of a client that read its partials too slowly: the streams audit)
            self._deliver(call, ("error", error_from(
                int(ErrorCode.WORKER_FAILED), f"the pinned worker of {call.service!r}, or its connection to this "
                f"client, ended after request {call.id} had streamed {call.partials} partial result(s): the worker "
                f"stopped or died, or this client read its replies too slowly (a worker ends the connection of a "
                f"client it holds too much for: read a stream's partials as they come); a stream is not run again",
                request_id=call.id)), True, now)
            return []
        if park:
            return self._park(call)
        call.broker = self.broker_instance
        call.route = self.broker_route
        return [self._encode_request(call, now)]

    def _pin_bounce(self, call: Any, pin: Pin, err: Any, now: float) -> list[list[Any]] | None:
        """A direct FINAL error for `call`: None when it is the call's answer, else the
        frames that send the call through the broker (the worker says it did not run it)."""
        code, msg = err.code, err.message or ""
        if code not in _BOUNCE_CODES or call.abandoned:
            return None
        if code == int(ErrorCode.PROTOCOL_ERROR) and not msg.startswith(_NOT_BOUND):
            return None
        if code == int(ErrorCode.SERVICE_UNAVAILABLE) and "through the broker" not in msg:
            return None
        if code != int(ErrorCode.QUEUE_FULL) and not pin.ending:
            # The worker no longer holds the lease (it stopped, or forgot us): end it here.
            log.info("the pinned worker of %r refused request %d (%s); back to the broker", pin.service, call.id, msg)
            self.pins_ended += 1
            # The broker still counts the lease's slots: say it is over (it ignores an
            # unknown lease, if it ended the lease itself meanwhile).
            self.ops.append(self._lease_end_frames(pin.service, pin.lease))
            self._end_pin(pin, now, resend=False)
        # (A 429 is this worker's load, with its broker as it was: through the broker at once.)
        return self._to_broker(call, now, lost=False, park=code != int(ErrorCode.QUEUE_FULL))

    def _park(self, call: Any) -> list[list[Any]]:
        """`call`, off its lease (its worker refused it, 503 or 400, or the connection was
        lost), goes through the broker only after the broker's next heartbeat answer
        (`unpark`), which a heartbeat asks for now (one for all the calls parked until it
        comes).  Such an end most often comes from a restart: a worker that lost its broker
        ends its leases and refuses what it had not started, and the worker may hear of a new
        broker before this client does.  Sent at once, the call reached the new broker and
        started there; the heartbeat answer that named the new broker a moment later had it
        sent again (core.py's `_resend_brokered`: what went out before that answer may have
        been lost with the old broker), and it ran twice.  Parked, it is sent once that
        answer has said where it goes: one round trip later.  Meanwhile it is a brokered call
        (the broker's silence fails it, `unreachable`) with no CANCEL to send."""
        call.broker = call.route = None
        self._parked[call.id] = call
        if self._park_asked:
            return []
        self._park_asked = True
        return [P.client_heartbeat(ask_route=True)]

    def unpark(self, now: float) -> list[list[Any]]:
        """The broker answered a heartbeat (and core.py took in what the answer says: a
        restart, a new connection): the REQUESTs of the parked calls, to send to it now,
        under their own ids (`_park`); those given up meanwhile are forgotten."""
        self._park_asked = False
        parked, self._parked = self._parked, {}
        out: list[list[Any]] = []
        for call in parked.values():
            if call.done:
                continue
            if call.abandoned or (call.inbox and call.inbox[-1][0] == "error"):
                self._forget(call)  # (nobody waits: the worker never ran it, nothing will answer)
                self._finish_inputs(call)
                call.done = call.done or call.abandoned
                continue
            call.broker = self.broker_instance
            call.route = self.broker_route
            out.append(self._encode_request(call, now))
        return out

    def _pin_reset(self, now: float) -> None:
        """A broker restart, or our connection to it replaced: every lease is ended here as
        by a drain (LEASE_END without resend), and every ask is void.  No new call goes on an
        old lease (they go through the broker, and the service is pinned again, no sooner
        than PIN_RETRY_MIN_S from now); the calls already on one stay on its connection,
        which is up and whose worker (alive, and registered with the new broker or soon to
        be) still runs them and answers there, and the connection closes after the last one.
        A call leaves it only as any call on an ended lease does: refused by its worker (503
        "resend through the broker": one it held unstarted when it lost its broker, or one
        sent after) or lost with the connection (`pin_link_lost`), then through the broker
        once (`_park`).  core.py's restart logic resends none of them: resent through the
        new broker (which never held them), those still running at their worker ran twice."""
        self._asking.clear()
        self._ask_ids.clear()
        services = {pin.service for pin in self.pin_all.values()} | set(self.pins)
        for pin in list(self.pins.values()):
            self._end_pin(pin, now, resend=False)
        for svc in services:
            self._pin_retry[svc] = max(self._pin_retry.get(svc, -1.0), now + PIN_RETRY_MIN_S)

    def pin_broken(self, pin: Pin, now: float, why: str) -> None:
        """The twin could not connect to the lease's worker: the lease goes back to the
        broker, and the service stays brokered for the backoff."""
        log.warning("cannot connect to the leased worker of %r at %s (%s); staying brokered",
                    pin.service, pin.endpoint, why)
        self.ops.append(self._lease_end_frames(pin.service, pin.lease))
        for call in list(pin.calls.values()):  # none yet: calls are routed after the connection opened
            self._unpin(call)
        self._close_pin(pin)
        self._pin_refused(pin.service, now)

    def pin_connected(self, pin: Pin) -> None:
        """The twin saw the handshake of a lease's tcp connection succeed: calls may go on it."""
        if not pin.closed and not pin.ready:
            pin.ready = True
            log.info("connected to the leased worker of %r at %s", pin.service, pin.endpoint)

    def pin_disconnected(self, pin: Pin, now: float, why: str, final: bool = False) -> list[list[Any]]:
        """The twin saw a lease's tcp connection fail (a connection refused or timed out, a
        handshake refused, a drop, a peer that stopped acknowledging: a partition).  Before
        its handshake succeeded, that is noted when libzmq tries again (`PIN_CONNECT_S`
        bounds the wait) and gives the lease back at once when it will not (``final``: the
        worker refused our key, or one side is CurveZMQ and the other not).  After, it is
        `pin_link_lost`: what was on it goes through the broker (the twin first routes
        the replies that reached its socket before the drop).  Returns frames to send to the
        broker."""
        if pin.closed:
            return []
        if not pin.ready:
            pin.trouble = why
            if final:
                self.pin_broken(pin, now, why)
            else:
                self._pin_overdue(pin, now)
            return []
        return self.pin_link_lost(pin, now, why)

    def _pin_overdue(self, pin: Pin, now: float) -> None:
        """Give a tcp lease back if its handshake has not succeeded within PIN_CONNECT_S."""
        # From the client's return, if it was away (ClientCore.looking): nobody watched.
        if not pin.ready and not pin.closed and now - max(pin.opened, self.resumed_at) >= PIN_CONNECT_S:
            self.pin_broken(pin, now, f"no handshake within {PIN_CONNECT_S:g} s"
                            + (f"; last: {pin.trouble}" if pin.trouble else ""))

    def pins_overdue(self, now: float) -> None:
        """`_pin_overdue` for every lease still connecting (the twins call it with their
        heartbeats, so a lease no call asks for is given back all the same)."""
        for pin in list(self.pins.values()):
            if not pin.ready:
                self._pin_overdue(pin, now)

    def pin_link_lost(self, pin: Pin, now: float, why: str) -> list[list[Any]]:
        """The lease's local link (docs/protocol.md section 10.6) or its tcp connection
        (section 10.4, once its handshake had succeeded) closed under us: its worker stopped
        or died (the broker will say which), closed the connection itself (too many, a send
        that failed), or stopped acknowledging (a network partition: `wire.tcp_liveness`).  Nothing
        more comes on it, so the calls still on it go through the broker, after the broker's
        next heartbeat answer (`_park`: the worker's end may be a restart's, of which the
        broker's answer tells; their inputs are read-only in our memory: a retry is free, and
        a late reply of theirs is dropped), and a lease still in use is handed back
        (LEASE_END ``client_done``: the broker frees its slots, or ignores it if it ended
        the lease itself).  Returns frames to send to the broker (a heartbeat)."""
        if pin.closed:
            return []
        if not pin.ending:
            log.warning("the connection to the leased worker of %r closed (%s); back to the broker", pin.service,
                        why)
            self.pins_ended += 1
            self.ops.append(self._lease_end_frames(pin.service, pin.lease))
        return self._end_pin(pin, now, resend=True, park=True)

    def pin_goodbye(self) -> None:
        """Closing: LEASE_END (client_done) for every lease in use, then every connection closed
        (queued in `ops`)."""
        for pin in list(self.pins.values()):
            self.ops.append(self._lease_end_frames(pin.service, pin.lease))
        for pin in list(self.pin_all.values()):
            for call in list(pin.calls.values()):
                call.pin = None
            pin.calls.clear()
            self._close_pin(pin)
        self._asking.clear()
        self._ask_ids.clear()
