"""Peers: the systems a benchmark measures, each behind the same small interface.

A peer owns its server processes (spawned in `start()`, always reaped in `stop()`) and hands
out clients whose `request(payload)` the load generator awaits. Adding a system to the
comparison is one class decorated with `@register`:

    @register
    class MyPeer(Peer):
        name = "my-peer"
        def available(self): return True, ""
        def start(self): self.spawn([...])           # blocks on the child's READY line
        def client(self): return MyClient(...)       # a PeerClient

`Peer.stop()` reaps whatever `spawn()` started, so most peers need not override it.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import importlib.util
import itertools
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, ClassVar

import numpy as np

from bench import echo_servers


class PeerStartError(RuntimeError):
    """A peer's server did not come up (exited, or no READY line in time)."""


class PeerClient:
    """What the load generator talks to.

    `request` is awaited on the harness's event loop (the client is created inside that loop,
    so it may bind loop resources lazily). It returns None or a dict; recognised keys:

    - `queue_ms`, `input_ms`, `compute_ms`, `output_ms`: server-side split, averaged in reports;
    - `error`: a truthy value marks the request failed (raising an exception does the same);
    - `reply`: the response payload (bytes-like), used by tests to check echoes bit-exactly.
    """

    async def request(self, payload: Any) -> dict | None:  # pragma: no cover - interface
        raise NotImplementedError

    def request_sync(self, payload: Any) -> dict | None:  # pragma: no cover - interface
        raise NotImplementedError

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        pass


PEERS: dict[str, type["Peer"]] = {}

