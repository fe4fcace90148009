"""The client's sockets: creating them, dropping them, and the direct-reply inbox.

Both twins use these; nothing here parses a reply or keeps request state (that is core.py).

- `context(endpoint)`: pyzmq's process-wide context; the first time, a check that libzmq's
  threads can start (it aborts the process when they cannot) and pyzmq's zero-copy sends
  started early.  `send_failure(e, endpoint)`: the typed error of a request that could not be
  sent for want of descriptors, memory or threads.
- `dealer(ctx, endpoint, curve, heartbeat_s)`: a DEALER connected to the broker (linger 0), with
  CurveZMQ when `curve` holds keys, and over tcp a connection closed when the broker's host
  stops acknowledging.  Works for a plain and an asyncio context alike.
- `curve_keys(endpoint, server_key, client_key, insecure)`: the keys a client of a tcp broker
  needs, or `InvalidInput` naming the options to pass (docs/security.md); `tcp_options`: what a
  tcp broker lets a client send (tensors inline, no reply socket).
- `broker_dealer`: `dealer` and, over tcp, the monitor of its handshakes (`broker_monitor`),
  attached before it connects; `handshakes`, `drop_monitor`: what that monitor reported (a
  new connection: the twins heartbeat at once), and dropping it.
- `lease_dealer`, `lease_events`, `drop_lease_dealer`: a lease's DEALER and, over tcp, the
  monitor of its connection (what the twins tell `pin_connected` and `pin_disconnected`).
- `drop_socket(sock)`: DISCONNECT, then close with a short linger.  For the short-lived
  socket of an opaque request: the DISCONNECT drops the request at the broker if it is
  still queued, so a late answer goes nowhere.
- `ipc_problem(endpoint)`: why an ipc endpoint cannot be connected to (no socket file, another
  user's, nothing listening, a broker near its descriptor limit), for the error of a call that
  never heard from the broker; `IpcDiagnosis`, the same asked at most once a second.
- `ReplyInbox`: the PULL socket a client binds for direct replies (docs/protocol.md section
  8).  Its ipc file is unlinked by `close()`, or by a finalizer when the client is dropped
  without closing; the broker sweeps the files of clients that died (SIGKILL).
"""
from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import threading
import time
import weakref
from typing import Any

import zmq
from zmq.utils.garbage import gc as zero_copy_gc

from broker import protocol as P
from broker.protocol import curve as C
from broker.protocol.limits import nofile_limit, open_descriptors
from broker.protocol.naming import ipc_problem
from broker.protocol.link import LinkConn
from broker.protocol.wire import monitor_event, out_of_resources, recv_frames, tcp_liveness, touched, warm_zero_copy

from .core import flag
from .errors import InferenceError, InvalidInput

__all__ = ["CLOSE_LINGER_MS", "dealer", "broker_dealer", "broker_monitor", "handshakes", "redial", "drop_monitor", "drop_socket", "ReplyInbox",
           "curve_keys", "tcp_options", "ENV_CLIENT_KEY", "lease_curve", "open_link", "lease_dealer", "lease_events",
           "drop_lease_dealer", "ipc_problem", "IpcDiagnosis", "send_failure", "drain_unread", "room_for_sockets",
           "MAX_SOCKETS"]

log = logging.getLogger("client_sdk")

#: milliseconds a closing socket may keep trying to deliver its DISCONNECT (close() itself
#: never waits: only terminating the context would)
CLOSE_LINGER_MS = 100

#: sun_path holds 108 bytes; a longer runtime directory keeps replies on the relayed path
_MAX_IPC_PATH = 100


#: this client's secret certificate when `client_key` is not given (with `C.ENV_SERVER_KEY`,
#: ZMQ_INFER_SERVER_KEY, for the broker's public key)
ENV_CLIENT_KEY = "ZMQ_INFER_CLIENT_KEY"


