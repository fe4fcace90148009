"""Blocking client, plus the transport-independent core that `aio.AsyncClient` shares.

`_Core` owns everything that is not a socket operation: request ids, packing, the input
pool, the output leases, routing each reply to the call it answers, freeing input slots at
the FINAL, and the transparent inline resend after NOT_LOCAL.  The front ends (`Client`
here, `AsyncClient` in aio.py) only move frames and wait.

Routing: a tensor reply carries its request id in the header, so any number of tensor
requests share the client's socket.  A client of a broker on this host also binds a reply
socket (`_ReplyInbox`) and names it in each request (`reply_to`): a worker on this host sends
the FINAL there, one hop instead of two through the broker (docs/protocol.md section 8).
Both sockets feed the same `_Core.on_message`; a second FINAL for one request (a retry that
raced a direct reply) finds no call and is dropped.

An opaque (plain MDP) reply carries nothing to match it by, and two requests to one service
may finish out of order on different workers, so each opaque request (`request()`,
`mmi_service()`) uses a short-lived socket of its own: its reply cannot be mistaken for
another's, and a late one after a timeout goes nowhere.
"""
from __future__ import annotations

import ipaddress
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterator, Mapping

import msgspec
import numpy as np
import zmq

import shm as _shm
from broker import protocol as P
from broker.protocol import ErrorCode, Priority
from broker.protocol.wire import NOBLOCK, recv_frames, send_frames

from . import tensors as T
from .errors import (
    BrokerUnreachable,
    DeadlineExceeded,
    InferenceError,
    ProtocolError,
    error_from,
)
from .tensors import InvalidInput, Result

__all__ = ["Client", "resolve_transport", "parse_priority"]

_POLLIN = int(zmq.POLLIN)
log = logging.getLogger("client_sdk")

#: milliseconds a closing socket may keep trying to deliver its DISCONNECT (close() itself
#: never waits: only terminating the context would)
CLOSE_LINGER_MS = 100

#: heartbeat intervals of silence (no reply, not even to a heartbeat) before the broker is
#: declared unreachable for a waiting call
LIVENESS = 5

_PRIORITY_NAMES = {"urgent": Priority.URGENT, "normal": Priority.NORMAL, "background": Priority.BACKGROUND}
_MMI_SERVICE = "mmi.service"


def parse_priority(p: Any) -> Priority:
    if isinstance(p, str):
        try:
            return _PRIORITY_NAMES[p.lower()]
        except KeyError:
            raise InvalidInput(f"priority {p!r} must be 'urgent', 'normal' or 'background'") from None
    try:
        return Priority(int(p))
    except (TypeError, ValueError):
        raise InvalidInput(f"priority {p!r} must be 0 (urgent), 1 (normal), 2 (background) or one of their names") from None


def _check_service(service: Any) -> None:
    """Reject a bad service name before anything is packed or sent."""
    if not isinstance(service, str):
        raise InvalidInput(f"service must be a str, got {type(service).__name__}")
    n = len(service.encode())
    if not 1 <= n <= P.MAX_SERVICE_LEN:
        raise InvalidInput(f"service name must be 1..{P.MAX_SERVICE_LEN} bytes of UTF-8, got {n}")


def _endpoint_is_local(endpoint: str) -> bool:
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    rest = rest.rsplit(";", 1)[-1]  # "tcp://source;host:port": the peer is after the ';'
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_transport(transport: str, endpoint: str) -> bool:
    """True when inputs should go through shared memory."""
    if transport == "shm":
        return True
    if transport == "inline":
        return False
    if transport == "auto":
        return _endpoint_is_local(endpoint)
    raise InvalidInput(f"transport {transport!r} must be 'auto', 'shm' or 'inline'")