# Peers still running at interpreter exit are stopped there, so an exception in the harness
# (or a test) never orphans server processes.
_LIVE: "weakref.WeakSet[Peer]" = weakref.WeakSet()


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM held off, then delivered as they came once the block is left: a
    process started and tracked (`Peer.spawn`, `start_ready`, bench.chaos's fleet) is
    stopped with the rest.  One that came while
    `subprocess.Popen` waited for the child's exec raised there, before the Popen was
    returned: the child (a worker peer) ran on, untracked, after the harness had exited
    (tests/bench/test_report_cli.py, once in a fresh clone's `make test`).  Only the main
    thread can set handlers: elsewhere it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    old = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for signum in got:
            if old[signum] is signal.SIG_DFL:
                # Its default would end the process at once, past every `finally` and
                # atexit that stops what was started: a harness that set no handler of
                # its own (`sigterm_exits`) exits as if it had.
                raise SystemExit(128 + signum)
            signal.raise_signal(signum)  # to the handler it was meant for, now


def sigterm_exits() -> None:
    """SIGTERM (what `timeout` sends) as SystemExit(143), for a harness's command (not a
    caller of its `main()`, whose handler it would replace for good): the processes it
    started are stopped on the way out (`finally`, atexit).  Left to its default, it ended
    the harness at once, and the broker and worker processes it had started ran on, their
    temporary directories kept (the bench audit; `python -m bench`, bench.chaos, bench.soak,
    bench.restart).  A second SIGTERM (the stop itself stuck, or a supervisor's impatience)
    SIGKILLs every process started and tracked here, then ends the harness at once."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def stop(signum, frame):
            signal.signal(signal.SIGTERM, kill_all)
            raise SystemExit(128 + signum)

        def kill_all(signum, frame):
            procs = list(_STARTED) + [p for peer in list(_LIVE) for p in getattr(peer, "_procs", ())]
            for p in procs:
                try:
                    p.kill()
                except Exception:
                    pass
            os._exit(128 + signum)

        try:
            signal.signal(signal.SIGTERM, stop)
        except ValueError:  # not the main thread: as before
            pass


@atexit.register
def _stop_live_peers() -> None:
    for peer in list(_LIVE):
        try:
            peer.stop()
        except Exception:
            pass


def register(cls: type["Peer"]) -> type["Peer"]:
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    PEERS[cls.name] = cls
    return cls


def make_peer(name: str, **options: Any) -> "Peer":
    try:
        cls = PEERS[name]
    except KeyError:
        raise KeyError(f"unknown peer {name!r}; known: {', '.join(PEERS)}") from None
    return cls(**options)


class Peer:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, **options: Any):
        self.options = options
        self._procs: list[subprocess.Popen] = []
        self._tmpdir: str | None = None

    # --- the interface -------------------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        """(True, "") when this peer can run here, else (False, why not)."""
        return True, ""

    def start(self) -> None:
        raise NotImplementedError

    def client(self) -> PeerClient:
        raise NotImplementedError

    @property
    def pids(self) -> list[int]:
        """The pids of the processes spawn() started, in order (for CPU accounting)."""
        return [p.pid for p in self._procs]

    def stop(self) -> None:
        """Reap every process spawn() started, newest first; idempotent; never raises."""
        procs, self._procs = self._procs, []
        for p in reversed(procs):
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except OSError:
                    pass
        for p in reversed(procs):
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        _LIVE.discard(self)

    def __enter__(self) -> "Peer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- helpers for subclasses ----------------------------------------------------------
    @property
    def tmpdir(self) -> str:
        if self._tmpdir is None:
            # Short and under /tmp: ipc:// paths are limited to ~107 bytes.
            self._tmpdir = tempfile.mkdtemp(prefix="zbench-")
        return self._tmpdir

    def ipc(self, name: str) -> str:
        return f"ipc://{os.path.join(self.tmpdir, name)}"

    def spawn(self, argv: list[str], *, ready_timeout: float = 60.0, env: dict | None = None) -> str:
        """Start a server process and block until it writes `READY [info]` on stdout.

        Returns the info after READY (e.g. a bound port). The process is tracked and reaped
        by stop(). Raises PeerStartError (with the exit status) if it dies or stays silent.
        """
        with signals_held():  # (a Ctrl-C or SIGTERM now: after the process is tracked)
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=None,  # server tracebacks go straight to the user's terminal
                env=env,
                close_fds=True,
            )
            self._procs.append(proc)
            _LIVE.add(self)
        try:
            return wait_ready(proc, ready_timeout)
        except (PeerStartError, KeyboardInterrupt, SystemExit):
            # (a Ctrl-C, or the harness's SIGTERM, goes on as itself: taken for this peer's
            # failure, the run went on against the peers the same signal had stopped, and
            # exited 0: the bench audit; the process is reaped by stop())
            raise
        except BaseException as e:
            raise PeerStartError(f"{self.name}: {e!r}") from e

    @staticmethod
    def python_module(module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    @staticmethod
    def unbuffered_env() -> dict:
        """This environment with PYTHONUNBUFFERED=1: a spawned server's READY line is not held
        in its stdout buffer."""
        return dict(os.environ, PYTHONUNBUFFERED="1")

    def spawn_broker(self, *broker_args: str) -> str:
        """`python -m broker` on ipc endpoints of this peer's own (``self.frontend`` is set to
        its frontend) with ``broker_args``; the backend endpoint, for the workers."""
        self.frontend = self.ipc("f.ipc")
        backend = self.ipc("b.ipc")
        self.spawn(self.python_module("broker", "--frontend", self.frontend, "--backend", backend, *broker_args),
                   env=self.unbuffered_env())
        return backend


# Processes `start_ready` started, stopped at interpreter exit if still running: a Ctrl-C or
# SIGTERM between its return and the caller's keeping the process (or a caller that stops
# its processes only once they all started) would leave it running after the harness.
_STARTED: "weakref.WeakSet[subprocess.Popen]" = weakref.WeakSet()


@atexit.register
def _stop_started() -> None:
    for p in list(_STARTED):
        try:
            stop_process(p)
        except Exception:
            pass


def start_ready(args: list[str], env: dict | None = None, timeout: float = 120,
                stderr: Any = subprocess.DEVNULL) -> subprocess.Popen:
    """`python ARGS` (one of our processes), returned once it printed its READY line (what
    follows the word: the process's ``ready_line``, e.g. ``http=127.0.0.1:40123``).  One
    that fails to (it exits, stays silent, or a signal interrupts the wait) is killed and
    reaped before the exception goes on; a SIGTERM or Ctrl-C while it is started is held
    until it is tracked (`signals_held`), and one still running at exit is stopped then.
    `stderr`: where its logs go (a file object or descriptor; discarded by default)."""
    full = None if env is None else {**os.environ, **env}
    with signals_held():
        p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=stderr, env=full)
        _STARTED.add(p)
    try:
        p.ready_line = wait_ready(p, timeout)  # (what its READY line says after the word)
    except BaseException:
        p.kill()
        p.wait(10)
        p.stdout.close()
        raise
    return p


def stop_process(p: subprocess.Popen) -> None:
    """SIGTERM (our processes drain and exit 0), then SIGKILL if it does not exit in time."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def wait_ready(proc: subprocess.Popen, timeout: float) -> str:
    """The first line a peer process prints on stdout (its READY line), waiting at most
    `timeout` seconds; PeerStartError if it exits or stays silent."""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerStartError(f"{proc.args!r}: no READY within {timeout:.0f} s")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            rc = proc.wait()
            raise PeerStartError(f"{proc.args!r}: exited with status {rc} before READY")
        buf += chunk
    line = buf.split(b"\n", 1)[0].decode(errors="replace").strip()
    if not line.startswith("READY"):
        raise PeerStartError(f"{proc.args!r}: expected READY, got {line!r}")
    return line[len("READY"):].strip()


def as_buffer(payload: Any) -> Any:
    """A flat byte view of the payload without copying (zmq sends any contiguous buffer)."""
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            payload = np.ascontiguousarray(payload)
        return payload.reshape(-1).view(np.uint8).data
    return payload


# ---------------------------------------------------------------------------------------
# ZeroMQ echo client (direct and proxy peers)
# ---------------------------------------------------------------------------------------
class ZmqEchoClient(PeerClient):
    """DEALER client that multiplexes concurrent requests over one socket.

    Each request carries an 8-byte id frame the echo returns verbatim; a reader task matches
    replies to waiting futures, so N coroutines (closed loop) or thousands of tasks (open
    loop) share one connection, like a real SDK would.
    """

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self._ids = itertools.count(1)
        self._actx = None
        self._asock = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[bytes, asyncio.Future] = {}
        self._sctx = None
        self._ssock = None

    # async -----------------------------------------------------------------------------
    def _async_socket(self):
        if self._asock is None:
            import zmq
            import zmq.asyncio

            self._actx = zmq.asyncio.Context()
            s = self._actx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(self.endpoint)
            self._asock = s
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        return self._asock

    async def _read_loop(self) -> None:
        sock = self._asock
        pending = self._pending
        try:
            while True:
                frames = await sock.recv_multipart(copy=False)
                fut = pending.pop(frames[0].bytes, None)
                if fut is not None and not fut.done():
                    fut.set_result(frames)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # socket closed under us: fail whoever is still waiting
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(f"reader stopped: {e!r}"))
            pending.clear()

    async def request(self, payload: Any) -> dict | None:
        sock = self._async_socket()
        rid = next(self._ids).to_bytes(8, "little")
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await sock.send_multipart([rid, as_buffer(payload)], copy=False)
            frames = await fut
        finally:
            self._pending.pop(rid, None)
        return {"reply": frames[1].buffer}

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None
        if self._asock is not None:
            self._asock.close(0)
            self._actx.term()
            self._asock = self._actx = None
        self.close()

    # sync ------------------------------------------------------------------------------
    SYNC_TIMEOUT_S = 60.0  # a blocking recv gives up (TimeoutError) after this long

    def request_sync(self, payload: Any) -> dict | None:
        """One blocking round trip on a plain DEALER of its own (no event loop, no thread)."""
        import zmq

        if self._ssock is None:
            self._sctx = zmq.Context()
            s = self._sctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, int(self.SYNC_TIMEOUT_S * 1000))
            s.connect(self.endpoint)
            self._ssock = s
        rid = next(self._ids).to_bytes(8, "little")
        self._ssock.send_multipart([rid, as_buffer(payload)], copy=False)
        while True:
            try:
                frames = self._ssock.recv_multipart(copy=False)
            except zmq.Again:
                raise TimeoutError(f"no reply within {self.SYNC_TIMEOUT_S:g} s") from None
            if frames[0].bytes == rid:  # skip late replies to an abandoned earlier request
                return {"reply": frames[1].buffer}

    def close(self) -> None:
        if self._ssock is not None:
            self._ssock.close(0)
            self._sctx.term()
            self._ssock = self._sctx = None