def curve_keys(endpoint: Any, server_key: Any, client_key: Any, insecure: bool) -> C.PeerKeys | None:
    """The CurveZMQ keys for a broker at `endpoint`: None unless it is tcp and not `insecure`.

    `server_key` is the broker's public certificate (a path, e.g. `keys/server.key`) or its
    40-character z85 key; `client_key` the path of this client's secret certificate
    (`NAME.key_secret`, made by `python -m broker keys DIR --name NAME`).  Missing ones are
    taken from $ZMQ_INFER_SERVER_KEY and $ZMQ_INFER_CLIENT_KEY.  `insecure` is a bool (or 0
    or 1): a str was taken for its truth, and `insecure="false"` (a value read from the
    environment, say) connected in plain tcp, leaving the keys of the environment unused
    (the configuration hunt)."""
    if not (isinstance(insecure, int) and insecure in (0, 1)):  # (bool is an int)
        raise InvalidInput(f"insecure must be True or False, got {insecure!r}")
    try:
        return C.peer_keys(endpoint, server_key, client_key, insecure=bool(insecure), server_opt="server_key=",
                           own_opt="client_key=", insecure_opt="insecure=True", own_name="client",
                           env_own=ENV_CLIENT_KEY)
    except C.CurveKeyError as e:
        raise InvalidInput(str(e)) from None


def tcp_options(endpoint: Any, transport: str, direct_reply: bool) -> tuple[str, bool]:
    """(transport, direct_reply) as a broker at `endpoint` takes them: a tcp broker refuses
    shared-memory and CUDA references and reply sockets from its tcp peers, loopback or not,
    so inputs go inline and replies come back through it.  `direct_reply` is checked either
    way (a tcp endpoint's `direct_reply="false"` was never looked at)."""
    direct_reply = flag("direct_reply", direct_reply)
    if not C.is_tcp(endpoint):
        return transport, direct_reply
    if transport == "shm":
        raise InvalidInput(f"transport='shm' cannot be used with the tcp endpoint {endpoint!r}: a broker takes "
                           f"only inline tensors over tcp; use transport='auto' or 'inline', or an ipc:// endpoint")
    return ("inline" if transport == "auto" else transport), False


def lease_curve(curve: C.PeerKeys | None, endpoint: str, server_key: str | None) -> C.PeerKeys | None:
    """The CurveZMQ keys for a lease's tcp direct socket (docs/security.md): this client's own
    pair, with the worker's public key from the lease (`LeaseInfo.server_key`); None for an
    ipc one.  A client with keys never connects in plain tcp, nor one without keys to a
    CurveZMQ worker: `InvalidInput` says which (the lease goes back to the broker)."""
    if not C.is_tcp(endpoint):
        return None
    if curve is None and server_key is None:
        return None  # --insecure on both sides
    if curve is None:
        raise InvalidInput(f"the leased worker at {endpoint} is a CurveZMQ server and this client has no keys "
                           "(insecure=True)")
    if server_key is None:
        raise InvalidInput(f"the leased worker at {endpoint} is plain tcp (--insecure); this client uses CurveZMQ "
                           "and does not send its requests in clear")
    return C.PeerKeys(server=server_key.encode("ascii"), public=curve.public, secret=curve.secret)


def open_link(pin: Any, hello: list[Any]) -> LinkConn | None:
    """A lease's local link (docs/protocol.md section 10.6), connected and its HELLO sent; None
    when the lease offers none or it cannot be used now (the twin then connects a DEALER to
    the lease's endpoint)."""
    if pin.link is None:
        return None
    try:
        link = LinkConn(pin.link)
    except OSError as e:
        log.info("cannot connect to the local link of %r's leased worker (%s); using %s", pin.service, e,
                 pin.endpoint)
        return None
    if link.send(hello):
        return link
    link.close()
    return None


#: the most a tcp connect to the broker may take before libzmq gives it up and tries again
#: (100 ms later): a SYN lost to a partition is sent again soon after it heals, instead of
#: after the kernel's backoff (1, 3, 7... s); long enough for a handshake over a link whose
#: round trip takes most of a second (a satellite hop)
BROKER_CONNECT_TIMEOUT_MS = 2000


#: the sockets the SDK asks of pyzmq's process-wide context, when it is the first to make
#: one there (libzmq's default, 1023, is about 250 clients: each takes a DEALER, a reply
#: inbox, a monitor and its pair; a slot costs a dozen bytes)
MAX_SOCKETS = 8192