class _Call:
    """One tensor request in flight and what the caller has not consumed yet."""

    __slots__ = ("id", "service", "packed", "priority", "meta", "reply", "timeout",
                 "deadline", "t_sent", "t_submit", "t_done", "inbox", "done", "abandoned", "retried",
                 "frame", "notify", "adopted", "__weakref__")

    def __init__(self, service: str, *, timeout: float | None):
        self.id = 0
        self.service = service
        self.packed: T.Packed | None = None
        self.priority = Priority.NORMAL
        self.meta: dict[str, Any] = {}
        self.reply = "auto"
        self.timeout = timeout
        self.deadline: float | None = None
        self.t_sent = 0.0
        self.t_submit = 0.0   # when the caller handed it over (a stream frame may wait before it is sent)
        self.t_done = 0.0
        # ("partial", Result) | ("final", Result) | ("error", InferenceError)
        self.inbox: deque[tuple[str, Any]] = deque()
        self.done = False        # FINAL (or error) received: inputs freed, nothing more will come
        self.abandoned = False   # the caller gave up: discard what still arrives
        self.retried = False
        self.frame: int | None = None
        self.notify: Callable[[], None] | None = None
        self.adopted: dict[int, T.Adopted] = {}  # input slots handed back as outputs

    def remaining(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now


class _Core:
    def __init__(self, endpoint: str, *, transport: str = "auto", timeout: float | None = 10.0,
                 pool_capacity: int = 256 << 20, heartbeat_interval: float | None = 1.0,
                 fallback_inline: bool = True, direct_reply: bool = True):
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise InvalidInput(f"endpoint {endpoint!r} must look like 'ipc:///tmp/broker.sock' or 'tcp://host:port'")
        self.endpoint = endpoint
        self.transport = transport
        self.use_shm = resolve_transport(transport, endpoint)
        self.timeout = timeout
        self.pool_capacity = int(pool_capacity)
        self.heartbeat_interval = heartbeat_interval if heartbeat_interval and heartbeat_interval > 0 else None
        self.fallback_inline = fallback_inline
        # Direct replies need a broker (hence workers) that can reach an ipc socket of ours.
        self.direct_reply = bool(direct_reply) and _endpoint_is_local(endpoint)
        self.reply_to: str | None = None  # set by the front end once its reply socket is bound
        self._pool: Any = None
        self._cuda: Any = None  # CudaSide, created by the first CUDA tensor or alloc_cuda
        self.leases = T.OutputLeases()
        self._user_bufs: dict[tuple[str, int, int], weakref.finalize] = {}
        self._owner_thread = threading.get_ident()
        self._deferred: deque[Any] = deque()
        self._next_id = 1
        self.calls: dict[int, _Call] = {}
        self.not_local: set[str] = set()
        self.last_recv = time.monotonic()
        self.last_send = 0.0
        self.closed = False
        self.discarded = 0   # late or unknown replies dropped (for tests and debugging)
        self.direct_replies = 0  # replies that came straight from a worker (reply_to)
        # MMI queries sent on the main socket, oldest first.  The broker answers MMI itself,
        # in the order it receives them, so replies match waiters first-in first-out; an
        # abandoned waiter still consumes its own late answer.
        self.mmi_waiters: deque = deque()

    # ---------------------------------------------------------------- pool

    @property
    def pool(self) -> Any:
        """The input pool, created on first use (an inline-only client never touches /dev/shm)."""
        if self._pool is None:
            self._check_open()
            try:
                self._pool = _shm.ShmPool(self.pool_capacity)
                self.leases.own_segment = self._pool.name
            except (OSError, _shm.ShmError) as e:
                if self.transport == "shm":
                    raise InferenceError(f"cannot create a shared-memory pool ({e}); use transport='inline'",
                                         code=None) from None
                log.warning("shared memory unavailable (%s); sending tensors inline", e)
                self.use_shm = False
                raise
        return self._pool

    def alloc(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        self.run_deferred()
        src = self.pool.alloc(shape, dtype)
        ref = self._pool.ref_of(src)
        key = (ref.segment, ref.slot, ref.generation)
        arr, fin = T.lease_array(src, self._buffer_dropped, key, ref)
        self._user_bufs[key] = fin
        return arr

    def cuda_side(self, device: Any = None) -> Any:
        """The client's CUDA side (device pool + pool cache), created on first use;
        NotSupported with the reason where CUDA is unavailable."""
        if self._cuda is None:
            self._check_open()
            from .cuda import CudaSide

            self._cuda = CudaSide(self.pool_capacity, device)
            self.leases.cuda_cache = self._cuda.cache
        return self._cuda

    def alloc_cuda(self, shape: Any, dtype: Any = np.float32, device: Any = "cuda:0") -> Any:
        side = self.cuda_side(device)
        side.check_device(device)
        return side.alloc(shape, dtype)

    def _buffer_dropped(self, key: tuple[str, int, int] | None, ref: Any) -> None:
        if key is not None:
            self._user_bufs.pop(key, None)
        if threading.get_ident() == self._owner_thread:
            self._free_buffer(ref)
        else:
            # The pool is single-threaded: a buffer dropped in another thread is freed by
            # the client's own thread at its next call.
            self._deferred.append(ref)

    def _free_buffer(self, ref: Any) -> None:
        if self._pool is not None:
            try:
                self._pool.free(ref)
            except Exception:  # already freed
                pass

    def run_deferred(self) -> None:
        while self._deferred:
            self._free_buffer(self._deferred.popleft())

    def free(self, arr: np.ndarray) -> None:
        ref = T._ref_in_pool(self._pool, arr) if self._pool is not None and isinstance(arr, np.ndarray) else None
        fin = self._user_bufs.pop((ref.segment, ref.slot, ref.generation), None) if ref is not None else None
        if fin is None:
            raise InvalidInput("free() takes an array returned by alloc() that was not freed yet")
        fin()

    # ---------------------------------------------------------------- building requests

    def _check_open(self) -> None:
        if self.closed:
            raise InferenceError("this client is closed; create a new one", code=None)

    def _timeout(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        if t is None or t == math.inf:
            return None  # wait as long as it takes
        t = float(t)
        if not t > 0:
            raise InvalidInput(f"timeout must be a positive number of seconds (or math.inf), got {timeout!r}")
        return t

    def new_call(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
                 priority: Any = "normal", meta: Mapping[str, Any] | None = None, reply: str = "auto",
                 copy_inline: bool = False) -> _Call:
        self._check_open()
        _check_service(service)
        if reply not in P.REPLY_MODES:
            raise InvalidInput(f"reply {reply!r} must be one of {sorted(P.REPLY_MODES)}")
        self.run_deferred()
        if self._cuda is not None:
            self._cuda.poll()
        call = _Call(service, timeout=self._timeout(timeout))
        call.priority = parse_priority(priority)
        call.meta = dict(meta or {})
        inline = not self.use_shm or service in self.not_local
        call.reply = ("inline" if inline else "auto") if reply == "auto" else reply
        pool = None
        if not inline:
            try:
                pool = self.pool
            except (OSError, _shm.ShmError):
                pool = None
                if call.reply == "auto":
                    call.reply = "inline"
        # CUDA IPC only reaches workers on this host, exactly as shared memory does.
        call.packed = T.pack(inputs, pool, copy_inline=copy_inline, cuda=None if inline else self.cuda_side)
        return call

    def opaque_frames(self, service: str, frames: list[Any]) -> list[Any]:
        """REQUEST frames of a plain MDP request (checked, not sent)."""
        self._check_open()
        _check_service(service)
        if not frames:
            raise InvalidInput("an MDP request needs at least one body frame")
        if P.is_header(frames[0]):
            raise InvalidInput("an opaque body must not start with the tensor header magic; use infer()")
        return P.client_request(service, list(frames))

    def request_frames(self, call: _Call, now: float) -> list[Any]:
        """Assign an id, register the call and return its REQUEST frames."""
        if call.deadline is None and call.timeout is not None:
            call.deadline = now + call.timeout
        call.t_sent = now
        call.id = self._next_id
        self._next_id += 1
        self.calls[call.id] = call
        rem = call.remaining(now)
        packed = call.packed
        hdr = P.Request(
            id=call.id,
            priority=int(call.priority),
            timeout_ms=None if rem is None else max(0.0, round(rem * 1000.0, 3)),
            host=P.local_host_id(),
            pid=os.getpid(),
            reply=call.reply,
            tensors=packed.tensors,
            meta=call.meta,
            reply_to=self.reply_to,
        )
        try:
            head = P.encode_header(hdr)
        except (TypeError, msgspec.EncodeError) as e:
            self.discard_unsent(call)
            raise InvalidInput(f"meta cannot be encoded as msgpack ({e}); use str/int/float/bool/list/dict values") from None
        return P.client_request(call.service, [head, *packed.frames])

    # ---------------------------------------------------------------- giving up

    def unregister(self, call: _Call) -> None:
        """Undo request_frames for a call that could not be sent yet."""
        self.calls.pop(call.id, None)
        call.id = 0
        call.deadline = None

    def discard_unsent(self, call: _Call) -> None:
        """A call that never reached the wire (dropped stream frame, failed send): nothing can
        be reading its inputs, so they are freed now."""
        if call.id:
            self.calls.pop(call.id, None)
        self._free_inputs(call)
        call.abandoned = True
        call.done = True
        _drain_inbox(call)

    def abandon(self, call: _Call) -> list[Any] | None:
        """The caller stopped waiting.  Returns CANCEL frames to send, if one is useful.
        Inputs stay allocated until the FINAL arrives: a worker may be reading them now."""
        if call.abandoned:
            return None
        call.abandoned = True
        call.notify = None
        _drain_inbox(call)
        if call.done or call.id == 0:
            return None
        return P.client_cancel(call.service, call.id)

    # ---------------------------------------------------------------- incoming

    def on_message(self, frames: list[Any], now: float, direct: bool = False) -> list[list[Any]]:
        """Route one message from the broker (or, `direct`, from a worker through the reply
        socket).  Returns messages to send in response (an inline resend after NOT_LOCAL)."""
        self.last_recv = now
        try:
            msg = P.parse_broker_to_client(frames)
        except P.ProtocolError as e:
            log.warning("dropping a malformed message from the broker: %s", e)
            return []
        if msg.command == P.C_HEARTBEAT:
            return []
        if direct:
            self.direct_replies += len(msg.body) if msg.command == P.C_FINALS else 1
        if msg.command == P.C_FINALS:
            # A worker's batch, straight from it: each frame is one header-only FINAL.
            out: list[list[Any]] = []
            for head in msg.body:
                out += self._on_final_body(msg.service, (head,), True, now)
            return out
        return self._on_final_body(msg.service, msg.body, msg.command == P.C_FINAL, now)

    def _on_final_body(self, service: bytes, body: tuple, final: bool, now: float) -> list[list[Any]]:
        if body and P.is_header(body[0]):
            try:
                rep = P.decode_reply(body[0], len(body) - 1)
                P.check_inline_sizes(rep.tensors, body[1:])
            except P.ProtocolError as e:
                # Fail the call it was meant for, if that can be told, rather than let it
                # wait for its deadline.
                call = self.calls.get(_lenient_id(body[0]))
                log.warning("bad reply header%s: %s", f" for request {call.id}" if call else "", e)
                if call is not None and final and not call.abandoned:
                    self.calls.pop(call.id, None)
                    self._finish_inputs(call)
                    self._deliver(call, ("error", ProtocolError(f"the reply header was invalid: {e}",
                                                                request_id=call.id)), True)
                return []
            call = self.calls.get(rep.id)
            if call is None:
                self.discarded += 1
                T.release_reply(rep, self.leases)
                return []
            return self._on_reply(call, rep, list(body[1:]), final, now)
        if service == _MMI_SERVICE.encode() and final and self.mmi_waiters:
            waiter = self.mmi_waiters.popleft()
            if not waiter.done():
                waiter.set_result([bytes(f) for f in body])
            return []
        # Any other opaque body on this socket answers nothing we sent (opaque requests have
        # their own sockets).
        self.discarded += 1
        return []

    def _on_reply(self, call: _Call, rep: P.Reply, frames: list[Any], final: bool, now: float) -> list[list[Any]]:
        if final:
            self.calls.pop(call.id, None)
            if (rep.error is not None and rep.error.code == ErrorCode.NOT_LOCAL and self.fallback_inline
                    and not call.retried and not call.abandoned and call.packed is not None):
                return [self._resend_inline(call, now)]
        if call.abandoned or rep.error is not None:
            if final:
                self._finish_inputs(call, rep)
            if call.abandoned:
                if final:
                    call.done = True
                self.discarded += 1
                T.release_reply(rep, self.leases)
            elif not final:
                log.warning("ignoring an error in a PARTIAL for request %d", rep.id)
            else:
                self._deliver(call, ("error", error_from(rep.error.code, rep.error.message, request_id=rep.id)), True)
            return []
        try:
            res = T.unpack(rep, frames, self.leases, final=final, frame=call.frame, local=self._local_outputs(call))
        except InferenceError as e:
            if final:
                self._finish_inputs(call, rep)
                self._deliver(call, ("error", e), True)
            else:
                log.warning("dropping a PARTIAL of request %d: %s", rep.id, e)
            return []
        if final:
            # After unpacking: inputs handed back as outputs were adopted by the Result.
            self._finish_inputs(call, rep)
            res.timing.setdefault("client_ms", (now - call.t_sent) * 1000.0)
        self._deliver(call, ("final" if final else "partial", res), final)
        return []

    def _local_outputs(self, call: _Call) -> Callable | None:
        pool = self._pool
        if pool is None or call.packed is None or not call.packed.uses_shm:
            return None
        own = pool.name

        def resolve(loc: P.ShmLoc, dt: np.dtype, shape: tuple) -> tuple | None:
            if loc.segment != own:
                return None
            return T.local_output(call.packed, loc, dt, shape, call.adopted, self._free_adopted)

        return resolve

    def _free_adopted(self, ref: Any) -> None:
        self._buffer_dropped(None, ref)

    def _finish_inputs(self, call: _Call, rep: P.Reply | None = None) -> None:
        """The request's FINAL arrived: the one moment no worker (including a retry) can
        read its inputs again."""
        self._free_inputs(call, reply=rep)
        adopted, call.adopted = call.adopted, {}
        for keeper in adopted.values():
            keeper.drop()

    def _resend_inline(self, call: _Call, now: float) -> list[Any]:
        """NOT_LOCAL: the worker cannot see our /dev/shm.  Send the same inputs again inline,
        under a new id (the old one is finished), within what is left of the deadline."""
        log.info("service %r is not on this host; resending request %d inline", call.service, call.id)
        self.not_local.add(call.service)
        call.retried = True
        old = call.packed
        # Copy out of the temporary slots before they are freed.
        call.packed = T.pack(old.arrays, None, copy_inline=True)
        self._free_inputs(call, old)
        if call.reply in ("auto", "shm"):
            call.reply = "inline"
        return self.request_frames(call, now)

    def _free_inputs(self, call: _Call, packed: T.Packed | None = None, reply: P.Reply | None = None) -> None:
        packed = packed or call.packed
        if packed is not None and packed.temp and self._pool is not None:
            T.free_temp(self._pool, packed.temp)
        if packed is not None and packed.cuda_temp and self._cuda is not None:
            # The worker's reads of these slots are ordered before its output events (same
            # worker stream); host and error replies were synchronised before FINAL.
            after = self._cuda.events_of(reply.tensors) if reply is not None else ()
            self._cuda.free_temp(packed.cuda_temp, after=after)

    def _deliver(self, call: _Call, item: tuple[str, Any], final: bool) -> None:
        if final:
            call.done = True
            call.t_done = time.monotonic()
        call.inbox.append(item)
        if call.notify is not None:
            call.notify()

    def fail(self, call: _Call, exc: InferenceError) -> None:
        """Deliver a client-side error (broker silent) to a waiting call."""
        if not call.abandoned and not call.done:
            call.inbox.append(("error", exc))
            if call.notify is not None:
                call.notify()

    def active(self) -> list[_Call]:
        return [c for c in self.calls.values() if not c.abandoned and not c.done]

    def silent_for(self, call: _Call, now: float) -> float:
        return now - max(self.last_recv, call.t_sent)

    def unreachable(self, call: _Call, now: float) -> BrokerUnreachable | None:
        if self.heartbeat_interval is None:
            return None
        silence = self.silent_for(call, now)
        if silence <= LIVENESS * self.heartbeat_interval:
            return None
        return BrokerUnreachable(
            f"the broker at {self.endpoint} has not answered anything, not even heartbeats, for "
            f"{silence:.1f}s (request to {call.service!r} given up)", request_id=call.id or None
        )

    def deadline_error(self, call: _Call) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"no reply from service {call.service!r} within {call.timeout:g}s; the request was cancelled",
            request_id=call.id or None,
        )

    # ---------------------------------------------------------------- shutdown

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for call in list(self.calls.values()):
            call.abandoned = True
            _drain_inbox(call)
        self.calls.clear()
        for fin in list(self._user_bufs.values()):
            fin.detach()
        self._user_bufs.clear()
        self._deferred.clear()
        self.leases.close()
        side, self._cuda = self._cuda, None
        if side is not None:
            side.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def _lenient_id(frame: Any) -> int:
    try:
        m = msgspec.msgpack.decode(memoryview(frame)[4:])
    except Exception:
        return 0
    rid = m.get("id") if isinstance(m, dict) else None
    return rid if isinstance(rid, int) else 0


def _drain_inbox(call: _Call) -> None:
    while call.inbox:
        kind, item = call.inbox.popleft()
        if isinstance(item, Result):
            item.release()


class _ClientFacade:
    """What `Client` and `AsyncClient` expose the same way: properties and buffers, all
    answered by their `_Core`."""

    _core: _Core

    @property
    def endpoint(self) -> str:
        return self._core.endpoint

    @property
    def uses_shm(self) -> bool:
        """Whether inputs go through shared memory (transport resolved against the endpoint)."""
        return self._core.use_shm

    @property
    def pool(self) -> Any:
        """The client's input `shm.ShmPool` (created on first use)."""
        return self._core.pool

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def direct_replies(self) -> int:
        """Replies that came straight from a worker on this host instead of through the
        broker (docs/protocol.md section 8); 0 when `direct_reply=False` or the broker is
        remote."""
        return self._core.direct_replies

    # ---------------------------------------------------------------- buffers

    def alloc(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A writable array in the client's shared memory.  Fill it and pass it to `infer`:
        it is sent by reference, never copied.  It is freed when the array (and every view of
        it) is dropped, or by `free()`; a request never frees it."""
        return self._core.alloc(shape, dtype)

    def alloc_cuda(self, shape: Any, dtype: Any = np.float32, device: Any = "cuda:0") -> Any:
        """A torch CUDA tensor in the client's device pool (created on first use).  Fill it
        (on the current stream) and pass it to `infer`: it is sent by CUDA IPC reference,
        never copied.  Freed when the tensor and every view of it are dropped.  Raises
        NotSupported (with the reason) where CUDA is unavailable."""
        return self._core.alloc_cuda(shape, dtype, device)

    def free(self, arr: np.ndarray) -> None:
        """Free an `alloc()` buffer now.  Do not use the array (or any view) afterwards, and
        not while a request that uses it is in flight."""
        self._core.free(arr)


# ================================================================================================

class Client(_ClientFacade):
    """Blocking client for the inference broker.

    One DEALER socket; not thread-safe (use one client per thread, or `AsyncClient`).
    Results hold zero-copy views of shared memory: see `Result` and docs/client.md for
    their lifetime.
    """

    def __init__(self, endpoint: str, *, transport: str = "auto", timeout: float | None = 10.0,
                 pool_capacity: int = 256 << 20, heartbeat_interval: float | None = 1.0,
                 fallback_inline: bool = True, direct_reply: bool = True):
        self._core = _Core(endpoint, transport=transport, timeout=timeout, pool_capacity=pool_capacity,
                           heartbeat_interval=heartbeat_interval, fallback_inline=fallback_inline,
                           direct_reply=direct_reply)
        self._ctx = zmq.Context.instance()
        self._sock = _dealer(self._ctx, endpoint)
        self._inbox = _ReplyInbox.open(self._ctx, self._core)
        self._items = [(self._sock, _POLLIN)]
        if self._inbox is not None:
            self._items.append((self._inbox.sock, _POLLIN))

    # ---------------------------------------------------------------- requests

    def infer(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
              priority: Any = "normal", meta: Mapping[str, Any] | None = None, reply: str = "auto") -> Result:
        """Run one request and return its FINAL outputs.  PARTIALs, if the service sends any,
        are released unread; use `infer_stream` to see them."""
        with self.infer_stream(service, inputs, timeout=timeout, priority=priority, meta=meta,
                               reply=reply) as replies:
            for res in replies:
                if res.final:
                    return res
                res.release()
        raise ProtocolError("the reply stream ended without a FINAL")  # pragma: no cover

    def infer_stream(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
                     priority: Any = "normal", meta: Mapping[str, Any] | None = None,
                     reply: str = "auto") -> "ReplyStream":
        """Send one request now; iterate to get each PARTIAL as it arrives, then the FINAL.
        Closing the iterator (or leaving a `with` block) before the FINAL cancels the
        request.  `timeout` covers the whole exchange."""
        call = self._core.new_call(service, inputs, timeout=timeout, priority=priority, meta=meta, reply=reply)
        self._send_call(call)
        return ReplyStream(self, call)

    def request(self, service: str, frames: list[bytes], timeout: float | None = None) -> list[bytes]:
        """Send a plain MDP request (opaque body frames) and return the FINAL's body frames.

        Uses a socket of its own (see the module docstring); on timeout it says DISCONNECT on
        it, which drops the request at the broker if it is still queued."""
        out = self._core.opaque_frames(service, frames)
        limit = self._core._timeout(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        sock = _dealer(self._ctx, self.endpoint)
        try:
            sock.send_multipart(out, copy=False)
            while True:
                wait = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                if not sock.poll(wait, zmq.POLLIN):
                    raise DeadlineExceeded(f"no reply from service {service!r} within {limit:g}s")
                done, body = _opaque_reply(sock.recv_multipart(), service)
                if done:
                    return body
        finally:
            _drop_socket(sock)

    def mmi_service(self, name: str, timeout: float | None = None) -> bool:
        """Whether the broker knows a worker for `name` (MMI, RFC 8)."""
        body = self.request(_MMI_SERVICE, [name.encode()], timeout=timeout)
        return _mmi_answer(body, name)

    def stream(self, service: str, *, latest_wins: bool = True, max_in_flight: int = 2,
               timeout: float | None = None, priority: Any = "normal",
               meta: Mapping[str, Any] | None = None, reply: str = "auto"):
        """A frame stream for interactive (AR) use; see `client_sdk.stream.Stream`."""
        from .stream import Stream

        return Stream(self, service, latest_wins=latest_wins, max_in_flight=max_in_flight,
                      timeout=timeout, priority=priority, meta=meta, reply=reply)

    # ---------------------------------------------------------------- socket work

    def _send(self, frames: list[Any], deadline: float | None) -> None:
        sock = self._sock
        while True:
            try:
                send_frames(sock, frames, NOBLOCK)
                self._core.last_send = time.monotonic()
                return
            except zmq.Again:
                # High-water mark reached: the broker is not reading.
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise BrokerUnreachable(
                        f"cannot send to the broker at {self.endpoint}: its queue is full"
                    ) from None
                wait = 1000 if deadline is None else max(1, int((deadline - now) * 1000))
                sock.poll(wait, zmq.POLLOUT)

    def _send_call(self, call: _Call) -> None:
        frames = self._core.request_frames(call, time.monotonic())
        try:
            self._send(frames, call.deadline)
        except BaseException:
            self._core.discard_unsent(call)
            raise

    def _send_call_nowait(self, call: _Call) -> bool:
        """Send without waiting; False (and the call back to unsent) if the socket is full."""
        frames = self._core.request_frames(call, time.monotonic())
        try:
            send_frames(self._sock, frames, NOBLOCK)
        except zmq.Again:
            self._core.unregister(call)
            return False
        except BaseException:
            self._core.discard_unsent(call)
            raise
        self._core.last_send = time.monotonic()
        return True

    def _try_send(self, frames: list[Any] | None) -> None:
        if frames is None:
            return
        try:
            send_frames(self._sock, frames, NOBLOCK)
            self._core.last_send = time.monotonic()
        except zmq.ZMQError:  # full or closed: the broker is gone anyway
            pass

    def _give_up(self, call: _Call) -> None:
        if self._core.closed:
            return
        self._try_send(self._core.abandon(call))

    def _pump(self, timeout: float | None) -> None:
        """Wait up to `timeout` seconds for traffic, then route everything that arrived.
        Sends a heartbeat first when one is due and calls are waiting."""
        core = self._core
        now = time.monotonic()
        hb = core.heartbeat_interval
        if hb is not None and now - core.last_send >= hb and core.active():
            self._try_send(P.client_heartbeat())
        if hb is not None:
            timeout = hb if timeout is None else min(timeout, hb)
        ms = -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))
        # zmq_poll directly: Socket.poll builds a Poller and a dict on every call.
        if not zmq.zmq_poll(self._items, ms):
            return
        self._drain()

    def _drain(self) -> None:
        # EVENTS rather than recv(NOBLOCK) until zmq.Again: an exception per wake-up costs
        # more than the rest of the client's work on a small request.
        core = self._core
        for sock, _ in self._items:
            direct = sock is not self._sock
            while sock.get(zmq.EVENTS) & _POLLIN:
                frames = recv_frames(sock)
                for out in core.on_message(frames, time.monotonic(), direct):
                    self._try_send(out)

    def _wait(self, call: _Call, limit: float | None = None) -> tuple[str, Any]:
        """Next item for `call`.  Raises DeadlineExceeded at the call's deadline, TimeoutError
        after `limit` seconds (the call stays in flight), BrokerUnreachable on silence."""
        core = self._core
        stop = None if limit is None else time.monotonic() + limit
        while not call.inbox:
            now = time.monotonic()
            if call.deadline is not None and now >= call.deadline:
                raise core.deadline_error(call)
            if stop is not None and now >= stop:
                raise TimeoutError(f"no result within {limit:g}s; the request is still in flight")
            err = core.unreachable(call, now)
            if err is not None:
                raise err
            ends = [t for t in (call.deadline, stop) if t is not None]
            self._pump(min(ends) - now if ends else None)
        return call.inbox.popleft()

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Tell the broker we are leaving, close the socket, unlink the input pool.  Results
        still alive stay readable; their output slots go back as they are dropped."""
        if self._core.closed:
            return
        try:
            self._sock.send_multipart(P.client_disconnect(), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._sock.close(linger=CLOSE_LINGER_MS)
        if self._inbox is not None:
            self._inbox.close()
        self._core.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("shm" if self.uses_shm else "inline")
        return f"<Client {self.endpoint} {state}>"


def _opaque_reply(frames: list[Any], service: str) -> tuple[bool, list[bytes]]:
    """(True, body) for the FINAL of an opaque request; raises its error; (False, []) for
    anything else (a PARTIAL, a heartbeat)."""
    try:
        msg = P.parse_broker_to_client(frames)
        if msg.command != P.C_FINAL:
            return False, []
        body = [bytes(f) for f in msg.body]
        rep = P.decode_reply(body[0], len(body) - 1) if body and P.is_header(body[0]) else None
    except P.ProtocolError as e:
        raise ProtocolError(f"bad reply to an opaque request to {service!r}: {e}") from None
    if rep is not None:
        if rep.error is not None:
            raise error_from(rep.error.code, rep.error.message)
        raise ProtocolError(f"service {service!r} answered an opaque request with a tensor header")
    return True, body


def _drop_socket(sock: zmq.Socket) -> None:
    """DISCONNECT (drops the request at the broker if it is still queued), then close."""
    try:
        sent = sock.send_multipart(P.client_disconnect(), flags=zmq.NOBLOCK)
        if hasattr(sent, "exception") and sent.done():  # an asyncio socket returns a future
            sent.exception()
    except zmq.ZMQError:
        pass
    sock.close(linger=CLOSE_LINGER_MS)


class _ReplyInbox:
    """The client's direct-reply socket: a PULL bound to an ipc path that only this user can
    reach (the runtime directory is mode 0700).  Workers on this host connect to it and send
    FINALs there (docs/protocol.md section 8).  libzmq leaves the socket file behind on close,
    so `close` unlinks it; the broker sweeps the files of clients that died (SIGKILL)."""

    def __init__(self, sock: zmq.Socket, path: str):
        self.sock = sock
        self.path = path
        # A client dropped without close() still removes its file (at collection or exit).
        self._unlink = weakref.finalize(self, _unlink_quietly, path)

    @classmethod
    def open(cls, ctx: zmq.Context, core: _Core) -> "_ReplyInbox | None":
        if not core.direct_reply:
            return None
        path = P.reply_socket_path()
        if len(path.encode()) > 100:  # sun_path holds 108 bytes: keep the relayed path instead
            log.info("runtime directory path too long for a reply socket; replies go through the broker")
            return None
        sock = ctx.socket(zmq.PULL)
        sock.linger = 0
        sock.rcvhwm = 100_000
        try:
            sock.bind("ipc://" + path)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            log.info("cannot bind a reply socket (%s); replies go through the broker", e)
            return None
        core.reply_to = "ipc://" + path
        return cls(sock, path)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._unlink()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise InvalidInput(f"cannot connect to {endpoint!r}: {e}; check the endpoint's spelling") from None
    return sock


class _ReplyStreamBase:
    """What the blocking and the asyncio reply streams share: the call, and giving up on it
    (CANCEL to the broker) when closed or dropped before its FINAL."""

    def __init__(self, client: Any, call: _Call):
        self._client = client
        self._call = call
        self._finished = False

    @property
    def request_id(self) -> int:
        return self._call.id

    def close(self) -> None:
        """Stop listening; cancels the request if its FINAL has not arrived."""
        if not self._finished:
            self._finished = True
            self._client._give_up(self._call)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class ReplyStream(_ReplyStreamBase):
    """Iterator over the replies to one request (`Client.infer_stream`)."""

    def __iter__(self) -> "ReplyStream":
        return self

    def __next__(self) -> Result:
        if self._finished:
            raise StopIteration
        try:
            kind, item = self._client._wait(self._call)
        except BaseException:
            self.close()
            raise
        if kind == "error":
            self._finished = True
            raise item
        if kind == "final":
            self._finished = True
        return item

    def __enter__(self) -> "ReplyStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _mmi_answer(body: list[bytes], name: str) -> bool:
    code = bytes(body[0]) if body else b""
    if code == b"200":
        return True
    if code == b"404":
        return False
    raise ProtocolError(f"mmi.service answered {code!r} for {name!r}; expected b'200' or b'404'")