# ---------------------------------------------------------------------------------------
# gRPC echo client
# ---------------------------------------------------------------------------------------
_STOP = object()


class GrpcEchoClient(PeerClient):
    """One bidirectional stream per client; replies come back in request order (the server
    echoes its stream in order), so a FIFO of futures matches them without an id."""

    def __init__(self, target: str):
        self.target = target
        self._achan = None
        self._acall = None
        self._reader: asyncio.Task | None = None
        self._fifo: collections.deque[asyncio.Future] = collections.deque()
        self._wlock: asyncio.Lock | None = None
        self._schan = None
        self._sq: queue.Queue | None = None
        self._sresp = None
        self._last_obj: Any = None
        self._last_bytes = b""

    def _bytes(self, payload: Any) -> bytes:
        # gRPC's C core wants bytes. Converting once per payload object mirrors a user who
        # already holds serialized bytes, and keeps the 64 MiB case from measuring memcpy.
        if payload is self._last_obj:
            return self._last_bytes
        data = payload if isinstance(payload, bytes) else bytes(as_buffer(payload))
        self._last_obj, self._last_bytes = payload, data
        return data

    async def _open(self) -> None:
        import grpc

        self._achan = grpc.aio.insecure_channel(self.target, options=echo_servers.GRPC_OPTIONS)
        self._acall = self._achan.stream_stream(echo_servers.GRPC_METHOD)()
        self._wlock = asyncio.Lock()
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        import grpc

        call, fifo = self._acall, self._fifo
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise ConnectionError("gRPC stream ended")
                fut = fifo.popleft()
                if not fut.done():  # a timed-out request's reply still arrives, in order
                    fut.set_result(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            while fifo:
                fut = fifo.popleft()
                if not fut.done():
                    fut.set_exception(ConnectionError(f"gRPC reader stopped: {e!r}"))

    async def request(self, payload: Any) -> dict | None:
        if self._acall is None:
            await self._open()
        data = self._bytes(payload)
        fut = asyncio.get_running_loop().create_future()
        # The FIFO order must equal the wire order, and grpc.aio allows one write at a time.
        async with self._wlock:
            self._fifo.append(fut)
            await self._acall.write(data)
        return {"reply": await fut}

    async def aclose(self) -> None:
        if self._acall is not None:
            try:
                await self._acall.done_writing()
            except Exception:
                pass
            self._acall.cancel()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None
        if self._achan is not None:
            await self._achan.close()
            self._achan = self._acall = None
        self.close()

    def request_sync(self, payload: Any) -> dict | None:
        """gRPC's blocking stream: a bidi stream_stream on a grpc.insecure_channel, fed by a
        queue-backed request iterator, one request at a time (the next reply is this one's).
        No per-message timeout exists on a stream: a server that never answers blocks."""
        import grpc

        if self._schan is None:
            self._schan = grpc.insecure_channel(self.target, options=echo_servers.GRPC_OPTIONS)
            self._sq = queue.Queue()
            method = self._schan.stream_stream(echo_servers.GRPC_METHOD)
            self._sresp = method(iter(self._sq.get, _STOP))
        self._sq.put(self._bytes(payload))
        return {"reply": next(self._sresp)}

    def close(self) -> None:
        if self._schan is not None:
            self._sq.put(_STOP)
            self._sresp.cancel()
            self._schan.close()
            self._schan = self._sq = self._sresp = None


# ---------------------------------------------------------------------------------------
# Floor peers
# ---------------------------------------------------------------------------------------
def _echo_argv(*args: str) -> list[str]:
    return Peer.python_module("bench.echo_servers", *args)


@register
class DirectPeer(Peer):
    name = "direct"
    description = "pyzmq DEALER -> ROUTER echo process, no broker (lower floor)"

    def start(self) -> None:
        self.endpoint = self.ipc("echo")
        self.spawn(_echo_argv("zmq-echo", "--bind", self.endpoint))

    def client(self) -> PeerClient:
        return ZmqEchoClient(self.endpoint)


@register
class ProxyPeer(Peer):
    name = "proxy"
    description = "direct's minimal echo behind a libzmq ROUTER/DEALER proxy process (bare floor)"

    def start(self) -> None:
        self.endpoint = self.ipc("front")
        back = self.ipc("back")
        self.spawn(_echo_argv("proxy", "--front", self.endpoint, "--back", back))
        self.spawn(_echo_argv("zmq-echo", "--connect", back))
        # The worker's READY only says it called connect(); one round trip through the relay
        # proves the whole path is up before anything is timed.
        probe = ZmqEchoClient(self.endpoint)
        try:
            probe.request_sync(b"ready?")
        finally:
            probe.close()

    def client(self) -> PeerClient:
        return ZmqEchoClient(self.endpoint)


@register
class GrpcPeer(Peer):
    name = "grpc"
    description = "grpcio (asyncio) bidirectional stream of raw bytes, echo, TCP loopback"

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("grpc") is None:
            return False, "grpcio is not installed (pip install grpcio)"
        return True, ""

    def start(self) -> None:
        port = self.spawn(_echo_argv("grpc", "--host", "127.0.0.1", "--port", "0"))
        self.target = f"127.0.0.1:{int(port)}"

    def client(self) -> PeerClient:
        return GrpcEchoClient(self.target)


# ---------------------------------------------------------------------------------------
# Optional third-party peers (only where their packages are installed)
# ---------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (for a peer told to bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpEchoClient(PeerClient):
    """Minimal keep-alive HTTP/1.1 POST client (stdlib only) with a connection per
    concurrent request, so the comparison does not depend on an extra HTTP library."""

    def __init__(self, host: str, port: int, path: str):
        self.host, self.port, self.path = host, port, path
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._all: list[asyncio.StreamWriter] = []

    def _head(self, n: int) -> bytes:
        return (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {n}\r\n\r\n"
        ).encode()

    @staticmethod
    def _parse_head(head: bytes) -> tuple[int, int]:
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v)
        return status, length

    async def request(self, payload: Any) -> dict | None:
        buf = as_buffer(payload)
        n = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
        if self._idle:
            r, w = self._idle.pop()
        else:
            r, w = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
            self._all.append(w)
        w.write(self._head(n))
        w.write(buf)
        await w.drain()
        head = await r.readuntil(b"\r\n\r\n")
        status, length = self._parse_head(head)
        body = await r.readexactly(length)
        self._idle.append((r, w))
        if status != 200:
            return {"error": f"HTTP {status}"}
        return {"reply": body}

    def request_sync(self, payload: Any) -> dict | None:
        buf = as_buffer(payload)
        n = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
        with socket.create_connection((self.host, self.port)) as s:
            s.sendall(self._head(n))
            s.sendall(buf)
            f = s.makefile("rb")
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = f.readline()
                if not line:
                    raise ConnectionError("connection closed")
                head += line
            status, length = self._parse_head(head)
            body = f.read(length)
        if status != 200:
            return {"error": f"HTTP {status}"}
        return {"reply": body}

    async def aclose(self) -> None:
        for w in self._all:
            w.close()
        self._all.clear()
        self._idle.clear()