def room_for_sockets(ctx: zmq.Context) -> zmq.Context:
    """``ctx`` with room for `MAX_SOCKETS` sockets where libzmq allows it (the limit counts
    only if set before the context's first socket: a context an application used first
    keeps its own).  The resource audit: past about 250 Clients a process got "out of
    descriptors, raise RLIMIT_NOFILE" with most of its descriptors free."""
    try:
        if ctx.get(zmq.MAX_SOCKETS) < MAX_SOCKETS:
            ctx.set(zmq.MAX_SOCKETS, min(MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT)))
    except zmq.ZMQError:
        pass
    return ctx


def _out_of_descriptors(e: zmq.ZMQError, endpoint: str) -> Exception:
    if e.errno in (errno.EMFILE, errno.ENFILE):
        if e.errno == errno.EMFILE and descriptor_room()[0]:
            # libzmq says EMFILE for its context's socket limit too: descriptors are not it.
            return InferenceError(
                f"cannot make a socket to {endpoint}: this process's ZeroMQ context has no room for another "
                f"socket ({e}; its limit, zmq.MAX_SOCKETS, is set before its first socket: the SDK asks "
                f"{MAX_SOCKETS}, an application that used zmq.Context.instance() first keeps its own); close "
                f"clients this process no longer uses (each takes about four sockets), or set "
                f"zmq.Context.instance().max_sockets before anything makes a socket", code=None)
        return InferenceError(f"cannot make a socket to {endpoint}: this process is out of descriptors ({e}); close "
                              f"some, or raise its RLIMIT_NOFILE", code=None)
    return e


def send_failure(e: BaseException, endpoint: str) -> InferenceError | None:
    """The error for a request that could not be sent because this process is out of
    descriptors, memory or threads (`wire.out_of_resources`; the socket was left at a
    message boundary, and nothing of the request was taken for a request), or None for any
    other exception."""
    if not out_of_resources(e):
        return None
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return InferenceError(f"cannot send a request to {endpoint}: this process is out of descriptors, memory or "
                          f"threads ({why}); the request was not sent: free some, or raise its limits "
                          f"(RLIMIT_NOFILE, RLIMIT_AS, the cgroup's pids.max), and retry", code=None)


#: threads libzmq starts for a context at its first socket (its reaper and one I/O thread),
#: and those pyzmq's zero-copy sends need (its garbage-collector thread, and that one's own
#: context's two): `context` sees that they can be started before anything starts them
_ZMQ_THREADS = 2
_ZERO_COPY_THREADS = 3
#: the process whose first client found room for those threads (a forked child asks again:
#: its pyzmq context and garbage collector are new)
_checked_in: int | None = None


def _startable_threads(n: int) -> int:
    """How many of `n` threads this process can have running at once now (started together,
    each waiting on one event, then let go and joined)."""
    gate = threading.Event()
    started: list[threading.Thread] = []
    try:
        for _ in range(n):
            t = threading.Thread(target=gate.wait, args=(10.0,), name="client-sdk-thread-room", daemon=True)
            t.start()
            started.append(t)
    except RuntimeError:  # "can't start new thread": a pids limit (cgroup pids.max, RLIMIT_NPROC) reached
        pass
    finally:
        gate.set()
        for t in started:
            t.join(10.0)
    return len(started)


def _check_threads(endpoint: str) -> None:
    """Once per process, before its first client makes the context's first socket: libzmq
    starts two threads then, and aborts the whole process when it cannot (an assertion in
    its thread.cpp), so a process at its pids limit got SIGABRT from a Client constructor.
    `InferenceError` instead.  With room for pyzmq's zero-copy machinery too, that is
    started now (`wire.warm_zero_copy`), while descriptors and threads are likely to be
    there, rather than at the first tensor of 64 KiB or more sent inline."""
    global _checked_in
    pid = os.getpid()
    if _checked_in == pid:
        return
    warm = not zero_copy_gc.is_alive()
    room = _startable_threads(_ZMQ_THREADS + (_ZERO_COPY_THREADS if warm else 0))
    if room < _ZMQ_THREADS:
        raise InferenceError(f"cannot connect to {endpoint}: this process cannot start threads (ZeroMQ needs "
                             f"{_ZMQ_THREADS}, and aborts the whole process without them): raise its pids limit "
                             f"(the cgroup's pids.max, RLIMIT_NPROC) or end some threads, and retry", code=None)
    if warm and room == _ZMQ_THREADS + _ZERO_COPY_THREADS:
        try:
            warm_zero_copy()
        except Exception as e:  # (pyzmq's thread may have printed why): large inline frames are then copied
            log.debug("pyzmq's zero-copy sends could not be started now (%s)", e)
    _checked_in = pid


