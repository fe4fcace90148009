"""Blocking client: the core (core.py) driven on the caller's own thread, which waits on its
sockets' descriptors (`broker.protocol.wire.Waiter`).

`Client` moves frames and waits; everything else (ids, packing, routing, slot lifetimes,
deadlines, liveness decisions) is `ClientCore`'s.  It mirrors `AsyncClient` (aio.py) method
for method.

Sockets: one DEALER to the broker carries every tensor request, every heartbeat and every
MMI question (so an MMI answer also tells that the broker has handled every request sent
before it).  A client of a broker on this host also binds a reply socket (`ReplyInbox`) and
names it in each request: a worker on this host sends the FINAL there, one hop instead of two
(docs/protocol.md section 8); both sockets feed the same `ClientCore.on_message`.  An opaque
request (`request()`) carries nothing to match its reply by, so it uses a short-lived socket
of its own.  With `pin=True` (or a stream's service pinned), one more DEALER per lease, on
its worker's direct socket (docs/protocol.md section 10; what goes where is decided by the
core, pins.py).

No thread: the client sends heartbeats and notices a silent broker only while one of its
calls waits (`pump`), which is what the caller's blocking calls do.  An ipc broker does not
count the silence in between against it (its connection is open: the process lives); a tcp
one does, after its client liveness window (docs/client.md).
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Any, Mapping

import zmq

from broker import protocol as P
from broker.protocol.link import LinkConn, LinkError
from broker.protocol.wire import NOBLOCK, TcpWatch, Waiter, recv_frames, send_frames, sock_events, touched, wait_ms

from .base import ClientBase, ReplyStreamBase
from .calls import Call, final_of_infer, mmi_answer, opaque_reply, parse_priority, resolve_transport
from .core import CLOSE_LINGER_S, LAST_LOOK_S, LIVENESS, PAUSED_S, ClientCore, close_linger, wait_limit
from .errors import BrokerUnreachable, DeadlineExceeded, InferenceError, InvalidInput
from .pins import PIN_CONNECT_S, PinClose, PinOpen, PinSend
from .sockets import (CLOSE_LINGER_MS, ReplyInbox, broker_dealer, context, curve_keys, dealer, descriptor_room, drain_unread, drop_lease_dealer,
                      drop_monitor, drop_socket, handshakes, IpcDiagnosis, lease_dealer, lease_events, open_link, redial,
                      refused_error, request_dealer, send_failure, tcp_options)
from .tensors import Result

#: the most seconds one drain of a lease's link waits for the rest of a message in pieces
#: that has begun to arrive (`Client._drain_link`): its pieces come as fast as they are read
LINK_PIECES_WAIT_S = 0.02

# resolve_transport and parse_priority are re-exported: they were importable from here.
__all__ = ["Client", "ReplyStream", "resolve_transport", "parse_priority"]

_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
log = logging.getLogger("client_sdk")
#: the broker connection's monitor in `_monitors` (the others are a lease's)
_BROKER = object()


_SHARED = ("this Client is in use by another thread: a Client is not thread-safe (one socket, one "
           "input pool); use one Client per thread, or one AsyncClient")
_NESTED = ("this Client is already in a call on this thread (from a signal handler?): its calls do not nest "
           "(the call interrupted is in the middle of its socket and its pool); in a handler, set a flag and act "
           "on it after the call, or use another Client there.  close() (and a handle's cancel()) may be called "
           "from a handler")
_CLOSED_WAITING = "the client was closed while this call was waiting"
_get_ident = threading.get_ident


def _inside(client) -> bool:
    """Whether this thread is inside a call of ``client`` now (a frame of a claiming wrapper
    of it is on the stack), asked only when its claim names this thread.  Not inside: the
    claim is stale, left by a KeyboardInterrupt (or any signal handler's exception) that
    came between the claim and the `try` that lets go of it, or inside that `finally`; it
    is this thread's, so the call takes it over.  Such a claim made every later call a
    "nested" refusal and close() a deferred no-op, for good (an interruption hunt: 99 in
    162,404 random Ctrl-Cs during small calls)."""
    f = inspect.currentframe().f_back.f_back  # past this and the wrapper asking
    while f is not None:
        if f.f_code in _CLAIMING and f.f_locals.get("self") is client:
            return True
        f = f.f_back
    return False


def _one_thread(method):
    """A `Client` method that refuses (InvalidInput) a thread other than the one inside the
    client now: two threads on one client interleave multipart messages on its socket and
    lose calls and pool slots.  It refuses a nested call of that thread too (a signal handler
    or a finalizer that runs while the thread is inside the client, in the middle of a send,
    a receive or a pool operation): the client's own steps call each other's undecorated
    parts.  The claim is one `dict.setdefault` (atomic under the GIL: no two threads both get
    in); the cost, a thread id, three dict operations and one attribute check.  A refusal
    asks first whether this is a forked child's copy (`Client._forked_claim`)."""
    def run(self, *args, **kw):
        tid = _get_ident()
        user = self._user
        if user.get(0) == tid and _inside(self):
            self._forked_claim()
            raise InvalidInput(_NESTED)
        if user.setdefault(0, tid) != tid:
            self._forked_claim()
            raise InvalidInput(_SHARED)
        try:
            return method(self, *args, **kw)
        finally:
            del user[0]
            if self._later:
                self._run_later()

    return functools.update_wrapper(run, method)


def _one_thread_or_later(method):
    """`_one_thread`, except that a nested call (a signal handler's `close()`, a reply
    handle's `cancel()` or one dropped by the garbage collector while the thread is inside
    the client) is not refused: it is done by the call it interrupted, as soon as that one
    is between two steps (`Client._later`), and a wait of it is woken to do so at once."""
    def run(self, *args, **kw):
        tid = _get_ident()
        user = self._user
        if (user.get(0) == tid and _inside(self)) or user.setdefault(0, tid) != tid:
            if self._core.forked():
                # A forked child's copy, claimed by a thread of the parent's that was inside
                # it at the fork (and is not in this process): close() lets go of the copy,
                # a handle's give-up only marks its call, as in any forked child.
                return method(self, *args, **kw)
            if user.get(0) != tid:
                raise InvalidInput(_SHARED)
            self._defer(functools.partial(method, self, *args, **kw))
            return None
        try:
            return method(self, *args, **kw)
        finally:
            del user[0]
            if self._later:
                self._run_later()

    return functools.update_wrapper(run, method)


def _wake_fd() -> int | None:
    """A descriptor a nested call writes to wake the client's wait (`Client._defer`); None
    where none can be had (then a wait notices at its next heartbeat or its end)."""
    try:
        return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    except (AttributeError, OSError):
        return None


def _let_go(waiter: Waiter, wake: list, core: ClientCore | None = None, socks: tuple = (),
            pins: dict | None = None, unclosed: list | None = None) -> None:
    """`Client._unwatch`: stop watching its sockets (wire's module-wide marks) and close its
    wake descriptor (`close()`, or a client dropped without it).  A client dropped unclosed
    gives back the output slots of the replies its sockets still hold, as `close()` does
    (`core`, its broker socket and inbox `socks`, its leases' sockets `pins`), and says so
    with a ResourceWarning naming its endpoint, as `AsyncClient` and Python's own files do
    (pyzmq's named only a socket); ``unclosed`` (the endpoint) is emptied by `close()`.  Not
    in a forked child's copy, nor at interpreter exit (not collected, only left open)."""
    if core is not None and not core.closed and not core.forked():
        if unclosed and threading.main_thread().is_alive():
            try:
                warnings.warn(f"unclosed Client ({unclosed[0]}): close it (client.close(), or with)",
                              ResourceWarning, stacklevel=3)
            except Exception:  # a finalizer never raises (warnings turned into errors: ignored, as here)
                pass
        try:
            drain_unread([*socks, *(pins.values() if pins else ())], core.release_unread)
        except Exception:  # a finalizer never raises
            pass
    waiter.close()
    fd = wake.pop() if wake else None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


class Client(ClientBase):
    """Blocking client for the inference broker.

    One DEALER socket; not thread-safe (use one client per thread, or `AsyncClient`).
    Results hold zero-copy views of shared memory: see `Result` and docs/client.md for
    their lifetime.

    A tcp endpoint is CurveZMQ: `server_key` is the broker's public certificate (path) or
    z85 key, `client_key` the path of this client's secret certificate (defaults:
    $ZMQ_INFER_SERVER_KEY, $ZMQ_INFER_CLIENT_KEY); `insecure=True` is plain tcp instead.
    Over tcp, tensors go inline and replies come through the broker (docs/security.md).
    `pin=True` (or a number of slots): pinned streams, requests straight to a leased worker
    of each service (docs/client.md, "Pinned streams"; client_sdk/pins.py); without it, only a
    `stream()`'s service is pinned (by default).
    """

    def __init__(self, endpoint: str, *, transport: str = "auto", timeout: float | None = 10.0,
                 pool_capacity: int = 256 << 20, heartbeat_interval: float | None = 1.0,
                 fallback_inline: bool = True, direct_reply: bool = True, restart_resends: int = 2,
                 server_key: str | bytes | None = None, client_key: str | None = None, insecure: bool = False,
                 pin: bool | int = False, max_inline_mb: float = 256, linger: float = CLOSE_LINGER_S):
        # A tcp broker: CurveZMQ keys (or an explicit insecure=True), inline tensors only.
        transport, direct_reply = tcp_options(endpoint, transport, direct_reply)
        self._user: dict[int, int] = {}  # {0: the thread inside the client now}: `_one_thread`
        self._core = ClientCore(endpoint, transport=transport, timeout=timeout, pool_capacity=pool_capacity,
                                heartbeat_interval=heartbeat_interval, fallback_inline=fallback_inline,
                                direct_reply=direct_reply, restart_resends=restart_resends, pin=pin,
                                max_inline_mb=max_inline_mb, linger=linger)
        self._core.endpoint_problem = IpcDiagnosis(endpoint)
        self._curve = curve_keys(endpoint, server_key, client_key, insecure)
        self._core.plain_tcp = self._curve is None and endpoint.startswith("tcp://")
        self._ctx = context(endpoint)
        # with the monitor of its handshakes (heartbeats on), attached before it connected
        self._sock, self._broker_monitor = broker_dealer(self._ctx, endpoint, self._curve, self._core.heartbeat_interval)
        # Over tcp, bytes of the broker's that are on their way count as its word (a large
        # message on a slow link: wire.TcpWatch).
        self._tcp = TcpWatch() if endpoint.startswith("tcp://") else None
        self._inbox = ReplyInbox.open(self._ctx) if self._core.direct_reply else None
        # Waited for by descriptor (wire.Waiter): the broker's socket, the inbox, a socket per lease.
        self._waiter = Waiter()
        self._waiter.add(self._sock)
        # What a nested call (a signal handler's close(), a handle dropped by the garbage
        # collector) leaves to the call it interrupted (`_one_thread_or_later`), and the
        # descriptor it writes to wake that call's wait.
        self._later: deque[Any] = deque()
        #: seconds this pump may still wait for the pieces of replies begun on leases' links
        #: (`_drain_link`); None between pumps
        self._piece_budget: float | None = None
        self._nested = False  # doing what a nested call left (`_do_later`)
        self._wake = _wake_fd()
        if self._wake is not None:
            self._waiter.add_fd(self._wake)
        # A client dropped without close(): its sockets are not held by the Waiter's marks
        # (wire's module-wide sets) for the life of the process, nor its wake descriptor open.
        self._pin_socks: dict[bytes, Any] = {}
        # The endpoint once made (below), emptied by close(): the finalizer's warning is for
        # clients dropped open, not for one whose __init__ raised.
        self._unclosed: list[str] = []
        self._unwatch = weakref.finalize(self, _let_go, self._waiter, [self._wake], self._core,
                                         (self._sock, self._inbox.sock if self._inbox is not None else None),
                                         self._pin_socks, self._unclosed)
        self._pending: deque[list[Any]] = deque()  # REQUESTs (resends) and CANCELs the socket refused, in order
        # pin=True or a stream's service: a DEALER per lease, on its worker's direct socket (pins.py)
        # (a near lease's is a LinkConn instead: the worker's local link, docs/protocol.md 10.6):
        # self._pin_socks, above (the finalizer's)
        self._pin_of: dict[Any, Any] = {}
        self._link_of: dict[int, LinkConn] = {}  # descriptor -> a lease's link, as the Waiter reports it
        self._monitors: dict[zmq.Socket, Any] = {}  # a tcp lease's connection monitor -> its Pin (or _BROKER)
        # The broker connection's handshakes (-> _BROKER): a new one heartbeats at once.
        if self._broker_monitor is not None:
            self._monitors[self._broker_monitor] = _BROKER
            self._waiter.add(self._broker_monitor)
        if self._inbox is not None:
            self._core.use_inbox(self._inbox.endpoint, descriptor_room)
            self._waiter.add(self._inbox.sock)
        hello = self._core.hello(time.monotonic())
        if hello is not None:
            self._send_soon(hello)
        self._unclosed.append(endpoint)

    # ---------------------------------------------------------------- requests

    def infer(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
              priority: Any = "normal", meta: Mapping[str, Any] | None = None, reply: str = "auto",
              traceparent: str | None = None) -> Result:
        """Run one request and return its FINAL outputs.  A service that streams its results
        (PARTIALs) and ends with an empty FINAL raises `NotSupported`: use `infer_stream`."""
        # What `infer_stream(...).result()` in a `with` block does, without the handle: this
        # is the hot path of a caller that sends one request at a time.  `_one_thread`, inline.
        tid = _get_ident()
        user = self._user
        if user.get(0) == tid and _inside(self):  # a signal handler's, while this thread is inside the client
            self._forked_claim()
            raise InvalidInput(_NESTED)
        if user.setdefault(0, tid) != tid:
            self._forked_claim()
            raise InvalidInput(_SHARED)
        try:
            return self._infer(service, inputs, timeout, priority, meta, reply, traceparent)
        finally:
            del user[0]
            if self._later:
                self._run_later()

    def _infer(self, service, inputs, timeout, priority, meta, reply, traceparent) -> Result:
        if self._core.pins:
            self._heed_lease_ends()
        call = self._core.new_call(service, inputs, timeout=timeout, priority=priority, meta=meta, reply=reply,
                                   traceparent=traceparent)
        self._send_call(call)
        partials = 0
        inbox = call.inbox
        last_look = False
        try:
            while True:
                # `_wait` without a limit
                while not inbox:
                    now = time.monotonic()
                    deadline = call.deadline
                    if deadline is None:
                        self._pump(None, now, inbox)
                    elif now < deadline:
                        self._pump(deadline - now, now, inbox)
                    elif now - deadline > PAUSED_S and not last_look:
                        last_look = True  # (core.PAUSED_S: we did not run when it passed)
                        self._last_look(inbox, now)
                    else:
                        raise self._core.deadline_error(call)
                kind, item = inbox.popleft()
                if kind == "final":
                    break
                if kind == "error":
                    raise item
                partials += 1  # a PARTIAL: released unread, as result() does
                item.release()
        except BaseException:
            # A deadline, a silent broker, a KeyboardInterrupt...: CANCEL is on its way to the
            # broker (or the leased worker) before the exception leaves.
            ClientBase.give_up(self, call)
            raise
        return final_of_infer(service, item, partials) if partials else item

    @_one_thread
    def infer_stream(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
                     priority: Any = "normal", meta: Mapping[str, Any] | None = None,
                     reply: str = "auto", traceparent: str | None = None) -> "ReplyStream":
        """Send one request now and return its handle: iterate it to get each PARTIAL as it
        arrives, then the FINAL, or call `result()` for the FINAL alone.  `cancel()` cancels
        the request at once (later `next()`/`result()` raise `Cancelled`); closing the handle
        (or leaving a `with` block) before the FINAL cancels it too.  `timeout` covers the
        whole exchange.
        `traceparent`: a W3C trace context (``00-<32 hex trace id>-<16 hex span id>-<2 hex
        flags>``) carried to the broker and the worker, whose log lines and spans name its
        trace id (docs/operations.md, "Logs and traces"); one that does not parse is ignored."""
        if self._core.pins:  # `prepare`'s
            self._heed_lease_ends()
        call = self._core.new_call(service, inputs, timeout=timeout, priority=priority, meta=meta, reply=reply,
                                   traceparent=traceparent)
        self._send_call(call)
        return ReplyStream(self, call)

    def request(self, service: str, frames: list[bytes], timeout: float | None = None) -> list[bytes]:
        """Send a plain MDP request (opaque body frames) and return the FINAL's body frames.

        Uses a socket of its own (see the module docstring); on timeout it says DISCONNECT on
        it, which drops the request at the broker if it is still queued."""
        out = self._core.opaque_frames(service, frames)
        limit = self._core.timeout_of(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        # Over tcp with keys, the socket's handshakes are watched: one the broker refuses for
        # good (a key removed from its allow-list since the client connected) fails the call
        # at once (`sockets.refused_error`).
        sock, monitor = (request_dealer(self._ctx, self.endpoint, self._curve, self._core.heartbeat_interval)
                         if self._curve is not None else (dealer(self._ctx, self.endpoint, self._curve), None))
        poller = None
        if monitor is not None:
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
        try:
            self._send_request(sock, monitor, out, deadline, service, limit)
            while True:
                # Whole milliseconds, rounded up: truncated, the deadline's last fraction of
                # one would be a poll(0), and the call would fail before its time.  And the
                # clock is asked again after a poll that found nothing: libzmq's own is
                # coarse, and its poll may end a little before the wait.
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._heed_broker_monitor()
                    raise self._core.opaque_deadline_error(service, limit)
                if poller is not None:
                    ready = dict(poller.poll(wait_ms(left)))
                    if monitor in ready:
                        # (This connection's word, for this request alone: the client's own
                        # connection has a word of its own, and this may be another thread.)
                        _, last, final = handshakes(monitor)
                        if final and last:
                            raise refused_error(self.endpoint, last)
                    if sock not in ready:
                        continue
                elif not sock.poll(wait_ms(left), zmq.POLLIN):
                    continue
                done, body = opaque_reply(sock.recv_multipart(), service)
                if done:
                    return body
        finally:
            drop_monitor(sock, monitor)
            drop_socket(sock)

    def _send_request(self, sock: zmq.Socket, monitor: zmq.Socket | None, out: list[Any], deadline: float | None,
                      service: str, limit: float | None) -> None:
        """Send a plain `request`'s message on its own socket by its deadline.  A blocking
        send waited for ever once the broker had refused that connection's handshake before
        it ran (libzmq gives a refused endpoint up, and a DEALER without a peer blocks): a
        loaded machine's test process, descheduled between its connect and its send, hung
        there (a full run)."""
        wait = zmq.Poller()
        wait.register(sock, zmq.POLLOUT)
        if monitor is not None:
            wait.register(monitor, zmq.POLLIN)
        while True:
            try:
                sock.send_multipart(out, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._heed_broker_monitor()
                raise self._core.unsent_deadline_error(f"no reply from service {service!r}", limit, False)
            ready = dict(wait.poll(wait_ms(left)))
            if monitor is not None and monitor in ready:
                _, last, final = handshakes(monitor)
                if final and last:
                    raise refused_error(self.endpoint, last)

    def _look_again(self) -> None:
        """The broker refuses this client (core `shut_out`): read its monitor's word before a
        call is made (a dial again due, a handshake's success unread), by the thread inside
        the client (the calls that ask are `_one_thread`'s)."""
        monitor = self._broker_monitor
        if monitor is not None:
            self._on_monitor(monitor)
            touched(monitor)

    def _heed_broker_monitor(self) -> None:
        """Read what the broker connection's monitor said (a refused handshake), for the error
        of a call that did not wait on the client's own socket (`request`): that socket's
        refusal is this one's, and unread it said "raise `timeout`, lower the load" to a
        client the broker refuses.  Only by the thread that can claim the client: another
        thread's call leaves the monitor alone."""
        monitor = self._broker_monitor
        if monitor is None or self._core.closed:
            return
        user, tid = self._user, _get_ident()
        if 0 in user or user.setdefault(0, tid) != tid:
            return
        try:
            self._on_monitor(monitor)
            touched(monitor)
        finally:
            del user[0]

    @_one_thread
    def mmi_service(self, name: str, timeout: float | None = None) -> bool:
        """Whether the broker knows a worker for `name` (MMI, RFC 8).

        Sent on the client's own socket, so it also works as a barrier: the broker handles
        one client's messages in order, and once this answer is back every request sent
        before it has been queued or dispatched."""
        core = self._core
        q = core.mmi_question(name)
        limit = core.timeout_of(timeout)
        stop = None if limit is None else time.monotonic() + limit
        if core.shut_out is not None:
            self._look_again()
            if core.shut_out is not None:
                raise core.shut_out(None)  # the broker refuses this client's handshake (core.refused_for_good)
        self._send(q.frames, stop, limit=limit)
        core.expect_mmi(q, time.monotonic())
        try:
            while q.answer is None:
                if q.error is not None:  # the broker's silence (core.fail_unreachable)
                    raise q.error
                now = time.monotonic()
                if stop is not None and now >= stop:
                    raise self._core.mmi_deadline_error(limit)
                self._pump(None if stop is None else stop - now, now)
        finally:
            if q.answer is None:
                q.abandoned = True  # its late answer is consumed and dropped
        return mmi_answer(q.answer, name)

    @_one_thread
    def stream(self, service: str, *, latest_wins: bool = True, max_in_flight: int = 2,
               timeout: float | None = None, priority: Any = "normal",
               meta: Mapping[str, Any] | None = None, reply: str = "auto", pin: bool | None = None):
        """A frame stream for interactive (AR) use; see `client_sdk.stream.Stream`.
        Pinned streams (docs/client.md): `pin=None` (the default) pins the service when this
        client can (heartbeats on): its requests to it go straight to a leased worker once
        the broker grants a lease, through the broker until then or when none can be had
        (no `--direct` worker, a plain MDP broker, tcp); `pin=False`: every frame through
        the broker; `pin=True`: pin, InvalidInput with heartbeats off.  A `pin=True` client
        pins every service anyway."""
        from .stream import Stream

        # As infer_stream: a closed (or forked) client, and options its frames could not
        # carry, say so here, not at every send().
        self._core.check_stream_options(service, timeout=timeout, priority=priority, meta=meta, reply=reply)
        may_pin = self._core.stream_pins(pin)
        st = Stream(self, service, latest_wins=latest_wins, max_in_flight=max_in_flight,
                    timeout=timeout, priority=priority, meta=meta, reply=reply, pin=may_pin)
        if may_pin:
            # its service asks for a lease; a stream it counted ends that lease when it closes
            st._pinned = self._core.pin_on_demand(service, st.max_in_flight)
        return st

    @_one_thread_or_later
    def stream_closed(self, service: str) -> None:
        """A stream that pinned `service` closed (client_sdk.stream): after the last one its
        lease ends."""
        if self._core.closed:
            return
        self._core.pin_release(service, time.monotonic())
        if self._core.ops:
            self._run_ops()

    # ---------------------------------------------------------------- seams for streams
    # Small steps that `infer` is made of, for code that keeps several calls in flight on
    # one client (client_sdk.stream).  AsyncClient has the same four.

    @_one_thread
    def prepare(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
                priority: Any = "normal", meta: Mapping[str, Any] | None = None, reply: str = "auto",
                copy_inline: bool = False, traceparent: str | None = None) -> Call:
        """Check the arguments and pack the inputs into a `Call`, without sending it.
        `copy_inline` makes inline frames private copies (the caller may then reuse its
        arrays at once).  A prepared call must end in `submit` or `give_up`: it may hold
        input slots."""
        if self._core.pins:
            self._heed_lease_ends()
        return self._core.new_call(service, inputs, timeout=timeout, priority=priority, meta=meta,
                                   reply=reply, copy_inline=copy_inline, traceparent=traceparent)

    def _heed_lease_ends(self) -> None:
        """Before a call picks its route: read what the broker sent meanwhile, if anything.
        This client reads only while a call waits, so between calls a LEASE_END (the worker
        stopping) can sit unread for as long as the caller likes, while the client still
        counts itself pinned; a call sent on that lease after the worker has exited would wait
        for its deadline (nobody is at the other end, and a stopping lease's calls are not
        resent).  Free when the broker's socket is quiet and nothing came (one poll of its
        descriptor; wire.Waiter)."""
        if self._waiter.has_message(self._sock):
            self._pump_quick()

    @_one_thread
    def submit(self, call: Call, timeout: float | None = 0.0) -> bool:
        """Register a prepared call and send its REQUEST, waiting at most `timeout` seconds
        (None: as long as it takes) for the socket to take it; its deadline starts now.
        False when the socket did not take it (the broker is not reading: high-water mark);
        the call is then unsent again, to be submitted later or given up."""
        core = self._core
        if core.closed or core.forked():  # (its socket is closed, or the parent's)
            core.check_open()
        core.check_submittable(call)
        sock = self._sock
        if timeout != 0 and not sock_events(sock) & _POLLOUT:
            self._wait_writable(sock, max(1, wait_ms(timeout)) if timeout is not None else -1)
            # A give_up() of this call left to the wait (a signal handler's, a stream's
            # close() there) discarded it and freed its inputs: it must not go now.
            core.check_submittable(call)
        now = time.monotonic()
        call.t_submit = call.t_submit or now
        try:
            # (In the try, as `_send_call`'s: an interrupt while the frames were made left the
            # call registered and never sent, for good.)
            if self._core.shut_out is not None:
                self._look_again()
            frames = self._core.request_frames(call, now)
            if self._core.ops:
                self._run_ops()
            if frames is None:  # answered already (core.refused_for_good)
                return True
            if call.pin is not None:
                sock = self._sock_for(call)
                if type(sock) is LinkConn:
                    if sock.send(frames):
                        self._core.last_send = time.monotonic()
                        return True
                    self._core.reroute(call)  # the link cannot take it now: the broker's
                    sock = self._sock
            send_frames(sock, frames, NOBLOCK)
        except zmq.Again:
            self._core.unregister(call)
            return False
        except BaseException as e:
            self._core.discard_unsent(call)
            typed = send_failure(e, self.endpoint)  # out of descriptors, memory or threads
            if typed is not None:
                raise typed from None
            raise
        self._core.last_send = time.monotonic()
        return True

    @_one_thread
    def pump(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: until something arrives) for messages from the
        broker or a worker, and route each to its call's inbox.  Returns after the first
        batch of traffic, and after at most one heartbeat interval (and may return earlier
        with nothing routed, on a wake-up that brought no message: loop on your own deadline).  While calls wait it also
        does what AsyncClient's heartbeat task does: sends a HEARTBEAT when one is due, and
        fails (in their inbox) the calls the broker has been silent on for too long.  A pump
        that finds a reply begun on a lease's local link waits for its remaining pieces, up to
        `LINK_PIECES_WAIT_S` (20 ms) in all, `timeout=0` included (a stream's `send()` too)."""
        self._pump(wait_limit(timeout), time.monotonic())

    def _last_look(self, inbox: Any, now: float) -> None:
        """A call's deadline passed while this process was not running (core.PAUSED_S):
        its sockets are looked at for up to `LAST_LOOK_S`, until ``inbox`` (the call's)
        holds something; a reply still inside libzmq's I/O thread, which runs again only
        now, is routed (another call's reply or a heartbeat answer may come first)."""
        end = now + LAST_LOOK_S
        while not inbox:
            now = time.monotonic()
            if now >= end:
                return
            self._pump(end - now, now, inbox)

    def _pump_quick(self) -> None:
        """`pump(0)` that never waits, not even for the rest of a reply begun on a lease's
        link (the look before a call picks its route, `_heed_lease_ends`)."""
        self._piece_budget = 0.0
        try:
            self._pump(0.0, time.monotonic())
        finally:
            self._piece_budget = None

    def _pump(self, timeout: float | None, now: float, until: Any = None) -> None:
        """`pump` at `now`; ``until``: `_drain`'s."""
        if self._piece_budget is None:  # (one budget for the pass, whatever links it reads)
            self._piece_budget = LINK_PIECES_WAIT_S
            try:
                return self._pump(timeout, now, until)
            finally:
                self._piece_budget = None
        core = self._core
        if self._later:  # left by a nested call (a signal handler's close(), ...)
            self._do_later()
            if core.closed:
                raise InferenceError(_CLOSED_WAITING, code=None)
        if core.closed or core.forked():  # a forked child's copy: its sockets are the parent's (it would spin)
            core.check_open()
        core.looking(now)
        if core.redial_at is not None and now >= core.redial_at:
            self._redial(now)
        if self._pending:
            self._flush_pending()
        hb = core.heartbeat_period
        if hb is not None:
            # The cheap tests first: heartbeat_due and fail_unreachable ask the same and more.
            if now - core.last_heartbeat >= hb and core.heartbeat_due(now):
                self._send_soon(core.heartbeat(now))
                if core.ops:  # a tcp lease given back (pins_overdue)
                    self._run_ops()
            if now - core.last_recv > hb and self._tcp is not None:
                core.heard_bytes(self._tcp.look(now))  # a long message still crossing
            if now - core.last_recv > LIVENESS * hb:
                # Silent that long, in our eyes: first read what has arrived meanwhile (a
                # caller may come back late, and a drain may have stopped at its budget), so
                # that a reply sitting in a socket is not failed as the broker's silence.
                ready = self._waiter.wait(0)
                if ready:
                    self._drain(ready, always_broker=True)  # the broker's word first, now
                    timeout = 0  # what it routed is for the callers now, not after a wait
                if core.fail_unreachable(now):
                    timeout = 0  # their callers must hear it now
            if timeout is None or timeout > hb:
                timeout = hb
        if core.redial_at is not None and (timeout is None or now + timeout > core.redial_at):
            timeout = core.redial_at - now
        if timeout is None:
            ms = -1
        elif timeout > 0:
            # To the microsecond (the Waiter sleeps a fraction of a millisecond in select):
            # rounded up to whole milliseconds, a call's last wait ended up to 1 ms past its
            # deadline and took a result that came in that overshoot, one the broker counted
            # `deadline_exceeded` (the game-server audit: 1-3 % of calls with 2-20 ms timeouts).
            ms = timeout * 1000.0
        else:
            ms = 0
        ready = self._waiter.wait(ms)
        if self._later:  # a nested call came while it waited (and woke it: `_defer`)
            self._do_later()
            if core.closed:
                raise InferenceError(_CLOSED_WAITING, code=None)
        if ready:
            self._drain(ready, until=until)

    def _wait_writable(self, sock: zmq.Socket, ms: int) -> None:
        """Wait up to ``ms`` (-1: for good) for ``sock`` to take a message (its queue is full:
        the broker does not read), or for a nested call (a signal handler's close()) that
        woke us: that one is done now, and a close ends this call."""
        items = [(sock, zmq.POLLOUT)]
        if self._wake is not None:
            items.append((self._wake, zmq.POLLIN))
        zmq.zmq_poll(items, ms)
        touched(sock)
        if self._later:
            self._do_later()
            if self._core.closed:
                raise InferenceError(_CLOSED_WAITING, code=None) from None

    # ---------------------------------------------------------------- nested calls

    def _forked_claim(self) -> None:
        """Before refusing a call as nested or as another thread's: in a forked child, the
        claim found is a thread of the parent's that was inside the client at the fork (only
        the forking thread lives on in the child), and the call is refused as any call on a
        forked child's copy is (`check_open`: InvalidInput, "... which forked this one").
        Asked only on a refusal: a call that gets in pays nothing more."""
        if self._core.forked():
            self._core.check_open()

    def _defer(self, action: Any) -> None:
        """A nested call (`_one_thread_or_later`): left to the call it interrupted, whose wait
        (if it waits) is woken now.  A close of a closed client is nothing to do."""
        if self._core.closed:
            return
        self._later.append(action)
        wake = self._wake
        if wake is not None:
            try:
                os.eventfd_write(wake, 1)
            except OSError:  # (full: already woken)
                pass

    def _do_later(self) -> None:
        """Do what nested calls left (the client is claimed by this thread).  The wake
        descriptor is read before each look, so that it is never left signalled with nothing
        to do (a wait would spin)."""
        later = self._later
        while True:
            wake = self._wake
            if wake is not None:
                try:
                    os.eventfd_read(wake)
                except OSError:  # (nothing written: BlockingIOError)
                    pass
            if not later:
                return
            while later:
                action = later.popleft()
                try:
                    self._nested = True  # (a deferred close() does not linger: `close`)
                    action()
                except Exception:  # the nested caller's (it returned long ago), not this call's
                    log.exception("error in a client call deferred from a signal handler or a finalizer")
                finally:
                    self._nested = False

    def _run_later(self) -> None:
        """`_do_later` after the outermost call returned (what a nested call left after that
        call's last wait, or in a call that does not wait): claims the client again, unless
        another thread got in first (its call's end does it then).  Round again if a nested
        call came between the last look and the release (found by review)."""
        tid = _get_ident()
        user = self._user
        while self._later:
            if user.setdefault(0, tid) != tid:
                return
            try:
                self._do_later()
            finally:
                del user[0]

    # ---------------------------------------------------------------- socket work

    def _send(self, frames: list[Any], deadline: float | None, call: Call | None = None,
              limit: float | None = None) -> None:
        """Send on the broker's socket, waiting while its queue is full (the broker does not
        read, or refuses our handshake), up to ``deadline``: then `DeadlineExceeded` for
        ``call`` (else for an MMI question of timeout ``limit``), as `AsyncClient` raises for
        a message it queued; `BrokerUnreachable` at the broker's liveness window before
        that, as `AsyncClient` does (docs/client.md, "Errors")."""
        sock = self._sock
        start = None  # when the socket first refused it
        while True:
            try:
                send_frames(sock, frames, NOBLOCK)
                self._core.last_send = time.monotonic()
                return
            except zmq.Again:
                # High-water mark reached: the broker is not reading, or (tcp) there is no
                # connection: libzmq gave it up at a refused handshake (`_redial`).
                if self._later:  # a signal handler's close() meanwhile: this send is moot
                    self._do_later()
                    if self._core.closed:
                        raise InferenceError(_CLOSED_WAITING, code=None) from None
                core = self._core
                if self._broker_monitor is not None:
                    self._on_monitor(self._broker_monitor)  # a refusal not read yet: dialled again
                    touched(self._broker_monitor)
                now = time.monotonic()
                if core.redial_at is not None and now >= core.redial_at:
                    self._redial(now)
                    continue
                if start is None:
                    start = now
                why = (f"it refuses this client's handshake: {core.refused}" if core.refused
                       else "its queue is full")
                if deadline is not None and now >= deadline:
                    if call is not None:
                        raise core.unsent_deadline_error(f"no reply from service {call.service!r}", call.timeout,
                                                         not core.refused, call.id or None) from None
                    raise core.unsent_deadline_error("no MMI answer from the broker", limit, not core.refused) from None
                wait = 1000 if deadline is None else max(1, min(wait_ms(deadline - now), 1000))
                hb = core.heartbeat_interval
                if hb is not None:
                    # The broker's liveness window holds here too, as for a call that waits
                    # for its reply (`_pump`): a call whose REQUEST the socket would not take
                    # waited for its whole timeout, and for ever with none (the timeouts
                    # hunt; AsyncClient queues it and fails it at the window).  What the
                    # broker said meanwhile is read first: its word counts.
                    core.looking(now)
                    window = LIVENESS * hb
                    if now - max(core.last_recv, start, core.resumed_at) > window:
                        ready = self._waiter.wait(0)
                        if ready:
                            self._drain(ready, always_broker=True)
                        silence = now - max(core.last_recv, start, core.resumed_at)
                        if silence > window:
                            raise BrokerUnreachable(
                                f"cannot send to the broker at {self.endpoint}: {why}, and it has not answered "
                                f"anything, not even heartbeats, for {silence:.1f}s") from None
                    left = max(core.last_recv, start, core.resumed_at) + window - now
                    wait = max(1, min(wait, math.ceil(left * 1000), math.ceil(core.heartbeat_period * 1000)))
                if core.redial_at is not None:
                    wait = max(1, min(wait, int((core.redial_at - now) * 1000 + 0.999)))
                self._wait_writable(sock, wait)

    def _send_call(self, call: Call) -> None:
        core = self._core
        try:
            # (In the try: a KeyboardInterrupt while the frames are made, or a LEASE sent,
            # left the call registered and never sent, in flight for good with its input
            # slot and, pinned, a lease slot: the interruption hunt.)
            if core.shut_out is not None:
                self._look_again()
            frames = core.request_frames(call, time.monotonic())
            if core.ops:
                self._run_ops()
            if frames is None:  # answered already (core.refused_for_good)
                return
            pin = call.pin
            if pin is not None:
                # On its lease's connection, unless that one cannot take it now (what
                # `_sock_for` asks EVENTS for, learnt from the send itself): then the call is
                # the broker's.
                sock = self._pin_socks.get(pin.lease)
                if type(sock) is LinkConn:
                    if sock.send(frames):  # False: full, gone, or larger than a datagram
                        core.last_send = time.monotonic()
                        return
                elif sock is not None:
                    try:
                        send_frames(sock, frames, NOBLOCK)
                        core.last_send = time.monotonic()
                        return
                    except zmq.Again:
                        pass
                core.reroute(call)
            self._send(frames, call.deadline, call)
        except BaseException as e:
            # Also a signal handler's exception as the request went out (wire.send_frames
            # left the socket at a message boundary; the request went out whole, short of a
            # frame, or not at all): forgotten, its input slots freed.  Should it have gone
            # out, a worker reading those slots finds them freed (their generation moved on)
            # and its answer is a stray, released.  Out of descriptors, memory or threads
            # (even for a copy of its frames): a typed error that says so.
            core.discard_unsent(call)
            typed = send_failure(e, self.endpoint)
            if typed is not None:
                raise typed from None
            raise

    def _send_soon(self, frames: list[Any] | None) -> None:
        if frames is None:
            return
        keep = frames[1] != P.C_HEARTBEAT
        if keep and self._pending:
            # Keep the order behind what already waits: a CANCEL must not overtake the
            # REQUEST (a resend after a restart) it cancels.
            self._pending.append(frames)
            self._flush_pending()
            return
        try:
            send_frames(self._sock, frames, NOBLOCK)
            self._core.last_send = time.monotonic()
        except zmq.Again:
            # A full queue (the broker not reading): a request (a resend after a restart) or a
            # CANCEL must not be lost, so it waits for the next pump (a later call of this
            # client), or is made moot by close()'s DISCONNECT; a heartbeat may be dropped.
            if keep:
                self._pending.append(frames)
        except zmq.ZMQError as e:  # closed: nothing will be delivered anyway
            if send_failure(e, self.endpoint) is not None:
                log.warning("could not send to the broker: %s (this process is out of descriptors or memory)", e)
        except Exception as e:
            # Out of memory or threads (wire.send_frames left the socket at a message
            # boundary): dropped, as a closed socket's; a call it was for waits for its deadline.
            if send_failure(e, self.endpoint) is None:
                raise
            log.warning("could not send to the broker: %s: %s (this process is out of memory or threads)",
                        type(e).__name__, e)

    def _flush_pending(self) -> None:
        pending = self._pending
        while pending:
            try:
                send_frames(self._sock, pending[0], NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                pending.clear()
                return
            except Exception as e:  # out of memory or threads: dropped (see _send_soon)
                if send_failure(e, self.endpoint) is None:
                    raise
                log.warning("could not send to the broker: %s: %s (this process is out of memory or threads)",
                            type(e).__name__, e)
            pending.popleft()
            self._core.last_send = time.monotonic()

    def _drain(self, ready: list | None = None, always_broker: bool = False, until: Any = None) -> None:
        # EVENTS rather than recv(NOBLOCK) until zmq.Again: an exception per wake-up costs
        # more than the rest of the client's work on a small request.  `ready`: the sockets
        # the Waiter found holding a message (each socket asked costs a syscall pair);
        # None: every socket.  Those hold a whole message (the Waiter asked EVENTS), so the
        # first read needs no question; it does not wait all the same, in case something
        # read that socket meanwhile (cheap insurance: nested calls are refused now).  The
        # last question of each socket (nothing left) leaves it quiet: the next wait need
        # not ask again.
        # Every socket is read (up to a budget of 256 messages each), the broker's last: a
        # LEASE_END that says "resend" must find the replies that already came on its lease
        # routed (or it would send them again), so a pass in which a reply socket ran out
        # of budget leaves the broker's socket for the next one (unless ``always_broker``:
        # the broker has seemed silent so long that its word cannot wait).
        # ``until``: a caller's inbox (`infer`'s); once a message from the broker's socket
        # routed something into it, that socket is not asked whether more is queued: what
        # is left is read by the next pass (the Waiter asks a socket read without a last
        # question before it sleeps), and a caller that sends one request at a time saves a
        # syscall pair per request.  The broker's socket is read last, so the pass ends
        # there; reply sockets are drained as always (their order before the broker's word).
        core = self._core
        pins = self._pin_of
        monitors = self._monitors
        tcp = self._tcp
        items = [*self._waiter.sockets(), *self._link_of] if ready is None else ready
        capped = False
        if len(items) > 1 and items[0] is self._sock:
            items = [*items[1:], items[0]]
        whole = ready is None or self._sock in items  # the broker's word comes after every reply
        for sock in items:
            if type(sock) is int:  # a lease's local link (the Waiter's plain descriptors)
                if not self._drain_link(sock, whole):
                    capped = True
                continue
            if monitors and sock in monitors:  # a tcp lease's connection came up or went down
                self._on_monitor(sock)
                continue
            direct = sock is not self._sock
            pin = pins.get(sock) if pins else None
            if capped and sock is self._sock and not always_broker:
                continue  # a lease's replies are left to read: the broker's LEASE_END waits for them
            readable = ready is not None
            most = 256  # each socket its own budget: a busy reply socket does not starve the rest
            # a lease's socket may close meanwhile
            while most and not sock.closed and (readable or sock_events(sock) & _POLLIN):
                most -= 1
                try:
                    frames = recv_frames(sock, NOBLOCK)
                except zmq.Again:
                    break
                if tcp is not None and not direct:
                    tcp.note(frames[0])  # the connection the broker's word comes on
                for out in core.on_message(frames, time.monotonic(), direct, pin):
                    self._send_soon(out)
                readable = False
                if until and not direct:
                    break
            if not most and direct:
                capped = True
        if core.ops:  # after the loop: it may open and close the sockets waited for
            self._run_ops()

    def _drain_link(self, fd: int, whole: bool) -> bool:
        """Read what a lease's link holds: everything (256 messages at most; False when that
        budget ran out) when ``whole``, else one message (the next wait finds the rest: the
        descriptor is level-triggered, and a read that finds nothing costs an exception)."""
        link = self._link_of.get(fd)
        if link is None:
            return True
        core = self._core
        pin = self._pin_of.get(link)
        n = 256 if whole else 1
        while n > 0:
            try:
                frames = link.recv()
                if frames is None and link.partial and self._piece_budget:
                    # A message in pieces has begun: the worker writes its next piece as soon as
                    # this one is read, so it is waited for here, briefly, rather than at the
                    # next pump.  A 2 MB reply is ten socket buffers: polled every 33 ms (a
                    # camera loop's recv(timeout=0)), it took ten polls, 300 ms, where the
                    # brokered path took 35 (the streams audit).
                    # At most LINK_PIECES_WAIT_S a pump, whatever links it reads; none for a
                    # pump that must not wait (`_pump_quick`).
                    t0 = time.monotonic()
                    ready = link.readable_within(self._piece_budget)
                    self._piece_budget = max(0.0, self._piece_budget - (time.monotonic() - t0))
                    if ready:
                        continue
            except (EOFError, LinkError) as e:
                # The worker closed it (it stopped or died) or it broke: what was on it goes
                # through the broker (pins.py, pin_link_lost).
                self._link_closed(link)
                if pin is not None:
                    for out in core.pin_link_lost(pin, time.monotonic(), str(e)):
                        self._send_soon(out)
                return True
            if frames is None:
                return True
            n -= 1
            for out in core.on_message(frames, time.monotonic(), True, pin):
                self._send_soon(out)
        return False

    def _link_closed(self, link: LinkConn) -> None:
        fd = link.fileno()
        if self._link_of.get(fd) is link:  # (a closed link's number may be another's by now)
            del self._link_of[fd]
            self._waiter.remove(fd)
        link.close()

    # ---------------------------------------------------------------- pinned streams

    def _run_ops(self) -> None:
        ops = self._core.ops
        while ops:
            op = ops.popleft()
            kind = type(op)
            if kind is list:
                self._send_soon(op)
            elif kind is PinSend:
                sock = self._pin_socks.get(op.pin.lease)
                if type(sock) is LinkConn:
                    sock.send(op.frames)  # a CANCEL the worker cannot take: its FINAL still comes
                elif sock is not None:
                    try:
                        send_frames(sock, op.frames, NOBLOCK)
                    except zmq.ZMQError:  # a CANCEL the worker cannot take: its FINAL still comes
                        pass
            elif kind is PinOpen:
                self._pin_open(op.pin, op.hello)
            elif kind is PinClose:
                sock = self._pin_socks.pop(op.pin.lease, None)
                if type(sock) is LinkConn:
                    del self._pin_of[sock]
                    sock.send(P.client_disconnect())
                    self._link_closed(sock)
                elif sock is not None:
                    del self._pin_of[sock]
                    self._waiter.remove(sock)
                    monitor = self._monitor_of(op.pin)
                    if monitor is not None:
                        del self._monitors[monitor]
                        self._waiter.remove(monitor)
                    drop_lease_dealer(sock, monitor)

    def _redial(self, now: float) -> None:
        """Dial the broker again: libzmq gave its endpoint up at a refused handshake
        (core.REDIAL_S).  What was queued on the lost connection went with it; the broker's
        answer to the next heartbeat names the new one, and the calls still waiting are sent
        again (core.py, `_on_broker_instance`)."""
        self._core.redialed(now)
        try:
            redial(self._sock, self.endpoint)
        except zmq.ZMQError as e:  # out of descriptors, say: tried again at the next refusal or call
            log.warning("could not dial the broker at %s again: %s", self.endpoint, e)

    def _monitor_of(self, pin: Any) -> zmq.Socket | None:
        for monitor, p in self._monitors.items():
            if p is pin:
                return monitor
        return None

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        """A tcp lease's connection reported (pins.py: pin_connected, pin_disconnected), or
        the broker's made a handshake (a new connection: its name is asked for at once)."""
        pin = self._monitors.get(monitor)
        core = self._core
        if pin is _BROKER:
            ups, last, final = handshakes(monitor)
            now = time.monotonic()
            core.broker_said(last, now, final, ups)
            if final and last:
                core.refused_for_good(lambda rid: refused_error(self.endpoint, last, None, rid), now)
            if core.redial_at is not None and now >= core.redial_at:
                self._redial(now)
            if ups and not core.closed and core.heartbeat_interval is not None:
                self._send_soon(core.heartbeat(now))
            return
        for up, final, why in lease_events(monitor):
            if pin is None or pin.closed:
                break
            if up:
                core.pin_connected(pin)
                continue
            if pin.ready:
                # Replies that arrived before the drop sit whole in the socket: they are
                # those calls' answers, to route before the rest go through the broker.
                sock = self._pin_socks.get(pin.lease)
                while sock is not None and not sock.closed and sock_events(sock) & _POLLIN:
                    for out in core.on_message(recv_frames(sock, NOBLOCK), time.monotonic(), True, pin):
                        self._send_soon(out)
            for out in core.pin_disconnected(pin, time.monotonic(), why, final):
                self._send_soon(out)

    def _pin_open(self, pin: Any, hello: list[Any]) -> None:
        link = open_link(pin, hello)
        if link is not None:
            self._pin_socks[pin.lease] = link
            self._pin_of[link] = pin
            self._link_of[link.fileno()] = link
            self._waiter.add_fd(link.fileno())
            return
        sock = monitor = None
        try:
            sock, monitor = lease_dealer(self._ctx, pin, self._curve, PIN_CONNECT_S, self._core.heartbeat_period)
            send_frames(sock, hello, NOBLOCK)  # queued until connected: the first thing the worker reads
        except (InvalidInput, zmq.ZMQError) as e:
            if sock is not None:
                drop_lease_dealer(sock, monitor)
            self._core.pin_broken(pin, time.monotonic(), str(e))
            if self._core.ops:
                self._run_ops()
            return
        self._pin_socks[pin.lease] = sock
        self._pin_of[sock] = pin
        self._waiter.add(sock)
        if monitor is not None:
            self._monitors[monitor] = pin
            self._waiter.add(monitor)

    def _sock_for(self, call: Call) -> zmq.Socket:
        """The socket for a pinned call: its lease's, or the broker's when that one cannot
        take it now (the call is then the broker's)."""
        sock = self._pin_socks.get(call.pin.lease)
        if type(sock) is LinkConn:
            if not sock.closed:
                return sock
        elif sock is not None and sock_events(sock) & _POLLOUT:
            return sock
        self._core.reroute(call)
        return self._sock

    def _wait(self, call: Call, limit: float | None = None) -> tuple[str, Any]:
        """Next item for `call`.  Raises DeadlineExceeded at the call's deadline and
        TimeoutError after `limit` seconds (the call stays in flight); a silent broker
        arrives as an error item (see `pump`)."""
        stop = None if limit is None else time.monotonic() + limit
        looked = False  # a limit of 0 still routes what has already arrived
        last_look = False
        while not call.inbox:
            now = time.monotonic()
            if call.deadline is not None and now >= call.deadline:
                if now - call.deadline > PAUSED_S and not last_look:
                    last_look = True  # (core.PAUSED_S: we did not run when it passed)
                    self._last_look(call.inbox, now)
                    continue
                raise self._core.deadline_error(call)
            if stop is not None and now >= stop and looked:
                raise TimeoutError(f"no result within {limit:g}s; the request is still in flight")
            ends = [t for t in (call.deadline, stop) if t is not None]
            self.pump(max(0.0, min(ends) - now) if ends else None)
            looked = True
        return call.inbox.popleft()

    # ---------------------------------------------------------------- lifetime

    @_one_thread_or_later
    def close(self, linger: float | None = None) -> None:
        """Cancel what is in flight and wait up to `linger` seconds (None: the client's own,
        1 s by default) for the answers that may name output slots, releasing them; then tell
        the broker we are leaving, close the sockets, unlink the input pool (docs/client.md,
        "Closing with requests in flight").  Results still alive stay readable; their output
        slots go back as they are dropped.  In a forked child, only this copy is let go of
        (the sockets are the parent's).

        From a signal handler that runs while this thread is inside a call of the client (a
        SIGTERM handler, as servers have): the close is done by that call as soon as it is
        between two steps (not in the middle of a send or a receive), at once when it waits,
        without lingering, and a call that waits raises `InferenceError` ("the client was
        closed...")."""
        if self._core.closed:
            return
        if self._core.forked():
            self._core.let_go()
            return
        wait = self._core.linger if linger is None else close_linger(linger)
        try:
            if wait > 0 and not self._nested:
                self._linger(wait)
        except Exception:  # nothing the linger meets stops the close (a broken socket, ...)
            log.debug("close(): the wait for the answers in flight ended early", exc_info=True)
        finally:
            # (Also after a KeyboardInterrupt in the wait: the client is closed all the same.)
            if not self._core.closed:  # (a nested close() done meanwhile closed it)
                self._close_now()

    def _linger(self, wait: float) -> None:
        """`close()`'s wait: the requests in flight that may be answered in shared memory are
        cancelled, and their answers read (each released: nobody will) for up to ``wait``
        seconds, or until none can still come."""
        core = self._core
        started = self._close_cancel(wait)
        if started is None:
            return
        calls, end = started
        now = time.monotonic()
        while core.lingering(calls, now) and now < end:
            self._pump(end - now, now)
            now = time.monotonic()

    def _close_now(self) -> None:
        """The close itself, nothing waited for."""
        # Each step in a finally of the one before: an exception from a signal handler
        # (Ctrl-C, an alarm) in the middle left a half-closed client that said it was open,
        # whose next call failed with a raw ZMQError or waited out its timeout.
        try:
            # Replies that came and will not be read (a stream's last frames, a handle not
            # waited on): their output slots go back before the sockets go.
            drain_unread([self._sock, self._inbox.sock if self._inbox is not None else None,
                          *self._pin_socks.values()], self._core.release_unread)
            if self._core.pin_slots or self._core.pin_services:
                self._core.pin_goodbye()  # LEASE_END for each lease, its connection closed
                self._run_ops()
            try:
                self._sock.send_multipart(P.client_disconnect(), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        finally:
            try:
                self._wake = None  # (closed by _unwatch: nothing may write to its number any more)
                self._unclosed.clear()  # closed, not dropped: no ResourceWarning
                self._unwatch()
                drop_monitor(self._sock, self._broker_monitor)
            finally:
                try:
                    self._sock.close(linger=CLOSE_LINGER_MS)
                    if self._inbox is not None:
                        self._inbox.close()
                finally:
                    self._core.close()

    give_up = _one_thread_or_later(ClientBase.give_up)
    alloc = _one_thread(ClientBase.alloc)
    alloc_cuda = _one_thread(ClientBase.alloc_cuda)
    free = _one_thread(ClientBase.free)

    def __enter__(self) -> "Client":
        self._core.check_open()  # a closed one (or a forked child's copy) is refused, as `async with` refuses it
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ReplyStream(ReplyStreamBase):
    """The handle on one request (`Client.infer_stream`): iterate it for each PARTIAL, then
    the FINAL; or `result()` for the FINAL alone; `cancel()` to stop it now (see
    `ReplyStreamBase`)."""

    def __iter__(self) -> "ReplyStream":
        return self

    def __next__(self) -> Result:
        if self._ended(True):
            raise StopIteration
        return self._item(*self._wait(None))

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the FINAL and return it, releasing any PARTIAL before it unread; raises
        what `infer` raises (the request's own deadline: `DeadlineExceeded`, and the
        request is cancelled).  `timeout` (seconds, None: as long as the request may take)
        bounds this wait only: when it passes, `TimeoutError` is raised and the request stays
        in flight (call `result()` again, or `cancel()`).  Raises `Cancelled` at once after
        `cancel()`, and `EndOfStream` once the FINAL was taken or the handle closed."""
        self._ended(False)
        timeout = wait_limit(timeout)
        stop = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if stop is None else max(0.0, stop - time.monotonic())
            res = self._final(*self._wait(left, timeout))
            if res is not None:
                return res

    def _wait(self, limit: float | None, asked: float | None = None) -> tuple[str, Any]:
        """The client's `_wait` for this call; anything but the `limit` running out closes
        the handle (a deadline, a KeyboardInterrupt: CANCEL is on its way to the broker
        before the exception leaves)."""
        try:
            return self._client._wait(self._call, limit)
        except DeadlineExceeded:
            self.close()
            raise
        except TimeoutError:
            if limit is None:  # pragma: no cover - only a limit raises a plain TimeoutError
                self.close()
                raise
            raise TimeoutError(f"no result within {asked:g}s; the request is still in flight") from None
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "ReplyStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: The code of every frame that holds a `Client`'s claim while it runs (`_inside`): the
#: wrappers' (one code object for all the methods each wraps) and `infer`'s, which inlines one.
_CLAIMING = frozenset({_one_thread(lambda self: None).__code__, _one_thread_or_later(lambda self: None).__code__,
                       Client.infer.__code__})
