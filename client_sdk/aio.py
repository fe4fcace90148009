"""asyncio client: the core (core.py) driven by the event loop; many requests in flight over
one DEALER socket.

`AsyncClient` mirrors `Client` (client.py) method for method; the methods that wait are
coroutines.  A reader callback on the socket's file descriptor (`loop.add_reader`) drains
every message and hands it to `ClientCore.on_message`, which routes it to its call by
request id, so any number of tasks can `await c.infer(...)` at once.  The main socket is a
plain pyzmq socket used without blocking, because zmq.asyncio's per-message futures and a
reader task's wake-up cost more than the rest of a small request's client-side work (opaque
requests use sockets of their own, as in client.py).  A heartbeat task keeps the broker
informed while calls are waiting and fails them with `BrokerUnreachable` when the broker
falls silent.  Cancelling a task that awaits `infer` sends CANCEL to the broker; the call's
input slots are freed when the FINAL that answers the cancellation arrives.

Requests are queued on the socket without awaiting the send: a request the caller stops
waiting for has still either left or will leave, so its input slots are only ever freed by
its FINAL (or by `close()`), never while a worker might read them.  Frames the socket
refuses (high-water mark) wait in `_pending`, in order, and go out before anything newer.

`infer` waits without a reply-stream handle (as `Client.infer` does): the reader resolves a
plain future through `call.notify`, and one client-wide timer, armed at the earliest
deadline of the `infer` calls waiting, wakes those whose deadline has passed (a timer per
request, or `asyncio.wait_for`'s task, would cost more than the rest of the wait).

Only the loop's thread touches the client: the loop is claimed under a lock (`_bind`), and a
plain method called from another thread while the loop runs is done on the loop (`give_up`
handed to it without waiting, the rest waited for: `_on_its_loop`, `_run_on_loop`;
docs/client.md, "Threads").
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
import warnings
import weakref
from collections import deque
from functools import partial
from typing import Any, Mapping

import zmq
import zmq.asyncio

from broker import protocol as P
from broker.protocol.link import LinkConn, LinkError
from broker.protocol.wire import NOBLOCK, TcpWatch, recv_frames, send_frames

from .base import ClientBase, ReplyStreamBase
from .calls import Call, final_of_infer, mmi_answer, opaque_reply
from .core import CLOSE_LINGER_S, LAST_LOOK_S, PAUSED_S, ClientCore, close_linger, wait_limit
from .errors import DeadlineExceeded, InferenceError, InvalidInput
from .pins import PIN_CONNECT_S, PinClose, PinOpen, PinSend
from .sockets import (CLOSE_LINGER_MS, ReplyInbox, room_for_sockets, broker_dealer, context, curve_keys, dealer, descriptor_room, drain_unread, drop_lease_dealer,
                      drop_monitor, drop_socket, handshakes, IpcDiagnosis, lease_dealer, lease_events, open_link, redial,
                      refusal, refused_error, request_dealer, send_failure, tcp_options)
from .tensors import Result

__all__ = ["AsyncClient", "AsyncReplyStream", "run"]

log = logging.getLogger("client_sdk")
#: the broker connection's monitor in `_monitors` (the others are a lease's)
_BROKER = object()
_POLLIN = int(zmq.POLLIN)
_Future = asyncio.Future  # what loop.create_future() makes, without its Python call
_running_loop = asyncio.events._get_running_loop  # (C; None outside a running loop)
_OTHER_LOOP = ("this AsyncClient belongs to another event loop, which is still open ({}): one AsyncClient per "
               "event loop (its reader, timers and futures live on that loop; a call from another one would be "
               "sent and never answered).  Call it from a coroutine on its own loop "
               "(asyncio.run_coroutine_threadsafe(..., loop) from another thread), or make a client on this loop; "
               "once its loop is closed, the client moves to the next loop that calls it")
_OTHER_THREAD = ("this AsyncClient's event loop runs in another thread ({}): its socket, reader and timers are "
                 "that thread's.  Call its coroutines there (asyncio.run_coroutine_threadsafe(..., loop)); its plain "
                 "methods (a handle's cancel(), a stream's send()) are handed to that loop by themselves")
#: how long a plain method called from another thread waits for the client's loop to run it
#: (`AsyncClient._run_on_loop`): one turn of a loop that is not blocked
HANDOFF_S = 10.0


def _on_its_loop(method):
    """A plain `AsyncClient` method that touches the client (its socket, its pool, its calls):
    called from another thread while the client's loop runs, it is run on that loop and waited
    for (`AsyncClient._run_on_loop`); otherwise here, as it is.  On the loop's own thread the
    cost is one function call and one compare."""
    def run(self, *args, **kw):
        loop = self._loop
        if loop is None or _running_loop() is loop or not loop.is_running():
            return method(self, *args, **kw)
        return self._wait_on_loop(loop, functools.partial(method, self, *args, **kw))

    run = functools.update_wrapper(run, method)
    if run.__name__.endswith("_here"):  # (`prepare = _on_its_loop(_prepare_here)`: named as called)
        run.__name__ = run.__name__[1:-len("_here")]
        run.__qualname__ = run.__qualname__.replace("._", ".", 1).removesuffix("_here")
    return run


def _resolve(fut: asyncio.Future) -> None:
    """`call.notify` of a waiting `infer` (as a `partial`): wake it.  Called once per item
    that lands in the call's inbox, and by the deadline timer; the future may already be
    done (a PARTIAL and its FINAL in one read) or cancelled (the waiting task was)."""
    if not fut.done():
        fut.set_result(None)


def run(coro: Any) -> Any:
    """`asyncio.run`, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency off Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


def _weakly(client: "AsyncClient", name: str) -> Any:
    """A callback for the client's loop (a reader, a timer) that calls the client's method
    `name` while the client is alive and does nothing once it is gone: what the loop holds
    must not hold the client, or a client dropped without close() lived as long as its loop
    (`_let_go`).  A closure over a weak reference and the plain function: one function call
    more per wake-up than the bound method."""
    ref = weakref.ref(client)
    func = getattr(type(client), name)

    def call(*args: Any) -> Any:
        c = ref()
        if c is not None:
            return func(c, *args)
        return None

    call.__qualname__ = call.__name__ = f"weakly_{name}"
    return call


async def _heartbeat(ref: "weakref.ref[AsyncClient]") -> None:
    """The client's heartbeat task (`AsyncClient._beat`, every half period): it holds the
    client only while it beats, never across its sleep, so a client dropped without close()
    is not kept alive by it (its finalizer cancels it)."""
    client = ref()
    while client is not None:
        core = client._core
        if not core.pins and not core.active() and not core.mmi_waiting():
            # Nothing waits and no lease is held: no heartbeat is due (`heartbeat_due`), so
            # the task waits for the next request (`_submit` sets the event) instead of
            # waking every half period for nothing (the idle hunt: 50 idle clients, 95
            # wake-ups and 13 ms of CPU a second).
            wake = client._hb_wake
            wake.clear()
            client._hb_parked = True
            client = None
            await wake.wait()
            client = ref()
            if client is None:
                break
        # A periodic timer, not synchronisation: half the period keeps the gap between two
        # heartbeats under one period whatever the phase (the period shortens once the
        # broker has said how long it waits for us).
        half = client._core.heartbeat_period / 2
        client = None
        await asyncio.sleep(half)
        client = ref()
        if client is not None:
            client._beat()