def context(endpoint: str) -> zmq.Context:
    """pyzmq's process-wide context (`zmq.Context.instance()`; its first use makes it, which
    takes descriptors: out of them, an `InferenceError` that says so).  The first time in a
    process, also sees that the threads libzmq starts with the context's first socket can
    be started (`InferenceError` when not: libzmq would abort the process)."""
    _check_threads(endpoint)
    try:
        return room_for_sockets(zmq.Context.instance())
    except zmq.ZMQError as e:
        raise _out_of_descriptors(e, endpoint) from None


def dealer(ctx: zmq.Context, endpoint: str, curve: C.PeerKeys | None = None,
           heartbeat_s: float | None = None) -> zmq.Socket:
    """A DEALER connected to `endpoint`; a CURVE client of it when `curve` is given.

    Over tcp with `heartbeat_s` (the client's broker socket): the connection is closed once
    the broker's host stops acknowledging for LIVENESS heartbeats, the client's silence
    window (`wire.tcp_liveness`: a partition, a host that died; not sooner, since Linux
    5.11 also counts a receive window closed that long, and a broker that only stopped
    reading for a while must keep its clients), and a connect not done within
    `BROKER_CONNECT_TIMEOUT_MS` is tried again; libzmq then connects again by itself, the
    name resolved afresh.  Without it a half-open connection holds the client for as long
    as TCP retries, many minutes after the network healed.  What was on the old connection
    is lost with it: the broker's heartbeat answers name the new one, and the client sends
    again what it still waits for (core.py, `_on_broker_instance`).  A process out of
    descriptors gets an `InferenceError` that says so (libzmq's own was a raw ZMQError)."""
    return _dealer(ctx, endpoint, curve, heartbeat_s, False)[0]


def broker_dealer(ctx: zmq.Context, endpoint: str, curve: C.PeerKeys | None,
                  heartbeat_s: float | None) -> tuple[zmq.Socket, zmq.Socket | None]:
    """A client's DEALER to its broker (`dealer`) and, over tcp with heartbeats, the monitor
    of its handshakes (`broker_monitor`), attached before it connects: a monitor hears only
    what happens after it is attached, and a first handshake the broker refused for good
    (libzmq then never dials again) before the monitor was there was never heard at all: a
    loaded client, descheduled between its connect and its monitor, was never told it was
    refused and never dialled again once the broker was put right."""
    return _dealer(ctx, endpoint, curve, heartbeat_s, True)


def request_dealer(ctx: zmq.Context, endpoint: str, curve: C.PeerKeys,
                   heartbeat_s: float | None) -> tuple[zmq.Socket, zmq.Socket]:
    """A plain MDP `request`'s own DEALER (`dealer`, with keys, its tcp liveness the client's)
    and the monitor of its handshakes (`broker_monitor`'s events, heartbeats or not),
    attached before it connects: a refusal fails the request at once (`refused_error`)."""
    sock, monitor = _dealer(ctx, endpoint, curve, heartbeat_s, True, always=True)
    assert monitor is not None
    return sock, monitor


def _dealer(ctx: zmq.Context, endpoint: str, curve: C.PeerKeys | None, heartbeat_s: float | None,
            watch: bool, always: bool = False) -> tuple[zmq.Socket, zmq.Socket | None]:
    try:
        sock = ctx.socket(zmq.DEALER)
    except zmq.ZMQError as e:
        raise _out_of_descriptors(e, endpoint) from None
    monitor = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        C.configure_peer(sock, curve)
        if heartbeat_s and C.is_tcp(endpoint):
            from .core import LIVENESS

            tcp_liveness(sock, LIVENESS * heartbeat_s)
            sock.setsockopt(zmq.CONNECT_TIMEOUT, BROKER_CONNECT_TIMEOUT_MS)
        if watch:
            # (``always``: a monitor whether or not heartbeats run, `request_dealer`)
            try:
                monitor = broker_monitor(sock, endpoint, heartbeat_s or (1.0 if always else None))
            except zmq.ZMQError as e:  # (its two sockets: the context's room, or descriptors)
                raise _out_of_descriptors(e, endpoint) from None
        _connect(sock, endpoint)
    except BaseException:
        if monitor is not None:
            monitor.close(linger=0)
        sock.close(linger=0)
        raise
    return sock, monitor