class PyTritonClient(PeerClient):
    """tritonclient.grpc against the `echo` model of `bench.triton_echo`: one UINT8 tensor in
    (`data`, shape [n]), the same bytes back (`out`).

    Unary ModelInfer calls on one channel: `tritonclient.grpc.aio` for `request` (concurrent
    requests are concurrent calls), the blocking `tritonclient.grpc` client for `request_sync`.
    Like GrpcEchoClient, the InferInput (whose set_data_from_numpy serializes the tensor, a
    copy) is built once per payload object and reused, as a caller holding a ready tensor would.
    Every reply's size is checked, and its bytes the first time a payload comes back.
    """

    def __init__(self, target: str):
        self.target = target  # "host:port" of Triton's gRPC endpoint
        self._aclient = None
        self._sclient = None
        self._last_obj: Any = None
        self._last_arr: np.ndarray | None = None
        self._last_inputs: list | None = None
        self._verified: Any = None  # the payload object whose echo was compared byte for byte

    def _inputs(self, payload: Any) -> tuple[np.ndarray, list]:
        if payload is not self._last_obj:
            from tritonclient.grpc import InferInput  # the aio client takes the same class

            from bench.triton_echo import INPUT

            arr = np.frombuffer(as_buffer(payload), dtype=np.uint8)
            inp = InferInput(INPUT, [arr.size], "UINT8")
            inp.set_data_from_numpy(arr)
            self._last_obj, self._last_arr, self._last_inputs = payload, arr, [inp]
        return self._last_arr, self._last_inputs

    def _check(self, payload: Any, arr: np.ndarray, result: Any) -> dict:
        from bench.triton_echo import OUTPUT

        out = result.as_numpy(OUTPUT)
        if out is None or out.dtype != np.uint8 or out.size != arr.size:
            got = None if out is None else f"{out.dtype}[{out.size}]"
            return {"error": f"bad echo: sent uint8[{arr.size}], got {got}"}
        if self._verified is not payload:
            if not np.array_equal(out, arr):
                return {"error": "bad echo: reply bytes differ from the request"}
            self._verified = payload
        return {"reply": out.data}

    async def request(self, payload: Any) -> dict | None:
        from bench.triton_echo import MODEL

        if self._aclient is None:
            import tritonclient.grpc.aio as grpcclient

            self._aclient = grpcclient.InferenceServerClient(self.target)
        arr, inputs = self._inputs(payload)
        result = await self._aclient.infer(MODEL, inputs)
        return self._check(payload, arr, result)

    def request_sync(self, payload: Any) -> dict | None:
        from bench.triton_echo import MODEL

        if self._sclient is None:
            import tritonclient.grpc as grpcclient

            self._sclient = grpcclient.InferenceServerClient(self.target)
        arr, inputs = self._inputs(payload)
        return self._check(payload, arr, self._sclient.infer(MODEL, inputs))

    async def aclose(self) -> None:
        if self._aclient is not None:
            try:
                await self._aclient.close()
            finally:
                self._aclient = None
        self.close()

    def close(self) -> None:
        if self._sclient is not None:
            try:
                self._sclient.close()
            finally:
                self._sclient = None