def _let_go(state: dict) -> None:
    """`AsyncClient._unwatch`: the finalizer of a client dropped without close(), given the
    client's attributes (its `__dict__`, which does not hold the client itself).  Its readers
    come off its loop and its timers and heartbeat task are cancelled, then its sockets (the
    broker's, the reply inbox, the leases' and their monitors) are closed, the inbox's file
    unlinked and the pool closed: done on the loop's thread (handed to it when the loop runs
    in another thread: finalizers run wherever the collector does), here when the loop is
    not running or closed.  Nothing is sent (a dropped `Client` says nothing either: the
    broker sees the connection close).  Warns as the sync client's sockets do (ResourceWarning),
    except at interpreter exit; never raises."""
    try:
        core = state.get("_core")
        if core is None or core.closed:
            return
        if core.forked():  # a forked child's copy: only let go of it (no warning: nothing was left open)
            _release(state)
            return
        if threading.main_thread().is_alive():  # (not at interpreter exit: not collected, only left open)
            warnings.warn(f"unclosed AsyncClient ({core.endpoint}): close it (await client.close(), "
                          "or async with)", ResourceWarning, stacklevel=3)
        loop = state.get("_loop")
        if loop is not None and _running_loop() is not loop and loop.is_running() and not core.forked():
            try:
                loop.call_soon_threadsafe(_release, state)
                return
            except RuntimeError:  # its loop closed meanwhile
                pass
        _release(state)
    except Exception:  # pragma: no cover - a finalizer must not raise
        log.debug("error while letting go of a dropped AsyncClient", exc_info=True)


def _release(state: dict) -> None:
    """`_let_go`'s work, on the loop's thread (or with no loop running)."""
    try:
        core = state["_core"]
        if core.closed:
            return
        if core.forked():  # a forked child's copy: the sockets and the loop's readers are the parent's
            core.let_go()
            return
        loop = state.get("_loop")
        live = loop is not None and not loop.is_closed()
        socks = [*state.get("_socks", ()), *state.get("_monitors", ())]
        links = list(state.get("_links", ()))
        if live:
            for sock in socks:
                try:
                    if not sock.closed:
                        loop.remove_reader(sock.getsockopt(zmq.FD))
                except Exception:
                    pass
            for link in links:
                try:
                    if not link.closed:
                        loop.remove_reader(link.fileno())
                except Exception:
                    pass
            for name in ("_retry", "_redial_timer", "_deadline_timer", "_heart"):
                handle = state.get(name)
                if handle is not None:
                    try:
                        handle.cancel()
                    except Exception:
                        pass
        state["_pending"].clear()
        # Replies that came and will not be read: their output slots go back (`Client.close`).
        drain_unread([*state.get("_socks", ()), *links], core.release_unread)
        lease_monitors = {pin: m for m, pin in state.get("_monitors", {}).items() if pin is not _BROKER}
        for sock, pin in list(state.get("_pin_of", {}).items()):
            try:
                if type(sock) is LinkConn:
                    sock.close()
                else:
                    drop_monitor(sock, lease_monitors.get(pin))
                    sock.close(linger=0)
            except Exception:
                pass
        sock = state["_sock"]
        try:
            drop_monitor(sock, state.get("_broker_monitor"))
            sock.close(linger=CLOSE_LINGER_MS)
        except Exception:
            pass
        inbox = state.get("_inbox")
        if inbox is not None:
            try:
                inbox.close()
            except Exception:
                pass
        core.close()
    except Exception:  # pragma: no cover - a finalizer must not raise
        log.debug("error while letting go of a dropped AsyncClient", exc_info=True)