def _connect(sock: zmq.Socket, endpoint: str) -> None:
    # A tcp port over 65535: libzmq wraps it (99999 is 34463) and connects there, to
    # whatever listens on it, without a word (the broker and the worker refused it already;
    # the client took it: the configuration hunt).
    problem = P.tcp_port_problem(endpoint) or P.endpoint_text_problem(endpoint)
    if problem is not None:
        sock.close(linger=0)
        raise InvalidInput(f"cannot connect to {problem}")
    try:
        P.ipv6_for(sock, endpoint)
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        if e.errno == errno.ENAMETOOLONG and endpoint.startswith("ipc://"):  # spelt right, maybe, but too long
            raise InvalidInput(f"cannot connect to {endpoint!r}: its path is {len(endpoint.encode()) - 6} bytes, "
                               f"and a socket's path holds at most 107: the broker must listen on a shorter "
                               f"one") from None
        raise InvalidInput(f"cannot connect to {endpoint!r}: {e}; check the endpoint's spelling") from None


#: what the monitor of a lease's tcp connection reports (`lease_dealer`, `lease_events`):
#: event -> (final, why).  libzmq 4.3 tries a refused connection, a handshake that timed
#: out and a dropped connection again by itself; a handshake the worker refused (its ZAP
#: handler: our key is not a leaseholder's) or that failed on the protocol (one side
#: CurveZMQ, the other not) ends the session for good.
LEASE_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_LEASE_DOWN = {
    zmq.EVENT_CONNECT_RETRIED: (False, "no connection yet (refused, unreachable or timed out)"),
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: (False, "the handshake failed or timed out"),
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (True, "the handshake failed (protocol error)"),
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: (True, "the worker refused the handshake (our key is not its leaseholder's)"),
    zmq.EVENT_DISCONNECTED: (False, "the connection dropped (or its peer stopped acknowledging)"),
}
_LEASE_EVENTS = LEASE_UP
for _e in _LEASE_DOWN:
    _LEASE_EVENTS |= _e
_monitors = itertools.count()


def lease_dealer(ctx: zmq.Context, pin: Any, curve: C.PeerKeys | None, connect_s: float,
                 heartbeat_s: float | None) -> tuple[zmq.Socket, zmq.Socket]:
    """The DEALER to a lease's worker (its HELLO not yet sent) and a monitor of its
    connection: a PAIR socket whose messages `lease_events` reads.  A tcp connection
    (docs/protocol.md section 10.4) gives a connect or a handshake `connect_s` seconds (then
    tries again, which the monitor reports), and is closed when its peer stops acknowledging
    for LIVENESS of `heartbeat_s` (`wire.tcp_liveness`), so a partition shows as a lost
    connection instead of calls that wait for their deadlines.  Over ipc the monitor reports
    drops alone (EVENT_DISCONNECTED: the worker's process ended, or closed its socket): while
    a broker holds the lease, it tells the client of a dead worker (LEASE_END with resend),
    but a lease whose broker restarted is known to nobody else, and its calls, which stay on
    it until their worker answers (pins.py, `_pin_reset`), waited for their deadlines when
    that worker died too.  (A connect that fails is left to libzmq's retries there: a worker
    near its descriptor limit moves its socket's file aside for a while.)  `InvalidInput`
    when it cannot be used (`lease_curve`)."""
    keys = lease_curve(curve, pin.endpoint, pin.server_key)
    tcp = C.is_tcp(pin.endpoint)
    sock = ctx.socket(zmq.DEALER)
    monitor = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        C.configure_peer(sock, keys)
        if tcp:
            from .core import LIVENESS

            ms = max(1, int(connect_s * 1000))
            sock.setsockopt(zmq.CONNECT_TIMEOUT, ms)
            sock.setsockopt(zmq.HANDSHAKE_IVL, ms)
            # tries again after 0.1 s, doubling to 2 s: a client idle between calls gives a
            # lease it cannot reach back only at its next call or heartbeat, and need not
            # knock 10 times a second until then
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            if heartbeat_s:
                tcp_liveness(sock, LIVENESS * heartbeat_s)
        # an address of its own: pyzmq's default names the descriptor, which a socket
        # closed a moment ago may still hold in libzmq's reaper
        monitor = sock.get_monitor_socket(_LEASE_EVENTS if tcp else zmq.EVENT_DISCONNECTED,
                                          addr=f"inproc://client-sdk-lease-{os.getpid()}-{next(_monitors)}")
        sock.connect(pin.endpoint)
    except zmq.ZMQError as e:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
        raise InvalidInput(f"cannot connect to the leased worker at {pin.endpoint!r}: {e}") from None
    return sock, monitor