@register
class PyTritonPeer(Peer):
    name = "pytriton"
    description = ("NVIDIA PyTriton: tritonserver + Python-backend echo model (CPU, one instance, "
                   "no batching), tritonclient over gRPC")

    def available(self) -> tuple[bool, str]:
        # find_spec only: nothing of pytriton or tritonclient is imported to answer.
        spec = importlib.util.find_spec("pytriton")
        if spec is None:
            return False, ("pytriton is not installed (pip install -e '.[triton]', "
                           "or pip install nvidia-pytriton)")
        if importlib.util.find_spec("tritonclient") is None or \
                importlib.util.find_spec("tritonclient.grpc") is None:
            return False, "tritonclient[grpc] is not installed (pip install 'tritonclient[grpc]')"
        ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
        stub = os.path.join(list(spec.submodule_search_locations or [""])[0], "tritonserver",
                            "python_backend_stubs", ver, "triton_python_backend_stub")
        if not os.path.exists(stub):
            return False, f"pytriton's Python backend stub for Python {ver} is not installed ({stub})"
        return True, ""

    def start(self) -> None:
        from bench import triton_echo

        # The child picks its own free gRPC port and prints READY host:port once the model is
        # loaded (a few seconds; more on a busy 2-core machine). stub_env(): the interpreter's
        # LIBDIR first on LD_LIBRARY_PATH, for the backend stub (see bench/triton_echo.py).
        # tritonserver's log goes to a file (its tail is printed if start-up fails).
        self.target = self.spawn(
            self.python_module("bench.triton_echo", "--host", "127.0.0.1",
                               "--log-file", os.path.join(self.tmpdir, "tritonserver.log")),
            ready_timeout=180.0,
            env=triton_echo.stub_env(),
        )

    def client(self) -> PeerClient:
        return PyTritonClient(self.target)

    def stop(self) -> None:
        # Triton's orderly exit (unload the model, stop the stub, remove PyTriton's workspace
        # and shared memory) takes about 4 s, more on a busy machine: longer than the 5 s that
        # Peer.stop() grants before SIGKILL, which would orphan tritonserver. Give it 30 s.
        deadline = time.monotonic() + 30.0
        for p in self._procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except OSError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        super().stop()