class AsyncClient(ClientBase):
    """asyncio twin of `Client`, with the same options (CurveZMQ keys for tcp included) and
    the same Result lifetime rules.

        async with AsyncClient("ipc:///tmp/zinf.sock") as c:
            r = await c.infer("echo", {"x": x})
    """

    def __init__(self, endpoint: str, *, transport: str = "auto", timeout: float | None = 10.0,
                 pool_capacity: int = 256 << 20, heartbeat_interval: float | None = 1.0,
                 fallback_inline: bool = True, direct_reply: bool = True, restart_resends: int = 2,
                 server_key: str | bytes | None = None, client_key: str | None = None, insecure: bool = False,
                 pin: bool | int = False, max_inline_mb: float = 256, linger: float = CLOSE_LINGER_S):
        # A tcp broker: CurveZMQ keys (or an explicit insecure=True), inline tensors only.
        transport, direct_reply = tcp_options(endpoint, transport, direct_reply)
        self._core = ClientCore(endpoint, transport=transport, timeout=timeout, pool_capacity=pool_capacity,
                                heartbeat_interval=heartbeat_interval, fallback_inline=fallback_inline,
                                direct_reply=direct_reply, restart_resends=restart_resends, pin=pin,
                                max_inline_mb=max_inline_mb, linger=linger)
        self._core.endpoint_problem = IpcDiagnosis(endpoint)
        self._curve = curve_keys(endpoint, server_key, client_key, insecure)
        self._core.plain_tcp = self._curve is None and endpoint.startswith("tcp://")
        ctx = context(endpoint)  # first: it sees that libzmq's threads can start
        self._ctx = room_for_sockets(zmq.asyncio.Context.instance())  # for opaque requests' own sockets
        # with the monitor of its handshakes (heartbeats on), attached before it connected
        self._sock, self._broker_monitor = broker_dealer(ctx, endpoint, self._curve, self._core.heartbeat_interval)
        # Over tcp, bytes of the broker's that are on their way count as its word (a large
        # message on a slow link: wire.TcpWatch).
        self._tcp = TcpWatch() if endpoint.startswith("tcp://") else None
        # Replies straight from same-host workers (docs/protocol.md section 8); read by the
        # same callback as the broker socket.
        self._inbox = ReplyInbox.open(zmq.Context.instance()) if self._core.direct_reply else None
        if self._inbox is not None:
            self._core.use_inbox(self._inbox.endpoint, descriptor_room)
        self._socks = [self._sock] if self._inbox is None else [self._sock, self._inbox.sock]
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop our reader is on
        # Held while a loop claims the client (`_bind`): two threads' loops whose first calls
        # came at the same moment had both bound it, both reading its socket.
        self._binding = threading.Lock()
        self._heart: asyncio.Task | None = None
        self._hb_wake = asyncio.Event()  # wakes a parked heartbeat task (`_heartbeat`)
        self._hb_parked = False
        self._streams: weakref.WeakSet = weakref.WeakSet()  # close() wakes their recv()s
        self._pending: deque = deque()  # frames the socket refused (high-water mark), in order
        self._retry: asyncio.TimerHandle | None = None
        self._broken: BaseException | None = None
        self._traffic: asyncio.Future | None = None  # resolved by the reader for pump()
        # pin=True or a stream's service: a DEALER per lease, on its worker's direct socket
        # (pins.py), read by the same callback
        # (a near lease's is a LinkConn instead: the worker's local link, docs/protocol.md
        # 10.6, with a reader of its own, `_drain_link`)
        self._pin_socks: dict[bytes, Any] = {}
        self._pin_of: dict[Any, Any] = {}
        self._links: list[LinkConn] = []
        self._monitors: dict[zmq.Socket, Any] = {}  # a tcp lease's connection monitor -> its Pin (or _BROKER)
        # The broker connection's handshakes (-> _BROKER): a new one heartbeats at once.
        if self._broker_monitor is not None:
            self._monitors[self._broker_monitor] = _BROKER
        # `infer` calls waiting now (a dict as an ordered set), and the one timer that wakes
        # them at their deadlines: armed at `_deadline_at`, the earliest deadline known when
        # it was armed (see `_deadlines`)
        self._waiters: dict[Call, None] = {}
        self._deadline_at: float | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        # What the loop holds (readers, timers) holds the client weakly, and a client dropped
        # without close() is let go of by its finalizer, as a `Client` is (`_let_go`).
        self._w_drain = _weakly(self, "_drain")
        self._w_drain_link = _weakly(self, "_drain_link")
        self._w_on_monitor = _weakly(self, "_on_monitor")
        self._w_deadlines = _weakly(self, "_deadlines")
        self._w_retry = _weakly(self, "_retry_now")
        self._w_redial = _weakly(self, "_redial")
        self._redial_timer: asyncio.TimerHandle | None = None
        self._unwatch = weakref.finalize(self, _let_go, self.__dict__)

    # ---------------------------------------------------------------- background tasks

    def _start(self) -> None:
        """Before a call that needs the event loop: refuses a closed or broken client, and a
        running loop other than the client's while the client's is open (before anything is
        sent: `_OTHER_LOOP`); binds the client to the running loop the first time, and again
        once the loop it had is closed (`asyncio.run()` returned: `_left_loop`)."""
        self._core.check_open()
        if self._broken is not None:
            raise InferenceError(f"the client's reader stopped ({self._broken!r}); create a new client",
                                 code=None)
        loop = self._loop
        if loop is not None:
            running = _running_loop()
            if running is loop:
                return
            if not loop.is_closed():
                if running is None:  # a plain method called outside any loop
                    if loop.is_running():  # (`_on_its_loop` hands those to it: not one of them)
                        raise InvalidInput(_OTHER_THREAD.format(loop))
                    return
                raise InvalidInput(_OTHER_LOOP.format(loop))
            if running is None:
                raise InvalidInput("this AsyncClient's event loop is closed: call it from a coroutine on a running "
                                   "loop (the client moves to it)")
        running = _running_loop()
        if running is None:  # (was asyncio's RuntimeError "no running event loop")
            raise InvalidInput("this AsyncClient is on no event loop yet: its first call must come from a coroutine "
                               "on the loop that is to serve it (`async with client`, or any await of it); from then "
                               "on, other threads may call its plain methods (docs/client.md, \"Threads\")")
        self._bind(running)

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make `loop` (running, in this thread) the client's: claimed under `_binding`, so
        that of two loops whose first calls come at once one gets it and the other is refused
        (`_OTHER_LOOP`), before either adds a reader; the claim comes first, so a call of
        another loop that does not wait for the lock is refused too."""
        with self._binding:
            held = self._loop
            if held is loop:
                return
            if held is not None:
                if not held.is_closed():
                    raise InvalidInput(_OTHER_LOOP.format(held))  # another thread's loop got it first
                self._left_loop()
            self._loop = loop
            # The loop's thread is the client's own from now on: a buffer dropped in any other
            # thread (the one that made the client, say) is freed here at the next call, not
            # there, in the pool this loop uses (the races hunt).
            self._core._owner_thread = threading.get_ident()
            added = []
            try:
                for sock in self._socks:
                    fd = sock.getsockopt(zmq.FD)
                    loop.add_reader(fd, self._w_drain, sock)
                    added.append(fd)
                for link in self._links:
                    loop.add_reader(link.fileno(), self._w_drain_link, link)
                    added.append(link.fileno())
                for monitor in self._monitors:
                    fd = monitor.getsockopt(zmq.FD)
                    loop.add_reader(fd, self._w_on_monitor, monitor)
                    added.append(fd)
                    loop.call_soon(self._on_monitor, monitor)  # edge-triggered: look once now
            except BaseException:
                for fd in added:
                    loop.remove_reader(fd)
                self._loop = None
                raise
            loop.call_soon(self._drain)  # the FD is edge-triggered: look once now
            hello = self._core.hello(time.monotonic())
            if hello is not None:
                self._send_soon(hello)
            if self._core.heartbeat_interval is not None:
                self._heart = loop.create_task(_heartbeat(weakref.ref(self)), name="client_sdk-heartbeat")

    def _run_on_loop(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, on the client's loop when called from another thread while that loop
        runs (`_wait_on_loop`), else here.  A stream's hand-off (`AsyncStream`'s `via`)."""
        loop = self._loop
        if loop is None or _running_loop() is loop or not loop.is_running():
            return fn(*args)
        return self._wait_on_loop(loop, functools.partial(fn, *args))

    def _wait_on_loop(self, loop: asyncio.AbstractEventLoop, fn: Any) -> Any:
        """Run ``fn()`` on ``loop`` (the client's, running in another thread) and return what it
        returns, or raise what it raises, in this thread: the socket, the pool and the calls
        are touched by the loop's thread only (a plain method run from another thread tore the
        messages of the loop's own calls).  Waits for the loop to get to it, `HANDOFF_S` at
        most (then InferenceError, and it is not run).  From a coroutine of another loop:
        `_OTHER_LOOP` (its thread would wait on another loop).  In a forked child (whose copy
        of the loop says it runs, and never will), ``fn()`` here: it refuses the child."""
        if self._core.forked():
            return fn()
        if _running_loop() is not None:
            raise InvalidInput(_OTHER_LOOP.format(loop))
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not done.set_running_or_notify_cancel():
                return  # its caller stopped waiting
            try:
                out = fn()
            except BaseException as e:
                done.set_exception(e)
                if not isinstance(e, Exception):
                    raise
            else:
                done.set_result(out)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop closed meanwhile: nobody else is on the client now
            return fn()
        try:
            return done.result(HANDOFF_S)
        except concurrent.futures.TimeoutError:
            if not done.cancel():  # it runs now, and never waits: its outcome, whatever it takes (review:
                return done.result()  # a limit here left a call done with its caller told it was not)
            raise InferenceError(f"this AsyncClient's event loop ({loop}) did not run this call within {HANDOFF_S:g}s "
                                 "(blocked, or stopped?); nothing was done", code=None) from None

    def _check_loop(self) -> None:
        """`_start`'s loop check for a plain method that sends nothing itself (`stream`):
        nothing when no loop runs, or when the client has none yet."""
        loop = self._loop
        if loop is not None:
            running = _running_loop()
            if running is not None and running is not loop and not loop.is_closed():
                raise InvalidInput(_OTHER_LOOP.format(loop))

    def _on_loop(self) -> None:
        """`_start`'s loop check for a wait on a call sent before (a handle's): refused on
        another open loop, moved to the running loop once the client's is closed."""
        loop = self._loop
        if loop is not None and _running_loop() is not loop and not self._core.closed:
            self._start()

    def _left_loop(self) -> None:
        """The loop the client was on is closed (`asyncio.run()` returned, and a later one
        calls): what lived on it is gone for good (its reader, its heartbeat task, which
        `asyncio.run` cancelled, its timers, the futures of its waiters), so the client
        forgets it and `_start` binds it to the running loop, its sockets, calls in flight and
        pool as they were (a FINAL that came meanwhile is read by the new reader).  A call
        whose waiter the loop dropped without running its `finally` (a loop closed with tasks
        pending) is given up: nobody will take its result."""
        self._loop = None
        self._heart = None
        self._retry = None
        self._deadline_timer = self._deadline_at = None
        self._traffic = None
        orphans = list(self._waiters)
        self._waiters.clear()
        for call in orphans:
            call.notify = None
            frames = self._core.give_up(call, time.monotonic())
            if frames is not None:
                self._pending.append(frames)  # sent by the new loop's first drain, in order

    def _drain(self, only: zmq.Socket | None = None) -> int:
        """Route every message that has arrived (`only`: on that socket, whose FD the loop
        found signalled: each socket's FD is its reader's own, and a send that may consume
        one's edge looks again itself); returns how many were handled."""
        core = self._core
        if core.closed or self._broken is not None:
            return 0
        handled = 0
        pins = self._pin_of
        try:
            if self._pending:
                self._flush()
                only = None  # its sends may have consumed the broker socket's edge
            if only is None or only is self._sock:
                # Every socket, the broker's last: a LEASE_END that says "resend" must find
                # the replies that already came on its lease routed (or it would send them
                # again), so the broker's signal reads the reply sockets first, and a pass in
                # which one ran out of its budget leaves the broker's for the next pass.
                socks = self._socks
                if len(socks) > 1 and socks[0] is self._sock:
                    socks = [*socks[1:], socks[0]]
            else:
                socks = (only,)
            capped = False
            if only is None or only is self._sock:
                monitor = self._broker_monitor
                if (core.broker_instance is None and monitor is not None and not monitor.closed
                        and monitor.getsockopt(zmq.EVENTS) & _POLLIN):
                    # The monitor's word first, as the blocking twin reads it, until the broker
                    # is known (nothing to pay on the hot path after): a second handshake read
                    # after the answer it came before was never seen as one (core
                    # `_replaced_unheard`), and the calls the dead connection took waited out
                    # their deadlines (the review).
                    self._on_monitor(monitor)
                for link in list(self._links):  # the leases' links first, as their sockets
                    n = self._read_link(link, 256)
                    handled += n
                    capped = capped or n >= 256
            for sock in socks:
                if capped and sock is self._sock:
                    continue  # a lease's replies are left to read: the broker's LEASE_END waits for them
                n = 0  # each socket its own budget: a busy one does not starve the broker's
                direct = sock is not self._sock
                pin = pins.get(sock) if pins else None
                # A lease's socket may be closed meanwhile (a stream woken by a FINAL ran
                # the core's ops): skip it rather than break the client on ENOTSOCK.
                while not sock.closed and sock.getsockopt(zmq.EVENTS) & _POLLIN:
                    try:
                        frames = recv_frames(sock, NOBLOCK)  # never waits on the loop
                    except zmq.Again:  # (nothing after all)
                        break
                    if not direct and self._tcp is not None:
                        self._tcp.note(frames[0])  # the connection the broker's word comes on
                    try:
                        outs = core.on_message(frames, time.monotonic(), direct, pin)
                    except Exception:  # one bad message must not stop every other call
                        log.exception("error while handling a message from the broker")
                        continue
                    for out in outs:
                        self._send_soon(out)
                    handled += 1
                    n += 1
                    if n >= 256:  # let other callbacks run; come back at once
                        self._loop.call_soon(self._drain)
                        capped = capped or direct
                        break
        except zmq.ZMQError as e:
            self._broken = e
            err = InferenceError(f"the client's socket failed ({e}); create a new client", code=None)
            for call in core.active():
                core.fail(call, err)
        finally:
            if core.ops and not core.closed:  # after the loop: it may open and close sockets of `_socks`
                self._run_ops()
            if self._traffic is not None and (handled or self._broken is not None):
                self._wake_pumps()
        return handled

    # ---------------------------------------------------------------- pinned streams

    def _drain_link(self, link: LinkConn) -> None:
        """A lease's link is readable (its reader; the descriptor is level-triggered)."""
        core = self._core
        if core.closed or self._broken is not None:
            return
        handled = self._read_link(link, 1)  # its reader runs again for the rest (level-triggered)
        if core.ops and not core.closed:
            self._run_ops()
        if self._traffic is not None and handled:
            self._wake_pumps()

    def _read_link(self, link: LinkConn, most: int) -> int:
        """Route what a lease's link holds, ``most`` messages at most (its reader runs again
        for the rest); how many were handled."""
        core = self._core
        pin = self._pin_of.get(link)
        handled = 0
        while handled < most:
            try:
                frames = link.recv()
            except (EOFError, LinkError) as e:
                # The worker closed it (it stopped or died) or it broke: what was on it goes
                # through the broker (pins.py, pin_link_lost).
                self._link_drop(link)
                if pin is not None:
                    for out in core.pin_link_lost(pin, time.monotonic(), str(e)):
                        self._send_soon(out)
                break
            if frames is None:
                break
            handled += 1
            try:
                outs = core.on_message(frames, time.monotonic(), True, pin)
            except Exception:  # one bad message must not stop every other call
                log.exception("error while handling a message from a leased worker")
                continue
            for out in outs:
                self._send_soon(out)
        return handled

    def _link_drop(self, link: LinkConn) -> None:
        if link in self._links:
            self._links.remove(link)
            if self._loop is not None and not link.closed:
                try:
                    self._loop.remove_reader(link.fileno())
                except Exception:  # the loop may already be closed
                    pass
        link.close()

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
                    self._look_again(sock)
            elif kind is PinOpen:
                self._pin_open(op.pin, op.hello)
            elif kind is PinClose:
                sock = self._pin_socks.pop(op.pin.lease, None)
                if type(sock) is LinkConn:
                    self._pin_of.pop(sock, None)
                    sock.send(P.client_disconnect())
                    self._link_drop(sock)
                elif sock is not None:
                    self._pin_drop(sock)

    def _pin_open(self, pin: Any, hello: list[Any]) -> None:
        link = open_link(pin, hello)
        if link is not None:
            self._pin_socks[pin.lease] = link
            self._pin_of[link] = pin
            self._links.append(link)
            if self._loop is not None:
                self._loop.add_reader(link.fileno(), self._w_drain_link, link)
            return
        sock = monitor = None
        try:
            sock, monitor = lease_dealer(zmq.Context.instance(), pin, self._curve, PIN_CONNECT_S,
                                         self._core.heartbeat_period)
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
        self._socks = [*self._socks, sock]
        if monitor is not None:
            self._monitors[monitor] = pin
        if self._loop is not None:
            self._loop.add_reader(sock.getsockopt(zmq.FD), self._w_drain, sock)
            self._look_again(sock)
            if monitor is not None:
                self._loop.add_reader(monitor.getsockopt(zmq.FD), self._w_on_monitor, monitor)
                self._loop.call_soon(self._on_monitor, monitor)  # edge-triggered: look once now

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        """A tcp lease's connection reported (pins.py: pin_connected, pin_disconnected), or
        the broker's made a handshake (a new connection: its name is asked for at once)."""
        core = self._core
        pin = self._monitors.get(monitor)
        if pin is None or core.closed or monitor.closed:
            return
        if pin is _BROKER:
            ups, last, final = handshakes(monitor)
            now = time.monotonic()
            core.broker_said(last, now, final, ups)
            if final and last:
                core.refused_for_good(lambda rid: refused_error(self.endpoint, last, None, rid), now)
            if core.redial_at is not None and self._redial_timer is None:
                # libzmq gave the endpoint up at a refused handshake (core.REDIAL_S)
                self._redial_timer = self._loop.call_later(max(0.0, core.redial_at - time.monotonic()),
                                                           self._w_redial)
            if ups and core.heartbeat_interval is not None:
                self._send_soon(core.heartbeat(time.monotonic()))
                if core.ops:
                    self._run_ops()
            return
        for up, final, why in lease_events(monitor):
            if pin.closed:
                break
            if up:
                core.pin_connected(pin)
                continue
            if pin.ready:
                # Replies that arrived before the drop sit whole in the socket: they are
                # those calls' answers, to route before the rest go through the broker.
                sock = self._pin_socks.get(pin.lease)
                while sock is not None and not sock.closed and sock.getsockopt(zmq.EVENTS) & _POLLIN:
                    try:
                        outs = core.on_message(recv_frames(sock, NOBLOCK), time.monotonic(), True, pin)
                    except zmq.Again:  # (nothing after all)
                        break
                    except Exception:  # one bad message must not stop every other call
                        log.exception("error while handling a message from a leased worker")
                        continue
                    for out in outs:
                        self._send_soon(out)
            for out in core.pin_disconnected(pin, time.monotonic(), why, final):
                self._send_soon(out)
        if core.ops and not core.closed:
            self._run_ops()
        if self._traffic is not None:
            self._wake_pumps()

    def _pin_drop(self, sock: zmq.Socket) -> None:
        pin = self._pin_of.pop(sock, None)
        self._socks = [s for s in self._socks if s is not sock]
        monitor = next((m for m, p in self._monitors.items() if p is pin), None) if pin is not None else None
        if monitor is not None:
            del self._monitors[monitor]
        if self._loop is not None:
            for s in (sock, monitor):
                if s is None:
                    continue
                try:
                    self._loop.remove_reader(s.getsockopt(zmq.FD))
                except Exception:  # the loop may already be closed
                    pass
        drop_lease_dealer(sock, monitor)

    def _look_again(self, sock: zmq.Socket) -> None:
        # Sending can consume the FD's edge for a message that has already arrived.
        if self._loop is not None and sock.getsockopt(zmq.EVENTS) & _POLLIN:
            self._loop.call_soon(self._drain)

    def _send_pinned(self, call: Call, frames: list[Any]) -> None:
        sock = self._pin_socks.get(call.pin.lease)
        if type(sock) is LinkConn:
            if sock.send(frames):  # False: full, gone, or larger than a datagram
                return
        elif sock is not None:
            try:
                send_frames(sock, frames, NOBLOCK)
                self._look_again(sock)
                return
            except Exception as e:  # full or gone (or out of memory or threads): the broker takes it
                if not isinstance(e, zmq.ZMQError) and send_failure(e, self.endpoint) is None:
                    raise
                if not sock.closed:
                    try:
                        self._look_again(sock)  # a failed send may have consumed its edge too
                    except zmq.ZMQError:
                        pass
        self._core.reroute(call)
        self._send_soon(frames, call)

    def _wake_pumps(self) -> None:
        fut, self._traffic = self._traffic, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _beat(self) -> None:
        """One turn of the heartbeat task (`_heartbeat`, every half period)."""
        core = self._core
        now = time.monotonic()
        back = core.looking(now)  # from a loop held by its application: silence counts from now
        if core.heartbeat_due(now):
            self._send_soon(core.heartbeat(now))
            if core.ops and not core.closed:  # a tcp lease given back (pins_overdue)
                self._run_ops()
        if self._tcp is not None and now - core.last_recv > core.heartbeat_period:
            core.heard_bytes(self._tcp.look(now))  # a long message still crossing
        if not back:  # else the reader first reads what came meanwhile: judged next time
            core.fail_unreachable(now)

    def _send_soon(self, frames: list[Any] | None, call: Call | None = None) -> None:
        """Send `frames` now, or queue them behind those the socket refused.  `call`: the
        request they are, which a process out of descriptors, memory or threads cannot send
        (wire.send_frames left the socket at a message boundary): forgotten, and a typed
        error raised to its submitter.  Anything else that cannot be sent is dropped, said."""
        if frames is None or self._core.closed:
            return
        if self._pending:  # keep the order: earlier frames are still waiting
            self._pending.append(frames)
            return
        sock = self._sock
        try:
            send_frames(sock, frames, NOBLOCK)
        except zmq.Again:
            self._pending.append(frames)
            self._schedule_retry()
            return
        except Exception as e:
            typed = send_failure(e, self.endpoint)
            if typed is None and not isinstance(e, zmq.ZMQError):
                raise
            if typed is not None and call is not None:
                self._core.discard_unsent(call)
                raise typed from None
            log.warning("could not send to the broker: %s: %s", type(e).__name__, e)
            return
        self._core.last_send = time.monotonic()
        # Sending can consume the FD's edge for a message that has already arrived.
        if self._loop is not None and sock.getsockopt(zmq.EVENTS) & _POLLIN:
            self._loop.call_soon(self._drain)

    def _flush(self) -> None:
        sock = self._sock
        while self._pending:
            try:
                send_frames(sock, self._pending[0], NOBLOCK)
            except zmq.Again:
                self._schedule_retry()
                return
            except Exception as e:  # gone, or out of memory or threads: dropped
                if not isinstance(e, zmq.ZMQError) and send_failure(e, self.endpoint) is None:
                    raise
                log.warning("could not send to the broker: %s: %s", type(e).__name__, e)
            self._pending.popleft()
            self._core.last_send = time.monotonic()

    def _redial(self) -> None:
        """Dial the broker again (core.REDIAL_S); what waits in `_pending` goes on the new
        connection, and the calls whose messages the lost one took are sent again once the
        broker's answer names it (core.py, `_on_broker_instance`)."""
        self._redial_timer = None
        core = self._core
        if core.closed or core.redial_at is None:
            return
        core.redialed(time.monotonic())
        try:
            redial(self._sock, self.endpoint)
        except zmq.ZMQError as e:  # out of descriptors, say: tried again at the next refusal
            log.warning("could not dial the broker at %s again: %s", self.endpoint, e)
            return
        if self._pending:
            self._flush()

    def _schedule_retry(self) -> None:
        # The broker is not reading (high-water mark): try again shortly rather than spin.
        if self._loop is not None and self._retry is None:
            self._retry = self._loop.call_later(0.001, self._w_retry)

    def _retry_now(self) -> None:
        self._retry = None
        self._drain()

    # ---------------------------------------------------------------- waiting

    def _arm_deadlines(self, at: float) -> None:
        """Have `_deadlines` run at `at` (a `time.monotonic()` instant), instead of later."""
        timer = self._deadline_timer
        if timer is not None:
            timer.cancel()
        self._deadline_at = at
        self._deadline_timer = self._loop.call_later(max(0.0, at - time.monotonic()), self._w_deadlines)

    def _deadlines(self) -> None:
        """The deadline timer: wake each waiting `infer` whose deadline has passed (it raises
        DeadlineExceeded and cancels its call), and arm again for the earliest deadline still
        ahead.  A waiter that finds its deadline not passed yet (an early timer) waits again,
        the timer armed for it."""
        self._deadline_timer = self._deadline_at = None
        if self._core.closed:
            return
        now = time.monotonic()
        ahead = None
        for call in self._waiters:
            deadline = call.deadline
            if deadline is None:
                continue
            if deadline <= now:
                wake = call.notify
                if wake is not None:
                    wake()  # resolves a future: nothing runs now, `_waiters` stays as it is
            elif ahead is None or deadline < ahead:
                ahead = deadline
        if ahead is not None:
            self._arm_deadlines(ahead)

    async def _last_look(self, call: Call, ev: asyncio.Event) -> None:
        """A call's deadline passed while this process was not running (core.PAUSED_S):
        what has arrived is routed, and a reply still inside libzmq's I/O thread (it runs
        again only now) waited for, `LAST_LOOK_S` at most (``ev``: set by the call's
        notify)."""
        end = time.monotonic() + LAST_LOOK_S
        self._drain()
        while not call.inbox:  # (another call's deadline may set ``ev`` meanwhile)
            left = end - time.monotonic()
            if left <= 0:
                return
            ev.clear()
            try:
                async with asyncio.timeout(left):
                    await ev.wait()
            except TimeoutError:
                return

    async def _next(self, call: Call, limit: float | None = None) -> tuple[str, Any]:
        """Next item for `call`.  Raises DeadlineExceeded at the call's deadline and
        TimeoutError after `limit` seconds (the call stays in flight)."""
        if call.inbox:
            return call.inbox.popleft()
        ev = asyncio.Event()
        call.notify = ev.set
        stop = None if limit is None else time.monotonic() + limit
        looked = False
        last_look = False
        core = self._core
        if core.forked():
            core.check_open()  # a forked child's copy: InvalidInput
        try:
            while not call.inbox:
                if core.closed:  # close() failed it, and then let go of every call (its inbox too)
                    raise InferenceError("the client was closed while this request was waiting", code=None)
                now = time.monotonic()
                ends = [t for t in (call.deadline, stop) if t is not None]
                if call.deadline is not None and now >= call.deadline:
                    if now - call.deadline > PAUSED_S and not last_look:
                        last_look = True  # (core.PAUSED_S: we did not run when it passed)
                        await self._last_look(call, ev)
                        continue
                    raise self._core.deadline_error(call)
                if stop is not None and now >= stop:
                    if looked:
                        raise TimeoutError(f"no result within {limit:g}s; the request is still in flight")
                    # Once at least, even with no time left: a reply already in the socket
                    # is routed now (as the blocking client's pump does).  Not by yielding
                    # to the reader: on plain asyncio a task woken by sleep(0) runs before
                    # the loop polls the socket's descriptor (the asyncio hunt).
                    looked = True
                    self._drain()
                    continue
                looked = True
                ev.clear()
                if ends:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for returns the inner result
                    # and drops the task's cancellation when both come at once.
                    try:
                        async with asyncio.timeout(min(ends) - now):
                            await ev.wait()
                    except TimeoutError:
                        pass
                else:
                    await ev.wait()
        finally:
            if call.notify is ev.set:
                call.notify = None
        return call.inbox.popleft()

    # ---------------------------------------------------------------- requests

    async def infer(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
                    priority: Any = "normal", meta: Mapping[str, Any] | None = None,
                    reply: str = "auto", traceparent: str | None = None) -> Result:
        """Run one request and return its FINAL outputs.  A service that streams its results
        (PARTIALs) and ends with an empty FINAL raises `NotSupported`: use `infer_stream`."""
        # What `infer_stream(...).result()` under `async with` does, without the handle (as
        # `Client.infer`): the hot path of a caller that awaits one request at a time.
        core = self._core
        if self._loop is None or self._broken is not None or _running_loop() is not self._loop:
            self._start()  # `prepare`'s; a closed client is refused by new_call
        call = core.new_call(service, inputs, timeout=timeout, priority=priority, meta=meta, reply=reply,
                             traceparent=traceparent)
        self._submit(call)
        loop = self._loop
        inbox = call.inbox
        waiters = self._waiters
        waiters[call] = None
        partials = 0
        last_look = False
        try:
            while True:
                while not inbox:
                    if core.closed:
                        # close() failed it, and then let go of every call (its inbox too)
                        raise InferenceError("the client was closed while this request was waiting", code=None)
                    deadline = call.deadline
                    if deadline is not None:
                        now = time.monotonic()
                        if now >= deadline:
                            if now - deadline > PAUSED_S and not last_look:
                                last_look = True  # (core.PAUSED_S: we did not run when it passed)
                                ev = asyncio.Event()
                                call.notify = ev.set
                                await self._last_look(call, ev)
                                continue
                            raise self._core.deadline_error(call)
                        at = self._deadline_at
                        if at is None or deadline < at:
                            self._arm_deadlines(deadline)
                    fut = _Future(loop=loop)
                    call.notify = partial(_resolve, fut)
                    await fut
                kind, item = inbox.popleft()
                if kind == "final":
                    break
                if kind == "error":
                    raise item
                partials += 1  # a PARTIAL: released unread, as result() does
                item.release()
        except BaseException:
            # A deadline, a silent broker, the awaiting task cancelled...: CANCEL is on its
            # way to the broker (or the leased worker) before the exception leaves.
            self.give_up(call)
            raise
        finally:
            waiters.pop(call, None)  # (`_left_loop` may have dropped it)
        call.notify = None
        return final_of_infer(service, item, partials) if partials else item

    @_on_its_loop
    def infer_stream(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
                     priority: Any = "normal", meta: Mapping[str, Any] | None = None,
                     reply: str = "auto", traceparent: str | None = None) -> "AsyncReplyStream":
        """Send one request now and return its handle: `async for` over it gets each
        PARTIAL, then the FINAL; `await handle.result()` the FINAL alone.  `cancel()` cancels
        the request at once; closing the handle (or leaving `async with`) before the FINAL
        cancels it too.
        `traceparent`: a W3C trace context (``00-<32 hex trace id>-<16 hex span id>-<2 hex
        flags>``) carried to the broker and the worker, whose log lines and spans name its
        trace id (docs/operations.md, "Logs and traces"); one that does not parse is ignored."""
        prepare, submit = self._stream_seams()
        call = prepare(service, inputs, timeout=timeout, priority=priority, meta=meta, reply=reply,
                       traceparent=traceparent)
        submit(call)
        return AsyncReplyStream(self, call)

    async def request(self, service: str, frames: list[bytes], timeout: float | None = None) -> list[bytes]:
        """Send a plain MDP request (opaque body frames) and return the FINAL's body frames.
        Like `Client.request`, it uses a socket of its own."""
        out = self._core.opaque_frames(service, frames)
        limit = self._core.timeout_of(timeout)
        # Over tcp with keys, a handshake the broker refuses for good fails it at once (as
        # `Client.request`).
        sock, monitor = (request_dealer(self._ctx, self.endpoint, self._curve, self._core.heartbeat_interval)
                         if self._curve is not None else (dealer(self._ctx, self.endpoint, self._curve), None))
        waits: list[asyncio.Future] = []
        try:
            async def final() -> list[bytes]:
                # (Sent here, by the deadline: a send to a connection the broker had refused
                # before it ran waited for ever, `Client._send_request`.)
                await sock.send_multipart(out, copy=False)
                while True:
                    done, body = opaque_reply(await sock.recv_multipart(), service)
                    if done:
                        return body

            async def refused() -> InferenceError:
                while True:
                    said = refusal(await monitor.recv_multipart())
                    if said is not None and said[0]:  # (this request's connection's word, for it alone)
                        return refused_error(self.endpoint, said[1])

            try:
                async with asyncio.timeout(limit):
                    if monitor is None:
                        return await final()
                    waits = [asyncio.ensure_future(final()), asyncio.ensure_future(refused())]
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if waits[0].done():
                        return waits[0].result()
                    if waits[1].exception() is not None:  # the monitor failed: the reply decides
                        return await waits[0]
                    raise waits[1].result()
            except TimeoutError:
                raise self._core.opaque_deadline_error(service, limit) from None
        finally:
            for w in waits:
                w.cancel()
                if w.done() and not w.cancelled():
                    w.exception()  # retrieved: a failure beside the one raised is not logged as lost
            drop_monitor(sock, monitor)
            drop_socket(sock)

    async def mmi_service(self, name: str, timeout: float | None = None) -> bool:
        """Whether the broker knows a worker for `name` (MMI, RFC 8).

        Sent on the client's own socket, so it also works as a barrier: the broker handles
        one client's messages in order, and once this answer is back every request sent
        before it has been queued or dispatched."""
        self._start()
        core = self._core
        q = core.mmi_question(name)
        limit = core.timeout_of(timeout)
        if core.shut_out is not None:
            raise core.shut_out(None)  # the broker refuses this client's handshake (core.refused_for_good)
        core.expect_mmi(q, time.monotonic())
        fut = self._loop.create_future()
        q.notify = lambda: fut.done() or fut.set_result(None)
        self._send_soon(q.frames)
        self._wake_heartbeat()  # its liveness check (`_beat`) fails the question if the broker stays silent
        try:
            async with asyncio.timeout(limit):
                await fut
        except TimeoutError:
            raise self._core.mmi_deadline_error(limit) from None
        finally:
            q.notify = None
            if q.answer is None:
                q.abandoned = True  # its late answer is consumed and dropped
        if q.answer is None and core.closed:  # woken by close()
            raise InferenceError("the client was closed while this question was waiting", code=None)
        if q.answer is None and q.error is not None:  # the broker's silence (core.fail_unreachable)
            raise q.error
        return mmi_answer(q.answer, name)

    @_on_its_loop
    def stream(self, service: str, *, latest_wins: bool = True, max_in_flight: int = 2,
               timeout: float | None = None, priority: Any = "normal",
               meta: Mapping[str, Any] | None = None, reply: str = "auto", pin: bool | None = None):
        """A frame stream for interactive (AR) use; see `client_sdk.stream.AsyncStream`.
        Pinned as `Client.stream`'s: `pin=None` (the default) when this client can (heartbeats
        on), `pin=False` never, `pin=True` always (InvalidInput with heartbeats off)."""
        from .stream import AsyncStream

        # As infer_stream: a closed (or forked) client, and options its frames could not
        # carry, say so here, not at every send().
        self._core.check_stream_options(service, timeout=timeout, priority=priority, meta=meta, reply=reply)
        self._check_loop()  # before it asks for a lease
        may_pin = self._core.stream_pins(pin)
        st = AsyncStream(self, service, latest_wins=latest_wins, max_in_flight=max_in_flight,
                         timeout=timeout, priority=priority, meta=meta, reply=reply, pin=may_pin,
                         via=self._run_on_loop)
        if may_pin:
            # its service asks for a lease; a stream it counted ends that lease when it closes
            st._pinned = self._core.pin_on_demand(service, st.max_in_flight)
        self._streams.add(st)
        return st

    @_on_its_loop
    def stream_closed(self, service: str) -> None:
        """A stream that pinned `service` closed (client_sdk.stream): after the last one its
        lease ends."""
        if self._core.closed:
            return
        self._core.pin_release(service, time.monotonic())
        if self._core.ops:
            self._run_ops()

    # ---------------------------------------------------------------- seams for streams
    # The same four as Client's (see there); none of them blocks the loop.  Called from
    # another thread while the client's loop runs, each is done on the loop (`_on_its_loop`;
    # `give_up` without waiting for it).

    def _prepare_here(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
                      priority: Any = "normal", meta: Mapping[str, Any] | None = None, reply: str = "auto",
                      copy_inline: bool = False, traceparent: str | None = None) -> Call:
        """Check the arguments and pack the inputs into a `Call`, without sending it (the
        reader starts on the running loop if it has not yet).  A prepared call must end in
        `submit` or `give_up`: it may hold input slots."""
        self._start()
        return self._core.new_call(service, inputs, timeout=timeout, priority=priority, meta=meta,
                                   reply=reply, copy_inline=copy_inline, traceparent=traceparent)

    def _submit_here(self, call: Call, timeout: float | None = 0.0) -> bool:
        """Register a prepared call and queue its REQUEST; its deadline starts now.  Never
        waits and always True: frames the socket refuses wait in the client's own queue, in
        order (`timeout` is there for `Client.submit`'s sake).  A closed client refuses it
        (InferenceError), as `Client.submit` does (it was registered there, and never
        answered), and the loop is checked as `prepare` checks it."""
        if self._core.closed or self._loop is None or _running_loop() is not self._loop:
            self._start()
        self._core.check_submittable(call)
        return self._submit(call)

    # The public seams check the thread; `infer_stream` and a stream's own steps (already on
    # the loop: `send` is handed over whole) call the `_here` ones (a check per frame, not three).
    prepare = _on_its_loop(_prepare_here)
    submit = _on_its_loop(_submit_here)

    def _stream_seams(self) -> tuple:
        """(prepare, submit) for `infer_stream` and streams: the `_here` ones, unless a subclass
        overrides the public seams (then those, as the blocking client's streams do)."""
        cls = type(self)
        return (self._prepare_here if cls.prepare is AsyncClient.prepare else self.prepare,
                self._submit_here if cls.submit is AsyncClient.submit else self.submit)

    def _wake_heartbeat(self) -> None:
        """Wake a parked heartbeat task (`_heartbeat`): something waits on the broker again
        (`_submit` does the same inline)."""
        if self._hb_parked:
            self._hb_parked = False
            self._hb_wake.set()

    def _submit(self, call: Call) -> bool:
        now = time.monotonic()
        call.t_submit = call.t_submit or now
        core = self._core
        if self._hb_parked:  # the first request after a quiet spell: heartbeats again
            self._hb_parked = False
            self._hb_wake.set()
        frames = core.request_frames(call, now)
        if core.ops:
            self._run_ops()
        if frames is None:  # answered already (core.refused_for_good)
            return True
        if call.pin is None:
            self._send_soon(frames, call)
        else:
            self._send_pinned(call, frames)
        return True

    def give_up(self, call: Call) -> None:
        """`ClientBase.give_up`; called from another thread while the client's loop runs (a
        handle cancelled by a watchdog thread, or dropped there: its `__del__`), it is handed
        to the loop and returns at once: the CANCEL goes out on the loop's thread (sent from
        the caller's, it tore the loop's own messages on the socket)."""
        if type(call) is not Call:  # (said here, not in the loop's callback)
            raise InvalidInput(f"give_up() takes a call made by prepare(), got {type(call).__name__}")
        loop = self._loop
        if (loop is not None and _running_loop() is not loop and loop.is_running()
                and not self._core.forked()):  # (a forked child's copy: only marks the call)
            try:
                loop.call_soon_threadsafe(self._give_up_now, call)
                return
            except RuntimeError:  # its loop closed meanwhile: nothing runs there any more
                pass
        ClientBase.give_up(self, call)

    def _give_up_now(self, call: Call) -> None:
        if not self._core.closed:  # (close() let go of every call)
            ClientBase.give_up(self, call)

    alloc = _on_its_loop(ClientBase.alloc)
    alloc_cuda = _on_its_loop(ClientBase.alloc_cuda)
    free = _on_its_loop(ClientBase.free)
    # They read the calls and leases the loop changes (a dict iterated from another thread
    # while the reader added to it raised RuntimeError: the AR audit's polling thread).
    in_flight = _on_its_loop(ClientBase.in_flight)
    pinned = _on_its_loop(ClientBase.pinned)

    async def pump(self, timeout: float | None = None) -> None:
        """Route what has arrived; if nothing had, wait up to `timeout` seconds (None: until
        something arrives) for the next message, which the reader routes before this
        returns.  The reader and the heartbeat task do the routing and the liveness work by
        themselves; this is for code that waits for traffic rather than for one call."""
        timeout = wait_limit(timeout)
        self._start()
        if self._drain() or (timeout is not None and timeout <= 0):
            return
        if self._traffic is None:
            self._traffic = self._loop.create_future()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._traffic)
        except TimeoutError:
            pass

    # ---------------------------------------------------------------- lifetime

    async def close(self, linger: float | None = None) -> None:
        """Wake every waiter with an error, cancel what is in flight and wait up to `linger`
        seconds (None: the client's own, 1 s by default) for the answers that may name
        output slots, releasing them (docs/client.md, "Closing with requests in flight");
        then say DISCONNECT, close the socket, unlink the pool.  A task cancelled while it
        waits still closes the client, and its cancellation goes on."""
        core = self._core
        if core.closed:
            return
        if core.forked():  # a forked child's copy: the sockets and the loop's readers are the parent's
            core.let_go()
            return
        loop = self._loop
        if loop is not None and loop.is_running() and _running_loop() is not loop:
            # Its loop runs in another thread: its readers, timers and waiters are that
            # thread's to touch (asyncio.run_coroutine_threadsafe(client.close(), loop)).
            raise InvalidInput(_OTHER_LOOP.format(loop))
        wait = core.linger if linger is None else close_linger(linger)
        # Its event loop closed (stopped with a call pending, then closed): nobody can wait on
        # it any more, and waking its futures, its timers or its heartbeat task raises
        # "Event loop is closed", which had left the client open for good.  The sockets, the
        # inbox and the pool are let go of all the same.
        dead = self._loop is not None and self._loop.is_closed()
        if not dead:
            self._tell_closed()
        stopped: BaseException | None = None  # this task's cancellation, met while it waited
        if wait > 0 and not dead and self._loop is not None:
            try:
                await self._linger(wait)
            except asyncio.CancelledError as e:
                stopped = e
            except Exception:  # nothing the wait meets stops the close
                log.debug("close(): the wait for the answers in flight ended early", exc_info=True)
            if core.closed:  # another task's close() finished it meanwhile
                if stopped is not None:
                    raise stopped
                return
            # Other tasks ran while it waited: a call or a question they made meanwhile is
            # let go of below (its inbox too), so it is told now, or it waited for good.
            self._tell_closed()
        self._unwatch.detach()  # (closed here: nothing for the finalizer to do)
        if self._loop is not None:
            for sock in [*self._socks, *([self._broker_monitor] if self._broker_monitor is not None else [])]:
                try:
                    self._loop.remove_reader(sock.getsockopt(zmq.FD))
                except Exception:  # the loop may already be closed
                    pass
            if dead:
                self._loop = None  # what follows (leases' goodbyes, sends, wake-ups) schedules nothing on it
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._redial_timer is not None:
            self._redial_timer.cancel()
            self._redial_timer = None
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = self._deadline_at = None
        heart, self._heart = self._heart, None
        if dead:
            heart = None  # a task of the closed loop: nothing to cancel or wait for
        if heart is not None:
            heart.cancel()
        # Replies that came and will not be read: their output slots go back (`Client.close`).
        drain_unread([*self._socks, *self._links], core.release_unread)
        if core.pin_slots or core.pin_services:
            core.pin_goodbye()  # LEASE_END for each lease, its connection closed
            self._run_ops()
        try:
            self._sock.send_multipart(P.client_disconnect(), flags=zmq.NOBLOCK)
        except (zmq.ZMQError, Exception):
            pass
        self._pending.clear()
        drop_monitor(self._sock, self._broker_monitor)
        self._sock.close(linger=CLOSE_LINGER_MS)
        if self._inbox is not None:
            self._inbox.close()
        core.close()
        if not dead:
            self._wake_pumps()
            if wait > 0:
                # Woken before the wait, a recv() with nothing in flight found the client
                # still open and waited again.
                for st in list(self._streams):
                    st.wake()
        if stopped is not None:
            raise stopped  # (the heartbeat task was cancelled; nobody waits for its end)
        if heart is not None:
            task = asyncio.current_task()
            before = task.cancelling() if task is not None else 0  # (a cancellation it caught earlier)
            try:
                await heart
            except asyncio.CancelledError:
                if task is not None and task.cancelling() > before:
                    raise  # ours, not the heartbeat's: the caller was cancelled meanwhile
            except Exception:
                pass

    def _tell_closed(self) -> None:
        """`close()`: every task waiting on the client is woken with its error: each call
        still waited for, each MMI question not answered (its `mmi_service()` raises that
        error even while the close still waits for answers: woken with none and the client
        open, it had taken the silence for the broker's answer, a ProtocolError), each
        stream's `recv()` (one with nothing in flight has no call to wake it)."""
        core = self._core
        err = InferenceError("the client was closed while this request was waiting", code=None)
        for call in core.active():
            core.fail(call, err)
        for q in list(core.mmi_waiters):
            if q.answer is None and q.error is None and not q.abandoned:
                q.error = InferenceError("the client was closed while this question was waiting", code=None)
            if q.notify is not None:
                q.notify()
        for st in list(self._streams):
            st.wake()

    async def _linger(self, wait: float) -> None:
        """`close()`'s wait (`Client._linger`): the requests in flight that may be answered in
        shared memory are cancelled, and their answers read by the loop's readers (each
        released: nobody will) for up to ``wait`` seconds, or until none can still come."""
        core = self._core
        started = self._close_cancel(wait)
        if started is None:
            return
        calls, end = started
        now = time.monotonic()
        while core.lingering(calls, now) and now < end:
            # A look at least once a heartbeat period (as the blocking twin's `_pump`): the
            # broker's silence ends the wait without anything arriving (a stopped broker held
            # the close for its whole linger).
            hb = core.heartbeat_period
            await self.pump(end - now if hb is None else min(end - now, hb))
            now = time.monotonic()

    aclose = close

    async def __aenter__(self) -> "AsyncClient":
        self._start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncReplyStream(ReplyStreamBase):
    """The handle on one request (`AsyncClient.infer_stream`): `async for` over it for each
    PARTIAL, then the FINAL; or `await result()` for the FINAL alone; `cancel()` (a plain
    method) to stop it now (see `ReplyStreamBase`)."""

    def __aiter__(self) -> "AsyncReplyStream":
        return self

    async def __anext__(self) -> Result:
        if self._ended(True):
            raise StopAsyncIteration
        return self._item(*await self._wait(None))

    async def result(self, timeout: float | None = None) -> Result:
        """Wait for the FINAL and return it, releasing any PARTIAL before it unread; as
        `ReplyStream.result`: `timeout` bounds this wait only (`TimeoutError`, the request
        stays in flight), `Cancelled` at once after `cancel()`.  Cancelling the task that
        awaits it cancels the request."""
        self._ended(False)
        timeout = wait_limit(timeout)
        stop = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if stop is None else max(0.0, stop - time.monotonic())
            res = self._final(*await self._wait(left, timeout))
            if res is not None:
                return res

    async def _wait(self, limit: float | None, asked: float | None = None) -> tuple[str, Any]:
        self._client._on_loop()  # another loop's task: refused before the handle is touched
        try:
            return await self._client._next(self._call, limit)
        except DeadlineExceeded:
            self.close()
            raise
        except TimeoutError:
            if limit is None:  # pragma: no cover - only a limit raises a plain TimeoutError
                self.close()
                raise
            raise TimeoutError(f"no result within {asked:g}s; the request is still in flight") from None
        except BaseException:
            # Task cancellation included: the broker hears CANCEL, the inputs wait for the
            # FINAL.
            self.close()
            raise

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> "AsyncReplyStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