def lease_events(monitor: zmq.Socket) -> list[tuple[bool, bool, str]]:
    """Everything a lease's monitor holds, oldest first, as (up, final, why): (True, False,
    "") for a handshake that succeeded, (False, final, why) for a connection that failed or
    dropped (`final`: libzmq will not try again).  Reads until it is empty (its descriptor,
    like every ZeroMQ one, signals edges)."""
    out: list[tuple[bool, bool, str]] = []
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.ZMQError:  # empty (or closed)
            return out
        try:
            event = monitor_event(frames)["event"]
        except Exception:  # not a monitor message: nothing of ours
            continue
        if event == LEASE_UP:
            out.append((True, False, ""))
        elif event in _LEASE_DOWN:
            out.append((False, *_LEASE_DOWN[event]))


def broker_monitor(sock: zmq.Socket, endpoint: str, heartbeat_s: float | None) -> zmq.Socket | None:
    """With heartbeats, a monitor (attached before the socket connects: `broker_dealer`) of
    the broker DEALER's handshakes (`handshakes` reads it): the twin heartbeats at each one,
    so that the answer naming a new broker (core.py, `_on_broker_instance`) or a new
    connection comes within a round trip instead of a heartbeat interval later (the first
    handshake's heartbeat follows the hello's: one more answer at start, nothing else), and,
    over tcp, the handshakes the broker refused (a call that times out says why).  Over ipc
    too: a broker restarted on the same endpoint is a new connection, and a call the dead
    broker held was sent again only at the next heartbeat, up to an interval after the
    new broker was up (1 s by default: a blocking client's call stalled that long, the
    stalls hunt).  None without heartbeats."""
    if not heartbeat_s:
        return None
    events = zmq.EVENT_HANDSHAKE_SUCCEEDED
    for e in _BROKER_REFUSED:
        events |= e
    return sock.get_monitor_socket(events, addr=f"inproc://client-sdk-broker-{os.getpid()}-{next(_monitors)}")


#: the broker's refusals of a handshake: event -> (final, what to do about it).  libzmq gives
#: the endpoint up at a final one (core.REDIAL_S: the client dials again, `redial`) and tries
#: again by itself after the others; it says nothing either way: calls waited out their
#: deadlines told to raise them.  A handshake that fails without detail is most often a
#: hello the broker could not decrypt (the broker logs that cause); a broker that died
#: during a handshake is the other case, said until the next handshake succeeds.
_BROKER_REFUSED = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (True, "one side speaks CurveZMQ and the other plain tcp (`insecure=True` "
                                          "against a broker with keys, or keys against an --insecure one: was the "
                                          "broker restarted with other security settings?)"),
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: (True, "it refused this client's key (its public certificate is not in the "
                                      "broker's --client-keys directory)"),
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: (False, "no detail given; most likely `server_key` (or "  # (core.NO_DETAIL)
                                           "$ZMQ_INFER_SERVER_KEY) is not that broker's public certificate (the "
                                           "broker's log says the cause)"),
}


def refusal(frames: list[Any]) -> tuple[bool, str] | None:
    """A monitor message (`broker_monitor`'s) that says the broker refused a handshake:
    (final, why), as `_BROKER_REFUSED` has them; None for anything else."""
    try:
        event = monitor_event(frames)["event"]
    except Exception:  # not a monitor message: nothing of ours
        return None
    return _BROKER_REFUSED.get(event)


