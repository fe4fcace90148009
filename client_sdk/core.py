"""The client's socket-free core: everything `Client` and `AsyncClient` share that is not I/O.

`ClientCore` is fed frames and the current time by its front end ("twin": `Client` in
client.py, `AsyncClient` in aio.py) and returns frames to send; it never touches a socket,
an event loop or the clock.  What a twin does with it:

    call = core.new_call(service, inputs, ...)    pack inputs (by reference, temp slot, inline)
    frames = core.request_frames(call, now)       assign an id, register, build the REQUEST
    outs = core.on_message(frames, now, direct)   route one reply; `outs` are frames to send
                                                  (the inline resend after NOT_LOCAL)
    frames = core.give_up(call)                   the caller stopped waiting: CANCEL, or None
    core.fail_unreachable(now)                    liveness: fail calls (and MMI questions) whose broker fell silent
    q = core.mmi_question(name); send q.frames; core.expect_mmi(q, now)   an MMI question

Delivery.  A reply is put in its call's `inbox` (("partial" | "final", Result) or
("error", InferenceError)), then `call.notify()` runs if the twin set one (an asyncio event,
a stream's wake-up).  An MMI answer goes to its `MmiQuery` the same way.  The core holds no
future: the blocking twin just looks at the inbox after each pump.  A question the broker
stays silent on is failed as a call is (`MmiQuery.error`, then its `notify()`).

Invariants a maintainer must keep:

- An input slot (host or CUDA) is freed only when the FINAL or error that answers its request
  arrives, or when the request never reached the wire.  Never at timeout or cancellation: a
  worker, or a retry on another worker, may be reading it until the broker sends that FINAL.
- Request ids are unique per client and never reused; a FINAL finds its call at most once
  (`calls.pop`), so a duplicate (a direct reply raced by its relayed copy after a retry) finds
  nothing, its output slots are given back unread, and it is counted in `discarded`.
- The broker answers MMI itself, in the order it receives the questions.  Each question
  carries a token that our broker echoes, and an answer goes to the waiter with its token;
  the waiters ahead of it lost their answers (a broker restart) and abandoned ones are
  dropped.  An answer without a token (a broker that does not echo) matches the oldest
  waiter; an abandoned waiter still consumes its own late answer.
- One thread drives the core.  Only finalizers of user buffers may run elsewhere: their
  frees are deferred to the owner thread's next call (the pools are single-threaded).
"""
from __future__ import annotations

import itertools
import logging
import math
import operator
import os
import secrets
import threading
import weakref
from collections import deque
from typing import Any, Callable, Mapping

import msgspec
import numpy as np

import shm as _shm
from broker import protocol as P
from broker.protocol import ErrorCode
from broker.protocol.wire import MAX_FRAMES
from shm.segment import max_capacity
from shm.pool import ShmPool  # (at import: `shm` loads it at first use, which may find no descriptor left)

from . import tensors as T
from .calls import (MMI_SERVICE, Call, MmiQuery, check_service, deadline_exceeded, endpoint_is_local, parse_priority,
                    resolve_transport)
from .errors import BrokerUnreachable, InferenceError, InvalidInput, PoolFull, ProtocolError, error_from
from .pins import PinEvents, forget_stale
from .tensors import Result

__all__ = ["ClientCore", "LIVENESS"]

log = logging.getLogger("client_sdk")

#: heartbeat intervals of silence (no reply, not even to a heartbeat) before the broker is
#: declared unreachable for a waiting call
LIVENESS = 5

_MMI_SERVICE_B = MMI_SERVICE.encode()
#: every request id of this process's clients (`ClientCore._ids`): from a random start, one
#: count for all (`next` is one step under the GIL), so an id names one client's request
_IDS = itertools.count(1 + secrets.randbelow(1 << 31))
#: request ids given up on without their answer (`ClientCore._give_up`), kept so that the
#: output slots a worker lent for them, in replies lost on their way, go back: at most this
#: many, each for this many heartbeat looks (ten minutes at the default interval: a request
#: that ran that long on a worker while its broker restarted still has its slots found)
GIVEN_UP_MAX = 4096
GIVEN_UP_LOOKS = 600

#: service names whose check (and UTF-8 encoding) a client remembers, so that the next
#: request to one skips both; bounded, for a client that makes up names as it goes
_SERVICE_CACHE = 256

# This process's pid, for request headers (a worker reclaims a dead client's output slots by
# it): os.getpid() is a system call, and a forked child gets its own value here.
_pid = os.getpid()


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def _drain_inbox(call: Call) -> None:
    while call.inbox:
        kind, item = call.inbox.popleft()
        if isinstance(item, Result):
            item.release()


# ------------------------------------------------------------------------------------ the core

#: seconds between two looks at this process's descriptors while it names its reply inbox:
#: near its limit (under half of it free), and far from it
ROOM_LOOK_S = 1.0
ROOM_LOOK_FAR_S = 5.0
#: longest wait before a client that fell back to inline tries shared memory again (seconds)
NOT_LOCAL_RETRY_MAX_S = 30.0
#: A call's deadline found passed by more than this: the process was not running when it
#: passed (stopped, starved), and a reply that came meanwhile may still be on its way through
#: libzmq's I/O thread, which runs again only now.  Such a call looks at its sockets once
#: more, for up to `LAST_LOOK_S`, before it raises DeadlineExceeded: a client stopped past a
#: call's timeout while its result came got the result or the error by a race of threads.
PAUSED_S = 0.02
LAST_LOOK_S = 0.1
#: A tcp broker that refused this client's handshake for its protocol (CurveZMQ on one side
#: only) or its key (ZAP): libzmq 4.3 gives the endpoint up for good at either (a protocol
#: error ends its connecting session; only refused, timed-out and dropped connections are
#: tried again), so a client that met a broker restarted with other security settings
#: stayed unconnected once the broker was put right, every call "its queue is full".  The
#: client dials again itself (`sockets.redial`): at once at the first refusal heard, then at
#: most once per `REDIAL_S` while the broker refuses.
REDIAL_S = 1.0
#: How the word on a handshake the broker failed without detail begins (`sockets.handshakes`):
#: a refusal with detail is not replaced by it (`broker_said`).
NO_DETAIL = "no detail given"
#: what a plain tcp client (`insecure=True`) is told of such a handshake: `sockets`' word
#: blames `server_key`, which it has none of (the client audit)
PLAIN_NO_DETAIL = (f"{NO_DETAIL}; this client speaks plain tcp (`insecure=True`): most likely the broker has keys "
                   "and cut its greeting short (give the client `server_key` and `client_key`, or run the broker "
                   "--insecure), else the broker went away during the handshake")
#: ... and a client whose keys that endpoint took before: `sockets`' word blamed
#: `server_key` for handshakes a restarting or overloaded broker cut short (the
#: reconnect-storm audit: correctly configured clients were told to check their keys)
KNOWN_NO_DETAIL = (f"{NO_DETAIL}; this client's keys were taken by this endpoint before: most likely the broker "
                   "restarted, is overloaded, or cut the handshake short (the client keeps dialling; the broker's "
                   "log says the cause: if it restarted with another key pair, give the client its new `server_key`)")


def _check_meta(meta: dict) -> None:
    """InvalidInput for a ``meta`` over `MAX_META_BYTES` (parameters for the model; data goes
    in tensors): encoded once more, only when the header it went into is that long."""
    n = len(msgspec.msgpack.encode(meta))
    if n > P.MAX_META_BYTES:
        raise InvalidInput(f"meta takes {n} bytes as msgpack; the limit is {P.MAX_META_BYTES}: it is for parameters, "
                           f"send data as tensors")


def _checked_route(service: Any, reply: Any, traceparent: Any) -> str:
    """`service`, `reply` and `traceparent` of a request checked (InvalidInput); `reply` as a
    plain str."""
    check_service(service)
    if service.startswith(P.MMI_PREFIX):
        raise InvalidInput(f"{service!r} is a broker query (MMI, RFC 8), not a service: it takes no tensors; "
                           "use client.mmi_service(name), or client.request() for another mmi. query")
    if not isinstance(reply, str) or reply not in P.REPLY_MODES:  # (a list: unhashable)
        raise InvalidInput(f"reply {reply!r} must be one of {sorted(P.REPLY_MODES)}")
    if traceparent is not None and not isinstance(traceparent, str):
        raise InvalidInput(f"traceparent must be a str ('00-<32 hex>-<16 hex>-<2 hex>') or None, "
                           f"got {type(traceparent).__name__}")
    return str.__str__(reply)  # a str subclass (numpy's str_) equal to one: the header takes str itself


def _meta_dict(meta: Any) -> dict:
    """A request's ``meta`` as a dict of str keys (InvalidInput otherwise)."""
    if meta is not None and not isinstance(meta, Mapping):
        raise InvalidInput(f"meta must be a dict of str keys, got {type(meta).__name__}")
    out = dict(meta or {})
    for key in out:  # msgpack takes other keys; the worker refused them as a protocol error
        if type(key) is not str:
            raise InvalidInput(f"meta keys must be str; got {key!r} ({type(key).__name__})")
    return out


def _unencodable_meta(e: Exception) -> str:
    return (f"meta cannot be encoded as msgpack ({type(e).__name__}: {e}); use str (valid UTF-8), int (within 64 "
            "bits), float, bool, list and dict values, and str keys")


def _unencodable(call: Call, e: Exception) -> str:
    """What in a request's header cannot be encoded, for `InvalidInput` (the error path only)."""
    for t in call.packed.tensors:
        try:
            t.name.encode()
        except UnicodeEncodeError as u:
            return f"input name {t.name!r} is not valid UTF-8 ({u.reason})"
        if type(t.name) is not str:  # a str subclass: msgspec takes str itself only
            return f"input name {t.name!r} is a {type(t.name).__name__}; give a str"
    return _unencodable_meta(e)