@register
class RayServePeer(Peer):
    name = "rayserve"
    description = "Ray Serve HTTP deployment echoing the request body"

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("ray") is None:
            return False, "ray is not installed (pip install 'ray[serve]')"
        if importlib.util.find_spec("ray.serve") is None:
            return False, "ray.serve is not importable (pip install 'ray[serve]')"
        return True, ""

    def start(self) -> None:
        port = free_port()
        # Ray's own start-up (GCS, raylet, proxy) takes tens of seconds on a small machine.
        self.spawn(_echo_argv("rayserve", "--port", str(port)), ready_timeout=300.0)
        self.port = port

    def client(self) -> PeerClient:
        return HttpEchoClient("127.0.0.1", self.port, "/echo")


def availability(names: list[str]) -> dict[str, tuple[bool, str]]:
    """available() of each named peer, without starting anything; unknown names included."""
    out: dict[str, tuple[bool, str]] = {}
    for n in names:
        if n not in PEERS:
            why = f"unknown peer (known: {', '.join(PEERS)})"
            if PLUGIN_ERRORS:
                why += "; plug-in import failed: " + "; ".join(
                    f"{m}: {e}" for m, e in PLUGIN_ERRORS.items())
            out[n] = (False, why)
            continue
        try:
            out[n] = make_peer(n).available()
        except Exception as e:
            out[n] = (False, f"available() raised {e!r}")
    return out


# Modules that register more peers when imported: the broker's own peers are in
# bench.broker_peers; others can be named with `--peer-module` on the command line.
DEFAULT_PLUGIN_MODULES = ("bench.broker_peers",)
PLUGIN_ERRORS: dict[str, str] = {}


def load_plugins(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Import peer plug-in modules (each registers its classes with @register).

    A default module that fails to import leaves its peers skipped with the error as the
    reason (the floors stay measurable); a module named explicitly must import, so a typo
    fails loudly.
    """
    loaded = []
    for mod in DEFAULT_PLUGIN_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as e:
            # The floors must still be measurable when the broker's module is broken; its
            # peers then show up as skipped with this error as the reason.
            PLUGIN_ERRORS[mod] = f"{type(e).__name__}: {e}"
            print(f"bench: could not import {mod}: {PLUGIN_ERRORS[mod]}", file=sys.stderr)
            continue
        loaded.append(mod)
    for mod in extra:
        importlib.import_module(mod)
        loaded.append(mod)
    return loaded