def refused_error(endpoint: str, why: str, conn: str | None = "this request's connection",
                  request_id: int | None = None) -> InferenceError:
    """The error of a call whose connection's handshake the broker refused for good
    (libzmq gives the endpoint up): `Forbidden` for this client's key, else
    `BrokerUnreachable`.  A plain MDP `request` (a socket of its own) raises it at once: it
    waited for its timeout, told to raise it, and for ever without one (the client audit).
    The client's own connection (``conn`` None) fails its waiting calls with it
    (`ClientCore.refused_for_good`): a client whose key is not on the broker's allow-list
    waited out each call's liveness window, or its timeout when shorter."""
    from .errors import BrokerUnreachable, Forbidden

    said = (f"the broker at {endpoint} refuses this client's handshake: {why}" if conn is None else
            f"the broker at {endpoint} refused the handshake of {conn}: {why}")
    if why == _BROKER_REFUSED[zmq.EVENT_HANDSHAKE_FAILED_AUTH][1]:
        return Forbidden(said, request_id=request_id)
    return BrokerUnreachable(said, request_id=request_id)


def redial(sock: zmq.Socket, endpoint: str) -> None:
    """Connect `sock` to `endpoint` again, libzmq having given it up at a refused handshake
    (`_BROKER_REFUSED`): what is left of the old connection's entry goes first, so that
    dials do not pile up.  The socket's options (keys, timeouts) hold for the new one."""
    try:
        sock.disconnect(endpoint)
    except zmq.ZMQError:  # nothing left of it (ENOENT)
        pass
    sock.connect(endpoint)
    touched(sock)


def handshakes(monitor: zmq.Socket) -> tuple[int, str | None, bool]:
    """What `monitor` (`broker_monitor`) reported, read until it is empty: how many
    handshakes succeeded, the last word on the connection (None when nothing was reported,
    "" when the latest handshake succeeded, else why the broker refused it), and whether a
    refusal since the last success made libzmq give the endpoint up (dial again)."""
    ups, last, final = 0, None, False
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.ZMQError:  # empty (or closed)
            return ups, last, final
        try:
            event = monitor_event(frames)["event"]
        except Exception:  # not a monitor message: nothing of ours
            continue
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            ups, last, final = ups + 1, "", False
        elif event in _BROKER_REFUSED:
            gone, why = _BROKER_REFUSED[event]
            final = final or gone
            if not (last and event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):  # (core.broker_said)
                last = why


class IpcDiagnosis:
    """`ipc_problem` for one client's endpoint, asked at most once a second: every call that
    times out asks (200 calls at once made 200 connections to a broker that was there but did
    not answer: found by review)."""

    def __init__(self, endpoint: str, every: float = 1.0):
        self.endpoint = endpoint
        self.every = every
        self._at = -math.inf
        self._said: str | None = None

    def __call__(self) -> str | None:
        now = time.monotonic()
        if now - self._at >= self.every:
            try:
                said = ipc_problem(self.endpoint)
            except OSError:  # its probe socket, when this process is out of descriptors
                said = None
            self._said = said or descriptors_problem(self.endpoint)
            self._at = now
        return self._said


#: descriptors within which of its limit a process counts as out of them (libzmq's
#: connection needs one, and the listing that counts them another)
OWN_FD_MARGIN = 2


def descriptors_problem(endpoint: str) -> str | None:
    """Why this process cannot connect to `endpoint` when it is out of descriptors, or None.
    libzmq's I/O thread makes the connection, and retries in silence when the socket call
    fails with EMFILE: a client whose process sat at its RLIMIT_NOFILE (a low `ulimit -n`,
    or an application that had used them up) had every call wait out its deadline with
    advice about the broker's endpoint and the broker's limit.  Any endpoint, tcp too."""
    limit = nofile_limit()
    used = open_descriptors()
    if 0 <= used < limit - OWN_FD_MARGIN:
        return None
    held = "all" if used < 0 else str(used)
    return (f"this process has {held} of its {limit} descriptors open (RLIMIT_NOFILE), so ZeroMQ cannot make its "
            f"connection to {endpoint}: close some, or raise the limit (ulimit -n)")