def _number(x: Any) -> float:
    """``x`` as a float, NaN for what is not a number (a str, a bool, None, an object)."""
    if isinstance(x, (str, bytes, bool)):
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def flag(name: str, value: Any) -> bool:
    """An on/off option: a bool (or 0 or 1, numpy's too); `InvalidInput` naming it for
    anything else.  A str was taken for its truth: ``fallback_inline="false"`` (a value read
    from the environment, say) turned the fallback on."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    try:
        v = operator.index(value)
    except TypeError:
        v = -1
    if v not in (0, 1):
        raise InvalidInput(f"{name} must be True or False, got {value!r}")
    return bool(v)


def _seconds(t: Any) -> float | None:
    """A timeout in seconds: None for none (None or math.inf), else a positive float;
    `InvalidInput` naming the value for anything else (0, negative, NaN, a str)."""
    if t is None:
        return None
    f = _number(t)
    if f == math.inf:
        return None  # wait as long as it takes
    if not f > 0:
        raise InvalidInput(f"timeout must be a positive number of seconds (or None or math.inf), got {t!r}")
    return f


#: The shortest client heartbeat interval taken: below it the liveness window (5 intervals)
#: is shorter than a broker's round trip under load, and every call failed at once with
#: BrokerUnreachable ("has not answered for 0.0s", found by the edge hunt).
MIN_HEARTBEAT_S = 0.001


def wait_limit(timeout: Any) -> float | None:
    """A `timeout=` that bounds one wait (`recv`, `result`, `pump`): None (or math.inf) for
    none, else a float >= 0 (a negative one is 0: look once, do not wait); `InvalidInput`
    for NaN or what is not a number (NaN had meant "for ever" to one call and "at once" to
    another)."""
    if timeout is None:
        return None
    f = _number(timeout)
    if f != f:
        raise InvalidInput(f"timeout must be None or a number of seconds, got {timeout!r}")
    return None if f == math.inf else max(0.0, f)


#: seconds `close()` waits, by default, for the answers of the requests it cancels (`linger`)
CLOSE_LINGER_S = 1.0


def close_linger(linger: Any) -> float:
    """`linger` (a client's, or one `close()`'s) as a float of seconds >= 0; `InvalidInput`
    for anything else (negative, NaN, infinite, a str)."""
    f = _number(linger)
    if not 0 <= f < math.inf:
        raise InvalidInput(f"linger must be a number of seconds >= 0 (close() waits that long at most "
                           f"for the answers of requests in flight; {CLOSE_LINGER_S:g} by default), got {linger!r}")
    return f


def _heartbeat_interval(hb: Any) -> float | None:
    """`heartbeat_interval` as the core keeps it: None (or 0) for no heartbeats, else a
    float of at least MIN_HEARTBEAT_S; `InvalidInput` for anything else (negative, NaN, a str)."""
    if hb is None:
        return None
    f = _number(hb)
    if f == 0:
        return None
    if not MIN_HEARTBEAT_S <= f < math.inf:
        raise InvalidInput(f"heartbeat_interval must be None (no heartbeats) or a number of seconds from "
                           f"{MIN_HEARTBEAT_S} up, got {hb!r}")
    return f



#: the most body frames of a plain MDP request (`opaque_frames`): the broker's bound on a
#: message's frames (`wire.MAX_FRAMES`), less the frames around the body (its routing id,
#: MDPC02, the command, the service name)
MAX_BODY_FRAMES = MAX_FRAMES - 4

class ClientCore(PinEvents):
    """Ids, packing, the input pools, output leases, reply routing and delivery, the inline
    fallback, deadlines and liveness of one client (see the module docstring); pinned
    streams (leases) in its `PinEvents` mixin (pins.py)."""

    def __init__(self, endpoint: str, *, transport: str = "auto", timeout: float | None = 10.0,
                 pool_capacity: int = 256 << 20, heartbeat_interval: float | None = 1.0,
                 fallback_inline: bool = True, direct_reply: bool = True, restart_resends: int = 2,
                 pin: Any = False, max_inline_mb: float = 256, linger: float = CLOSE_LINGER_S):
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise InvalidInput(f"endpoint {endpoint!r} must look like 'ipc:///tmp/broker.sock' or 'tcp://host:port'")
        if (isinstance(max_inline_mb, bool) or not isinstance(max_inline_mb, (int, float))
                or not 0 < max_inline_mb < float("inf")):
            raise InvalidInput(f"max_inline_mb {max_inline_mb!r} must be a number of MiB > 0")
        #: the largest tensor sent inline: a larger one the broker would drop with its
        #: connection (its --max-frame-mb, 256 by default), seen here as a reconnect
        self.max_inline_bytes = int(max_inline_mb * (1 << 20))
        self.endpoint = endpoint
        self.transport = transport
        self.use_shm = resolve_transport(transport, endpoint)
        # transport="shm" means every tensor by reference; "auto" sends small ones inline
        # (P.SMALL_INLINE_BYTES), and lets the worker answer small outputs inline too.
        self.inline_max = 0 if transport == "shm" else P.SMALL_INLINE_BYTES
        _seconds(timeout)  # checked now: every call would otherwise raise for the default
        self.timeout = timeout
        try:
            # A whole number (numpy's too): int() took 1.5 as 1 and "256" as a pool of 256
            # bytes (the configuration hunt; restart_resends refused them already).
            capacity = operator.index(pool_capacity)
        except TypeError:
            capacity = 0
        if isinstance(pool_capacity, bool) or not 1 <= capacity < 1 << 62:
            raise InvalidInput(f"pool_capacity {pool_capacity!r} must be a whole number of bytes >= 1 (256 << 20 by default)")
        if capacity > max_capacity():  # (workers would refuse its segment, as a protocol bug)
            raise InvalidInput(f"pool_capacity {capacity} is over the {max_capacity()} bytes a worker maps of a "
                               f"client's pool (64 GiB with its header and slot table)")
        self.pool_capacity = capacity
        try:
            resends = operator.index(restart_resends)  # (1.5, "2": not a count)
        except TypeError:
            resends = -1
        if isinstance(restart_resends, bool) or resends < 0:
            raise InvalidInput(f"restart_resends {restart_resends!r} must be a whole number >= 0 (2 by default)")
        self.restart_resends = resends
        self.heartbeat_interval = _heartbeat_interval(heartbeat_interval)
        self.linger = close_linger(linger)
        self.fallback_inline = flag("fallback_inline", fallback_inline)
        # Direct replies need a broker (hence workers) that can reach an ipc socket of ours.
        self.direct_reply = flag("direct_reply", direct_reply) and endpoint_is_local(endpoint)
        self.reply_to: str | None = None  # what requests name: the inbox, while descriptors allow (use_inbox)
        self._inbox_ep: str | None = None
        self._room: Callable[[], bool] | None = None
        self._room_at = 0.0  # when to look at the descriptors again
        self._host = P.local_host_id()    # for every request header (constant per process)
        self._service_b: dict[str, bytes] = {}  # service names checked: their UTF-8 (_SERVICE_CACHE)
        self._bad = P.RateLimitedLog(log)  # a broken or hostile peer's replies: one line a second
        self._pool: Any = None
        self._cuda: Any = None  # CudaSide, created by the first CUDA tensor or alloc_cuda
        self.leases = T.OutputLeases()
        self._user_bufs: dict[tuple[str, int, int], weakref.finalize] = {}
        self._owner_thread = threading.get_ident()
        self._gen = T.fork_generation()  # a forked child's copy is refused, and gives nothing back
        self._creator = os.getpid()
        self._deferred: deque[Any] = deque()
        # Request ids come from one count per process (`_IDS`): two clients of one process (or
        # one made again) name different requests in the logs' rid=<pid>:<id>, and a worker's
        # output slot, lent to this pid for a request id (its `lend_tag`), is one client's.
        self._ids = _IDS
        self._given_up: dict[int, int] = {}  # request id -> `_looks` when given up
        self._looks = 0
        self.calls: dict[int, Call] = {}
        # service -> when (on the clock of `now`, as last seen) to try shared memory again: a
        # service with no worker on this host may get one later (a worker started or moved).
        self.not_local: dict[str, float] = {}
        self._not_local_backoff: dict[str, float] = {}
        # Silence is counted from max(last_recv, call.t_sent) (silent_for), so before the
        # first message the call's own send time is the reference.
        self.last_recv = 0.0
        self.last_send = 0.0
        # Set by a twin: why its endpoint cannot be connected to, asked only for the error of
        # a call the broker never answered (`sockets.ipc_problem`; it looks at the file system).
        self.endpoint_problem: Callable[[], str | None] | None = None
        #: why the broker refused this client's latest tcp handshake (None: it did not)
        self.refused: str | None = None
        self.handshook = False  # a handshake with the broker succeeded once (`broker_said`)
        self.connections = 0    # ... how many times (each a new connection)
        #: the error of a call made while the broker's latest word was a refusal for good
        #: (`refused_for_good`; None once a handshake succeeds)
        self.shut_out: Callable[[int | None], InferenceError] | None = None
        # A connection was replaced before any heartbeat answer named the broker: what was
        # sent on it may be lost, told by the next answer (`_on_broker_instance`).
        self._replaced_unheard = False
        # ... then the time of the first answer, which the next one says the connection of
        self._confirm_before: float | None = None
        #: when to dial the broker again, libzmq having given its endpoint up at a refused
        #: handshake (None: not needed; `broker_said`, `redialed`)
        self.redial_at: float | None = None
        self._redialed = -math.inf
        self.last_heartbeat = 0.0
        self._first_unanswered: float | None = None  # the first heartbeat sent since the broker's last word
        # When the client last looked at its sockets (`looking`), and when it came back from
        # an absence longer than a heartbeat period: silence is counted from then too, since
        # nothing could be heard (or asked) while nobody looked.
        self.last_look: float | None = None
        self.resumed_at = 0.0
        self.broker_instance: bytes | None = None  # from the broker's heartbeat answers
        self.broker_window: float | None = None    # ... and how long it waits for our heartbeats
        self.broker_restarts = 0
        # The identity the broker's ROUTER gave our connection, from its heartbeat answers: a
        # new one (same instance) means libzmq connected again (a reset, a partition cut by
        # keepalive, a broker that closed it), and what went to the old one is lost.
        self.broker_route: bytes | None = None
        self.broker_reconnects = 0
        self.resent = 0  # brokered calls sent again after a restart or a replaced connection
        # Counts the answers that named the connection: a stream whose first PARTIAL is
        # stamped with the current value got it after the last of them (`_on_broker_instance`)
        self._route_mark = 0
        # streams that may have been lost with a replaced connection: id -> (call, since)
        self._suspects: dict[int, tuple[Call, float]] = {}
        self.closed = False
        self.discarded = 0   # late or unknown replies dropped (for tests and debugging)
        self.plain_tcp = False  # a tcp client without keys (`insecure=True`): set by the twin
        self.given_up_returned = 0  # output slots of given-up requests given back (`_return_given_up`)
        self.direct_replies = 0  # replies that came straight from a worker (reply_to)
        self.mmi_waiters: deque[MmiQuery] = deque()  # MMI questions sent, oldest first
        self._mmi_seq = 0
        self._mmi_in_order = False  # an MMI answer came without its token: answers go by order
        self._init_pins(pin)  # leases (pins.py); pin=False: asked for only on a stream's service
        if self.pin_slots and self.heartbeat_interval is None:
            raise InvalidInput("pin=True needs heartbeats (heartbeat_interval > 0): a leaseholder the broker "
                               "does not hear from loses its lease")

    # ---------------------------------------------------------------- pools and buffers

    @property
    def pool(self) -> Any:
        """The input pool, created on first use (an inline-only client never touches /dev/shm)."""
        if self._pool is None:
            self.check_open()
            try:
                self._pool = ShmPool(self.pool_capacity)
                self.leases.own_segment = self._pool.name
            except (OSError, _shm.ShmError) as e:
                transient = isinstance(e, _shm.OutOfResources) or (
                    isinstance(e, OSError) and e.errno in _shm.RESOURCE_ERRNOS)
                if self.transport == "shm" or transient:
                    # Out of descriptors or memory is this moment's, not the host's: the next
                    # call tries again (the request path sends inline meanwhile), and alloc()
                    # says so in a typed error.  Before, shared memory was off for good.
                    raise InferenceError(
                        f"cannot create a shared-memory pool ({e})" + (
                            "; this process is out of descriptors or memory: raise its RLIMIT_NOFILE, or "
                            "retry" if transient else "; use transport='inline'"), code=None) from None
                log.warning("shared memory unavailable (%s); sending tensors inline", e)
                self.use_shm = False
                raise
        return self._pool

    def alloc(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        if self.closed or self._gen != T.fork_generation():
            # A forked child's copy: its pool is the parent's, whose next alloc() was handed
            # the same slot (the child's writes went out in the parent's next request).
            self.check_open()
        self.run_deferred()
        if shape is True or shape is False or (type(shape) in (tuple, list) and bool in map(type, shape)):
            # (shm's fast path takes a bool for 0 or 1, as Python's arithmetic does)
            raise InvalidInput(f"alloc({shape!r}, {dtype!r}): a dimension is a bool; give a shape of ints >= 0")
        try:
            src = self.pool.alloc(shape, dtype)
        except _shm.ShmFull as e:  # its message names the pool's own argument, capacity=: the client's is pool_capacity=
            raise PoolFull(f"alloc: {e} (the client's pool holds pool_capacity bytes: pass a larger pool_capacity, "
                           "or free alloc() buffers and release results sooner)") from None
        except InferenceError:
            raise
        except (TypeError, ValueError, OverflowError) as e:  # a bad shape or dtype (object, no size, ...)
            raise InvalidInput(f"alloc({shape!r}, {dtype!r}): {e}; give a shape of ints >= 0 and a numeric, "
                               "bool, string or datetime dtype") from None
        ref = self._pool.ref_of(src)
        key = (ref.segment, ref.slot, ref.generation)
        arr, fin = T.lease_array(src, self._buffer_dropped, key, ref)
        self._user_bufs[key] = fin
        return arr

    def cuda_side(self, device: Any = None) -> Any:
        """The client's CUDA side (device pool + pool cache), created on first use;
        NotSupported with the reason where CUDA is unavailable."""
        if self._cuda is None:
            self.check_open()
            from .cuda import CudaSide

            self._cuda = CudaSide(self.pool_capacity, device)
            self.leases.cuda_cache = self._cuda.cache
        return self._cuda

    def alloc_cuda(self, shape: Any, dtype: Any = np.float32, device: Any = "cuda:0") -> Any:
        self.check_open()
        side = self.cuda_side(device)
        side.check_device(device)
        return side.alloc(shape, dtype)

    def _buffer_dropped(self, key: tuple[str, int, int] | None, ref: Any) -> None:
        if self._gen != T.fork_generation():
            return  # a forked child's copy of a buffer or an adopted result: the parent's slot
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
        if self.closed:  # its pool went with it, alloc() buffers included: nothing to free
            raise InferenceError("this client is closed: its alloc() buffers were freed with its pool by close() "
                                 "(do not use them any more)", code=None)
        self.check_open()  # a forked child's copy: the buffers are the parent's (it returned None, freeing nothing)
        # The array alloc() returned itself, not a view of it: a slice's bytes lie in the
        # same slot, and freeing it freed the whole buffer, which the next alloc() then
        # shared with the array it was sliced from (silently mixed data).
        src = T.alloc_source(arr) if self._pool is not None and isinstance(arr, np.ndarray) else None
        ref = self._pool.ref_of(src) if src is not None else None
        fin = self._user_bufs.pop((ref.segment, ref.slot, ref.generation), None) if ref is not None else None
        if fin is None:
            if (src is None and self._pool is not None and isinstance(arr, np.ndarray)
                    and T.ref_in_pool(self._pool, arr) is not None):
                raise InvalidInput("free() takes the array alloc() returned, not a view of it (a slice, a "
                                   "reshape): the buffer is freed whole, views included")
            raise InvalidInput("free() takes an array returned by alloc() that was not freed yet")
        fin()

    # ---------------------------------------------------------------- building requests

    def check_open(self) -> None:
        if self.closed:
            raise InferenceError("this client is closed; create a new one", code=None)
        if self._gen != T.fork_generation():
            # Its sockets are libzmq's in the parent (a child that used them spun forever),
            # its slots and buffers the parent's.
            raise InvalidInput(f"this client was made in process {self._creator}, which forked this one; "
                               "make a new client in this process")

    def forked(self) -> bool:
        """Whether this is a forked child's copy of the client (unusable: `check_open`)."""
        return self._gen != T.fork_generation()

    def let_go(self) -> None:
        """A forked child's `close`: this copy is closed and drops what it refers to, closing
        nothing (the pool, the mappings, the CUDA side and their shared tables are the
        parent's: closing the CUDA pool's would reclaim the parent's slots)."""
        self.closed = True
        self.calls.clear()
        self._parked.clear()
        self.ops.clear()
        for fin in list(self._user_bufs.values()):
            fin.detach()
        self._user_bufs.clear()
        self._deferred.clear()
        self._pool = self._cuda = None

    def timeout_of(self, timeout: float | None) -> float | None:
        """Seconds a request may take: `timeout`, else the client's default; None for no limit."""
        return _seconds(self.timeout if timeout is None else timeout)

    def check_stream_options(self, service: str, *, timeout: float | None, priority: Any,
                             meta: Mapping[str, Any] | None, reply: str) -> None:
        """What `stream()` checks when it opens: the options each of its frames will carry,
        refused as `new_call` (and the header) would refuse them, so that a bad one raises
        `InvalidInput` here rather than at every `send()`."""
        self.check_open()
        _checked_route(service, reply, None)
        self.timeout_of(timeout)
        parse_priority(priority)
        meta = _meta_dict(meta)
        if meta:
            try:
                msgspec.msgpack.encode(meta)
            except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
                raise InvalidInput(_unencodable_meta(e)) from None
            _check_meta(meta)

    def new_call(self, service: str, inputs: Mapping[str, Any], *, timeout: float | None = None,
                 priority: Any = "normal", meta: Mapping[str, Any] | None = None, reply: str = "auto",
                 copy_inline: bool = False, traceparent: str | None = None) -> Call:
        """Check the arguments and pack the inputs; nothing is registered or sent yet."""
        # The defaults, to a service already checked (the usual request): nothing to check,
        # and the Call's own defaults (normal priority, no meta, no traceparent) stand.
        plain = (meta is None and traceparent is None and reply == "auto" and type(priority) is str
                 and priority == "normal" and type(service) is str and service in self._service_b
                 and not self.closed and self._gen == T.fork_generation())
        if not plain:
            self.check_open()
            reply = _checked_route(service, reply, traceparent)
        if self._deferred:
            self.run_deferred()
        if self._cuda is not None:
            self._cuda.poll()
        call = Call(service, timeout=self.timeout_of(timeout))
        if not plain:
            call.priority = parse_priority(priority)
            call.meta = _meta_dict(meta)
            call.traceparent = traceparent
            if len(self._service_b) < _SERVICE_CACHE:
                self._service_b[service] = service.encode()  # checked: the next call may skip that
        retry_at = self.not_local.get(service) if self.not_local else None
        inline = not self.use_shm or (retry_at is not None and self.last_recv < retry_at)
        if self.pins and not inline:
            pin = self.pins.get(service)  # pin_inline(), inlined: this runs for every request
            if pin is not None and not pin.near:
                inline = True  # its lease is not near: only inline tensors can go on it
        call.probe = self.use_shm and retry_at is not None and not inline
        asked = reply
        call.reply = ("inline" if inline else "auto") if reply == "auto" else reply
        pool = None
        if not inline:
            pool = self._pool
            if pool is None:
                try:
                    pool = self.pool  # created on first use
                except (OSError, _shm.ShmError, InferenceError):
                    if self.transport == "shm":
                        raise
                    pool = None
                    if call.reply == "auto":
                        call.reply = "inline"
        # CUDA IPC only reaches workers on this host, exactly as shared memory does.
        call.packed = packed = T.pack(inputs, pool, copy_inline=copy_inline,
                                      cuda=None if inline else self.cuda_side, inline_max=self.inline_max,
                                      max_inline_bytes=self.max_inline_bytes)
        if asked == "auto" and call.reply == "auto" and self.transport == "shm" and pool is not None:
            # transport="shm": outputs in shared memory too, whatever their size; except
            # for CUDA inputs, whose outputs may stay on the device ("auto" there).
            if not any(type(t.loc) is P.CudaLoc for t in packed.tensors):
                call.reply = "shm"
        if call.probe:
            # A probe asks whether shared memory works again: one with only small (inline)
            # tensors cannot tell, so it is a plain request and the backoff stands.
            call.probe = any(type(t.loc) is not P.InlineLoc for t in packed.tensors)
        return call

    def opaque_frames(self, service: str, frames: list[Any]) -> list[Any]:
        """REQUEST frames of a plain MDP request (checked, not sent)."""
        self.check_open()
        check_service(service)
        if not isinstance(frames, (list, tuple)):
            raise InvalidInput(f"frames must be a list of bytes-like body frames, got {type(frames).__name__}")
        if not frames:
            raise InvalidInput("an MDP request needs at least one body frame")
        if len(frames) > MAX_BODY_FRAMES:
            # (the broker drops a message of more frames unread, and the connection with it:
            # the call waited for its deadline)
            raise InvalidInput(f"an MDP request of {len(frames)} body frames: at most {MAX_BODY_FRAMES} (the broker "
                               f"refuses a message of more than {MAX_FRAMES} frames); join them into fewer")
        for f in frames:
            if not isinstance(f, (bytes, bytearray, memoryview)):
                try:
                    memoryview(f)
                except TypeError:
                    raise InvalidInput(f"body frames must be bytes-like, got {type(f).__name__}") from None
        if P.is_header(frames[0]):
            raise InvalidInput("an opaque body must not start with the tensor header magic; use infer()")
        return P.client_request(service, list(frames))

    @staticmethod
    def check_submittable(call: Any) -> None:
        """`submit` takes a call that `prepare` made and nothing has sent yet (InvalidInput
        before anything is touched): one in flight, answered or given up, submitted again,
        named input slots that were freed at its FINAL (another call's by then: the worker
        read that call's tensors) or left the first run's answer to the second's caller."""
        if type(call) is not Call:
            raise InvalidInput(f"submit() takes a call made by prepare(), got {type(call).__name__}")
        if call.id or call.done or call.abandoned:
            raise InvalidInput("this call was submitted already (in flight, answered or given up): "
                               "prepare() a new one for each request")

    def request_frames(self, call: Call, now: float) -> list[Any] | None:
        """Assign an id, register the call and return its REQUEST frames.  On a pinning
        client (or to a service pinned on demand by a stream) `call.pin` then says where to
        send them: None, to the broker; else on that lease's connection (pins.py); `ops` may
        hold a LEASE to send.  None: nothing to send, the call answered already (the broker
        refuses this client's handshake: `refused_for_good`)."""
        frames = self._brokered_request(call, now)
        if (self.pin_slots or call.service in self.pin_services) and not call.no_pin:
            self._pin_route(call, now)
        if self.shut_out is not None and call.pin is None:
            # (`refused_for_good`) answered with its error, not sent: queued, it went to the
            # broker once a handshake succeeded, run for nobody
            self._end_with(call, self.shut_out(call.id), now)
            return None
        return frames

    def use_inbox(self, endpoint: str, room: Callable[[], tuple[bool, bool]]) -> None:
        """The twin bound its reply inbox at ``endpoint``: requests name it as `reply_to`
        while ``room()`` (this process has descriptors to spare, and plenty:
        `sockets.descriptor_room`) said so when last asked, at the first request and then
        once a second while under half its limit is free, every five seconds otherwise (a
        process that goes from half its descriptors free to none faster than that can still
        meet the abort: the look costs a millisecond per two thousand descriptors, on the
        request that makes it).  A
        worker that replies straight to a client connects to its inbox, and at the
        descriptor limit libzmq aborts the process in that accept (the application hunt: a
        server that filled its descriptors after making its client); near it, replies come
        through the broker instead, and straight again once descriptors are freed."""
        self._inbox_ep = self.reply_to = endpoint
        self._room = room
        self._room_at = 0.0

    def _look_at_room(self, now: float) -> None:
        ok, plenty = self._room()
        # (A process with half its descriptors free is looked at less often: the listing
        # costs a millisecond per two thousand descriptors, on the request that does it.)
        self._room_at = now + (ROOM_LOOK_FAR_S if plenty else ROOM_LOOK_S)
        if ok != (self.reply_to is not None):
            self.reply_to = self._inbox_ep if ok else None
            log.info("descriptors to spare again: replies come straight from workers" if ok else
                     "this process is near its descriptor limit: replies go through the broker")

    def _brokered_request(self, call: Call, now: float) -> list[Any]:
        if self._room is not None and now >= self._room_at:
            self._look_at_room(now)
        if call.deadline is None and call.timeout is not None:
            call.deadline = now + call.timeout
        call.t_sent = now
        call.broker = self.broker_instance
        call.route = self.broker_route
        call.id = next(self._ids)
        self.calls[call.id] = call
        return self._encode_request(call, now)

    def _encode_request(self, call: Call, now: float) -> list[Any]:
        """The REQUEST frames of a registered call, its deadline's remainder in the header."""
        packed = call.packed
        if call.deadline is None:
            timeout_ms = None
        else:
            ms = (call.deadline - now) * 1000.0
            timeout_ms = round(ms, 3) if ms > 0 else 0.0
        hdr = P.Request(
            id=call.id,
            priority=call.priority,  # an IntEnum: msgspec writes its int
            timeout_ms=timeout_ms,
            deadline_at=call.deadline,  # (time.monotonic(): a broker on our clock counts from our send)
            host=self._host,
            pid=_pid,
            reply=call.reply,
            tensors=packed.tensors,
            meta=call.meta,
            reply_to=self.reply_to,
            traceparent=call.traceparent,
            # A stream's frame says so (0 included): its worker keeps the stream's frames in
            # order (docs/models.md, "Congestion"); a plain call writes nothing.
            dropped=call.dropped if call.frame is not None else None,
        )
        try:
            head = P.encode_header(hdr)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
            # (ValueError: a lone surrogate in a string; OverflowError: an int over 64 bits.)
            # The call was registered and its slots taken: both go, or each such call
            # leaked one (the data hunt).
            self.discard_unsent(call)
            raise InvalidInput(_unencodable(call, e)) from None
        if len(head) > P.MAX_META_BYTES:  # only so long a header can hold too big a meta, or too long names
            try:
                if call.meta:
                    _check_meta(call.meta)
                if len(head) > P.MAX_HEADER_BYTES:  # the broker would refuse it
                    raise InvalidInput(f"the request's header is {len(head)} bytes, over the {P.MAX_HEADER_BYTES} "
                                       f"a header may take: its {len(packed.tensors)} input names are too long")
            except InvalidInput:
                self.discard_unsent(call)
                raise
        svc = self._service_b.get(call.service)
        if svc is None:
            return P.client_request(call.service, [head, *packed.frames])
        return [P.MDPC, P.C_REQUEST, svc, head, *packed.frames]

    # ---------------------------------------------------------------- MMI

    def mmi_question(self, name: str) -> MmiQuery:
        """An `mmi.service` question about `name`: its REQUEST frames (checked, not sent) with
        a fresh token.  A name that `infer` refuses (`check_service`: empty, over
        `MAX_SERVICE_LEN` bytes, not UTF-8) is refused here too, as `InvalidInput`: it was
        sent, and the broker's 404 made it False, a service that merely had no worker yet."""
        if not isinstance(name, str):
            raise InvalidInput(f"mmi_service takes a service name (str), got {type(name).__name__}")
        check_service(name)
        encoded = name.encode()
        self._mmi_seq += 1
        token = self._mmi_seq.to_bytes(8, "big")
        return MmiQuery(name, token, self.opaque_frames(MMI_SERVICE, [encoded, token]))

    def expect_mmi(self, q: MmiQuery, now: float = 0.0) -> MmiQuery:
        """Register the waiter of an MMI question sent (or queued) on the main socket at
        `now` (`time.monotonic()`): the broker's silence on it counts from then, or from
        the last word heard, whichever is later (`fail_unreachable`)."""
        q.t_sent = now
        self.mmi_waiters.append(q)
        return q

    def mmi_waiting(self) -> bool:
        """Whether an MMI question is waited for: asked, not answered, failed nor given up."""
        return any(q.answer is None and q.error is None and not q.abandoned for q in self.mmi_waiters)

    def _take_mmi_waiter(self, body: tuple) -> MmiQuery | None:
        """The waiter an MMI answer belongs to, removed from the queue (None: nobody's)."""
        waiters = self.mmi_waiters
        if len(body) < 2:
            self._mmi_in_order = True
            return waiters.popleft()  # no token echoed: answers come in question order
        token = bytes(body[1])
        for i, q in enumerate(waiters):
            if q.token == token:
                # The broker answers in order: the waiters ahead lost their answers.  The
                # abandoned ones go; the others keep waiting until their own deadline.
                ahead = [w for w in list(waiters)[:i] if not w.abandoned]
                for _ in range(i + 1):
                    waiters.popleft()
                waiters.extendleft(reversed(ahead))
                return q
        return None

    # ---------------------------------------------------------------- giving up

    def unregister(self, call: Call) -> None:
        """Undo request_frames for a call that could not be sent yet."""
        if call.pin is not None:
            self._unpin(call)
        self.calls.pop(call.id, None)
        call.id = 0
        call.deadline = None

    def discard_unsent(self, call: Call) -> None:
        """A call that never reached the wire (dropped stream frame, failed send): nothing can
        be reading its inputs, so they are freed now."""
        if call.pin is not None:
            self._unpin(call)
        if call.id:
            self.calls.pop(call.id, None)
        self._free_inputs(call)
        call.abandoned = True
        call.done = True
        _drain_inbox(call)

    def abandon(self, call: Call, now: float | None = None) -> list[Any] | None:
        """The caller stopped waiting (at ``now``, on the clock of the calls' deadlines, if
        known).  Returns CANCEL frames to send, if one is useful.  Inputs stay allocated
        until the FINAL arrives: a worker may be reading them now."""
        if call.abandoned:
            return None
        call.abandoned = True
        call.notify = None
        _drain_inbox(call)
        if call.done or call.id == 0 or call.id in self._parked:
            return None  # (a parked call was never sent: `unpark` forgets it)
        # (A timer may wake a hair early: a millisecond's slack.)
        expired = now is not None and call.deadline is not None and now >= call.deadline - 1e-3
        if call.pin is not None:
            # Where it runs: on its lease's connection (in `ops`).
            self._pin_cancel(call, expired=expired, now=now)
            return None
        # Expired: the broker counts it `deadline_exceeded`, as at its own timer (which the
        # client's usually beats), not `cancelled`.
        return P.client_cancel(call.service, call.id, expired=expired)

    def give_up(self, call: Call, now: float | None = None) -> list[Any] | None:
        """The caller is done with `call`, FINAL or not: a call never registered (id 0) is
        discarded and its inputs freed now; one in flight is abandoned (CANCEL frames
        returned when useful, inputs kept until its FINAL).  In a forked child (its copy of
        the call): only marked so; its slots and its socket are the parent's."""
        if type(call) is not Call:
            raise InvalidInput(f"give_up() takes a call made by prepare(), got {type(call).__name__}")
        if self._gen != T.fork_generation():
            call.abandoned = call.done = True
            return None
        if call.id == 0 and not call.abandoned:
            self.discard_unsent(call)
            return None
        return self.abandon(call, now)

    # ---------------------------------------------------------------- incoming

    def on_message(self, frames: list[Any], now: float, direct: bool = False, pin: Any = None) -> list[list[Any]]:
        """Route one message from the broker (or, `direct`, from a worker through the reply
        socket; `pin`, from a leased worker on that lease's connection).  Returns messages to
        send to the broker in response (an inline resend after NOT_LOCAL, a pinned call moved
        to the broker)."""
        if pin is None:
            # The broker's (or a reply socket's) word keeps the broker alive in our eyes; a
            # leased worker's traffic must not hide a silent broker.
            self.last_recv = now
        if len(frames) > 3 and bytes(frames[1]) == P.C_FINAL and bytes(frames[0]) == P.MDPC:
            out = self._on_plain_final(frames, now, direct, pin)
            if out is not None:
                return out
        try:
            msg = P.parse_broker_to_client(frames)
        except P.ProtocolError as e:
            # Whether or not anything pins now: a LEASED that answers an ask given up on (a
            # stream closed before it came) is ended, or its worker's credit stays held.
            if pin is None and not direct:
                out = self._on_lease_message(frames, now)  # LEASED, LEASE_END (pins.py)
                if out is not None:
                    return out
            log.warning("dropping a malformed message from the broker: %s", e)
            return []
        if direct and msg.command == P.C_HEARTBEAT:
            # Only the broker speaks for the broker: a worker's HEARTBEAT, on a lease's
            # connection or on the reply socket, could fake a restart (another instance), and
            # every call in flight was sent again.
            self._bad.warning("dropping a HEARTBEAT from %s", "a worker on the reply socket" if pin is None
                              else f"the leased worker of {pin.service!r}")
            return []
        if msg.command == P.C_HEARTBEAT:
            if not msg.body:
                return self.unpark(now) if self._parked else []  # a broker without the extension
            instance, window_ms, route = msg.body
            self.broker_window = window_ms / 1000.0
            out = self._on_broker_instance(instance, now, route)
            if self._parked:  # pinned calls off their leases: to this broker now (pins.py, `_park`)
                out = [*out, *self.unpark(now)]
            return out
        if direct and pin is None:
            self.direct_replies += len(msg.body) if msg.command == P.C_FINALS else 1
        if msg.command == P.C_FINALS:
            # A worker's batch, straight from it: each frame is one header-only FINAL.
            out: list[list[Any]] = []
            for head in msg.body:
                out += self._on_final_body(msg.service, (head,), True, now, pin)
            return out
        return self._on_final_body(msg.service, msg.body, msg.command == P.C_FINAL, now, pin)

    def _on_plain_final(self, frames: list[Any], now: float, direct: bool, pin: Any) -> list[list[Any]] | None:
        """The usual message, taken in one step: a FINAL with a valid tensor header and no
        error, for the current id of a call that still waits for it (on its own lease's
        connection when `pin`).  Does what `_on_final_body` and `_on_reply` do for it, in
        the same order; None, having changed nothing, for anything else (then the general
        path runs: errors, strays, old ids, probes, MMI answers, opaque bodies)."""
        body = frames[4:]
        try:
            rep = P.decode_reply(frames[3], frames=body)  # and the inline frames' sizes
        except P.ProtocolError:
            return None  # not a header at all, or a bad one: the general path tells which
        call = self.calls.get(rep.id)
        if (call is None or call.pin is not pin or rep.error is not None or rep.id != call.id
                or call.abandoned or call.probe):
            return None
        if pin is not None:
            self.pinned_replies += 1
        elif direct:
            self.direct_replies += 1
        self._forget(call, call.id)
        packed = call.packed
        pool = self._pool
        try:
            # `_own_inputs(call)`, inlined: this runs for every request.
            res = T.unpack(rep, body, self.leases, final=True, frame=call.frame,
                           own=(pool.name, packed, call.adopted, self._free_adopted)
                           if packed is not None and packed.uses_shm and pool is not None else None)
        except InferenceError as e:
            self._finish_inputs(call, rep)
            self._deliver(call, ("error", e), True, now)
            return []
        if call.adopted or (packed is not None and (packed.temp or packed.cuda_temp)):
            # After unpacking: inputs handed back as outputs were adopted by the Result.
            self._finish_inputs(call, rep)
        timing = res.timing
        if "client_ms" not in timing:
            timing["client_ms"] = (now - call.t_sent) * 1000.0
        call.done = True
        call.t_done = now
        call.inbox.append(("final", res))
        if call.notify is not None:
            call.notify()
        return []

    def _on_final_body(self, service: bytes, body: tuple, final: bool, now: float,
                       pin: Any = None) -> list[list[Any]]:
        if body and P.is_header(body[0]):
            try:
                rep = P.decode_reply(body[0], frames=body[1:])  # and the inline frames' sizes
            except P.ProtocolError as e:
                # Fail the call it was meant for, if that can be told, rather than let it
                # wait for its deadline.
                call = self.calls.get(P.lenient_request_id(body[0]))
                if call is not None and pin is not None and call.pin is not pin:
                    call = None  # a leased worker answers only for the calls on its lease
                self._bad.warning("bad reply header%s: %s", f" for request {call.id}" if call else "", e)
                if call is not None and final and not call.abandoned:
                    self._end_with(call, ProtocolError(f"the reply header was invalid: {e}", request_id=call.id),
                                   now)
                return []
            call = self.calls.get(rep.id)
            if call is None or (pin is not None and call.pin is not pin):
                # Nobody's, or (on a lease's connection) a call no longer on that lease: it
                # was moved to the broker, whose answer is the one that counts.
                self.discarded += 1
                T.release_reply(rep, self.leases)
                return []
            if pin is not None:
                if final and rep.error is not None:
                    out = self._pin_bounce(call, pin, rep.error, now)
                    if out is not None:
                        return out  # it did not run: through the broker instead
                self.pinned_replies += 1
            return self._on_reply(call, rep, list(body[1:]), final, now)
        if pin is not None:
            # Not a header: nothing a leased worker may send (MMI answers and opaque bodies
            # are the broker's and plain workers' business).
            self.discarded += 1
            return []
        if service == _MMI_SERVICE_B and final and self.mmi_waiters:
            q = self._take_mmi_waiter(body)
            if q is not None and not q.abandoned:
                q.answer = [bytes(body[0])] if body else []
                if q.notify is not None:
                    q.notify()
            elif q is None:
                self.discarded += 1
            return []
        # An opaque FINAL on this socket answers a tensor call (opaque requests have sockets
        # of their own): the service is not one of ours (a plain MDP worker).  It carries no
        # id, so it fails the oldest call waiting on that service; each such call gets one.
        name = bytes(service).decode(errors="replace")
        waiting = ([c for k, c in self.calls.items() if k == c.id and not c.done and c.service == name]
                   if final else [])
        if not waiting:
            self.discarded += 1
            return []
        call = min(waiting, key=lambda c: c.t_submit or c.t_sent)  # the oldest first sent
        self._forget(call)
        self._finish_inputs(call)
        if call.abandoned:  # its caller is gone: nothing to tell, but its entry and inputs go
            call.done = True
            return []
        self._deliver(call, ("error", ProtocolError(
            f"service {name!r} answered a tensor request with an opaque body (a plain MDP worker?); "
            f"use client.request() for opaque services", request_id=call.id)), True, now)
        return []

    def _on_reply(self, call: Call, rep: P.Reply, frames: list[Any], final: bool, now: float) -> list[list[Any]]:
        out: list[list[Any]] = []
        if rep.id != call.id:
            # The run from before a broker restart answered.  A result is the call's result
            # (and the resent run is cancelled); an error may be the old run's loss, so the
            # resent run keeps its chance.
            self.calls.pop(rep.id, None)
            if not final or rep.error is not None:
                self.discarded += 1
                T.release_reply(rep, self.leases)
                if not final:
                    # A stream of the old run: it cannot win (its PARTIALs are not the
                    # call's), and left alone it would stream on to its end for nobody.
                    return [P.client_cancel(call.service, rep.id)]
                return []
            if not call.abandoned and not call.done:
                out.append(P.client_cancel(call.service, call.id))
        if final:
            self._forget(call, rep.id)
            if (rep.error is not None and rep.error.code == ErrorCode.NOT_LOCAL and self.fallback_inline
                    and not call.retried and not call.abandoned and call.packed is not None):
                return [self._resend_inline(call, now)]
            if call.probe and (rep.error is None or rep.error.code != ErrorCode.NOT_LOCAL):
                # Shared memory reached a worker: the service is local again.
                self.not_local.pop(call.service, None)
                self._not_local_backoff.pop(call.service, None)
        if call.abandoned or rep.error is not None:
            if final:
                self._finish_inputs(call, rep)
            if call.abandoned:
                if final:
                    call.done = True
                self.discarded += 1
                T.release_reply(rep, self.leases)
                return []
            if rep.tensors:
                # An error that names output slots (a worker's bug, or the broker's 400 for a
                # reply it did not relay): nobody views them, so they go back now, or they
                # stayed lent for this process's life.
                T.release_reply(rep, self.leases)
            if not final:
                log.warning("ignoring an error in a PARTIAL for request %d", rep.id)
            elif (rep.error.code == ErrorCode.CANCELLED and call.deadline is not None
                  and now >= call.deadline):
                # Not ours (a call we cancel is abandoned): the broker's deadline cancelled it
                # at its worker, whose answer can beat the broker's own DEADLINE_EXCEEDED.
                self._deliver(call, ("error", self.deadline_error(call)), True, now)
            else:
                self._deliver(call, ("error", error_from(rep.error.code, rep.error.message, request_id=rep.id)),
                              True, now)
            return []
        try:
            res = T.unpack(rep, frames, self.leases, final=final, frame=call.frame, own=self._own_inputs(call))
        except InferenceError as e:
            if final:
                self._finish_inputs(call, rep)
                self._deliver(call, ("error", e), True, now)
            else:
                log.warning("dropping a PARTIAL of request %d: %s", rep.id, e)
            return []
        if final:
            # After unpacking: inputs handed back as outputs were adopted by the Result.
            self._finish_inputs(call, rep)
            res.timing.setdefault("client_ms", (now - call.t_sent) * 1000.0)
        if not final:
            if not call.partials:
                call.mark = self._route_mark  # when its first PARTIAL came (_on_broker_instance)
            call.partials += 1
        self._deliver(call, ("final" if final else "partial", res), final, now)
        return out

    def _own_inputs(self, call: Call) -> tuple | None:
        """What `T.unpack` needs to resolve outputs that point into our own pool (inputs
        handed back): None when the request sent nothing through it."""
        pool = self._pool
        if pool is None or call.packed is None or not call.packed.uses_shm:
            return None
        return (pool.name, call.packed, call.adopted, self._free_adopted)

    def _free_adopted(self, ref: Any) -> None:
        self._buffer_dropped(None, ref)

    def _finish_inputs(self, call: Call, rep: P.Reply | None = None) -> None:
        """The request's FINAL arrived: the one moment no worker (including a retry) can
        read its inputs again."""
        self._free_inputs(call, reply=rep)
        adopted, call.adopted = call.adopted, {}
        for keeper in adopted.values():
            keeper.drop()

    def _resend_inline(self, call: Call, now: float) -> list[Any]:
        """NOT_LOCAL: the worker cannot see our /dev/shm.  Send the same inputs again inline,
        under a new id (the old one is finished), within what is left of the deadline."""
        log.info("service %r is not on this host; resending request %d inline", call.service, call.id)
        # Inline from now on, and shared memory tried again after a backoff that doubles
        # while the service stays remote (1 s, 2 s, ... 30 s): a probe that finds it still
        # remote costs one broker round trip (NOT_LOCAL is answered at once) and is resent.
        backoff = min(2.0 * self._not_local_backoff.get(call.service, 0.5), NOT_LOCAL_RETRY_MAX_S)
        self._not_local_backoff[call.service] = backoff
        self.not_local[call.service] = now + backoff
        forget_stale(self.not_local, self._not_local_backoff, now, NOT_LOCAL_RETRY_MAX_S)
        call.retried = True
        call.probe = False  # its inline answer says nothing about shared memory
        old = call.packed
        # Copy out of the temporary slots before they are freed.
        call.packed = T.pack(old.arrays, None, copy_inline=True)
        self._free_inputs(call, old)
        if call.reply in ("auto", "shm"):
            call.reply = "inline"
        call.dropped = 0  # the broker counted the stream's drops with the first (`_resend_brokered`)
        return self._brokered_request(call, now)

    def _free_inputs(self, call: Call, packed: T.Packed | None = None, reply: P.Reply | None = None) -> None:
        packed = packed or call.packed
        if packed is not None and packed.temp and self._pool is not None:
            T.free_temp(self._pool, packed.temp)
        if packed is not None and packed.cuda_temp and self._cuda is not None:
            # The worker's reads of these slots are ordered before its output events (same
            # worker stream); host and error replies were synchronised before FINAL.
            after = self._cuda.events_of(reply.tensors) if reply is not None else ()
            self._cuda.free_temp(packed.cuda_temp, after=after)

    def _end_with(self, call: Call, exc: InferenceError, now: float) -> None:
        """End `call` with ``exc``, its last word: no id of it answerable any more, its
        inputs freed (nothing can read them: its caller's error is its final outcome)."""
        self._forget(call)
        self._finish_inputs(call)
        self._deliver(call, ("error", exc), True, now)

    def _deliver(self, call: Call, item: tuple[str, Any], final: bool, now: float) -> None:
        if self._suspects:
            self._suspects.pop(id(call), None)  # heard of: on a live connection
        if final:
            call.done = True
            call.t_done = now
        call.inbox.append(item)
        if call.notify is not None:
            call.notify()

    # ---------------------------------------------------------------- liveness

    def fail(self, call: Call, exc: InferenceError) -> bool:
        """Deliver a client-side error (broker silent, client closed) to a waiting call;
        whether it was queued.  One such error is enough: another is not queued behind one
        not yet consumed."""
        if call.abandoned or call.done:
            return False
        if call.inbox and call.inbox[-1][0] == "error":
            return False
        call.inbox.append(("error", exc))
        if call.notify is not None:
            call.notify()
        return True

    def active(self) -> list[Call]:
        """Calls sent whose caller still waits for a FINAL."""
        return [c for k, c in self.calls.items() if k == c.id and not c.abandoned and not c.done]

    def in_flight(self) -> int:
        """Calls sent and not yet answered with a FINAL (each once, whatever ids it has)."""
        return sum(1 for k, c in self.calls.items() if k == c.id)

    def _forget(self, call: Call, answered: int | None = None) -> None:
        """The call is over: no id of it is answerable any more.  ``answered``: the id whose
        FINAL came (the others are given up: `_give_up`)."""
        self.calls.pop(call.id, None)
        for old in call.old_ids:
            self.calls.pop(old, None)
        if call.pin is not None:
            self._unpin(call)
        if call.old_ids or call.id != answered:
            self._give_up(call, answered)

    def _give_up(self, call: Call, answered: int | None) -> None:
        """The ids of ``call`` other than ``answered`` will never be answered here: a reply
        for one that comes is released unread, and the output slots lent for one whose reply
        was lost on its way (with a broker that died, or with a connection the broker dropped
        for not reading) go back at the next heartbeat looks (`_return_given_up`).  Without
        this they stayed lent until the process exited (docs/shm.md, "When a process dies")."""
        if call.reply == "inline":
            return  # (no slot can be lent for it: its outputs come inline)
        given = self._given_up
        for rid in (call.id, *call.old_ids):
            if rid and rid != answered:
                given[rid] = self._looks
        while len(given) > GIVEN_UP_MAX:
            del given[next(iter(given))]

    def _return_given_up(self) -> None:
        """Give back the output slots lent for the requests given up on (`_give_up`), in the
        rings this client has mapped; the ids older than `GIVEN_UP_LOOKS` looks are dropped."""
        given = self._given_up
        oldest = self._looks - GIVEN_UP_LOOKS
        while given and next(iter(given.values())) < oldest:
            del given[next(iter(given))]
        if given:
            self.given_up_returned += self.leases.release_given_up(given)

    def heard_bytes(self, when: float) -> None:
        """Bytes from the broker were seen on their way at `when` (its tcp connection moved:
        wire.TcpWatch): a message that takes longer to cross than the liveness window, and
        the heartbeat answers queued behind it, are not the broker's silence."""
        if when > self.last_recv:
            self.last_recv = when

    def looking(self, now: float) -> bool:
        """The client is looking at its sockets (a blocking call waits, the asyncio
        heartbeat task runs); whether it comes back from an absence longer than two
        heartbeat periods (a blocking client's program doing something else, an asyncio
        loop held by its application; while a call waits, the client looks at least once a
        period).  Then the broker's silence is counted from now, the heartbeat that asks for
        its answer going out only now; but once per message heard: a program that keeps
        coming back for a moment and leaving again, and hears nothing, learns at last that
        the broker is silent."""
        period = self.heartbeat_period
        # Present at its last look or its last send (its first look may come only after a
        # pause: an asyncio client's heartbeat task first wakes half a period in).
        last = max(self.last_look or 0.0, self.last_send)
        self.last_look = now
        if not last or period is None or now - last <= 2 * period:
            return False
        if self.last_recv >= self.resumed_at:  # heard from since the last return
            self.resumed_at = now
        return True

    def deadline_error(self, call: Call) -> "DeadlineExceeded":
        """``call.deadline_error()``, with a word on the endpoint when nothing at all has
        come from it since this client connected although the call waited long enough for
        a heartbeat's answer: a wrong endpoint (a broker's backend, another program) answers
        nothing, and "raise the timeout" was the wrong advice."""
        advice = self.silence_advice(call.timeout)
        if advice is None and call.deadline is not None:
            advice = self.quiet_advice(call, call.deadline)
        return call.deadline_error(advice)

    def quiet_advice(self, call: Call, now: float) -> str | None:
        """`broker_silence` for a call's `DeadlineExceeded`; None for a call on a live lease
        (its worker answers it, not the broker)."""
        pin = call.pin
        if pin is not None and pin.ready and not pin.closed:
            return None
        return self.broker_silence(now)

    def broker_silence(self, now: float) -> str | None:
        """What an error says when the broker has answered nothing, not even a heartbeat,
        for more than two heartbeat periods since the first heartbeat it was sent after its
        last word (the client heartbeats once a period while calls wait; an answer takes a
        round trip): it stopped, restarted or stalled, or the connection is down.  "Raise
        `timeout`, lower the load" was the wrong advice there (the broker-restart audit: a
        call shorter than the liveness window against a killed broker; a 2 s call, made 4.5 s
        after it was killed, was still told to raise its timeout).  None when it answered
        since, with heartbeats off, or counting from the client's return from an absence
        (`resumed_at`): nobody asked meanwhile."""
        period = self.heartbeat_period
        asked = self._first_unanswered
        if period is None or asked is None or asked <= self.last_recv:
            return None
        silence = now - max(asked, self.resumed_at)
        if silence <= 2 * period:
            return None
        why = self._endpoint_problem()
        return (f"nothing has come from the broker at {self.endpoint} for {silence:.1f}s, not even answers to "
                f"heartbeats: it stopped, restarted or stalled, or the connection is down"
                + (f" ({why})" if why else "") + "; check that it runs, and its log")

    def broker_said(self, last: str | None, now: float, final: bool = False, ups: int = 0) -> None:
        """The broker connection's monitor's word (`sockets.handshakes`): ``last`` "" a
        handshake succeeded, a reason the broker refused it, None nothing new; ``final``:
        libzmq gave the endpoint up at a refusal, so it is dialled again at once, or
        `REDIAL_S` after the dial before.  ``ups``: handshakes that succeeded meanwhile (one
        read may hold a success and a later refusal: `last` is the refusal)."""
        if ups or last == "":
            self.handshook = True
        if ups:
            self.shut_out = None
            if self.connections + ups > 1 and self.broker_instance is None:
                self._replaced_unheard = True
            self.connections += ups
        if last is None:
            return
        if self.plain_tcp and last.startswith(NO_DETAIL):
            last = PLAIN_NO_DETAIL
        elif self.handshook and last.startswith(NO_DETAIL):
            last = KNOWN_NO_DETAIL
        # A refusal without detail does not replace one with: a plain tcp client of a broker
        # with keys hears both (the one whose greeting the broker cut short, as a loaded
        # broker often does, is told nothing), and "most likely `server_key`" misleads it.
        if not (last.startswith(NO_DETAIL) and self.refused and not self.refused.startswith(NO_DETAIL)):
            self.refused = last or None
        if final and self.redial_at is None and not self.closed:
            self.redial_at = max(now, self._redialed + REDIAL_S)

    def refused_for_good(self, error: Callable[[int | None], InferenceError], now: float) -> int:
        """The broker refused this client's handshake for good (its key, or plain tcp
        against keys: libzmq gave the endpoint up, `broker_said`'s ``final``): every call that
        waits on the broker fails now with ``error(request id)``, as do the MMI questions; a
        call on a lease whose connection is up is its worker's, and goes on.  What was sent
        on the refused connection never reaches the broker (its queue goes with it), and
        answers to what went on an earlier one have no connection to come back on, so
        waiting could only end at the liveness window or the deadline, told to raise it.
        A call made after it, until the client dials again (`redialed`: at once after a
        first refusal, then at most each `REDIAL_S`, so a key put on the allow-list is served
        within about that), fails at once, unsent (`request_frames`), as a gRPC channel in
        TRANSIENT_FAILURE fails its calls; one made once it dialled waits for that dial's word.
        Returns how many were failed."""
        self.shut_out = error
        n = 0
        for call in self.active():
            pin = call.pin
            if pin is not None and pin.ready and not pin.closed:
                continue
            if pin is None and not self.use_shm:
                # Over tcp (CurveZMQ is tcp's): inputs inline, replies through the broker,
                # which lost this client's connection: nothing can answer it, forgotten (its
                # caller's CANCEL went into the refused connection, and it stayed for good).
                if not (call.inbox and call.inbox[-1][0] == "error"):
                    self._end_with(call, error(call.id or None), now)
                    n += 1
            elif self.fail(call, error(call.id or None)):
                n += 1
        for q in self.mmi_waiters:
            if q.answer is None and q.error is None and not q.abandoned:
                q.error = error(None)
                if q.notify is not None:
                    q.notify()
                n += 1
        return n

    def redialed(self, now: float) -> None:
        """The client dialled the broker again (`sockets.redial`): calls go out again and
        wait for that handshake's word (`refused_for_good` fails them at a refusal)."""
        self.redial_at = None
        self._redialed = now
        self.shut_out = None

    def silence_advice(self, timeout: float | None, *, heard: bool = True) -> str | None:
        """What a call's `DeadlineExceeded` says instead of "raise the timeout" when the
        broker never answered this client: what the kernel says of an ipc endpoint's socket
        file (none there, nobody listening, another user's), else, for a call that waited
        long enough for a heartbeat's answer, that nothing at all came from the endpoint.
        ``heard=False`` for a call on a socket of its own (`request`), whose silence the
        client's own socket cannot speak for: the socket file alone then."""
        if self.refused is not None:  # (heard before: a broker restarted with other keys)
            return f"the broker at {self.endpoint} refuses this client's handshake: {self.refused}"
        if self.last_recv != 0.0 and heard:
            return None
        why = self._endpoint_problem()
        if why is not None:
            return f"the broker never answered: {why}"
        hb = self.heartbeat_interval
        if heard and hb is not None and timeout is not None and timeout > 1.5 * hb:
            return (f"nothing at all has come from {self.endpoint} since this client connected, not even an "
                    f"answer to its heartbeats: check that it is the broker's frontend endpoint (not its "
                    f"backend), that the broker runs, and its log (near its descriptor limit it takes no new "
                    f"clients)")
        return None

    def mmi_deadline_error(self, timeout: float | None) -> "DeadlineExceeded":
        """The error of an `mmi.service` question unanswered within ``timeout``: the same word
        on the endpoint as a call's (`silence_advice`), instead of "lower the load"."""
        return deadline_exceeded(f"no MMI answer from the broker within {timeout:g}s", self.silence_advice(timeout))

    def unsent_deadline_error(self, what: str, timeout: float | None, full: bool,
                              request_id: int | None = None) -> "DeadlineExceeded":
        """The error of a call (``what``: "no reply from service 'x'", ...) whose message the
        client's socket did not take by its deadline (the blocking twin waits in its send:
        the broker does not read, or ``full`` False: it refuses this client's handshake).
        `DeadlineExceeded`, as the asyncio twin's, which queues the message and meets its
        deadline waiting for the reply; the broker's silence for the liveness window is
        `BrokerUnreachable` on both."""
        text = f"{what} within {timeout:g}s; nothing was sent"
        if full:
            text += f": the client's queue to the broker at {self.endpoint} is full (the broker does not read it)"
        advice = self.silence_advice(timeout) or ("check that the broker runs and is not stopped, and its log; "
                                                  "or raise `timeout`")
        return deadline_exceeded(text, advice, request_id)

    def opaque_deadline_error(self, service: str, timeout: float | None) -> "DeadlineExceeded":
        """The error of a plain MDP `request` unanswered within ``timeout`` (on a socket of its
        own): what the kernel says of an ipc endpoint's socket file, when it says anything."""
        return deadline_exceeded(f"no reply from service {service!r} within {timeout:g}s",
                         self.silence_advice(timeout, heard=False))

    def _endpoint_problem(self) -> str | None:
        if self.refused is not None:
            return f"the broker at {self.endpoint} refuses this client's handshake: {self.refused}"
        ask = self.endpoint_problem
        if ask is None:
            return None
        try:
            return ask()
        except Exception:  # a look at the file system must not replace the call's own error
            log.debug("looking at the endpoint failed", exc_info=True)
            return None

    def silent_for(self, call: Call, now: float) -> float:
        return now - max(self.last_recv, call.t_sent, self.resumed_at)

    def unreachable(self, call: Call, now: float, why: str | None = None) -> BrokerUnreachable | None:
        """The error for `call` if the broker has been silent for LIVENESS heartbeat
        intervals since it was sent (None with heartbeats off).  Never for a call on a lease
        whose connection is up: its worker answers it, not the broker, and that connection
        is watched on its own (`pin_link_lost`: closed, or no longer acknowledging); a
        partition between this client and its broker alone must not fail it (the network
        hunt saw pinned calls failed, then resent and run twice)."""
        if self.heartbeat_interval is None:
            return None
        pin = call.pin
        if pin is not None and pin.ready and not pin.closed:
            return None
        silence = self.silent_for(call, now)
        if silence <= LIVENESS * self.heartbeat_interval:
            return None
        return self._silent(silence, f"request to {call.service!r}", why, call.id or None)

    def _silent(self, silence: float, what: str, why: str | None, request_id: int | None = None) -> BrokerUnreachable:
        text = (f"the broker at {self.endpoint} has not answered anything, not even heartbeats, for "
                f"{silence:.1f}s ({what} given up)")
        if why is not None:
            text = f"{text}: {why}"
        return BrokerUnreachable(text, request_id=request_id)

    def fail_unreachable(self, now: float) -> int:
        """Fail every waiting call the broker has been silent on for too long; how many were
        newly failed (a call whose error is still unread is not counted again)."""
        hb = self.heartbeat_interval
        if hb is None or now - max(self.last_recv, self.resumed_at) <= LIVENESS * hb:
            return 0  # heard from (or back) recently: no call can have been silent longer
        n = 0
        why = looked = None
        for call in self.active():
            if (call.inbox and call.inbox[-1][0] == "error") or self.unreachable(call, now) is None:
                continue  # (already told: `fail` would not queue another)
            if looked is None:  # once for all of them, and only when one is given up
                why, looked = self._endpoint_problem(), True
            err = self.unreachable(call, now, why)
            if err is not None and self.fail(call, err):
                n += 1
        # An MMI question waits on the broker's word as a call does: without this, its asker
        # waited for its timeout (DeadlineExceeded, for a broker that answered nothing), or
        # for ever with none, heartbeats on (the timeouts hunt).
        for q in self.mmi_waiters:
            if q.answer is not None or q.error is not None or q.abandoned:
                continue
            silence = now - max(self.last_recv, q.t_sent, self.resumed_at)
            if silence <= LIVENESS * hb:
                continue
            if looked is None:
                why, looked = self._endpoint_problem(), True
            q.error = self._silent(silence, f"mmi.service question about {q.name!r}", why)
            if q.notify is not None:
                q.notify()
            n += 1
        return n

    def heartbeat_due(self, now: float) -> bool:
        """Whether a HEARTBEAT should go out now: calls are waiting and none went out for a
        heartbeat interval.  Sent whatever other traffic flows: its answer carries the
        broker's instance id, which is how calls lost to a broker restart are found.  A
        client holding leases heartbeats while idle too (where its twin can: the asyncio
        one): the broker ends the leases of a client it has not heard from."""
        hb = self.heartbeat_period
        return hb is not None and now - self.last_heartbeat >= hb and (bool(self.active()) or bool(self.pins))

    @property
    def heartbeat_period(self) -> float | None:
        """Seconds between heartbeats while calls wait: the configured interval, shortened to
        a third of the broker's client liveness window once the broker has told it, so that a
        broker configured with short heartbeats never presumes this client dead."""
        hb = self.heartbeat_interval
        if hb is None or self.broker_window is None:
            return hb
        return min(hb, self.broker_window / 3)

    def heartbeat(self, now: float) -> list[bytes]:
        """A HEARTBEAT to send now (and, while at it, give back a tcp lease whose handshake
        is overdue: `pins_overdue`, whose ops the twin runs; and fail the streams a replaced
        connection took with it: `_expire_suspects`)."""
        self.last_heartbeat = now
        if self._first_unanswered is None or self._first_unanswered <= self.last_recv:
            self._first_unanswered = now  # (`broker_silence`)
        if self.pins:
            self.pins_overdue(now)
            self.free_given_up(now, LIVENESS * (self.heartbeat_interval or 0.0))
        if self._suspects:
            self._expire_suspects(now)
        self._sweep_outputs()
        return P.client_heartbeat(ask_route=True)

    def _sweep_outputs(self) -> None:
        """The mappings of workers that are gone, dropped (once a heartbeat period, while
        calls wait or leases are held): their output rings, and, with a CUDA side, their
        device pools, whose IPC mappings hold GPU memory.  Output slots lent for requests
        given up on go back (`_return_given_up`)."""
        self._looks += 1
        if self._given_up:
            self._return_given_up()
        self.leases.sweep()
        side = self._cuda
        if side is not None:
            try:
                side.cache.sweep()
            except Exception:
                log.exception("could not sweep the CUDA pools of departed workers")

    def _expire_suspects(self, now: float) -> None:
        """Fail the streams nothing came for since the connection was replaced, LIVENESS
        heartbeat intervals ago: they were the old connection's (`_on_broker_instance`)."""
        window = LIVENESS * (self.heartbeat_interval or 0.0)
        for key, (call, since) in list(self._suspects.items()):
            if call.abandoned or call.done:
                del self._suspects[key]
            elif now - max(since, self.resumed_at) > window:  # counted while it listened
                del self._suspects[key]
                self.fail(call, BrokerUnreachable(
                    f"the connection to the broker (or its record of this client) was replaced while request {call.id} to {call.service!r} "
                    f"was streaming, and nothing came for it on the new one for {window:g} s", request_id=call.id))

    def hello(self, now: float) -> list[bytes] | None:
        """What a twin sends once connected: a HEARTBEAT, so that the broker's answer tells
        its instance before any request can be lost to a restart (None with heartbeats off)."""
        return None if self.heartbeat_interval is None else self.heartbeat(now)

    def _on_broker_instance(self, instance: bytes, now: float, route: bytes | None = None) -> list[list[Any]]:
        """A heartbeat answer named the broker process (and, when we asked, our connection:
        ``route``, the same name for every answer on one connection).

        A new process: the calls sent to its predecessor may be lost with it.  The same
        process under a new route: libzmq connected again (a connection reset, or one closed
        because the broker's host stopped acknowledging: `sockets.dealer`), and what was sent
        on the old connection may be lost with it, as are the replies the broker still holds
        for it (its ROUTER has nowhere to send them) and the leases it granted to it (the
        broker ends them once it presumes the old connection's client gone).  Either way the
        leases end as by a drain (`_pin_reset`): no new call goes on them, and the calls on
        them stay with their workers, which the broker never held them for (they answer on
        the lease's connection, or refuse or lose them, which sends them through the broker
        once: pins.py, `_park`).  Each brokered call still
        waited for that was sent before this answer came, to the predecessor or
        (`call.route`) on an older connection, is sent again under a new id, at most
        `restart_resends` times, after a CANCEL of its old id (a copy that reached the broker
        on the new connection, queued before the client knew, is dropped there rather than
        run twice, and one that started there is left to answer: `queued_only`; one on the
        old connection is the broker's to drop with it).  The old id
        stays answerable: whichever run answers first with a result is the call's, and
        anything later for it is dropped (see `_on_reply`).  A call that streamed PARTIALs
        cannot be replayed and fails; calls nobody waits for any more (abandoned, or already
        failed) are forgotten, their inputs freed: no FINAL will come for them.

        A call sent on the new connection before the answer came is sent again too (nothing
        tells the connections apart before it): it may then run twice, and its caller still
        gets one result.  The exception is a brokered stream whose first PARTIAL came after
        the last answer on the old connection: a DEALER keeps the order of what it receives
        across connections, so a stream with a PARTIAL before that answer was the old
        connection's (and fails), but this one may be either's, and a stream cannot be
        replayed.  It goes on while anything comes for it; if nothing does for LIVENESS
        heartbeat intervals (it was the old connection's), it fails with `BrokerUnreachable`
        (`_expire_suspects`).  Leases granted to the new connection before the answer came are
        handed back too (LEASE_END; the broker ignores it for the old connection's, which it
        ends itself).  MMI questions still waited for are asked again (`_reask_mmi`).

        A connection replaced before any answer came (its monitor saw a second handshake
        first: `broker_said`) is one whose broker the client never knew: a broker killed
        before its answer to the client's first heartbeat left its socket (a CI run), and
        what was sent on it waited out its deadline.  Its first answer may be the old
        connection's, read late, or the new one's: the client asks again at once, and the
        next answer tells.  A new name (instance or route) is a restart or a replaced
        connection as above; the same one means the first answer was this connection's,
        and the calls sent before it are sent again as a replaced connection's (a restart
        cannot be told from a reset there: `broker_reconnects`), streams that streamed
        excepted (what came for them came on this connection)."""
        known, self.broker_instance = self.broker_instance, instance
        known_route = self.broker_route
        if route is not None:
            self.broker_route = route
        mark = self._route_mark  # every PARTIAL stamped with it came before this answer
        self._route_mark += 1
        # (an answer that followed one taken as a connection's replaced before any answer)
        confirm, self._confirm_before = self._confirm_before, None
        if known is not None and known != instance:
            self.broker_restarts += 1
            if self.pin_all or self._asking:
                self._pin_reset(now)  # no new call on a lease of the old broker (pins.py)
            # An old id (seen with its call), one sent to the new broker already, or one
            # unsent, is not sent again.
            return [*self._resend_brokered(now, "the broker restarted", lambda call: call.broker != instance,
                                           same_broker=False),
                    *self._reask_mmi()]
        unheard, self._replaced_unheard = self._replaced_unheard and known is None and route is not None, False
        if known is None or (known_route is None and route is not None):
            # first learnt: what was sent went there
            for call in self.calls.values():
                call.broker = call.broker or instance
                call.route = call.route or route
            if unheard:  # ... unless this answer is the replaced connection's: asked at once
                self._confirm_before = now
                return [self.heartbeat(now)]
            return []
        if route is None or route == known_route:
            if confirm is None:
                return []
            # The first answer was this connection's: what was sent before it went on the
            # one replaced before any answer (a stream that streamed is this one's).
            self.broker_reconnects += 1
            return [*self._resend_brokered(now, "the connection to the broker was replaced before it answered",
                                           lambda call: call.t_sent < confirm and not call.partials),
                    *self._reask_mmi()]
        self.broker_reconnects += 1
        # Brokered streams that may be the new connection's (the docstring): spared, watched.
        spared = {id(call): call for call in self.active()
                  if call.pin is None and call.partials and call.mark == mark}
        for key, call in spared.items():
            self._suspects[key] = (call, now)
        if self.pin_all or self._asking:
            for pin in list(self.pin_all.values()):  # one granted to the new connection stays otherwise
                self.ops.append(self._lease_end_frames(pin.service, pin.lease))
            self._pin_reset(now)
        return [*self._resend_brokered(now, "the connection to the broker (or its record of this client) was replaced",
                                       lambda call: call.route != route and id(call) not in spared),
                *self._reask_mmi()]

    def _reask_mmi(self) -> list[list[Any]]:
        """The MMI questions still waited for, asked again (`_on_broker_instance`): a question
        or its answer may have been lost with the old broker or connection.  A question is
        safe to ask twice: answers find their question by its token, and a second answer
        finds nobody and is dropped.  Not with a broker that answers without the token:
        there answers go by order, and a second one would answer the next question."""
        if self._mmi_in_order:
            return []
        return [q.frames for q in self.mmi_waiters if not q.abandoned and q.answer is None]

    def _resend_brokered(self, now: float, what: str, stale: Callable[[Call], bool],
                         same_broker: bool = True) -> list[list[Any]]:
        """The frames that send again the calls `stale` selects (see `_on_broker_instance`).
        ``same_broker``: the process that saw them before (a replaced connection), which
        counted a stream frame's drops when its first copy came (what was lost with the old
        connection is a frame or two's): the copy carries none, or they counted twice."""
        out = []
        for cid, call in list(self.calls.items()):
            if cid != call.id or call.id == 0 or call.pin is not None or cid in self._parked or not stale(call):
                # An old id (seen with its call), unsent, on a lease (its worker's: pins.py,
                # `_pin_reset`), waiting for this very answer (`_park`), or not lost.
                continue
            if call.abandoned or call.done or (call.inbox and call.inbox[-1][0] == "error"):
                self._forget(call)
                self._finish_inputs(call)
                continue
            if call.partials or call.resends >= self.restart_resends:
                why = ("it had streamed results" if call.partials
                       else f"it was resent {call.resends} times already")
                self._end_with(call, BrokerUnreachable(f"{what} while request {call.id} to {call.service!r} was in "
                                                       f"flight, and {why}", request_id=call.id), now)
                continue
            log.info("%s; resending request %d to %r", what, call.id, call.service)
            call.resends += 1
            self.resent += 1
            # Only a copy still queued is dropped: one that started (it reached this
            # connection before the client knew it was new) answers, maybe first; a CANCEL
            # of it would throw its result away and leave the call to a second full run.
            out.append(P.client_cancel(call.service, call.id, queued_only=True))
            call.old_ids.append(call.id)  # stays answerable: a worker may still reply to it directly
            if same_broker:
                call.dropped = 0
            out.append(self._brokered_request(call, now))
        return out

    # ---------------------------------------------------------------- shutdown

    def close_cancel(self, now: float) -> tuple[list[Call], list[list[Any]]]:
        """The start of a `close()` that lingers (docs/client.md, "Closing with requests in
        flight"): every request in flight whose answer may name output slots (its reply not
        asked inline) is cancelled, and given up (what still comes for it is released, not
        delivered; an item already in its inbox stays for its caller, who may be woken by
        the close's error).  Returns those calls, for `lingering`, and the CANCEL frames to
        send to the broker; a leased call's CANCEL is queued in `ops` for its lease's
        connection.  A worker drops the result of a request cancelled while it runs, so
        what can still name slots is an answer sent before the CANCEL reached it: on its
        way, it arrives within a round trip; the others end with a 499 when their batch
        ends (or the broker's answer at once, for a queued one)."""
        if self.closed or self._gen != T.fork_generation():
            return [], []
        for call in self._parked.values():
            # Off its lease, waiting for the broker's next heartbeat answer (pins.py, `_park`):
            # it never ran and nothing answers it.  Given up, `unpark` forgets it at that
            # answer, which the close's wait may read; else it went out then, through the
            # broker, run for nobody (its reply after the close kept its slot lent).
            call.abandoned = True
            call.notify = None
        calls = [c for k, c in self.calls.items()
                 if k == c.id and not c.done and c.reply != "inline" and k not in self._parked]
        out: list[list[Any]] = []
        for call in calls:
            if call.abandoned:
                continue  # its CANCEL went when its caller gave up
            call.abandoned = True
            call.notify = None
            expired = call.deadline is not None and now >= call.deadline - 1e-3
            if call.pin is not None:
                self._pin_cancel(call, expired=expired, now=now)
            else:
                out.append(P.client_cancel(call.service, call.id, expired=expired))
        return calls, out

    def lingering(self, calls: list[Call], now: float) -> bool:
        """Whether a closing client should still wait for one of ``calls`` (`close_cancel`'s):
        its answer has not come, and its path can still bring it (a call through the broker
        is not waited for once the broker has been silent for the liveness window since it
        was sent, nor when nothing was ever heard from it and its endpoint has a problem
        that says why: no socket file, nothing listening, a refused handshake)."""
        hb = self.heartbeat_interval
        heard = max(self.last_recv, self.resumed_at)
        nobody: bool | None = None  # (asked once, and only if it matters)
        for c in calls:
            if self.calls.get(c.id) is not c:
                continue  # answered
            if c.pin is None:
                if hb is not None and now - max(heard, c.t_sent) > LIVENESS * hb:
                    continue  # a silent broker
                if nobody is None:
                    nobody = self.last_recv == 0.0 and self._endpoint_problem() is not None
                if nobody:
                    continue  # no broker ever answered: nothing it was sent reached a worker
            return True
        return False

    def release_unread(self, frames: list[Any]) -> None:
        """A message left in a socket that is being closed (`close()`, or a client let go
        of unclosed), which nobody will read: the output slots a reply in it names go back
        to their worker.  The worker lent them to this process, which gives them back by
        releasing them or by exiting: a reply dropped unread kept them lent for the
        process's life, and its ring filled (a `with c.stream(...)` whose last frames'
        results were not read leaked one slot or two per session).  Nothing else is done
        with it (its call is failed by the close)."""
        try:
            msg = P.parse_broker_to_client(frames)
        except P.ProtocolError:
            return
        if msg.command == P.C_FINALS:
            bodies = [(head,) for head in msg.body]
        elif msg.command in (P.C_FINAL, P.C_PARTIAL):
            bodies = [msg.body]
        else:
            return
        for body in bodies:
            if not body or not P.is_header(body[0]):
                continue
            try:
                rep = P.decode_reply(body[0], frames=body[1:])
            except P.ProtocolError:
                continue
            T.release_reply(rep, self.leases)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for call in list(self.calls.values()):
            call.abandoned = True
            _drain_inbox(call)
        self.calls.clear()
        self._suspects.clear()
        self._parked.clear()
        self.pins.clear()
        self.pin_all.clear()
        self.pin_services.clear()
        self.ops.clear()
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