def drop_monitor(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Stop `sock`'s monitor and close it (before `sock` itself is closed)."""
    if monitor is None:
        return
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    monitor.close(linger=0)


def drop_lease_dealer(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Close a lease's DEALER (DISCONNECT first) and its monitor."""
    drop_monitor(sock, monitor)
    drop_socket(sock)


#: the most messages read from one socket as a client closes it (`drain_unread`)
UNREAD_MAX = 4096


def drain_unread(socks: Any, release: Any) -> None:
    """What a closing client's sockets still hold, read without waiting, each message handed
    to ``release`` (`ClientCore.release_unread`: the output slots its replies name go back).
    ``socks``: zmq sockets and lease links (`LinkConn`); closed ones are skipped.  Never
    raises a socket's error (a socket that cannot be read has nothing to give back)."""
    for sock in socks:
        if sock is None or sock.closed:
            continue
        link = type(sock) is LinkConn
        for _ in range(UNREAD_MAX):
            try:
                frames = sock.recv() if link else recv_frames(sock, zmq.NOBLOCK)
            except Exception:  # zmq.Again (nothing left), a closed or broken connection
                break
            if frames is None:
                break
            release(frames)


def drop_socket(sock: zmq.Socket) -> None:
    """DISCONNECT (drops the request at the broker if it is still queued), then close."""
    try:
        sent = sock.send_multipart(P.client_disconnect(), flags=zmq.NOBLOCK)
        if hasattr(sent, "exception") and sent.done():  # an asyncio socket returns a future
            sent.exception()
    except zmq.ZMQError:
        pass
    sock.close(linger=CLOSE_LINGER_MS)


def descriptor_room() -> tuple[bool, bool]:
    """Whether this process has descriptors to spare for connections a worker would make to
    its reply inbox (at its limit, libzmq's ipc listener asserts on EMFILE in accept and
    aborts the process), and whether it has plenty (half its limit free or more).  A
    listing of /proc/self/fd: half a millisecond for a thousand, 6 ms for ten thousand;
    looked at when an inbox is opened, then every `ROOM_LOOK_S` (`ClientCore.use_inbox`)."""
    limit = nofile_limit()
    used = open_descriptors()
    if used < 0:
        return False, False
    free = limit - used
    return free >= max(64, limit // 8), free >= limit // 2


class ReplyInbox:
    """The client's direct-reply socket: a PULL bound to an ipc path that only this user can
    reach (the runtime directory is mode 0700).  Workers on this host connect to it and send
    FINALs there.  libzmq leaves the socket file behind on close, so `close` unlinks it."""

    def __init__(self, sock: zmq.Socket, path: str):
        self.sock = sock
        self.path = path
        self.endpoint = "ipc://" + path   # what requests name as `reply_to`
        # A client dropped without close() still removes its file (at collection or exit),
        # in the process that made it only: a forked child's copy must not take the
        # parent's file away (workers would relay every reply through the broker).
        self._unlink = weakref.finalize(self, _unlink_quietly, path, os.getpid())

    @classmethod
    def open(cls, ctx: zmq.Context) -> "ReplyInbox | None":
        """Bind a fresh inbox; None (replies then come through the broker) when it cannot be:
        also when this process is near its descriptor limit, where the connection a worker
        makes to it would have libzmq abort the process (its ipc listener asserts on EMFILE
        in accept): a library must not take its host down."""
        if not descriptor_room()[0]:
            log.info("this process is near its limit of %d descriptors; replies go through the broker",
                     nofile_limit())
            return None
        try:
            path = P.reply_socket_path()
        except (OSError, ValueError) as e:  # the runtime directory or /proc unreadable now
            log.info("no reply socket (%s); replies go through the broker", e)
            return None
        if len(path.encode()) > _MAX_IPC_PATH:
            log.info("runtime directory path too long for a reply socket; replies go through the broker")
            return None
        try:
            sock = ctx.socket(zmq.PULL)
        except zmq.ZMQError as e:  # no room for a socket in the context (or no descriptor): a bare error before
            log.info("no reply socket (%s); replies go through the broker", e)
            return None
        sock.linger = 0
        sock.rcvhwm = 100_000
        try:
            sock.bind("ipc://" + path)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            log.info("cannot bind a reply socket (%s); replies go through the broker", e)
            return None
        try:
            os.chmod(path, 0o600)  # only this user's processes may connect (the directory is 0700 too)
        except OSError as e:
            sock.close(linger=0)
            _unlink_quietly(path)
            log.info("cannot restrict the reply socket to this user (%s); replies go through the broker", e)
            return None
        return cls(sock, path)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._unlink()


def _unlink_quietly(path: str, owner: int | None = None) -> None:
    if owner is not None and os.getpid() != owner:
        return
    try:
        os.unlink(path)
    except OSError:
        pass
